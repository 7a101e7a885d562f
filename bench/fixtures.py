"""The benchmark's checkpoints, written once with bounded memory and cached.

From one config: a Hugging Face Llama folder (sharded safetensors, index,
config.json), the same tensors as one safetensors file, and as one torch zip
state dict; plus the checksums of sampled tensors that every method's result
is verified against.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

import materialize as mz
from materialize.dtypes import dtype_name
from bench.checksum import crc  # noqa: F401  (the benches import it from here)
from bench.writer import INDEX_NAME, write_sharded_checkpoint
from materialize.skeleton.spec import read_config

SAMPLE_EVERY = 7
_SAFETENSORS_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def hf_config(args: dict, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args["hidden_size"],
        "intermediate_size": args["intermediate_size"],
        "num_hidden_layers": args["num_layers"],
        "num_attention_heads": args["num_heads"],
        "num_key_value_heads": args["num_heads"],
        "vocab_size": args["vocab_size"],
        "tie_word_embeddings": args.get("tie_embeddings", False),
        "rms_norm_eps": args.get("norm_eps", 1e-6),
        "rope_theta": args.get("rope_theta", 10000.0),
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }


def write_safetensors_streaming(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file written tensor by tensor (the sources may be file views)."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for tensor in tensors.values():
            out.write(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))
    partial.rename(path)


def ensure(config_path: str, root: Path) -> dict[str, Path]:
    """Write (once) every form of the benchmark checkpoint; return their paths."""
    config = read_config(config_path)
    args, settings = config["model"]["args"], config.get("checkpoint", {})
    folder = root / Path(config_path).stem
    paths = {
        "sharded": folder / "hf",
        "single": folder / "model.safetensors",
        "torch": folder / "model.pt",
        "expected": folder / "expected.json",
    }
    if all(p.exists() for p in paths.values()):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    if not (paths["sharded"] / INDEX_NAME).exists():
        write_sharded_checkpoint(
            config_path, paths["sharded"], dtype=settings.get("dtype"),
            shard_size=settings.get("shard_size", "1GB"), seed=settings.get("seed", 0),
        )
    (paths["sharded"] / "config.json").write_text(json.dumps(hf_config(args, dtype_name(mz.dtypes.parse_dtype(settings.get("dtype", "bf16")))), indent=2))
    views, _ = mz.load_tensors(paths["sharded"], mmap=True)
    write_safetensors_streaming(views, paths["single"])
    torch.save(views, paths["torch"].with_suffix(".partial"))
    paths["torch"].with_suffix(".partial").rename(paths["torch"])
    names = list(views)[::SAMPLE_EVERY]
    expected = {
        "names": names,
        "same": {n: crc(views[n]) for n in names},
        "float32": {n: crc(views[n].float()) for n in names},
        "nbytes": sum(t.numel() * t.element_size() for t in views.values()),
        "model_args": args,
    }
    paths["expected"].write_text(json.dumps(expected))
    return paths
