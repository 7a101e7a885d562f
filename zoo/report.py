"""The zoo's results as ``docs/zoo.md``, and its failing cases added to ``tests/zoo_failed.txt``.

Failures are grouped by cause: a difference's text with tensor and module names, numbers and values taken
out (``[materialize] <name>: __dict__ mz={} ref={...}``), so one cause over a hundred classes is one row
with its count and an example. A case is counted under every cause its differences show.
"""

from __future__ import annotations

import importlib

import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable

from zoo.cases import LIBRARIES, ORACLES, split

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "zoo.md"
FAILED_LIST = ROOT / "tests" / "zoo_failed.txt"
STATUSES = ("equal", "skipped", "refused", "different", "error", "timeout", "crashed")
FAILING = ("refused", "different", "error", "timeout", "crashed")

_NAME = re.compile(r"^(\[[^\]]*\] )?([\w.]+|ties .*?|module '[^']*' \((\w+)\) attribute (\w+)):")
_VALUES = re.compile(r"(mz|ref)=(<[^>]*>|\{.*?\}|\[.*?\]|\S+)")
_NUMBER = re.compile(r"\b\d+(\.\d+)?\b")
_QUOTED = re.compile(r"'[^']*'")


def cause(text: str) -> str:
    """What a difference or an error says, without the names and values that vary from case to case."""
    text = re.sub(r"/[^\s:']*/", "", text)  # a scratch folder's path: the same cause in every case
    match = _NAME.match(text)
    if match:
        stage = match.group(1) or ""
        subject = f"module attribute {match.group(4)}" if match.group(4) else "<tensor>"
        if match.group(2).startswith("ties"):
            subject = "ties"
        rest = text[match.end():]
        what = rest.split(" mz=")[0].strip() if " mz=" in rest else rest.strip()
        if what.startswith("__dict__"):
            keys = sorted(set(re.findall(r"'(\w+)':", rest.split(" ref=")[-1])) ^
                          set(re.findall(r"'(\w+)':", rest.split(" ref=")[0])))
            what = f"__dict__ differs in {keys}"
        what = _NUMBER.sub("N", what)
        return f"{stage}{subject}: {what}"[:200]
    text = re.sub(r"^\w+ builds at no tiny level: ", "no tiny level builds: ", text)  # one row per error, not per class
    text = _QUOTED.sub("'…'", _NUMBER.sub("N", text))
    return text[:160]


def _causes(result: dict[str, Any]) -> list[str]:
    if result["status"] == "different":
        return sorted({cause(d) for d in result.get("differences", [result.get("detail", "")])})
    return [cause(result.get("detail", ""))]


def _cell(text: Any, limit: int = 220) -> str:
    text = " ".join(str(text).split())
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*").replace("_", "\\_")


def _versions() -> str:
    try:
        from zoo.vision import import_libraries

        import_libraries()  # timm and torchvision live apart (.venv/vision): their versions from their modules
    except ImportError:
        pass
    found = []
    for package in ("torch", "transformers", "timm", "torchvision", "peft", "diffusers"):
        try:
            found.append(f"{package} {importlib.import_module(package).__version__}")
        except Exception:
            found.append(f"{package} (not installed)")
    return ", ".join(found)


