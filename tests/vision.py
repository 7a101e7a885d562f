"""timm and torchvision, importable beside the CPU torch the tests run on.

``make test`` installs them apart from the venv's packages, in ``.venv/vision`` (requirements-vision.txt),
and only this module puts that folder on ``sys.path``: transformers imports torchvision wherever it can be
imported, so the broken import described below would otherwise break every process that uses transformers.

torchvision's wheels on PyPI are CUDA builds. Beside the CPU torch of the locked environment its compiled
ops (``torchvision/_C.so``, linked against CUDA's libraries) do not load, which torchvision tolerates, but
then its import stops at two fake-kernel registrations it makes unconditionally (``torchvision::nms`` and
``qnms``): ``RuntimeError: operator torchvision::nms does not exist``. ``import timm`` imports torchvision,
so it fails the same way.

Where that is the failure, :func:`import_torchvision` declares the two operators' schemas (no kernel: a
call would raise) and imports again. The model code the tests use is pure Python and never calls them, so
the models are the libraries' own. Where the compiled ops load (a CPU or matching CUDA build), nothing is
declared. A subprocess (the CLI) gets the same through :func:`pythonpath_with_shim`.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Optional

import torch

VISION_PACKAGES = Path(sys.prefix) / "vision"  # see the Makefile; absent in make test-oldest's venvs
_MISSING_OP = "operator torchvision::nms does not exist"
_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_declared: list[torch.library.Library] = []  # kept alive: a Library's definitions go with it


def import_torchvision() -> Optional[types.ModuleType]:
    """torchvision, or None where it is not installed (make test-oldest's venvs)."""
    if VISION_PACKAGES.is_dir() and str(VISION_PACKAGES) not in sys.path:
        sys.path.append(str(VISION_PACKAGES))  # last: nothing of the venv's own is shadowed
    try:
        import torchvision
    except ImportError:
        return None
    except RuntimeError as error:
        if _MISSING_OP not in str(error) or _declared:
            raise
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]  # the half-imported package goes; the import below starts afresh
        library = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS:
            library.define(schema)
        _declared.append(library)
        import torchvision
    return torchvision


def compiled_ops_load() -> bool:
    """Whether torchvision imports without the declared schemas (its compiled ops loaded)."""
    return import_torchvision() is not None and not _declared


_SITECUSTOMIZE = """\
import sys
sys.path.insert(0, {tests!r})
import vision
vision.import_torchvision()
"""


def pythonpath_with_shim(folder: Path) -> dict[str, str]:
    """An environment whose Python imports torchvision as :func:`import_torchvision` does, at start-up."""
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(tests=str(Path(__file__).parent)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def pythonpath_without_shim() -> dict[str, str]:
    """An environment that finds timm and torchvision as a user's would, and imports them with no help."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(VISION_PACKAGES)]))}
