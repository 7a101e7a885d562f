"""The torch cases of the zoo: every module class torch exports, at its flags, under each parametrization.

Classes: every ``nn.Module`` subclass exported by ``torch.nn.modules``, ``torch.nn.parallel`` and each public
package of ``torch.ao.nn`` (quantized, dynamic, qat, intrinsic, quantizable, reference, sparse), named
``Linear`` for ``torch.nn`` and by their package below ``torch`` otherwise (``ao.nn.quantized.dynamic.LSTM``).
Arguments come from rules over parameter names (:mod:`zoo.torchnn_args`); a class the rules cannot build is
still a case, skipped with the reason.

Variants: the defaults; each flag of the signature alone (a boolean flipped, or a value of
:data:`zoo.torchnn_args.FLAG_VALUES`: ``proj_size``, ``padding_mode``, ``kdim``...), named ``LSTM[bidirectional]``,
``Conv2d[padding_mode=circular]``; and every flag that builds alone, at once. A lazy module (``LazyLinear``) is
given a first forward on its tiny input as it is built, which gives its parameters their shapes.
Parametrizations: torch's ``weight_norm``, ``spectral_norm`` and ``orthogonal`` and the older
``torch.nn.utils.weight_norm`` and ``spectral_norm``, each on each kind of weight (:func:`weights`) of the
defaults, and on each kind only every flag at once makes (``LSTM[...]+spectral_norm(weight_hr_l0)``).

Listing the variants builds every class at every flag (seconds: a process-group module imports torch's
compiler), so the list is kept in ``zoo/torch_variants.json`` with the torch version it was made for;
``python -m zoo.torchnn`` makes it again, and a different torch makes it again on first use (into
``data/zoo/``), as :mod:`zoo.vision` keeps timm's families.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import pkgutil
import re
import warnings
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from zoo.outcomes import Skipped
from zoo.torchnn_args import FLAG_VALUES, FORWARD_ONLY, Made, arguments, describe, make_input

PARAMETRIZATIONS = ("weight_norm", "spectral_norm", "orthogonal", "legacy_weight_norm", "legacy_spectral_norm")
VARIANTS_FILE = Path(__file__).with_name("torch_variants.json")
LOCAL_VARIANTS_FILE = Path(__file__).resolve().parent.parent / "data" / "zoo" / "torch_variants.json"


def namespaces() -> list[str]:
    """``torch.nn.modules``, ``torch.nn.parallel`` and every public package of ``torch.ao.nn`` but its internals."""
    import torch.ao.nn

    found = ["torch.nn.modules", "torch.nn.parallel"]
    for info in pkgutil.walk_packages(torch.ao.nn.__path__, "torch.ao.nn."):
        parts = info.name.split(".")
        if info.ispkg and "modules" not in parts and not any(p.startswith("_") for p in parts):
            found.append(info.name)
    return found


def _label(namespace: str, name: str) -> str:
    return name if namespace in ("torch.nn.modules", "torch.nn.parallel") else f"{namespace[len('torch.'):]}.{name}"


@functools.lru_cache(maxsize=None)
def module_classes() -> dict[str, type]:
    """label -> class: the ``nn.Module`` subclasses each namespace exports (``__all__``, else its public names)."""
    classes: dict[str, type] = {}
    for namespace in namespaces():
        module = importlib.import_module(namespace)
        for name in getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]:
            value = getattr(module, name, None)
            if isinstance(value, type) and issubclass(value, nn.Module):
                classes[_label(namespace, name)] = value
    return dict(sorted(classes.items()))


@functools.lru_cache(maxsize=None)
def signature(cls: type) -> list[inspect.Parameter]:
    """The constructor's named parameters; a ``(*args, **kwargs)`` one takes its nearest base's, but ``mode``
    (which ``nn.LSTM`` and its kind pass to ``RNNBase`` themselves)."""
    for owner in cls.__mro__:
        if "__init__" not in vars(owner):
            continue
        params = list(inspect.signature(owner.__init__).parameters.values())[1:]
        named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if named or owner is nn.Module:
            return [p for p in named if owner is cls or p.name != "mode"]
    return []


@functools.lru_cache(maxsize=None)
def flags(cls: type) -> dict[str, Any]:
    """name -> the value its variant takes: booleans flipped, and the values :data:`FLAG_VALUES` gives."""
    found = {}
    for p in signature(cls):
        if p.name.startswith("_") or p.name in FORWARD_ONLY:
            continue
        if isinstance(p.default, bool):
            found[p.name] = not p.default
        elif p.name in FLAG_VALUES:
            value, default = FLAG_VALUES[p.name]
            if p.default is default or (type(p.default) is type(default) and p.default == default):
                found[p.name] = value
    return found


def _token(name: str, value: Any) -> str:
    return name if value is True else f"{name}={describe(value)}"


@dataclass(frozen=True)
class Variant:
    label: str  # the class's label
    flags: tuple[str, ...] = ()  # names of the flags set
    parametrization: Optional[str] = None
    weight: Optional[str] = None

    @property
    def cls(self) -> type:
        return module_classes()[self.label]

    @property
    def name(self) -> str:
        values = flags(self.cls)
        text = self.label + (f"[{','.join(_token(f, values[f]) for f in self.flags)}]" if self.flags else "")
        return text + (f"+{self.parametrization}({self.weight})" if self.parametrization else "")

    def kwargs(self) -> dict[str, Any]:
        """Its arguments by the rules, those made at build time still unmade (:class:`Skipped`: no rule)."""
        values = flags(self.cls)
        return arguments(self.cls, signature(self.cls), {f: values[f] for f in self.flags})

    def build(self) -> nn.Module:
        """The module, built after the caller seeded torch (every tensor of the arguments made here too)."""
        kwargs = self.kwargs()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = self.cls(**{k: v() if isinstance(v, Made) else v for k, v in kwargs.items()})
            if isinstance(model, nn.modules.lazy.LazyModuleMixin):  # its shapes come from a first forward
                model(*make_input(self.cls, self.label, kwargs))
            if self.parametrization:
                parametrize(model, self.parametrization, self.weight)
        return model


def parametrize(model: nn.Module, how: str, weight: str) -> None:
    from torch.nn.utils import parametrizations

    owner_name, _, leaf = weight.rpartition(".")
    owner = model.get_submodule(owner_name)
    if how.startswith("legacy_"):
        getattr(nn.utils, how[len("legacy_"):])(owner, name=leaf)
    else:
        getattr(parametrizations, how)(owner, name=leaf)


def weights(model: nn.Module) -> dict[tuple, str]:
    """Its weight-like parameters (floating, named ``*weight*``, two or more dimensions, not lazy), one of each
    kind, by kind: the owner's class, its attribute name and the name with layer numbers and ``_reverse`` taken
    out (an LSTM's ``weight_hh_l1_reverse`` is of ``weight_hh_l0``'s kind, a Transformer's ``linear1.weight``
    of every layer one kind, ``igates`` and ``hgates`` two)."""
    kinds: dict[tuple, str] = {}
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if "weight" in leaf and p.is_floating_point() and p.dim() >= 2 \
                and not isinstance(p, nn.parameter.UninitializedParameter):
            kind = (type(model.get_submodule(owner)).__qualname__, owner.rpartition(".")[2],
                    re.sub(r"_l\d+|_reverse", "", leaf))
            kinds.setdefault(kind, name)
    return kinds


def _builds(variant: Variant) -> bool:
    try:
        variant.build()
        return True
    except Exception:
        return False


def _weights_of(variant: Variant) -> dict[tuple, str]:
    try:
        return weights(variant.build())
    except Exception:  # it does not build: its case says why (Skipped)
        return {}


def compute_variants() -> list[Variant]:
    """Every variant, in a stable order (builds each class at each flag: seconds)."""
    found: dict[str, Variant] = {}
    for label, cls in module_classes().items():
        plain = Variant(label)
        alone = [Variant(label, (f,)) for f in flags(cls)]
        every = [plain, *alone]
        building = tuple(v.flags[0] for v in alone if _builds(v))
        flagged = Variant(label, building)
        if len(building) > 1:
            every.append(flagged)
        default_weights = _weights_of(plain)
        every += [Variant(label, (), how, w) for w in default_weights.values() for how in PARAMETRIZATIONS]
        if building:
            every += [Variant(label, flagged.flags, how, w) for kind, w in _weights_of(flagged).items()
                      if kind not in default_weights for how in PARAMETRIZATIONS]
        for variant in every:
            found[variant.name] = variant
    return list(found.values())


def _torch_version() -> str:
    return torch.__version__.split("+")[0]


@functools.lru_cache(maxsize=None)
def variants() -> dict[str, Variant]:
    """Every variant by its name: the kept list where it was made for this torch, else made now (and kept)."""
    for path in (VARIANTS_FILE, LOCAL_VARIANTS_FILE):
        if path.is_file():
            saved = json.loads(path.read_text())
            if saved["torch"] == _torch_version():
                listed = [Variant(label, tuple(flags), how, weight) for label, flags, how, weight in saved["variants"]]
                return {v.name: v for v in listed if v.label in module_classes()}
    computed = compute_variants()
    LOCAL_VARIANTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    LOCAL_VARIANTS_FILE.write_text(_saved(computed))
    return {v.name: v for v in computed}


def _saved(listed: list[Variant]) -> str:
    rows = ",\n".join(" " + json.dumps(astuple(v)) for v in listed)
    return f'{{"torch": "{_torch_version()}", "variants": [\n{rows}\n]}}\n'


def case_models() -> list[tuple[str, str]]:
    return [(oracle, name) for name in variants() for oracle in ("deferred", "load")]


def builder(name: str) -> Callable[[], nn.Module]:
    variant = variants().get(name)
    if variant is None:
        raise Skipped(f"no torch module variant named {name!r} here")
    return variant.build


def inputs(name: str) -> Optional[tuple]:
    """A tiny input for its forward (``None``: no forward the rules know how to feed)."""
    variant = variants()[name]
    return make_input(variant.cls, variant.label, variant.kwargs())


def run_case(oracle: str, name: str, folder) -> list[str]:
    build = builder(name)
    if oracle == "deferred":
        from zoo import deferred

        return deferred.check(build, folder)
    from zoo import module_load

    return module_load.check(f"torch/{oracle}/{name}", build, folder, make_inputs=lambda: inputs(name))


if __name__ == "__main__":
    computed = compute_variants()
    VARIANTS_FILE.write_text(_saved(computed))
    print(f"{len(computed)} torch module variants written to {VARIANTS_FILE}")
