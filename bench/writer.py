"""Writing realistic checkpoints with bounded memory: the demo and benchmark inputs.

A model is built on ``meta`` from a spec; one module at a time is allocated,
initialized by its own ``reset_parameters()``, written into the current
shard and dropped, so memory stays near one shard whatever the model size.
The output appears atomically: it is written to a temporary folder beside
the target and renamed into place at the end.

Run as ``python -m bench.writer CONFIG OUT_DIR`` from the repository's root (``make demo`` does).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors.torch import save_file
from torch import nn

from materialize.checkpoint.index import SAFETENSORS_INDEX_NAME
from materialize.dtypes import parse_dtype
from materialize.sizes import parse_size
from materialize.skeleton.spec import ModelSpec, build, read_config

INDEX_NAME = SAFETENSORS_INDEX_NAME


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _module_tensors(module: nn.Module, dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
    """Allocate and initialize one module's own tensors, return them on CPU."""
    module.to_empty(device="cpu", recurse=False)
    if callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()
    tensors = {}
    for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[name] = tensor.detach().contiguous()
    module.to_empty(device="meta", recurse=False)
    return tensors


class _ShardWriter:
    def __init__(self, folder: Path, shard_bytes: int, metadata: Optional[dict] = None) -> None:
        self.folder = folder
        self.metadata = dict(metadata or {})
        self.shard_bytes = shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total += size

    def flush(self) -> None:
        if not self.pending:
            return
        file_name = f"shard-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(self.folder / file_name), metadata={"format": "pt"})
        os.chmod(self.folder / file_name, 0o666 & ~_umask())  # the writer creates it private
        self.written.append((file_name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        self.flush()
        count = len(self.written)
        weight_map = {}
        for index, (old_name, names) in enumerate(self.written):
            new_name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            (self.folder / old_name).rename(self.folder / new_name)
            weight_map.update({name: new_name for name in names})
        index_doc = {"metadata": {**self.metadata, "total_size": self.total}, "weight_map": weight_map}
        (self.folder / INDEX_NAME).write_text(json.dumps(index_doc, indent=2))


def write_sharded_checkpoint(
    model: Union[nn.Module, ModelSpec],
    out_dir: Union[str, os.PathLike],
    *,
    dtype: Union[str, torch.dtype, None] = None,
    shard_size: Union[str, int] = "1GB",
    seed: int = 0,
    model_args: Optional[dict] = None,
    metadata: Optional[dict] = None,
) -> Path:
    """Write a model's initialized weights as sharded safetensors plus index.

    Tied tensors are written once, under their first name, as saving tools do.
    Non-persistent buffers are not written.
    """
    skeleton = model if isinstance(model, nn.Module) else build(model, **(model_args or {}))
    target = Path(out_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's 0700 would make the result private
    torch.manual_seed(seed)
    try:
        writer = _ShardWriter(staging, parse_size(shard_size), metadata)
        persistent = set(skeleton.state_dict(keep_vars=True))
        seen: set[int] = set()
        for prefix, module in skeleton.named_modules():
            owned = [t for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))]
            if not owned or all(id(t) in seen for t in owned):
                continue
            ids = {name: id(t) for name, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))}
            for name, tensor in _module_tensors(module, parse_dtype(dtype)).items():
                full = f"{prefix}.{name}" if prefix else name
                if full in persistent and ids[name] not in seen:
                    writer.add(full, tensor)
            seen.update(ids.values())
        writer.finish()
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def fingerprint(config: str) -> str:
    """What decides the checkpoint's content: the config, and the names and shapes its model has."""
    skeleton = build(config)
    layout = sorted((name, list(t.shape)) for name, t in skeleton.state_dict().items())
    digest = hashlib.sha256(Path(config).read_bytes())
    digest.update(json.dumps(layout).encode())
    return digest.hexdigest()[:16]


def _built_from(out: Path) -> Optional[str]:
    try:
        return json.loads((out / INDEX_NAME).read_text())["metadata"].get("source")
    except (OSError, ValueError, KeyError, AttributeError):
        return None


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Write the checkpoint a configs/ TOML file describes, once.")
    parser.add_argument("config")
    parser.add_argument("out_dir")
    parser.add_argument("--force", action="store_true", help="rewrite even if the output exists")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    source = fingerprint(args.config)
    if not args.force and _built_from(out) == source:
        print(f"{out}: checkpoint already built from {args.config}")
        return
    settings = read_config(args.config).get("checkpoint", {})
    written = write_sharded_checkpoint(
        args.config,
        out,
        dtype=settings.get("dtype"),
        shard_size=settings.get("shard_size", "1GB"),
        seed=settings.get("seed", 0),
        metadata={"source": source},
    )
    total = sum(p.stat().st_size for p in written.iterdir())
    print(f"{written}: wrote {total / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
