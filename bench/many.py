"""A checkpoint of a hundred thousand small tensors: where a load's time goes when the bytes cost little.

``python -m bench.many`` (``make bench-many``) writes once, under ``data/bench/many-<tensors>/``, a
mixture-of-experts checkpoint of ``--tensors`` tensors (100,000 by default: 40 layers of 832 experts, each
expert three bf16 projections of 128 x 96, 24 KB; a router and two norms a layer; 2.5 GB), named as
DeepSeek-V3's hub files name theirs (``bench/models/moe.py``), in three forms: one safetensors file, a
sharded safetensors folder with its index, and a torch zip (``torch.save`` of the state dict). Then it
loads it into the model built on meta, each load a fresh process, page cache warm (every file evicted and
read back once first, as ``bench.run`` does), the methods of a group taking turns after a warm-up (none with
``--no-warm-up``, for a quick check), median of ``--runs``:

- ours: ``mz.load`` into the model built under ``mz.meta_init``, and into the model made from scratch by
  ``mz.deferred_init`` (its recording: the build column; the load replays nothing, every tensor is in the
  checkpoint);
- safetensors' ``load_file`` (per shard for the folder) + ``load_state_dict(assign=True)``; for the torch
  zip, ``torch.load(mmap=True, weights_only=True)`` + ``load_state_dict(assign=True)``; both into the
  ``meta_init`` model;
- the floor (one safetensors file, the torch zip): ``bench/floor.py``, a bare Python loader that trusts the
  file and checks and reports nothing: ``json.loads`` of the header (``zipfile`` and the C unpickler for the
  zip), each name's module from one ``named_modules`` dict, ``torch.frombuffer`` + ``view`` + a parameter a
  tensor, one read of the bytes by every core: what no check removes, the interpreter's and torch's own
  cost a tensor;
- the raw read: every byte of the files read into fresh memory by every core, each 16 MB chunk prefaulted
  (``bench.methods.read_everything``), the bar a load's per-tensor cost is counted above;
- bf16 to fp32 (``--groups cast``), the one safetensors file: ours, ``mz.load(model, file, dtype=torch.float32)``
  into the ``meta_init`` model, against accelerate's ``load_checkpoint_and_dispatch(model, file,
  device_map={"": "cpu"}, dtype=torch.float32)`` into a model built under its ``init_empty_weights`` (as
  ``make bench`` runs it), and the floor: twice the file's bytes of fresh memory faulted in by every core
  (``bench.methods.fresh_memory``), what any cast pays for its destination alone;
- FSDP2 over 2 gloo ranks (``--groups fsdp2``): ours on every rank against rank 0's ``load_file`` +
  ``set_model_state_dict(broadcast_from_rank0=True)``, sharding on meta timed apart;
- ``materialize inspect`` of each form, as a CLI subprocess (its wall time, interpreter start-up included,
  beside the start-up of ``python -c "import materialize"`` alone);
- cold (``--groups cold``): ``inspect`` of the torch zip, and ours and ``torch.load(mmap=True)`` + assign on
  it, and ours on the one safetensors file, each run with its file dropped from the page cache first
  (``posix_fadvise(DONTNEED)``): what opening a file of 100,000 records costs when each of its headers is a
  trip to the disk;
- build (``--groups build``): the model alone, built under ``mz.meta_init``, accelerate's
  ``init_empty_weights``, torch's ``with torch.device("meta")`` and recorded by ``mz.deferred_init``, in
  fresh processes taking turns (the load s column is the build here): what a user waits for before a load
  of a model of many modules begins;
- scaling (``--scaling-counts``): ours on one safetensors file and on a torch zip of 12,500 to 100,000
  tensors of 256 bytes, each phase per tensor: whether each grows linearly with the count.

transformers' ``from_pretrained`` is not among them: its MoE classes (Mixtral, Qwen2-MoE, DeepSeek-V3 and
the others its conversion mapping sends to them, transformers 5.x) hold a layer's experts fused, one 3-D
``gate_up_proj`` and one ``down_proj`` per layer, and stack the hub's per-expert tensors into them while
loading: another model, of two expert tensors a layer, than this one of 2,500. Its classes that do keep one
module per expert (Switch Transformers, NLLB-MoE) are T5-style encoder-decoders with ``wi``/``wo`` feed-forwards,
not gate/up/down experts.

``--baseline CHECKOUT`` adds ours on another checkout's library (an earlier commit's ``materialize``
package, as old as ccd4344's flat one; ``--baseline-name`` names its rows) to the groups of the three forms,
the cast, the scaling and ``inspect``, taking turns with the rest: a change measured before and after in one
run, on the machine as it is then (this VM's fresh memory costs twice as much in one hour as in another).
Each row records the library it ran.

Each of our loads is given a progress object that records when the library reports each step
(``materialize.progress.report_phase``: opening, planning, loading) and when its reads start and end (the
first and last byte callbacks), which splits a load into open (headers, index, pickle scan), plan,
allocate (allocation, registration, the read jobs made), read, and report (ties settled, the report built)
without changing the library. ``--profile`` runs ours once per form under cProfile instead and writes the
heaviest functions to ``bench/results/many-profile/``. Writes ``bench/results/bench-many.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from bench.checksum import crc
from bench.models.moe import MoELM, shape_for, tensor_count
from bench.turns import after, take_turns

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parent.parent
SAMPLE_EVERY = 7
SHARD_BYTES = 512 * 1024 * 1024
FORMS = {"single": "model.safetensors", "sharded": "hf", "torch": "model.pt"}
FORM_WORDS = {"single": "one safetensors file", "sharded": "sharded safetensors", "torch": "torch zip"}
GROUPS = {
    "single": {
        "ours, meta_init model": "ours",
        "ours, deferred_init model": "ours-deferred",
        "safetensors load_file + load_state_dict(assign=True)": "safetensors",
        "floor: a bare Python loader, no checks (bench/floor.py)": "floor",
        "limit: raw read, all cores, chunks prefaulted": "limit",
    },
    "sharded": {
        "ours, meta_init model": "ours",
        "ours, deferred_init model": "ours-deferred",
        "safetensors load_file per shard + load_state_dict(assign=True)": "safetensors",
        "limit: raw read, all cores, chunks prefaulted": "limit",
    },
    "torch": {
        "ours, meta_init model": "ours",
        "ours, deferred_init model": "ours-deferred",
        "torch.load(mmap=True) + load_state_dict(assign=True)": "torch-mmap",
        "floor: a bare Python loader, no checks (bench/floor.py)": "floor",
        "limit: raw read, all cores, chunks prefaulted": "limit",
    },
    "cast": {
        "ours, meta_init model, bf16 -> fp32": "ours-cast",
        "accelerate load_checkpoint_and_dispatch, init_empty_weights model, bf16 -> fp32": "accelerate-cast",
        "limit: fresh fp32 memory alone, all cores": "limit-fresh-fp32",
    },
    "fsdp2": {
        "ours: every rank reads its own rows": "fsdp-ours",
        "torch: rank 0 load_file, set_model_state_dict broadcasts": "fsdp-broadcast",
    },
    "build": {  # the model alone, no load: its load s is its build s
        "mz.meta_init": "build-meta",
        "accelerate init_empty_weights": "build-accelerate",
        "torch: with torch.device('meta')": "build-torch-meta",
        "mz.deferred_init": "build-deferred",
    },
    "scaling": {},  # ours at several tensor counts of tiny tensors: see scaling_methods
    "inspect": {
        "materialize inspect, one safetensors file": "inspect-single",
        "materialize inspect, sharded safetensors": "inspect-sharded",
        "materialize inspect, torch zip": "inspect-torch",
        "start-up alone: python -c 'import materialize'": "startup",
    },
    # Each run with its file dropped from the page cache first (bench.run.evict): what the disk adds.
    "cold": {
        "materialize inspect, torch zip": "inspect-torch",
        "ours, meta_init model, torch zip": "ours:torch",
        "torch.load(mmap=True) + load_state_dict(assign=True), torch zip": "torch-mmap:torch",
        "ours, meta_init model, one safetensors file": "ours:single",
    },
}
GROUP_FORMS = {"cast": "single", "build": "single"}  # a group not named after its form: the form it loads
GROUP_WORDS = {**FORM_WORDS, "cast": "one safetensors file, bf16 -> fp32",
               "fsdp2": "FSDP2 over 2 ranks (gloo, CPU), one safetensors file",
               "build": "the model built without memory, no load (load s: the build)"}
PHASES = ("open", "plan", "allocate", "read", "assign", "report")
SCALING_COUNTS = "12500,25000,50000,100000"
SCALING_SHAPE = (16, 8)  # 256-byte experts: the bytes cost nothing, each phase's cost per tensor shows


def with_baseline(methods: dict[str, str], group: str, name: str) -> dict[str, str]:
    """``methods`` with ours on the baseline's library beside ours (the meta_init model's load, and inspect),
    taking turns with the rest: the two libraries compared in one run, on the machine as it is then."""
    if group in ("single", "sharded", "torch"):
        return {**methods, f"ours, meta_init model, {name}": "ours" + BASELINE}
    if group == "cast":
        return {**methods, f"ours, meta_init model, bf16 -> fp32, {name}": "ours-cast" + BASELINE}
    if group == "build":
        return {**methods, f"mz.meta_init, {name}": "build-meta" + BASELINE}
    if group == "fsdp2":
        return {**methods, f"ours: every rank reads its own rows, {name}": "fsdp-ours" + BASELINE}
    if group in ("cold", "inspect"):  # each of ours followed by its baseline row; the rest run no library of ours
        interleaved: dict[str, str] = {}
        for label, method in methods.items():
            interleaved[label] = method
            if method != "startup" and not method.startswith("torch-mmap"):
                interleaved[f"{label}, {name}"] = method + BASELINE
        return interleaved
    return methods


def scaling_methods(counts: dict[int, int]) -> dict[str, str]:
    """Ours on one safetensors file and on a torch zip at each count asked (to the count the model makes of
    it): is each phase linear in the tensors?"""
    return {f"{made:,} tensors, {FORM_WORDS[form]}": f"ours,{form},{asked}" for asked, made in counts.items()
            for form in ("single", "torch")}
FSDP_WORLD = 2


def model_args(tensors: int, hidden: int, intermediate: int) -> dict:
    layers, experts = shape_for(tensors)
    return {"vocab_size": 4096, "hidden_size": hidden, "num_layers": layers, "intermediate_size": intermediate,
            "num_experts": experts}


def ensure(data: Path, tensors: int, hidden: int, intermediate: int) -> dict[str, Path]:
    """Write (once) the checkpoint in every form and the checksums of every ``SAMPLE_EVERY``-th tensor."""
    args = model_args(tensors, hidden, intermediate)
    folder = data / f"many-{tensor_count(args['num_layers'], args['num_experts'])}-{hidden}x{intermediate}"
    paths = {form: folder / name for form, name in FORMS.items()}
    paths["expected"] = folder / "expected.json"
    if all(path.exists() for path in paths.values()):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    import materialize as mz
    from bench.fixtures import write_safetensors_streaming

    with mz.meta_init():
        skeleton = MoELM(**args)
    generator = torch.Generator().manual_seed(0)
    # Each tensor its own storage, as a trained model's are: torch.save then writes one record per tensor.
    state = {name: (torch.randn(tensor.shape, generator=generator) * 0.02).to(torch.bfloat16)
             for name, tensor in skeleton.state_dict().items()}
    write_safetensors_streaming(state, paths["single"])
    _write_sharded(state, paths["sharded"])
    torch.save(state, paths["torch"].with_suffix(".partial"))
    paths["torch"].with_suffix(".partial").rename(paths["torch"])
    names = list(state)[::SAMPLE_EVERY]
    expected = {"names": names, "same": {name: crc(state[name]) for name in names}, "tensors": len(state),
                "nbytes": sum(t.numel() * t.element_size() for t in state.values()), "model_args": args}
    paths["expected"].write_text(json.dumps(expected))
    return paths


def _write_sharded(state: dict[str, torch.Tensor], folder: Path) -> None:
    from safetensors.torch import save_file

    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for index, names in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: state[name] for name in names}, str(partial / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (partial / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    partial.rename(folder)


class PhaseClock:
    """A progress object (:class:`materialize.progress.Phased`) noting when each step and the reads begin and end."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, str]] = []
        self.first_bytes: Optional[float] = None
        self.last_bytes: Optional[float] = None

    def phase(self, text: str) -> None:
        self.steps.append((time.perf_counter(), text.split()[0]))

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self.first_bytes is None:
            self.first_bytes = now
        if done >= total:
            self.last_bytes = now

    def phases(self, started: float, ended: float) -> dict[str, float]:
        """Seconds of open, plan, allocate, read and report, from the steps a load reported. A library that
        reports no steps (before ``materialize.progress``: ccd4344 and earlier) has no open and plan: its
        allocate is everything before the first byte."""
        at = {step: when for when, step in self.steps}
        first = self.first_bytes or ended
        last = self.last_bytes or first
        if not at:
            return {"allocate": first - started, "read": last - first, "report": ended - last}
        planning, loading = at.get("planning", started), at.get("loading", started)
        # What comes before the opening step is the model's, not the file's: its device looked up, by the walk of
        # its modules that planning then uses (materialize.skeleton.modtree.one_walk). It counts as planning; a
        # library that did not report "opening" (none here) would count it as the open's.
        opening = at.get("opening", started)
        return {"open": planning - opening, "plan": (opening - started) + (loading - planning),
                "allocate": first - loading, "read": last - first, "report": ended - last}


