"""Every error the library raises on purpose.

Each class also inherits the builtin it resembles, so callers that catch
``ValueError`` or ``FileNotFoundError`` keep working, and carries the file and
tensor it is about so that a one-line message can always name both.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from .text import hide_url_secrets, printable, shown_url


class MaterializeError(Exception):
    """Base class: a load, build or data error a user can cause.

    Its message shows the file and tensor it is about through
    :func:`~materialize.text.printable`: a name from a hostile file cannot
    drive the terminal or log the message is printed to, nor break the
    message's one line. The exact ones stay in ``path`` and ``tensor``.
    Names written into a message's text are written with ``!r`` or through
    :func:`summarize_names`, which escape them too.

    Attributes:
        path: the file (or folder) the error is about, exactly (a URL as :func:`~materialize.text.shown_url`
            shows it); ``None`` where none.
        tensor: the tensor's name, exactly; ``None`` where the error is about no one tensor.
        reason: the message without the file and tensor in front.
    """

    def __init__(
        self,
        message: str,
        *,
        path: Optional[os.PathLike | str] = None,
        tensor: Optional[str] = None,
    ) -> None:
        self.path = shown_url(os.fspath(path)) if path is not None else None
        self.tensor = tensor
        self.reason = hide_url_secrets(message)
        super().__init__(self._format())

    def _format(self) -> str:
        where = []
        if self.path is not None:
            where.append(printable(self.path))
        if self.tensor is not None:
            where.append(f"tensor '{printable(self.tensor)}'")
        return f"{': '.join(where)}: {self.reason}" if where else self.reason

    def __str__(self) -> str:
        return self._format()


class CheckpointError(MaterializeError, ValueError):
    """A checkpoint file is malformed, truncated or inconsistent."""


class BudgetError(CheckpointError):
    """A file's pickle would build more than the stated bounds allow (nesting, shared references);
    see docs/reliability.md."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint path, or a shard an index names, does not exist."""


class CheckpointAccessError(CheckpointError, PermissionError):
    """A checkpoint exists but cannot be read (permissions, I/O error)."""


class UnsupportedFormatError(CheckpointError):
    """A file in a format this library does not read (TorchScript, a big-endian torch file)."""


class StateDictKeyError(CheckpointError):
    """Which entry of a saved dict holds the model's state needs saying: the file holds several copies of one
    model's (an EMA beside the trained weights), or the entry named with ``state_dict_key`` holds none."""


class UnsafeCheckpointError(CheckpointError):
    """Loading the file would run code it carries; refused without trust_pickle."""


class KeyMismatchError(MaterializeError, LookupError):
    """The model and the checkpoint disagree on which tensors exist.

    Attributes:
        missing: the model's names the checkpoint lacks.
        unexpected: the checkpoint's names the model lacks.
        mismatched: the names whose shapes differ.
        architecture_differs: the names or shapes say the checkpoint was saved from another architecture
            (or another size of it), not that a head or a prefix differs; the CLI then asks whether ``--model``
            is the right one.
    """

    def __init__(
        self,
        message: str,
        *,
        path: Optional[os.PathLike | str] = None,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[str] = (),
        architecture_differs: bool = False,
    ) -> None:
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)
        self.architecture_differs = architecture_differs
        super().__init__(message, path=path)


class ShapeMismatchError(KeyMismatchError, ValueError):
    """A tensor's shape in the checkpoint differs from the model's."""


class NothingLoadedError(KeyMismatchError):
    """A load (or a plan) would take no tensor from the checkpoint while the model has tensors to take:
    ``strict=False``, ``ignore_mismatched_sizes`` or ``ignore_unexpected`` let every difference go, and the
    model would come out initialized, not loaded."""


class InitError(MaterializeError, RuntimeError):
    """A tensor the checkpoint lacks has no initializer to fill it."""


class MetaInitError(MaterializeError, RuntimeError):
    """Building a model under ``meta_init`` asked for the value of a tensor on meta, which has none."""