def render(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "# The model zoo",
        "",
        "Every model class transformers registers in its auto mappings, the smallest model of every timm family",
        "and every torchvision builder, each under two oracles (the cases are listed by the libraries; `zoo/`",
        "generates them, nothing is hand-listed):",
        "",
        "- **deferred**: `torch.manual_seed(0); mz.deferred_init(build)` then `mz.materialize` equals",
        "  `torch.manual_seed(0); build()` bit for bit (values, dtypes, strides, parameter classes, their",
        "  attributes, `requires_grad`, ties, modules' attributes), and so does a recorded model given a file of",
        "  every other tensor with `mz.load(..., strict=False)`. Tensors two eager constructions disagree on",
        "  (memory `torch.empty` left as it was) are compared for everything but their values.",
        "- **load**: for transformers, `mz.load_model(folder)` equals `Class.from_pretrained(folder)` for what",
        "  `save_pretrained` wrote (one of eight variants per class by a stable hash of its name: sharded or",
        "  not, safetensors or torch `.bin`, fp32 or bf16), then a forward on a tiny input where the class has",
        "  the usual arguments; for timm and torchvision, `mz.build(\"timm:NAME\")` + `mz.load(model, file)`",
        "  equals the eager model given the same file by `load_state_dict`, then a forward.",
        "",
        "peft and diffusers are two more libraries, their cases listed by the libraries too:",
        "",
        "- **peft**: every tuner type peft registers (its `PeftType`s and their config classes:",
        "  `zoo/peft_cases.py`) on a tiny `LlamaForCausalLM`, its config the class's defaults with what rules",
        "  over field names make tiny (ranks, block and group sizes, frequencies) or give where the tuner asks",
        "  (virtual tokens, token indices, a step count, the LoRA adapters X-LoRA mixes), the target modules",
        "  peft picks for a Llama. **deferred**: `mz.deferred_init(lambda: get_peft_model(base(), config))`",
        "  as above. **load**, three ways a user loads one: `TYPE/adapter`, the base saved with",
        "  `save_pretrained` and the adapter with peft's, `mz.load_model` of the base then",
        "  `PeftModel.from_pretrained` against `from_pretrained` then the same; `TYPE/whole`, the adapted model",
        "  built under `mz.meta_init()` given its whole state by `mz.load` against eager + `load_state_dict`;",
        "  `TYPE/merged`, `merge_and_unload()` saved, `mz.load_model` against `from_pretrained` (skipped where",
        "  the tuner does not merge). Each compares every tensor and a forward on a tiny input.",
        "- **diffusers**: every class diffusers exports that subclasses `ModelMixin` (`zoo/diffusers_cases.py`),",
        "  its config the constructor's defaults shrunk by `zoo/tiny.py`'s rules and a few of diffusers' own",
        "  (group norms' groups, layers per block, rotary axes adding up to the head dim, widths by size).",
        "  **deferred** as above; **load**: `save_pretrained` (one of four variants by a stable hash: sharded",
        "  or not, safetensors or `.bin`), then the model built under `mz.meta_init()` from the saved config",
        "  and given the folder by `mz.load` (`mz.load_model` builds transformers models only) against",
        "  `Class.from_pretrained(folder)`, then a forward where the class takes the usual arguments.",
        "",
        "Transformers classes are built from a tiny config made from the config class's defaults by rules over",
        "attribute names (`zoo/tiny.py`: widths, layers, heads, experts, vocabulary, image sizes, nested",
        "configs). A class whose own eager construction fails at every tiny level, or whose reference path",
        "(`from_pretrained`, `load_state_dict`) fails on its own save, is **skipped** with the reason.",
        "**refused** is a `MaterializeError`; **different** is a difference found by the oracle (the first one",
        "shown); **error** is any other exception; **timeout** and **crashed** are what the runner saw of a",
        "worker. Every failing case is added to `tests/zoo_failed.txt`, which `make test` runs beside a sample.",
        "",
        "torch itself is three more libraries of cases, generated from torch as the others are from theirs:",
        "",
        "- **torch**: every `nn.Module` class `torch.nn` and `torch.ao.nn` export (quantized, dynamic, qat,",
        "  intrinsic, quantizable, reference, sparse: `zoo/torchnn.py`), built from tiny arguments made by rules",
        "  over parameter names (`zoo/torchnn_args.py`), at its defaults, at each flag of its signature alone",
        "  (`LSTM[bidirectional]`, `Conv2d[padding_mode=circular]`) and at every flag at once, and under each",
        "  parametrization (`weight_norm`, `spectral_norm`, `orthogonal`, the older `torch.nn.utils` ones) of",
        "  each kind of weight (`LSTM+spectral_norm(weight_hh_l0)`); both oracles. A variant the rules cannot",
        "  build (no rule for a required argument, a flag the class refuses) is **skipped** with torch's reason;",
        "  a lazy module is given its first forward as it is built. Its load oracle saves a",
        "  trained state (a torch file or safetensors by a stable hash of the name), then compares",
        "  `mz.meta_init()` + `mz.load` with eager + `load_state_dict`: tensors, every `state_dict()` entry",
        "  (packed quantized weights too), the tensors modules keep in their `__dict__`, and a forward on a",
        "  tiny input where the rules know one (RNNs, attention and transformers included).",
        "- **linalg**: every `torch.linalg` function called in a constructor that keeps its results as",
        "  parameters and buffers (`zoo/linalg.py`; inputs by rules: square, symmetric positive definite,",
        "  triangular, tall; float32, batched, complex64); the deferred oracle.",
        "- **loadcode**: each kind of load code torch runs (`zoo/loadcode.py`): load pre-hooks by each",
        "  registration API, `_load_from_state_dict` overrides, post-hooks, extra state, versioned `_metadata`,",
        "  `__setstate__` of a module pickled whole; the load oracle against torch's own load of the same file.",
        "",
        "A refusal the docs name as one (a quantized module under `deferred_init`, a file of quantized tensors,",
        "an op with no meta kernel, load code computing a tensor from checkpoint values) is the one other answer",
        "these oracles accept: such cases are listed in `tests/zoo_failed.txt` with that cause. Listing the torch",
        "cases builds every class at every flag: the list is kept in `zoo/torch_variants.json`",
        "(`python -m zoo.torchnn` remakes it), as timm's families are.",
        "",
        "Run it with `make zoo` (resumable: `data/zoo/results.jsonl`); `python -m zoo.run --help` for more.",
        "timm's family representatives come from `zoo/timm_families.json` (`python -m zoo.vision` remakes it).",
        "",
        f"Last run with {_versions()}: {len(results)} cases.",
        "",
        "## Counts",
        "",
        "| library | oracle | cases | " + " | ".join(STATUSES) + " |",
        "|---|---|---:|" + "---:|" * len(STATUSES),
    ]
    counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for case, result in results.items():
        library, oracle, _ = split(case)
        counts[library, oracle][result["status"]] += 1
    for library in LIBRARIES:
        for oracle in ORACLES:
            c = counts.get((library, oracle), Counter())
            if not c:
                continue  # not run, or an oracle the library has not (linalg is deferred only, loadcode load only)
            lines.append(f"| {library} | {oracle} | {sum(c.values())} | " + " | ".join(str(c[s]) for s in STATUSES) + " |")
    lines += _open_causes(results)
    lines += _grouped("Failures by cause", [r for r in results.values() if r["status"] in FAILING], with_status=True)
    lines += _grouped("Skips by reason", [r for r in results.values() if r["status"] == "skipped"], with_status=False)
    lines += ["", "## Every case", "", "| case | status | first difference, reason or notes |", "|---|---|---|"]
    for case in sorted(results):
        result = results[case]
        detail = result.get("detail") or "; ".join(result.get("notes", []))
        lines.append(f"| {_cell(case, 120)} | {result['status']} | {_cell(detail)} |")
    return "\n".join(lines) + "\n"


