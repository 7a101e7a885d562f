"""A Llama-style decoder-only transformer, small enough to read in one sitting.

It carries the parts that make materialization hard: tied embeddings
(optional), a non-persistent rotary buffer that no checkpoint holds, and
modules whose ``reset_parameters`` is the only init.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding; ``inv_freq`` is computed, never saved."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=self.inv_freq.device)
        self.inv_freq = 1.0 / (self.theta ** (steps / self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        first, second = x[..., ::2], x[..., 1::2]
        return torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, rope_theta: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.rotary = Rotary(self.head_dim, rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(self.rotary(q), self.rotary(k), v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, rope_theta: float, eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = Attention(hidden_size, num_heads, rope_theta)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = MLP(hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The stack without its head: embedding, blocks, final norm."""

    def __init__(self, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                 intermediate_size: int, rope_theta: float, norm_eps: float) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            Block(hidden_size, num_heads, intermediate_size, rope_theta, norm_eps) for _ in range(num_layers)
        )
        self.norm = RMSNorm(hidden_size, norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class DecoderLM(nn.Module):
    """Embedding, ``num_layers`` pre-norm blocks, final norm, LM head.

    Tensor names follow Hugging Face's Llama (``model.layers.0.self_attn.q_proj.weight``),
    so a checkpoint written from it is a Llama checkpoint of the same shape.
    """

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        num_layers: int = 12,
        num_heads: int = 16,
        intermediate_size: int = 2816,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-6,
        tie_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.model = Decoder(vocab_size, hidden_size, num_layers, num_heads, intermediate_size, rope_theta, norm_eps)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))
