"""One load, in a fresh interpreter: ``python -m bench.methods METHOD FORM FIXTURE_DIR``.

Prints one JSON object: load seconds (after imports), seconds to then touch
every weight, peak anonymous and resident memory growth, whether the sampled
tensors match the file's checksums, and whether a forward pass runs.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from materialize.io.peak import PeakMemory

from .fixtures import crc

FIXTURE_PATHS = {"sharded": "hf", "single": "model.safetensors", "torch": "model.pt"}


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _skeleton(args: dict, how: str) -> torch.nn.Module:
    from bench.models.transformer import DecoderLM

    if how == "meta-device":
        with torch.device("meta"):
            return DecoderLM(**args)
    if how == "accelerate":
        from accelerate import init_empty_weights

        with init_empty_weights():
            return DecoderLM(**args)
    import materialize as mz

    with mz.meta_init():
        return DecoderLM(**args)


Setup = Callable[[dict], Any]
Load = Callable[[Path, Any], Any]


def _prepare(method: str) -> tuple[Setup, Load]:
    """Import what the method needs; return its untimed setup and its timed load.

    The setup builds the model skeleton where the method allows one to be
    built apart from the load, so the load column compares loading alone.
    """
    if method.startswith("ours"):
        from materialize import load

        dtype = torch.float32 if "-cast" in method else None
        options = dict(dtype=dtype, mmap=method == "ours-mmap", direct_io="-direct" in method, device=_device(method))
        return (lambda args: _skeleton(args, "ours")), (
            lambda path, model: _with(model, lambda m: load(m, path, **options))
        )
    if method == "naive":
        from bench.models.transformer import DecoderLM

        def naive(path: Path, args: dict) -> torch.nn.Module:
            torch.set_default_dtype(torch.bfloat16)
            model = DecoderLM(**args)
            torch.set_default_dtype(torch.float32)
            model.load_state_dict(torch.load(path, weights_only=True))
            return model

        return (lambda args: args), naive
    if method == "torch-mmap":
        return (lambda args: _skeleton(args, "meta-device")), (
            lambda path, model: _with(model, lambda m: m.load_state_dict(torch.load(path, mmap=True, weights_only=True), assign=True))
        )
    if method == "torch-cuda":
        return (lambda args: _skeleton(args, "meta-device")), (
            lambda path, model: _with(model, lambda m: m.load_state_dict(
                torch.load(path, mmap=True, weights_only=True, map_location="cuda"), assign=True))
        )
    if method.startswith("safetensors"):
        from safetensors.torch import load_file

        backend = {"safetensors-pread": {"backend": "pread"}, "safetensors": {}}.get(method, {})
        device = _device(method)
        return (lambda args: _skeleton(args, "meta-device")), (
            lambda path, model: _with(model, lambda m: m.load_state_dict(load_file(path, device=device, **backend), assign=True))
        )
    if method.startswith("accelerate"):
        from accelerate import load_checkpoint_and_dispatch

        dtype = torch.float32 if "-cast" in method else torch.bfloat16
        placement = {"": 0} if method.endswith("-cuda") else {"": "cpu"}
        return (lambda args: _skeleton(args, "accelerate")), (
            lambda path, model: load_checkpoint_and_dispatch(model, str(path), device_map=placement, dtype=dtype)
        )
    if method.startswith("transformers"):
        from transformers import LlamaForCausalLM

        dtype = torch.float32 if "-cast" in method else torch.bfloat16
        placement = {"device_map": "cuda"} if method.endswith("-cuda") else {}
        return (lambda args: args), (lambda path, _: LlamaForCausalLM.from_pretrained(str(path), dtype=dtype, **placement))
    if method == "limit-mapped":
        return (lambda args: args), (lambda path, _: copy_from_mapping(path))
    if method == "limit-fresh-fp32":
        return (lambda args: args), (lambda path, _: fresh_memory(path, scale=2, threads=os.cpu_count() or 1))
    if method.startswith("limit"):
        threads = 1 if method == "limit-1t" else os.cpu_count() or 1
        prefaulted = method == "limit-prefault"
        return (lambda args: args), (lambda path, _: read_everything(path, threads=threads, prefaulted=prefaulted))
    raise SystemExit(f"unknown method {method}")


def _device(method: str) -> str:
    return "cuda" if method.endswith("-cuda") else "cpu"


def _with(model: torch.nn.Module, action: Callable[[torch.nn.Module], Any]) -> torch.nn.Module:
    action(model)
    return model


def copy_from_mapping(path: Path) -> dict[str, torch.Tensor]:
    """Another bar for cold reads: one thread copying out of a mapping, so kernel read-ahead does the I/O."""
    import mmap

    buffers = {}
    for file in _checkpoint_files(path):
        with open(file, "rb") as handle:
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        mapping.madvise(mmap.MADV_SEQUENTIAL)
        buffer = torch.empty(len(mapping), dtype=torch.uint8)
        source = torch.frombuffer(mapping, dtype=torch.uint8)
        buffer.copy_(source)
        del source
        mapping.close()
        buffers[str(file)] = buffer
    return buffers


def fresh_memory(path: Path, *, scale: int, threads: int) -> dict[str, torch.Tensor]:
    """The floor of a widening cast to CPU: ``scale`` times the files' bytes of fresh memory, faulted in by every core.

    No reading, no converting: what any method pays for its destination alone.
    """
    from materialize.io.hostmem import prefault

    nbytes = scale * sum(file.stat().st_size for file in _checkpoint_files(path))
    memory = torch.empty(nbytes, dtype=torch.uint8)
    chunk = 16 * 1024 * 1024
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda start: prefault(memory.data_ptr() + start, min(chunk, nbytes - start)), range(0, nbytes, chunk)))
    return {"memory": memory}


def _checkpoint_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors")) if path.is_dir() else [path]


def read_everything(path: Path, *, threads: int, prefaulted: bool = False) -> dict[str, torch.Tensor]:
    """The physical bar: every byte of the files read into fresh process memory.

    ``prefaulted``: each chunk's pages are faulted in by one ``madvise``
    before its read, as the engine does (a lower bar than plain reads).
    """
    from materialize.io.hostmem import prefault

    files = _checkpoint_files(path)
    chunk = 64 * 1024 * 1024 if threads == 1 else 16 * 1024 * 1024
    buffers = {}
    tasks = []
    for file in files:
        size = file.stat().st_size
        buffers[str(file)] = torch.empty(size, dtype=torch.uint8)
        tasks += [(file, start, min(size, start + chunk)) for start in range(0, size, chunk)]
    lock = threading.Lock()
    fds: dict[Path, int] = {}

    def read(file: Path, start: int, stop: int) -> None:
        with lock:
            fd = fds.setdefault(file, os.open(file, os.O_RDONLY))
        view = memoryview(buffers[str(file)].numpy())[start:stop]
        if prefaulted:
            prefault(buffers[str(file)].data_ptr() + start, stop - start)
        done = 0
        while done < stop - start:
            done += os.preadv(fd, [view[done:]], start + done)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda task: read(*task), tasks))
    for fd in fds.values():
        os.close(fd)
    return buffers


def _tensors(result) -> dict[str, torch.Tensor]:
    if isinstance(result, torch.nn.Module):
        named = dict(result.named_parameters())
        named.update(result.named_buffers())
        return named
    return result


def _verify(tensors: dict[str, torch.Tensor], expected: dict, method: str) -> bool:
    if method.startswith("limit"):
        return True  # raw bytes, not tensors: nothing to compare by name
    wanted = expected["float32" if "-cast" in method else "same"]
    return all(name in tensors and crc(tensors[name].cpu()) == value for name, value in wanted.items())


def _touch(tensors: dict[str, torch.Tensor]) -> float:
    """Read every byte once: zero-copy methods pay their page faults here."""
    started = time.perf_counter()
    with torch.no_grad():
        for tensor in tensors.values():
            if tensor.device.type == "cpu" and tensor.numel():
                tensor.reshape(-1).view(torch.uint8)[:: 4096].sum()
    return time.perf_counter() - started


def _forward_ok(result) -> bool:
    if not isinstance(result, torch.nn.Module):
        return False
    try:
        with torch.no_grad():
            device = next(result.parameters()).device
            result(torch.zeros(1, 4, dtype=torch.long, device=device))
        return True
    except Exception:
        return False


def main() -> None:
    method, form, fixture = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    expected = json.loads((fixture / "expected.json").read_text())
    path = fixture / FIXTURE_PATHS[form]
    setup, load = _prepare(method)
    built = time.perf_counter()
    prepared = setup(expected["model_args"])
    build_seconds = time.perf_counter() - built
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # restart the peak-RSS counter: imports are not the load
    rss_before = _status("VmRSS")
    started = time.perf_counter()
    with PeakMemory() as memory:
        result = load(path, prepared)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # asynchronous copies are not done until they are done
    load_seconds = time.perf_counter() - started
    peak_rss = _status("VmHWM")
    tensors = _tensors(result)
    print(json.dumps({
        "load_s": load_seconds,
        "build_s": build_seconds,
        "touch_s": _touch(tensors),
        "anon_growth": memory.host_growth,
        "rss_growth": peak_rss - rss_before,
        "verified": _verify(tensors, expected, method),
        "forward_ok": _forward_ok(result),
    }))


if __name__ == "__main__":
    main()
