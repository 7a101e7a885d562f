"""What :func:`~materialize.skeleton.spec.build` made each model from, kept weakly beside the model.

Its own module, importing nothing of the package's, so that planning's hints
can read the record without importing the spec builder (which reaches the
Hugging Face integration, and so back into planning).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Union

from torch import nn


@dataclass(frozen=True)
class BuiltFrom:
    """What :func:`~materialize.skeleton.spec.build` made a model from: the spec as given, the callable it names, and the arguments the
    callable was given (a config file's and the caller's)."""

    spec: Union[str, os.PathLike, Callable[..., nn.Module]]  # a ModelSpec (skeleton.spec)
    factory: Callable[..., nn.Module]
    args: dict[str, Any]


# Weak: remembering a model must not keep it alive. A mismatch error reads it to name the model argument
# that gives the checkpoint's sizes in the spec's own terms (see materialize.planning.shapehints).
_BUILT: "weakref.WeakKeyDictionary[nn.Module, BuiltFrom]" = weakref.WeakKeyDictionary()


def built_from(model: nn.Module) -> Optional[BuiltFrom]:
    """The spec :func:`~materialize.skeleton.spec.build` (or ``build_recorded``) made ``model`` from; None for any other model."""
    try:
        return _BUILT.get(model)
    except TypeError:  # a module that cannot be weakly referenced was never recorded
        return None


Spec = Union[str, os.PathLike, Callable[..., nn.Module]]


def remember_built(model: nn.Module, spec: Spec, factory: Callable[..., nn.Module], args: dict[str, Any]) -> nn.Module:
    """Record what made ``model`` (see :func:`built_from`), and give it back."""
    try:
        _BUILT[model] = BuiltFrom(spec, factory, dict(args))
    except TypeError:
        pass
    return model
