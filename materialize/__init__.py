"""torch-materialize: build on meta, open checkpoints lazily, allocate every tensor once.

::

    import materialize as mz

    with mz.meta_init():
        model = MyModel(cfg)                      # parameters on meta, buffers real
    report = mz.load(model, "ckpt/", device="cuda", dtype="bf16")
    print(report)
"""

from .checkpoint import Checkpoint, TensorInfo, open_checkpoint
from .errors import (
    CheckpointAccessError,
    CheckpointError,
    CheckpointNotFoundError,
    DeviceError,
    InitError,
    KeyMismatchError,
    MaterializeError,
    ModelSpecError,
    ShapeMismatchError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from .keymap import KeyMap
from .loading import load, load_model, load_tensors, plan
from .meta import meta_init
from .planning import Plan
from .report import Report
from .spec import build

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointAccessError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "DeviceError",
    "InitError",
    "KeyMap",
    "KeyMismatchError",
    "MaterializeError",
    "ModelSpecError",
    "Plan",
    "Report",
    "ShapeMismatchError",
    "TensorInfo",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "build",
    "load",
    "load_model",
    "load_tensors",
    "meta_init",
    "open_checkpoint",
    "plan",
]
