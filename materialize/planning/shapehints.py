"""What a shape mismatch says, in a mismatch error: a classifier sized for other classes, or another architecture.

A checkpoint fine-tuned for 10 classes differs from a model built for 1000
only in its classifier's outputs: the way out is the model argument that
sizes the classifier (``num_classes`` in timm and torchvision), given the
checkpoint's size, which loads every tensor. A new head
(``ignore_mismatched_sizes``) is the other way, for a model meant to have
its own size. A difference anywhere else (a convolution of another kernel,
an embedding of another width) is no head: the checkpoint was saved from
another architecture, or another size of it, and no argument of this
model's fixes that.

The classifier is what the model says it is (timm's ``pretrained_cfg`` /
``default_cfg`` ``classifier``, its ``get_classifier()``), else the last
module holding parameters of its own, where that is a ``Linear`` or a
convolution (torchvision's ``fc`` and ``classifier.N``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from ..skeleton.modtree import named_modules
from ..skeleton.provenance import BuiltFrom, built_from

# Names a factory or a model class gives the argument that sizes its classifier, the most usual first.
CLASS_COUNT_ARGUMENTS = ("num_classes", "num_labels", "n_classes", "nb_classes", "num_class", "n_class", "num_outputs",
                         "n_outputs", "out_features", "output_size", "output_dim", "out_dim")

_SAYS_CLASSES = frozenset(CLASS_COUNT_ARGUMENTS[:6])

Mismatch = tuple[str, tuple[int, ...], tuple[int, ...]]  # (model name, model shape, checkpoint shape)


@dataclass(frozen=True)
class HeadSizes:
    """A mismatch confined to the classifier's outputs: the classifier's modules and both sizes."""

    modules: tuple[str, ...]
    model_outputs: int
    checkpoint_outputs: int


def classifier_modules(model: nn.Module) -> tuple[str, ...]:
    """The names of the modules ``model`` reports as its classifier (``""`` for the root itself), or none."""
    names = {name: module for name, module in named_modules(model)}
    config = _attribute(model, "pretrained_cfg") or _attribute(model, "default_cfg")
    said = config.get("classifier") if isinstance(config, dict) else None
    if isinstance(said, str):
        said = (said,)
    if isinstance(said, (tuple, list)):
        found = tuple(name for name in said if isinstance(name, str) and name in names)
        if found:
            return found
    get_classifier = _attribute(model, "get_classifier")
    if callable(get_classifier):
        try:
            head = get_classifier()
        except Exception:  # noqa: BLE001 - a model's own method may not hold on meta; the rule below still can
            head = None
        found = tuple(name for name, module in names.items() if module is head)
        if found:
            return found[:1]
    last = None
    for name, module in names.items():
        if any(tensor is not None for tensor in module._parameters.values()):
            last = (name, module)
    if last is not None and isinstance(last[1], (nn.Linear, nn.modules.conv._ConvNd)):
        return (last[0],)
    return ()


def _attribute(model: nn.Module, name: str) -> Any:
    try:
        return getattr(model, name, None)
    except Exception:  # noqa: BLE001 - a property of the model's own that fails is no answer
        return None


def inside(name: str, modules: Sequence[str]) -> bool:
    """Whether the tensor ``name`` belongs to one of ``modules`` (or their children)."""
    return any(module == "" or name.startswith(module + ".") for module in modules)


def head_sizes(mismatched: Sequence[Mismatch], classifier: Sequence[str]) -> Optional[HeadSizes]:
    """The classifier's two output sizes, where every mismatch is in the classifier and differs only there
    (the first dimension: a Linear's or a convolution's outputs, a bias's length), else None."""
    if not mismatched or not classifier:
        return None
    model_sizes, checkpoint_sizes = set(), set()
    for name, model_shape, checkpoint_shape in mismatched:
        if not inside(name, classifier) or not model_shape or len(model_shape) != len(checkpoint_shape):
            return None
        if model_shape[1:] != checkpoint_shape[1:]:
            return None
        model_sizes.add(model_shape[0])
        checkpoint_sizes.add(checkpoint_shape[0])
    if len(model_sizes) != 1 or len(checkpoint_sizes) != 1:
        return None
    return HeadSizes(tuple(classifier), model_sizes.pop(), checkpoint_sizes.pop())


def size_argument(model: nn.Module, outputs: int) -> Optional[str]:
    """The argument that sizes ``model``'s classifier, found in the signature of what built it: the spec's
    factory (:func:`~materialize.skeleton.spec.build`), and the model's class where the factory passes its
    keywords on (timm's and torchvision's do) or the model was built by hand.

    An argument whose value for this model is known (given to the factory, the model's attribute of that
    name, or the factory's default) is taken only where that value is the classifier's ``outputs``: an
    ``out_dim`` that sizes something else is no answer. Where the value is unknown (a class reached through
    a factory's ``**kwargs``, which may fill it in), a name that says classes is taken, another name only
    where its default is ``outputs``.
    """
    made = built_from(model)
    given = made.args if made is not None else {}
    signatures: list[tuple[Optional[inspect.Signature], bool]] = []  # (a signature, whether `given` was passed to it)
    factory = _signature(made.factory) if made is not None else None
    if factory is not None:
        signatures.append((factory, True))
    if made is None or factory is None or any(p.kind is p.VAR_KEYWORD for p in factory.parameters.values()):
        signatures.append((_signature(type(model)), False))
    for signature, called in signatures:
        if signature is None:
            continue
        for name in CLASS_COUNT_ARGUMENTS:
            parameter = signature.parameters.get(name)
            if parameter is None or parameter.kind not in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
                continue
            value = given[name] if name in given else _attribute(model, name)
            if not _is_count(value) and called and parameter.default is not parameter.empty:
                value = parameter.default
            if _is_count(value):
                if value == outputs:
                    return name
            elif name in _SAYS_CLASSES or parameter.default is parameter.empty or (
                    _is_count(parameter.default) and parameter.default == outputs):
                return name
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _signature(target: Any) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


def classifier_hint(model: nn.Module, head: HeadSizes) -> str:
    """Where the classifier's outputs alone differ: the argument that builds the model with the checkpoint's."""
    where = ", ".join(head.modules) or "the model itself"
    said = (f"the checkpoint's classifier ({where}) has {head.checkpoint_outputs} outputs where the model's has "
            f"{head.model_outputs}")
    argument = size_argument(model, head.model_outputs)
    if argument is None:
        return f"{said}: build the model for the checkpoint's {head.checkpoint_outputs} outputs"
    keyword = f"{argument}={head.checkpoint_outputs}"
    made = built_from(model)
    if made is None:
        return f"{said}: build the model as {type(model).__name__}(..., {keyword})"
    others = "..., " if any(name != argument for name in made.args) else ""
    return (f"{said}: build the model with {keyword}: model_args={{{argument!r}: {head.checkpoint_outputs}}}, or "
            f"mz.build({_spec_words(made)}, {others}{keyword}) (CLI: --model-arg {keyword})")


def _spec_words(made: BuiltFrom) -> str:
    if isinstance(made.spec, str):
        return repr(made.spec)
    name = getattr(made.spec, "__qualname__", None) or getattr(made.spec, "__name__", None)
    return name if isinstance(name, str) else repr(made.spec)


def body_words(differing: Sequence[Mismatch], in_body: bool = True) -> str:
    """Where shapes differ beyond a classifier's outputs: what that says, with the first of them. ``in_body``:
    they are outside the classifier; else the classifier's own differ in more than its outputs (its inputs:
    the body before it is another width)."""
    many = len(differing) != 1
    where = (f"{len(differing)} tensor{'s' if many else ''} in the body differ{'' if many else 's'}" if in_body
             else "the classifier differs in more than its outputs")
    return f"the checkpoint was saved from another architecture, or another size of it: {where}, e.g. {differing[0][0]!r}"


def missing_body_words(missing: Sequence[str]) -> str:
    """Where the model has tensors outside its classifier that the checkpoint lacks, no rename explaining them."""
    many = len(missing) != 1
    return (f"the model has {len(missing)} tensor{'s' if many else ''} in its body that the checkpoint lacks, "
            f"e.g. {missing[0]!r}: it may have been saved from another architecture, or another size of it")
