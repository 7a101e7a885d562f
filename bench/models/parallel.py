"""torchtitan's 2-D layout of the decoder: tensor parallel inside each rank group, FSDP2 across them."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def torchtitan_2d(model: nn.Module, mesh) -> nn.Module:
    """torchtitan's plan on ``mesh["tp"]`` (without sequence parallel), then FSDP2 over ``mesh["dp"]`` block by
    block, as its ``parallelize_llama`` does.

    Column-wise weights (embedding rows, q/k/v, gate/up, the head) end up
    ``_StridedShard(0, sf=tp)`` beside ``Shard(0)``; row-wise ones (o, down)
    ``Shard(0)`` beside ``Shard(1)``; norms ``Shard(0)`` over ``dp`` alone.
    """
    tp = mesh["tp"].size()
    parallelize_module(model, mesh["tp"], {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    for block in model.model.layers:
        parallelize_module(block, mesh["tp"], {
            **{f"self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")},
            "self_attn.o_proj": RowwiseParallel(),
            **{f"mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")},
            "mlp.down_proj": RowwiseParallel(),
        })
        block.self_attn.num_heads //= tp  # each rank computes its own heads, as torchtitan's attention does
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model