def _skeleton(args: dict, how: str) -> torch.nn.Module:
    if how == "accelerate":
        from accelerate import init_empty_weights

        with init_empty_weights():
            return MoELM(**args)
    if how == "torch-meta":
        with torch.device("meta"):
            return MoELM(**args)
    import materialize as mz

    if how == "deferred":
        torch.manual_seed(0)
        return mz.deferred_init(MoELM, **args)
    with mz.meta_init():
        return MoELM(**args)


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


def _peak_rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _imported(path: Path) -> Callable[..., Any]:
    """``mz.load``, with the modules it imports on first use for ``path``'s format imported: imports are not
    the load."""
    import materialize as mz

    if path.suffix == ".pt":
        import materialize.checkpoint.torchzip  # noqa: F401
    return mz.load


def child(method: str, path: Path, expected: dict) -> dict:
    """One timed load in this fresh process."""
    # A process's first meta computation imports torch's Python meta kernels (about a second): paid here,
    # untimed, by every method alike.
    torch.ones(3, device="meta").cos()
    load = _imported(path)
    if method.startswith("build-"):
        return _built_alone(method.removeprefix("build-"), expected)
    how = next((how for how in ("deferred", "accelerate") if how in method), "meta")
    if how == "accelerate":
        import accelerate  # noqa: F401  (an import of seconds: not the build)
    built = time.perf_counter()
    model = None if method.startswith("limit") else _skeleton(expected["model_args"], how)
    build_s = time.perf_counter() - built
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak counter from here: the skeleton and imports are not the load
    before = _rss()
    phases: dict[str, float] = {}
    started = time.perf_counter()
    cast = "-cast" in method
    if method.startswith("ours"):
        clock = PhaseClock()
        load(model, path, progress=clock, **({"dtype": torch.float32} if cast else {}))
        ended = time.perf_counter()
        phases = clock.phases(started, ended)
    elif method == "accelerate-cast":  # as bench.methods runs it
        from accelerate import load_checkpoint_and_dispatch

        load_checkpoint_and_dispatch(model, str(path), device_map={"": "cpu"}, dtype=torch.float32)
        ended = time.perf_counter()
    elif method == "safetensors":
        from safetensors.torch import load_file

        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        state = {}
        for file in files:
            state.update(load_file(file))
        read = time.perf_counter()
        model.load_state_dict(state, assign=True)
        ended = time.perf_counter()
        phases = {"read": read - started, "assign": ended - read}
        del state
    elif method == "torch-mmap":
        state = torch.load(path, mmap=True, weights_only=True)
        read = time.perf_counter()
        model.load_state_dict(state, assign=True)
        ended = time.perf_counter()
        phases = {"read": read - started, "assign": ended - read}
        del state
    elif method == "floor":
        from bench.floor import bare_load

        marks = {"open": started}
        bare_load(model, path, lambda step: marks.setdefault(step, time.perf_counter()))
        ended = time.perf_counter()
        steps = [*marks.items(), ("end", ended)]
        phases = {step: following - when for (step, when), (_, following) in zip(steps, steps[1:])}
    elif method == "limit":
        from bench.methods import read_everything

        buffers = read_everything(path, threads=os.cpu_count() or 1, prefaulted=True)
        ended = time.perf_counter()
        phases = {"read": ended - started}
        del buffers
    elif method == "limit-fresh-fp32":  # the cast's floor: its destination's fresh memory alone
        from bench.methods import fresh_memory

        buffers = fresh_memory(path, scale=2, threads=os.cpu_count() or 1)
        ended = time.perf_counter()
        del buffers
    else:
        raise SystemExit(f"unknown method {method}")
    import materialize

    result = {"load_s": ended - started, "build_s": build_s, "phases": phases, "rss_growth": _peak_rss() - before,
              "library": str(Path(materialize.__file__).resolve().parent)}  # which checkout's, with --baseline
    if model is None:
        result["verified"] = True  # raw bytes: nothing to compare by name
    else:
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        # A cast's tensors are fp32, each the file's bf16 exactly: cast back, they are the file's bytes.
        dtype = torch.float32 if cast else torch.bfloat16
        result["verified"] = (len(tensors) == expected["tensors"] and not any(t.is_meta for t in tensors.values())
                              and all(tensors[name].dtype == dtype and crc(tensors[name].to(torch.bfloat16)) == value
                                      for name, value in expected["same"].items()))
    return result


