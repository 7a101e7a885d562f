"""torch-materialize: build on meta, open checkpoints lazily, allocate every tensor once.

::

    import materialize as mz

    with mz.meta_init():
        model = MyModel(cfg)                      # parameters on meta, buffers real
    report = mz.load(model, "ckpt/", device="cuda", dtype="bf16")
    print(report)

The names below are imported on first use, so tools that only read headers
(``materialize inspect`` on safetensors) never pay for importing torch.

Logging: each module logs to ``logging.getLogger(__name__)``, a child of the
``materialize`` logger, what a call chose or fell back to without being asked
(which of a folder's checkpoints it read, the checkpoint's dtype kept, a
retried request): INFO for those, DEBUG for detail. The library prints none
of it: ``materialize`` holds a ``NullHandler`` and nothing else, so records
go only where the application sends them (``logging.basicConfig(level=logging.INFO)``,
or a handler on ``logging.getLogger("materialize")``); the CLI's ``-v``
shows them on stderr. What needs the user's attention is a warning
(``materialize.MaterializeWarning``), never only a log record.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Quiet unless the application configures logging: records of materialize.* reach its handlers (the root's
# included), never Python's last-resort handler on stderr.
logging.getLogger(__name__).addHandler(logging.NullHandler())

# public name -> the module that defines it
_EXPORTS = {
    "meta_init": "skeleton.meta",
    "deferred_init": "skeleton.deferred",
    "materialize": "api",
    "build": "skeleton.spec",
    "open_checkpoint": "checkpoint",
    "Checkpoint": "checkpoint",
    "TensorInfo": "checkpoint",
    "inspect": "inspection",
    "load": "loading",
    "load_model": "api",
    "load_tensors": "api",
    "plan": "api",
    "check_memory": "api",
    "Plan": "planning.plan",
    "TensorsPlan": "planning.plan",
    "Report": "report",
    "KeyMap": "planning.keymap",
    "MaterializeError": "errors",
    "CheckpointError": "errors",
    "BudgetError": "errors",
    "CheckpointNotFoundError": "errors",
    "CheckpointAccessError": "errors",
    "UnsupportedFormatError": "errors",
    "UnsafeCheckpointError": "errors",
    "StateDictKeyError": "errors",
    "KeyMismatchError": "errors",
    "ShapeMismatchError": "errors",
    "NothingLoadedError": "errors",
    "InitError": "errors",
    "MetaInitError": "errors",
    "ReplayError": "errors",
    "ModelSpecError": "errors",
    "ModelSpecUsageError": "errors",
    "CastOverflowError": "errors",
    "SanitizerError": "errors",
    "ModelRequiredError": "errors",
    "DeviceError": "errors",
    "ShardingError": "errors",
    "OutputError": "errors",
    "ExpansionError": "errors",
    "AllocationError": "errors",
    "LowMemoryWarning": "errors",
    "MostlyInitializedWarning": "errors",
    "MaterializeWarning": "errors",
    "ConvertWarning": "errors",
    "convert": "conversion",
    "ConvertReport": "conversion",
    "Progress": "progress",
    "RemoteOptions": "sources.settings",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'materialize' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from .checkpoint import Checkpoint, TensorInfo, open_checkpoint
    from .inspection import inspect
    from .conversion import ConvertReport, convert
    from .errors import (
        AllocationError,
        BudgetError,
        CastOverflowError,
        CheckpointAccessError,
        CheckpointError,
        CheckpointNotFoundError,
        DeviceError,
        ExpansionError,
        InitError,
        KeyMismatchError,
        MaterializeError,
        ModelRequiredError,
        ModelSpecError,
        ModelSpecUsageError,
        MostlyInitializedWarning,
        NothingLoadedError,
        OutputError,
        ReplayError,
        SanitizerError,
        ShardingError,
        ShapeMismatchError,
        UnsafeCheckpointError,
        UnsupportedFormatError,
    )
    from .planning.keymap import KeyMap
    from .loading import load
    from .skeleton.meta import meta_init
    from .skeleton.deferred import deferred_init
    from .planning.plan import Plan, TensorsPlan
    from .report import Report
    from .api import load_model, load_tensors, materialize, plan
    from .skeleton.spec import build
