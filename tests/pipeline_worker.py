"""A torchtitan-shaped decoder split into pipeline stages, and one rank of a pipeline run over gloo.

The stages are cut as torchtitan cuts them (``pipeline_module_split``): a deep
copy of the whole model built on meta, the layers of other stages deleted
from the ``ModuleDict``, the embeddings, final norm and output head set to
``None`` where the stage has none. Each stage then loads its own tensors from
the whole model's checkpoint.

Usage (run by test_pipeline_stages.py through ``conftest.run_ranks``):
python pipeline_worker.py SCENARIO CHECKPOINT STORE RANK WORLD OUT
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn

import materialize as mz

DIM, VOCAB, LAYERS = 8, 32, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class Decoder(nn.Module):
    """torchtitan's layout: ``tok_embeddings``, ``layers`` (a ModuleDict keyed "0", "1"...), ``norm``, ``output``,
    and a buffer the model computes (never saved), as its ``freqs_cis``."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("scale", self._scale(), persistent=False)

    @staticmethod
    def _scale() -> torch.Tensor:
        return torch.linspace(0.5, 1.5, DIM)

    def init_non_persistent_buffers(self) -> None:  # a model built on meta recomputes it so
        with torch.no_grad():
            self.scale.copy_(self._scale())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) * self.scale if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def layers_of(stage: int, stages: int, layers: int = LAYERS) -> list[int]:
    per = layers // stages
    return list(range(stage * per, (stage + 1) * per))


def split(whole: nn.Module, stage: int, stages: int) -> nn.Module:
    """Stage ``stage`` of ``stages``, cut from ``whole`` (left as it is) as torchtitan cuts it."""
    part = copy.deepcopy(whole)
    kept = {str(i) for i in layers_of(stage, stages, len(whole.layers))}
    for name in [name for name in part.layers if name not in kept]:
        del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != stages - 1:
        part.norm = None
        part.output = None
    return part


def make_stage(stage: int = 0, stages: int = 2) -> nn.Module:
    """A model spec for ``materialize --model``: the whole model built (on meta, by the caller), then cut."""
    return split(Decoder(), stage, stages)


def tokens() -> torch.Tensor:
    return torch.arange(24).reshape(4, 6) % VOCAB


def gpipe(checkpoint: str, rank: int, world: int) -> dict:
    """This rank's stage built on meta and loaded from the whole checkpoint, then run as a GPipe schedule."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    with torch.device("meta"):
        whole = Decoder()
    stage = split(whole, rank, world)
    report = mz.load(stage, checkpoint, ignore_unexpected=True)
    saved = mz.load_tensors(checkpoint)[0]
    result = {
        "loaded": sorted(report.loaded),
        "ignored": sorted(report.ignored),
        "unexpected": report.unexpected,
        "equal": {name: torch.equal(tensor, saved[name]) for name, tensor in stage.state_dict().items()},
    }
    schedule = ScheduleGPipe(PipelineStage(stage, rank, world, torch.device("cpu")), n_microbatches=2)
    with torch.no_grad():
        output = schedule.step(tokens()) if rank == 0 else schedule.step()
    if rank == world - 1:
        eager = Decoder()
        eager.load_state_dict(saved)
        with torch.no_grad():  # the whole model on the same microbatches: the same kernels on the same shapes
            expected = torch.cat([eager(part) for part in tokens().chunk(2)])
        result["output_equal"] = torch.equal(output, expected)
    return result


def main() -> None:
    scenario, checkpoint, store, rank, world, out = sys.argv[1:7]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(rank), world_size=int(world))
    from sharded_worker import finish_rank  # here: the CLI tests load this file as a model file, without bench/

    finish_rank(lambda: {"gpipe": gpipe}[scenario](checkpoint, int(rank), int(world)), out)


if __name__ == "__main__":
    main()