def _open_causes(results: dict[str, dict[str, Any]]) -> list[str]:
    """The differences and refusals left open on purpose, each with the cause ``tests/zoo_failed.txt`` gives."""
    known = {case: reason for case, reason in known_differences().items() if reason}
    lines = ["", "## Left open, with their causes", ""]
    if not known:
        return lines + ["None.", ""]
    lines += ["Each runs in `make test` as a case that must still fail; fixed, it fails there until unlisted.", "",
              "| case | last status | cause |", "|---|---|---|"]
    for case, reason in sorted(known.items()):
        lines.append(f"| {_cell(case, 120)} | {results.get(case, {}).get('status', 'not run')} | {_cell(reason, 300)} |")
    return lines


def _grouped(title: str, failing: list[dict[str, Any]], *, with_status: bool) -> list[str]:
    lines = ["", f"## {title}", ""]
    if not failing:
        return lines + ["None.", ""]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for result in failing:
        for key in _causes(result):
            groups[result["status"] if with_status else "skipped", key].append(result)
    lines += ["| status | cause | cases | example |", "|---|---|---:|---|"]
    for (status, key), members in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        example = members[0]
        text = next((d for d in example.get("differences", []) if cause(d) == key), example.get("detail", ""))
        lines.append(f"| {status} | {_cell(key, 160)} | {len(members)} | {_cell(example['case'], 80)}: {_cell(text, 200)} |")
    return lines


def add_failed(results: Iterable[dict[str, Any]], path: Path = FAILED_LIST) -> list[str]:
    """Add every failing case not yet listed; returns those added. The list only grows (cases are removed by hand)."""
    listed = read_failed(path)
    new = sorted({r["case"] for r in results if r["status"] in FAILING} - set(listed))
    if new:
        with path.open("a") as out:
            out.writelines(f"{case}\n" for case in new)
    return new


def read_failed(path: Path = FAILED_LIST) -> list[str]:
    return list(known_differences(path))


def known_differences(path: Path = FAILED_LIST) -> dict[str, str]:
    """Each listed case, with the reason it still differs where a line gives one (``case | reason``): those
    run as expected failures that must fail, so a fix shows as one to unlist."""
    if not path.exists():
        return {}
    listed = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            case, _, reason = line.partition("|")
            listed[case.strip()] = reason.strip()
    return listed


def write_report(results: dict[str, dict[str, Any]]) -> None:
    DOC.write_text(render(results))
    added = add_failed(results.values())
    print(f"wrote {DOC.relative_to(ROOT)}; {len(added)} failing cases added to {FAILED_LIST.relative_to(ROOT)}")