class ReplayError(MaterializeError, RuntimeError):
    """A recorded construction (``deferred_init``) cannot make a tensor as eager construction made it."""


class CastOverflowError(MaterializeError, OverflowError):
    """A cast to a narrower float type would turn finite values into inf."""


class SanitizerError(MaterializeError, AssertionError):
    """Check mode found a tensor that was not materialized exactly once, as planned."""


class ModelSpecError(MaterializeError, ValueError):
    """A model spec (factory, TOML file) cannot be turned into a model."""


class ModelRequiredError(ModelSpecError):
    """The operation needs a model and the source does not describe one."""


class ModelSpecUsageError(ModelSpecError):
    """The model spec as given cannot be used: not ``module:callable``, nothing to import, arguments the
    factory rejects, a class that does not fit the folder's config. The CLI's usage error (exit 2)."""


class AllocationError(MaterializeError, MemoryError):
    """A tensor's memory cannot be allocated on its device."""


class OutputError(MaterializeError, OSError):
    """A conversion cannot write its output (it exists, or the disk refuses), or a tensor's name cannot be a
    safetensors name (``__metadata__``, a lone surrogate)."""


class ExpansionError(MaterializeError, ValueError):
    """A conversion would write a tensor many times larger than the bytes it reads (a view repeating them)."""


class DeviceError(MaterializeError, RuntimeError):
    """The requested device does not exist or cannot be used."""


class ShardingError(MaterializeError, ValueError):
    """A sharded (DTensor) tensor cannot be read as this rank's part of the checkpoint tensor."""


def summarize_names(names: Sequence[str], limit: int = 8) -> str:
    """A short, one-line rendering of many tensor names (each through :func:`~materialize.text.printable`)."""
    shown = ", ".join(map(printable, names[:limit]))
    extra = len(names) - limit
    return f"{shown} (and {extra} more)" if extra > 0 else shown


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type's name where it has none (or where making the
    message fails: a KeyError about a file's object holds the object, whose ``str`` may raise)."""
    try:
        text = str(error).strip()
    except Exception:  # noqa: BLE001
        return type(error).__name__
    return text.splitlines()[0] if text else type(error).__name__


def torchvision_mismatch(error: BaseException) -> str:
    """Why an import failed on torchvision's own operators, where it did (the error or one it came from): its
    compiled ops were built for another torch build (PyPI's CUDA wheels beside a CPU torch, say), so they did
    not load and its import stopped. transformers imports torchvision wherever it can, so its model code
    fails the same way. Empty otherwise."""
    seen: set[int] = set()
    cause: Optional[BaseException] = error
    while cause is not None and id(cause) not in seen:
        if "torchvision::" in str(cause):
            import torch
            from importlib import metadata

            try:
                installed = f"torchvision {metadata.version('torchvision')}"
            except metadata.PackageNotFoundError:
                installed = "torchvision"
            return (f" ({installed} is installed beside torch {torch.__version__}; its compiled operators were "
                    "built for another torch build)")
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return ""


def described(error: BaseException) -> str:
    """An exception in one line: ``Type: first line of its message`` (its type alone where it has none)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


class MaterializeWarning(UserWarning):
    """A warning of this library's: the CLI prints it as one ``Warning:`` line on stderr."""


class ConvertWarning(MaterializeWarning):
    """``convert`` leaves out what safetensors cannot hold (modules' extra state that is not a tensor), or
    leaves a killed conversion's staging it could not remove."""


class MostlyInitializedWarning(MaterializeWarning):
    """A load (or a plan) gives more of the model's tensors no value from the checkpoint (initialized,
    reinitialized, or kept as built) than it loads from it; see ``Report.mostly_not_loaded``."""


class LowMemoryWarning(MaterializeWarning):
    """A CPU load copies more into host memory than is available now (it fits the machine, so it goes on)."""
