"""What :func:`~materialize.skeleton.deferred.deferred_init` records: a program of steps over storages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

DEFAULT_GENERATOR = 0  # the default generator of the device a model is replayed on


@dataclass(frozen=True, slots=True)  # slots: a recording holds one per tensor an op reads, writes or makes
class Ref:
    """A tensor as a view of a recorded storage (``sid``)."""

    sid: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    conj: bool = False  # a lazily conjugated view (a.mH, a.conj()): the replay reads it conjugated too
    neg: bool = False  # a lazily negated view (a.conj().imag)

    @classmethod
    def of(cls, sid: int, tensor: torch.Tensor) -> "Ref":
        return cls(sid, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype,
                   tensor.is_conj(), tensor.is_neg())


@dataclass(frozen=True)
class GeneratorRef:
    index: int


@dataclass(frozen=True)
class TargetDevice:
    """A device the recording saw as ``meta``: the replay's device."""


@dataclass(slots=True)
class Step:
    """One op (an aten overload, a whole ``torch.nn.init`` call, or the remaking of a constant) and its effects."""

    run: Any
    args: tuple
    kwargs: dict
    made: tuple[tuple[int, int], ...]  # (output position, sid) of the storages it makes
    reads: frozenset
    writes: frozenset  # sids it writes, made ones included
    generator: Optional[int]  # the generator it draws from, if it draws
    where: str  # the module being built, for messages
    whole_call: bool = False  # a torch.nn.init function: it may draw from the global generator whatever it is given
    grad: bool = False  # run where a gradient may be needed (see deferred._GRAD_DECIDED): replayed so too

    @property
    def draws_from(self) -> frozenset:
        """The generators it advances: its own, and the global one for a whole init call (see whole_call)."""
        if self.generator is None:
            return frozenset()
        return frozenset({self.generator, DEFAULT_GENERATOR}) if self.whole_call else frozenset({self.generator})

    @property
    def name(self) -> str:
        return str(getattr(self.run, "__name__", self.run))


@dataclass
class SetGenerator:
    """A generator reseeded (``seed``) or set to a state between two draws."""

    generator: int
    seed: Optional[int]
    state: Optional[torch.Tensor]


@dataclass
class Program:
    """What :func:`deferred_init` recorded: the steps, the generators' states at their first use, where each
    tensor of the model lies, and what cannot be replayed."""

    steps: list = field(default_factory=list)
    start_states: dict[int, torch.Tensor] = field(default_factory=dict)
    start_seeds: dict[int, int] = field(default_factory=dict)
    made_as: dict[int, Ref] = field(default_factory=dict)  # sid -> the tensor that made it
    made_empty: set[int] = field(default_factory=set)  # sids made by an empty allocation (a target can stand in)
    constants: dict[int, torch.Tensor] = field(default_factory=dict)  # sid -> a real tensor from before the recording
    unrecorded: set[int] = field(default_factory=set)  # sids of meta tensors from before the recording
    bindings: dict[str, Ref] = field(default_factory=dict)  # a parameter's or buffer's qualified name -> its values
    device: Optional[torch.device] = None  # where the model was moved after construction (model.cuda()), if it was
