"""A mixture-of-experts decoder of many small tensors, named as DeepSeek-V3's hub checkpoints name them.

Each layer holds two norms, a router (``mlp.gate``) and ``num_experts`` experts of three projections each
(``mlp.experts.7.gate_proj.weight``): with hundreds of experts a layer, a checkpoint of this model is
tens of thousands of small tensors, the case ``bench.many`` measures. No attention: its few tensors a
layer change nothing here, and each expert is one module with one tensor per projection, as in the hub's
files (transformers' own MoE classes fuse a layer's experts into 3-D tensors; see ``bench/many.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bench.models.transformer import RMSNorm


class Expert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = min(top_k, num_experts)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.gate(flat).softmax(-1), self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for token in range(flat.shape[0]):
            for weight, expert in zip(weights[token], chosen[token].tolist()):
                out[token] += weight * self.experts[expert](flat[token])
        return out.reshape(x.shape)


class MoEBlock(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size)
        self.post_attention_layernorm = RMSNorm(hidden_size)
        self.mlp = SparseMoE(hidden_size, intermediate_size, num_experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(x)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoEDecoder(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int, intermediate_size: int, num_experts: int,
                 top_k: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(MoEBlock(hidden_size, intermediate_size, num_experts, top_k)
                                    for _ in range(num_layers))
        self.norm = RMSNorm(hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class MoELM(nn.Module):
    """Embedding, ``num_layers`` blocks of ``num_experts`` experts, final norm, LM head:
    ``3 * num_layers * (num_experts + 1) + 3`` tensors."""

    def __init__(self, vocab_size: int = 4096, hidden_size: int = 128, num_layers: int = 40,
                 intermediate_size: int = 96, num_experts: int = 832, top_k: int = 2) -> None:
        super().__init__()
        self.model = MoEDecoder(vocab_size, hidden_size, num_layers, intermediate_size, num_experts, top_k)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


def tensor_count(num_layers: int, num_experts: int) -> int:
    return 3 * num_layers * (num_experts + 1) + 3


def shape_for(tensors: int, *, max_layers: int = 40) -> tuple[int, int]:
    """Layers and experts a layer for about ``tensors`` tensors: 40 layers at the full size, fewer below 100,000."""
    layers = max(1, min(max_layers, tensors // 2500))
    experts = max(1, round((tensors - 3) / (3 * layers)) - 1)
    return layers, experts
