"""The timm and torchvision models of the zoo, listed by the libraries themselves.

timm: one model per family, the family being the module that registers it (``timm.list_modules()``), the
model its smallest by parameter count at default arguments. Counting builds every timm model on meta
(minutes), so the choice is kept in ``zoo/timm_families.json`` with the timm version it was made for;
``python -m zoo.vision`` makes it again, and a different installed timm makes it again on first use (into
``data/zoo/``), so the list never silently follows an old release.

torchvision: every builder of ``torchvision.models.list_models()`` in the classification, detection,
segmentation, video, optical-flow and quantization namespaces, with ``weights=None`` (and
``weights_backbone=None`` where the builder has it: nothing is downloaded).
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
FAMILIES_FILE = Path(__file__).with_name("timm_families.json")
LOCAL_FAMILIES_FILE = ROOT / "data" / "zoo" / "timm_families.json"
TORCHVISION_NAMESPACES = ("", "detection", "segmentation", "video", "optical_flow", "quantization")


def import_libraries() -> None:
    """timm and torchvision as the tests import them (``tests/vision.py``: the shim for PyPI's CUDA build)."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import vision

    if vision.import_torchvision() is None:
        raise ImportError("torchvision is not installed here (make installs it into .venv/vision)")


def _parameters_on_meta(name: str) -> int:
    import timm

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = timm.create_model(name, pretrained=False)
    return sum(p.numel() for p in model.parameters())


def compute_timm_families() -> dict[str, Any]:
    import timm

    families: dict[str, str] = {}
    for module in timm.list_modules():
        sizes = {}
        for name in timm.list_models(module=module):
            try:
                sizes[name] = _parameters_on_meta(name)
            except Exception:  # a model that needs arguments to build: not its family's representative
                continue
        if sizes:
            families[module] = min(sorted(sizes), key=lambda n: sizes[n])
    return {"timm": timm.__version__, "families": families}


@functools.lru_cache(maxsize=None)
def timm_families() -> dict[str, str]:
    """family (timm module) -> its smallest model."""
    import_libraries()
    import timm

    for path in (FAMILIES_FILE, LOCAL_FAMILIES_FILE):
        if path.is_file():
            saved = json.loads(path.read_text())
            if saved["timm"] == timm.__version__:
                return saved["families"]
    computed = compute_timm_families()
    LOCAL_FAMILIES_FILE.parent.mkdir(parents=True, exist_ok=True)
    LOCAL_FAMILIES_FILE.write_text(json.dumps(computed, indent=1, sort_keys=True) + "\n")
    return computed["families"]


@functools.lru_cache(maxsize=None)
def torchvision_builders() -> dict[str, str]:
    """builder name -> its namespace ("" for classification)."""
    import_libraries()
    import torchvision.models as models

    found: dict[str, str] = {}
    for namespace in TORCHVISION_NAMESPACES:
        module = getattr(models, namespace) if namespace else models
        for name in models.list_models(module=module):
            found.setdefault(name, namespace)
    return dict(sorted(found.items()))


def model_args(library: str, name: str) -> dict[str, Any]:
    """The builder's arguments beside the defaults: never weights, and detection at a small image size."""
    if library == "timm":
        return {}
    import torchvision.models as models

    builder = models.get_model_builder(name)
    args: dict[str, Any] = {}
    if "weights_backbone" in inspect.signature(builder).parameters:
        args["weights_backbone"] = None
    if torchvision_builders()[name] == "detection":
        args.update(min_size=64, max_size=96)  # its transform resizes every image to 800 otherwise
    return args


# Above this a torchvision builder is skipped: eager construction, the replay beside it and a saved file are
# each the model's size (regnet_y_128gf, 644 M parameters, 2.6 GB in fp32, did not fit the worker's cap twice;
# vit_h_14 took 107 s a case), and a sampled case must stay cheap in make test., and the zoo's cases stay small.
MAX_PARAMETERS = 150_000_000


def factory(library: str, name: str) -> Callable[[], nn.Module]:
    import_libraries()
    args = model_args(library, name)
    if library == "timm":
        import timm

        return lambda: timm.create_model(name, pretrained=False, **args)
    import torchvision.models as models

    import materialize as mz

    try:
        with mz.meta_init():  # not torch.device("meta"): RegNet reads values to size its stages
            count = sum(p.numel() for p in models.get_model(name, weights=None, **args).parameters())
    except Exception:  # noqa: BLE001 - eager construction fails the same way, and the case says so
        count = 0
    if count > MAX_PARAMETERS:
        from zoo.outcomes import Skipped

        raise Skipped(f"{count:,} parameters (more than {MAX_PARAMETERS:,}): too large for the zoo")
    return lambda: models.get_model(name, weights=None, **args)


def input_sides(library: str, name: str) -> list[int]:
    """Image sides to try a forward at, smallest first (many models accept 64; some need their own)."""
    if library == "timm":
        import timm

        side = timm.get_pretrained_cfg_value(name, "input_size") or (3, 224, 224)
        return [64, side[-1]] if side[-1] != 64 else [64]
    return [64, 224]


def make_input(library: str, name: str, side: int) -> tuple:
    g = torch.Generator().manual_seed(7)
    namespace = torchvision_builders().get(name, "") if library == "torchvision" else ""
    if namespace == "detection":
        return ([torch.rand(3, side, side, generator=g)],)
    if namespace == "video":
        return (torch.randn(1, 3, 16 if side > 64 else 8, side, side, generator=g),)
    if namespace == "optical_flow":
        return (torch.randn(1, 3, side, side, generator=g), torch.randn(1, 3, side, side, generator=g))
    return (torch.randn(1, 3, side, side, generator=g),)


if __name__ == "__main__":
    import_libraries()
    result = compute_timm_families()
    FAMILIES_FILE.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"{len(result['families'])} timm families written to {FAMILIES_FILE}")