def _built_alone(how: str, expected: dict) -> dict:
    """The model built in this fresh process by ``how`` (see :func:`_skeleton`), timed; no load."""
    import materialize

    if how == "accelerate":
        import accelerate  # noqa: F401  (an import of seconds: not the build)
    before = _rss()
    started = time.perf_counter()
    model = _skeleton(expected["model_args"], how)
    build_s = time.perf_counter() - started
    tensors = [*model.parameters(), *model.buffers()]
    return {"load_s": build_s, "build_s": build_s, "phases": {}, "rss_growth": _peak_rss() - before,
            "library": str(Path(materialize.__file__).resolve().parent),
            "verified": len(tensors) == expected["tensors"] and all(p.is_meta for p in model.parameters())}


def rank_main(method: str, path: Path, expected: dict, store: Path, rank: int, world: int, out: Path) -> None:
    """One rank of an FSDP2 load: the model sharded on meta layer by layer, then filled by ``method``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import materialize as mz

    torch.ones(3, device="meta").cos()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    built = time.perf_counter()
    model = _skeleton(expected["model_args"], "meta").to(torch.bfloat16)  # a DTensor keeps the dtype it is sharded in
    build_s = time.perf_counter() - built
    sharded = time.perf_counter()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shard_s = time.perf_counter() - sharded
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    phases: dict[str, float] = {}
    if method == "fsdp-ours":
        clock = PhaseClock()
        mz.load(model, path, progress=clock)
        phases = clock.phases(started, time.perf_counter())
    else:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        model.to_empty(device="cpu")
        state = load_file(path) if rank == 0 else {}
        read = time.perf_counter()
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        phases = {"read": read - started, "assign": time.perf_counter() - read}
        del state
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = dict(model.named_parameters())
    checked = expected["names"][:: max(1, len(expected["names"]) // 200)]  # a gather each: a couple of hundred
    verified = all(crc(params[name].full_tensor()) == expected["same"][name] for name in checked)
    out.write_text(json.dumps({"load_s": seconds, "build_s": build_s, "shard_s": shard_s, "phases": phases,
                               "rss_growth": peak - before, "verified": verified}))
    dist.barrier()
    os._exit(0)  # gloo's teardown at exit aborts now and then on its own; the result is written


def child_env(data: str, warm_up: bool = True) -> dict[str, str]:
    """The environment of every measured process. Where bytecode is not written (PYTHONDONTWRITEBYTECODE), a
    fresh process would compile every module it imports that has none written beside it (this checkout's),
    which a user's does not: the children keep theirs under the data folder instead, written by the warm-up.
    With no warm-up (``--no-warm-up``) the environment is left as it is: that folder would hide the bytecode
    installed with every package, and the first measured run would compile all of torch's."""
    env = dict(os.environ)
    if warm_up and env.pop("PYTHONDONTWRITEBYTECODE", None):
        env["PYTHONPYCACHEPREFIX"] = str(Path(data).resolve() / "pycache")
    return env


def _child_command(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "bench.many", "--data", args.data, "--tensors", str(args.tensors),
            "--hidden", str(args.hidden), "--intermediate", str(args.intermediate)]


BASELINE = "@baseline"  # a method's suffix: run on the library of --baseline


def baseline_folder(checkout: Path, data: Path) -> Path:
    """A folder holding only ``materialize``, the package of ``checkout``: a child started there imports it
    (its working folder comes first on its path), and the bench itself from this checkout."""
    folder = data / "baseline-library"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "materialize"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to((checkout / "materialize").resolve(), target_is_directory=True)
    return folder


def _where(args: argparse.Namespace, method: str) -> tuple[str, dict[str, str], Path]:
    """The method without its suffix, and the environment and working folder of its child: the baseline's
    library for a method of :data:`BASELINE`, this checkout's otherwise."""
    env = child_env(args.data, warm_up=not args.no_warm_up)
    if not method.endswith(BASELINE):
        return method, env, ROOT
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return method.removesuffix(BASELINE), env, args.baseline_folder


def run_child(args: argparse.Namespace, method: str, form: str) -> dict:
    method, env, cwd = _where(args, method)
    done = subprocess.run([*_child_command(args), "--one", f"{method},{form}"], capture_output=True, text=True,
                          cwd=cwd, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{method} on {form} failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_scaling(args: argparse.Namespace, method: str) -> dict:
    """One load of ``ours,FORM,COUNT`` on the tiny-tensor checkpoint of that count, in a fresh process."""
    method, env, cwd = _where(args, method)
    name, form, count = method.split(",")
    hidden, intermediate = SCALING_SHAPE
    command = [sys.executable, "-m", "bench.many", "--data", args.data, "--tensors", count, "--hidden", str(hidden),
               "--intermediate", str(intermediate), "--one", f"{name},{form}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{method} failed: {done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["tensors"] = json.loads(ensure(Path(args.data), int(count), hidden, intermediate)["expected"].read_text())["tensors"]
    return result


def run_fsdp(args: argparse.Namespace, method: str, scratch: Path) -> dict:
    """One FSDP2 load on fresh processes: the slowest rank's times, the largest rank's memory."""
    scratch.mkdir(parents=True, exist_ok=True)
    store = scratch / "store"
    store.unlink(missing_ok=True)
    outs = [scratch / f"rank{rank}.json" for rank in range(FSDP_WORLD)]
    for out in outs:
        out.unlink(missing_ok=True)
    method, env, cwd = _where(args, method)
    processes = [subprocess.Popen([*_child_command(args), "--rank", f"{method},{rank},{FSDP_WORLD},{store},{out}"],
                                  cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for rank, out in enumerate(outs)]
    errors = [process.communicate(timeout=3600)[1] for process in processes]
    if not all(out.exists() for out in outs):
        raise RuntimeError(f"{method}: a rank wrote no result: {errors[0][-3000:]}")
    ranks = [json.loads(out.read_text()) for out in outs]
    slowest = max(ranks, key=lambda rank: rank["load_s"])
    return {"load_s": slowest["load_s"], "build_s": max(r["build_s"] for r in ranks),
            "shard_s": max(r["shard_s"] for r in ranks), "phases": slowest["phases"],
            "rss_growth": max(r["rss_growth"] for r in ranks), "verified": all(r["verified"] for r in ranks)}


def inspect_command() -> list[str]:
    script = Path(sys.executable).parent / "materialize"
    return [str(script)] if script.exists() else [sys.executable, "-c", "from materialize_cli.main import main; main()"]


def run_inspect(args: argparse.Namespace, method: str, paths: dict[str, Path]) -> dict:
    """The CLI's ``inspect`` in a subprocess, its listing discarded: wall seconds, start-up included."""
    method, env, cwd = _where(args, method)
    if cwd != ROOT:  # the command's own folder comes first on its path: the baseline's package, from PYTHONPATH
        env["PYTHONPATH"] = os.pathsep.join([str(cwd), env["PYTHONPATH"]])
    if method == "startup":
        command = [sys.executable, "-c", "import materialize"]
    else:
        command = [*inspect_command(), "inspect", str(paths[method.removeprefix("inspect-")])]
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env)
    seconds = time.perf_counter() - started
    listed = done.stdout.count(b"\n")
    return {"load_s": seconds, "verified": done.returncode == 0 and (method == "startup" or listed >= 1),
            "lines": listed}


def run_cold(args: argparse.Namespace, method: str, paths: dict[str, Path]) -> dict:
    """A method of the ``cold`` group (``inspect-FORM``, or ``METHOD:FORM`` for a load), its files evicted first."""
    from bench.run import evict

    name = method.removesuffix(BASELINE)
    suffix = method[len(name):]
    if name.startswith("inspect-"):
        evict(paths[name.removeprefix("inspect-")])
        return run_inspect(args, method, paths)
    load, form = name.split(":")
    evict(paths[form])
    return run_child(args, load + suffix, form)


def profile_child(method: str, form: str, path: Path, expected: dict, out: Path) -> None:
    """``method`` once under cProfile: the heaviest functions by own time and by cumulative time."""
    torch.ones(3, device="meta").cos()
    load = _imported(path)
    model = _skeleton(expected["model_args"], "deferred" if "deferred" in method else "meta")
    profiler = cProfile.Profile()
    clock = PhaseClock()
    started = time.perf_counter()
    profiler.enable()
    load(model, path, progress=clock)
    profiler.disable()
    ended = time.perf_counter()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    phases = clock.phases(started, ended)
    text.write(f"{method} on {FORM_WORDS[form]} ({expected['tensors']} tensors), under cProfile: {ended - started:.3f} s; "
               + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in phases.items()) + "\n")
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(70)
    out.mkdir(parents=True, exist_ok=True)
    stats.dump_stats(out / f"{method}-{form}.prof")
    (out / f"{method}-{form}.txt").write_text(text.getvalue().replace(str(ROOT) + "/", ""))


def summarize(rows: list[dict]) -> dict:
    times = [row["load_s"] for row in rows]
    summary: dict[str, Any] = {"load_s": statistics.median(times), "runs": times,
                               "verified": all(row["verified"] for row in rows)}
    for key in ("build_s", "shard_s", "rss_growth", "lines", "tensors"):
        if all(key in row for row in rows):
            summary[key] = statistics.median(row[key] for row in rows)
    if all("library" in row for row in rows):
        summary["library"] = rows[0]["library"]
    names = [name for name in PHASES if all(name in row.get("phases", {}) for row in rows)]
    if names:
        summary["phases"] = {name: statistics.median(row["phases"][name] for row in rows) for name in names}
    return summary


def markdown(report: dict) -> str:
    m, tensors = report["machine"], report["tensors"]
    lines = [f"{tensors:,} tensors, {report['nbytes'] / 1e9:.2f} GB of bf16 ({report['shape']}); {m['cpu']}, "
             f"{m['cores']} cores, {m['memory_gb']} GiB, Linux {m['kernel']}, torch {m['torch']}. Median of "
             f"{report['runs']} runs {after(not report.get('warm_up', True))}, the methods of a group taking turns "
             "(fastest and slowest beside it); each run a fresh process, page cache warm. Load s: the load alone "
             "(the model built "
             "before the clock, build s); us/tensor above the read: (load - the raw read of the same files, for the "
             "cast its floor) / tensors. transformers' from_pretrained is left out: its MoE classes fuse a layer's experts into "
             "3-D tensors (see bench/many.py).", ""]
    groups = [group for group in GROUPS if group in report["results"]]
    for group in groups:
        rows = report["results"][group]
        if group in ("inspect", "scaling", "cold"):
            continue
        limit = next((row for label, row in rows.items() if label.startswith("limit")), None)
        peer = next((row for label, row in rows.items() if label.startswith("accelerate")), None)
        lines += [f"**{GROUP_WORDS[group]}**", "",
                  "| method | load s | min-max s | x ours |" + (" x accelerate |" if peer else "")
                  + f" us/tensor above the {'floor' if group == 'cast' else 'read'} | build s |"
                  + (" shard s |" if group == "fsdp2" else "") + " RSS growth GB | verified |",
                  "| --- | ---: | ---: | ---: |" + (" ---: |" if peer else "") + " ---: | ---: |"
                  + (" ---: |" if group == "fsdp2" else "") + " ---: | --- |"]
        ours = next(iter(rows.values()))
        for label, row in rows.items():
            above = ("-" if limit is None or row is limit
                     else f"{(row['load_s'] - limit['load_s']) / tensors * 1e6:.1f}")
            lines.append(f"| {label} | {row['load_s']:.3f} | {min(row['runs']):.3f}-{max(row['runs']):.3f} | "
                         f"{row['load_s'] / ours['load_s']:.2f} |"
                         + (f" {row['load_s'] / peer['load_s']:.2f} |" if peer else "")
                         + f" {above} | {row.get('build_s', 0):.2f} |"
                         + (f" {row['shard_s']:.2f} |" if group == "fsdp2" else "")
                         + f" {row.get('rss_growth', 0) / 1e9:.2f} | {'yes' if row['verified'] else 'NO'} |")
        lines.append("")
    phased = [(group, label, row) for group in groups if group not in ("inspect", "scaling", "cold")
              for label, row in report["results"][group].items() if "phases" in row]
    if phased:
        lines += ["Phases (median seconds; us a tensor in brackets). Ours: open (headers, index, pickle scan), plan, "
                  "allocate (allocation, registration, read jobs), read (first to last byte), report; a library that "
                  "reports no steps (ccd4344 and before) has no open and plan, its allocate is all before the first "
                  "byte. Peers: read is load_file / torch.load, assign is load_state_dict(assign=True) "
                  "(set_model_state_dict under FSDP2).",
                  "", "| form | method | " + " | ".join(PHASES) + " |", "| --- | --- |" + " ---: |" * len(PHASES)]
        for group, label, row in phased:
            cells = [f"{row['phases'][name]:.3f} ({row['phases'][name] / tensors * 1e6:.1f})"
                     if name in row["phases"] else "-" for name in PHASES]
            lines.append(f"| {GROUP_WORDS[group]} | {label} | " + " | ".join(cells) + " |")
        lines.append("")
    if "scaling" in report["results"]:
        lines += ["**Ours as the tensors grow** (tiny experts of 16 x 8, so the bytes cost nothing; median seconds, "
                  "us a tensor in brackets)", "", "| tensors, form | load | " + " | ".join(PHASES[:4] + PHASES[5:]) + " |",
                  "| --- |" + " ---: |" * 6]
        for label, row in report["results"]["scaling"].items():
            count = row["tensors"]
            cells = [f"{row['phases'][name]:.3f} ({row['phases'][name] / count * 1e6:.1f})"
                     for name in PHASES if name != "assign"]
            lines.append(f"| {label} | {row['load_s']:.3f} ({row['load_s'] / count * 1e6:.1f}) | " + " | ".join(cells) + " |")
        lines.append("")
    if "inspect" in report["results"]:
        lines += ["**materialize inspect** (CLI subprocess, wall seconds, interpreter start-up included; the listing "
                  "discarded)", "", "| command | s | min-max s | lines listed | verified |", "| --- | ---: | ---: | ---: | --- |"]
        for label, row in report["results"]["inspect"].items():
            lines.append(f"| {label} | {row['load_s']:.3f} | {min(row['runs']):.3f}-{max(row['runs']):.3f} | "
                         f"{int(row.get('lines', 0))} | {'yes' if row['verified'] else 'NO'} |")
        lines.append("")
    if "cold" in report["results"]:
        lines += ["**Cold**: each run with its file dropped from the page cache first (wall seconds; inspect as a CLI "
                  "subprocess, start-up included; a load's open and read phases beside it)", "",
                  "| method | s | min-max s | open s | read s | verified |", "| --- | ---: | ---: | ---: | ---: | --- |"]
        for label, row in report["results"]["cold"].items():
            phases = row.get("phases", {})
            cells = " | ".join(f"{phases[name]:.3f}" if name in phases else "-" for name in ("open", "read"))
            lines.append(f"| {label} | {row['load_s']:.3f} | {min(row['runs']):.3f}-{max(row['runs']):.3f} | {cells} | "
                         f"{'yes' if row['verified'] else 'NO'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100_000, help="about this many tensors (default 100,000)")
    parser.add_argument("--hidden", type=int, default=128, help="the model's width: experts are hidden x intermediate")
    parser.add_argument("--intermediate", type=int, default=96)
    parser.add_argument("--data", default="data/bench")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scaling-counts", default=SCALING_COUNTS,
                        help="the tensor counts of the scaling group (tiny tensors), comma-separated")
    parser.add_argument("--baseline", help="a checkout of the library to compare with, in the same run: ours on "
                                           "its materialize package takes turns with ours on this one's")
    parser.add_argument("--baseline-name", default="baseline", help="how the tables name --baseline's rows")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="no discarded first run (for a quick check); the children's bytecode as the environment "
                             "has it (see child_env)")
    parser.add_argument("--groups", help=f"comma-separated, of {', '.join(GROUPS)} (default all)")
    parser.add_argument("--merge", action="store_true", help="keep the other groups of an earlier report in --out")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the table: ours once per form under cProfile, into --out/many-profile/")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--name", default="bench-many", help="the results' file name, without .md/.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    parser.add_argument("--profile-one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.data = str(Path(args.data).resolve())  # children may start in another folder (--baseline)
    paths = ensure(Path(args.data), args.tensors, args.hidden, args.intermediate)
    expected = json.loads(paths["expected"].read_text())
    if args.one:
        method, form = args.one.split(",")
        print(json.dumps(child(method, paths[form], expected)))
        return
    if args.rank:
        method, rank, world, store, out = args.rank.split(",")
        rank_main(method, paths["single"], expected, Path(store), int(rank), int(world), Path(out))
        return
    if args.profile_one:
        method, form = args.profile_one.split(",")
        profile_child(method, form, paths[form], expected, Path(args.out) / "many-profile")
        return
    from bench.run import machine, recache

    recache({form: paths[form] for form in FORMS})
    if args.profile:
        for form in FORMS:
            subprocess.run([*_child_command(args), "--out", args.out, "--profile-one", f"ours,{form}"], cwd=ROOT,
                           env=child_env(args.data), check=True)
        return
    wanted = args.groups.split(",") if args.groups else list(GROUPS)
    args.baseline_folder = baseline_folder(Path(args.baseline), Path(args.data)) if args.baseline else None
    out = Path(args.out)
    earlier = out / f"{args.name}.json"
    report = json.loads(earlier.read_text()) if args.merge and earlier.exists() else {"results": {}}
    report.update(machine=machine(), runs=args.runs, warm_up=not args.no_warm_up, tensors=expected["tensors"],
                  nbytes=expected["nbytes"],
                  model_args=expected["model_args"],
                  shape=f"{expected['model_args']['num_layers']} layers of {expected['model_args']['num_experts']} "
                        f"experts, {args.hidden} x {args.intermediate} projections")
    scratch = Path(args.data).resolve() / "many-runs"  # a file:// store wants an absolute path
    for group in wanted:
        methods = with_baseline(GROUPS[group], group, args.baseline_name) if args.baseline else GROUPS[group]
        run: Callable[[str], dict]
        if group == "scaling":
            counts = {int(count): json.loads(ensure(Path(args.data), int(count), *SCALING_SHAPE)["expected"].read_text())
                      ["tensors"] for count in args.scaling_counts.split(",")}  # written before the clock
            methods = scaling_methods(counts)
            if args.baseline:
                methods = {key: value for label, method in methods.items()
                           for key, value in ((label, method), (f"{label}, {args.baseline_name}", method + BASELINE))}
            run = lambda method: run_scaling(args, method)  # noqa: E731
        elif group == "fsdp2":
            run = lambda method: run_fsdp(args, method, scratch)  # noqa: E731
        elif group == "inspect":
            run = lambda method: run_inspect(args, method, paths)  # noqa: E731
        elif group == "cold":
            run = lambda method: run_cold(args, method, paths)  # noqa: E731
        else:
            run = lambda method, form=GROUP_FORMS.get(group, group): run_child(args, method, form)  # noqa: E731
        measured = take_turns(methods, run, args.runs, warm_up=not args.no_warm_up)
        if group == "cold":  # the groups after it read warm files
            recache({form: paths[form] for form in FORMS})
        report["results"][group] = {label: summarize(rows) for label, rows in measured.items()}
        report["results"] = {g: report["results"][g] for g in GROUPS if g in report["results"]}
        out.mkdir(parents=True, exist_ok=True)  # after each group: a run cut short keeps what it measured
        (out / f"{args.name}.json").write_text(json.dumps(report, indent=2))
        (out / f"{args.name}.md").write_text(markdown(report))
        print(f"{group}: " + "; ".join(f"{label} {row['load_s']:.3f} s" for label, row in report["results"][group].items()),
              flush=True)
    print()
    print(markdown(report))


if __name__ == "__main__":
    main()
