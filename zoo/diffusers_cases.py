"""The diffusers cases of the zoo: every ``ModelMixin`` class diffusers exports, built from a tiny config.

The classes are diffusers' own exports (every class of ``diffusers`` that subclasses ``ModelMixin``). A
diffusers model takes its config as its constructor's keyword arguments (``register_to_config``), so a
tiny config is the constructor's defaults shrunk by :mod:`zoo.tiny`'s rules over names (widths, heads,
head dims, layers, experts, vocabulary) and a few of diffusers' own (:func:`shrink`): group norms' group
counts that divide the shrunk channels, a block's layer count, rotary axes that add up to the shrunk head
dim. A class that builds at no level of :data:`LEVELS` small enough (:data:`MAX_PARAMETERS`) is skipped
with the reasons, as is one whose constructor asks for what has no default (a ``Multi...`` wrapper of
other models).

Two oracles: ``deferred`` (:mod:`zoo.deferred`'s check) and ``load``: ``save_pretrained`` to a folder (one
of four variants by a stable hash of the class name: sharded or one file, safetensors or torch ``.bin``),
then the model built under ``mz.meta_init`` from the saved config and given the folder by ``mz.load``
(``mz.load_model`` builds transformers models only: a diffusers ``config.json`` names no ``model_type``,
docs/library.md), then ``eval()`` as ``from_pretrained`` does, against ``Class.from_pretrained(folder)``:
every tensor and module attribute, then a forward where the
class's forward takes the usual arguments (``sample``/``hidden_states``, ``timestep``,
``encoder_hidden_states``) and the reference runs on them.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

import materialize as mz
from zoo.module_load import as_the_next_forward_computes
from zoo.differential import compare_models, flat_outputs, perturb, seeded
from zoo.outcomes import Different, Skipped, one_line
from zoo.pretrained import compare_forwards
from zoo import tiny

MAX_PARAMETERS = 30_000_000
LEVELS = ("tiny", "tiny widths, default per-stage lists", "defaults")
GROUPS = 4  # group norms' groups: they divide the shrunk channels (16, 32, 64)
SOURCE_SEED = 1234
VARIANTS = [(sharded, safe) for sharded in (False, True) for safe in (True, False)]
SHARD_SIZE = "40KB"

_GROUPS = re.compile(r".*norm_num_groups|.*num_groups|.*groups")
_BLOCK_LAYERS = re.compile(r".*layers_per_block")
_AXES = re.compile(r".*axes_dims?(_rope)?|.*rope_axes_dims?|.*axes_dim_rope")
_HEAD_DIM = re.compile(r"(.*_)?(attention_head_dim|head_dim)")
# a width by its name that zoo/tiny.py's rules leave (a VAE's "ch", "in_text_dim2", "txt_in_features"): shrunk
# where it is a width's size (data channels, in, out, latent, keep theirs)
_WIDE = re.compile(r"(ch|.*channels?|.*features|.*_dim(_\w+|\d+)?)")
WIDE = 64
_DATA = re.compile(r".*(in|out|input|output|latent|z)_channels")
_BLOCKS = re.compile(r"num_\w*blocks")
_CODEBOOK = re.compile(r".*codebook_size")
CODEBOOK = 128
_NONE_GIVEN = {"in_channels": 4}  # data channels a class asks for but does not default


@functools.lru_cache(maxsize=None)
def model_classes() -> list[str]:
    """Every class diffusers exports that subclasses ``ModelMixin``, by name."""
    import diffusers
    from diffusers import ModelMixin

    found = []
    for name in sorted(dir(diffusers)):
        try:
            value = getattr(diffusers, name)
        except Exception:  # noqa: BLE001 - an export whose module needs what is not installed: not listed
            continue
        if inspect.isclass(value) and issubclass(value, ModelMixin) and value is not ModelMixin:
            found.append(name)
    return found


def model_class(name: str) -> type:
    import diffusers

    return getattr(diffusers, name)


def defaults(cls: type) -> dict[str, Any]:
    """The constructor's keyword arguments with their defaults; :class:`Skipped` where one has none."""
    values = {}
    for parameter in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.default is inspect.Parameter.empty:
            raise Skipped(f"{cls.__name__}({parameter.name}=...) has no default: it is made of other models")
        values[parameter.name] = parameter.default
    return values


def _as_lists(value: Any) -> Any:
    return [_as_lists(v) for v in value] if isinstance(value, tuple) else value


def _as_tuples(value: Any, like: Any) -> Any:
    if isinstance(like, tuple) and isinstance(value, list):
        return tuple(_as_tuples(v, w) for v, w in zip(value, like + (None,) * (len(value) - len(like))))
    return value


def _axes(value: list[int], old_head: int, new_head: int) -> list[int]:
    """Rotary axes (even, adding up to the head dim or a share of it) for the new head dim."""
    total = max(2 * len(value), sum(value) * new_head // old_head)
    total -= total % 2
    new = [max(2, (v * total // sum(value)) // 2 * 2) for v in value]
    new[-1] += total - sum(new)
    return new if new[-1] >= 2 else [2] * len(value)


def shrink(values: dict[str, Any], level: int) -> dict[str, Any]:
    """The constructor's defaults made tiny at ``level`` (see :data:`LEVELS`)."""
    if level >= 2:
        return dict(values)
    plain = {k: _as_lists(v) for k, v in values.items()}
    out = tiny.shrink(plain, 0 if level == 0 else 2)
    for name, value in plain.items():
        if value is None and name in _NONE_GIVEN:
            out[name] = _NONE_GIVEN[name]
        if isinstance(value, bool) or value is None:
            continue
        if tiny._int(value) and out[name] == value and not tiny._NEVER.fullmatch(name):
            if _WIDE.fullmatch(name) and value >= WIDE and not _DATA.fullmatch(name):
                out[name] = tiny.WIDTH
            elif _BLOCKS.fullmatch(name):
                out[name] = min(value, tiny.LAYERS)
            elif _CODEBOOK.fullmatch(name):
                out[name] = min(value, CODEBOOK)
        if _GROUPS.fullmatch(name) and isinstance(value, int) and value > GROUPS:
            out[name] = GROUPS
        elif _BLOCK_LAYERS.fullmatch(name) and isinstance(value, int) and level == 0:
            out[name] = min(value, 1)
        elif _AXES.fullmatch(name) and tiny._ints(value):
            heads = [(k, v) for k, v in plain.items() if _HEAD_DIM.fullmatch(k) and tiny._int(v) and v > 0]
            if heads and out[heads[0][0]] != heads[0][1]:
                out[name] = _axes(value, heads[0][1], out[heads[0][0]])
    return {k: _as_tuples(out[k], values[k]) for k in values}


def _quiet(make: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from diffusers.utils import logging as diffusers_logging

        verbosity = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()
        diffusers_logging.disable_progress_bar()  # "Loading checkpoint shards", one per case, in the run's log
        try:
            return make()
        finally:
            diffusers_logging.set_verbosity(verbosity)


@functools.lru_cache(maxsize=None)
def tiny_level(name: str) -> int:
    """The first level of :data:`LEVELS` that builds the class on meta, small enough."""
    cls = model_class(name)
    values = defaults(cls)

    def make(level: int) -> Callable[[], nn.Module]:
        return lambda: _quiet(lambda: cls(**shrink(values, level)))

    return tiny.first_that_builds(name, ((LEVELS[level], level, make(level)) for level in range(len(LEVELS))),
                                  MAX_PARAMETERS)


def tiny_kwargs(name: str) -> dict[str, Any]:
    return shrink(defaults(model_class(name)), tiny_level(name))


def builder(name: str) -> Callable[[], nn.Module]:
    cls = model_class(name)
    level = tiny_level(name)

    def build() -> nn.Module:
        return _quiet(lambda: cls(**shrink(defaults(cls), level)))

    return build


def describe(name: str) -> str:
    return f"config: {LEVELS[tiny_level(name)]}"


def variant_of(name: str) -> tuple[bool, bool]:
    return VARIANTS[zlib.crc32(name.encode()) % len(VARIANTS)]


def describe_variant(variant: tuple[bool, bool]) -> str:
    sharded, safe = variant
    return f"variant: {'sharded' if sharded else 'one file'}, {'safetensors' if safe else 'bin'}"


def _config(model: nn.Module, *names: str) -> Optional[Any]:
    for name in names:
        value = model.config.get(name) if hasattr(model.config, "get") else getattr(model.config, name, None)
        if value is not None:
            return value
    return None


def generic_inputs(model: nn.Module) -> Optional[dict[str, Any]]:
    """A tiny input for a forward whose arguments are the usual ones; None where there is none."""
    params = inspect.signature(model.forward).parameters
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    g = torch.Generator().manual_seed(3)
    channels = _config(model, "in_channels", "latent_channels")
    if not isinstance(channels, int):
        return None
    inputs: dict[str, Any] = {}
    for name in ("sample", "hidden_states", "x"):
        if name in params:
            inputs[name] = torch.randn(1, channels, 16, 16, generator=g)
            break
    if "timestep" in params:
        inputs["timestep"] = torch.tensor([10])
    width = _config(model, "cross_attention_dim", "joint_attention_dim")
    if "encoder_hidden_states" in params and isinstance(width, int):
        inputs["encoder_hidden_states"] = torch.randn(1, 4, width, generator=g)
    return inputs if inputs and required <= set(inputs) else None


def _run(model: nn.Module, inputs: dict[str, Any]) -> list[torch.Tensor]:
    model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(5)
        output = model(**inputs)
    return flat_outputs(output.to_tuple() if hasattr(output, "to_tuple") else output)


def check_load(name: str, folder: Path) -> list[str]:
    """``save_pretrained``, then ``meta_init`` + ``mz.load`` against ``from_pretrained``; raises :class:`Different`."""
    build = builder(name)
    cls = model_class(name)
    variant = variant_of(name)
    notes = [describe(name), describe_variant(variant)]
    try:
        source = seeded(build, SOURCE_SEED)
    except Exception as error:
        raise Skipped(f"eager construction fails: {one_line(error)}") from None
    perturb(source)  # the file differs from any fresh init: a tensor not loaded shows
    eager_module_tensors = {(owner, key): value for owner, module in source.named_modules()
                            for key, value in vars(module).items() if isinstance(value, torch.Tensor)}
    sharded, safe = variant
    try:
        _quiet(lambda: source.save_pretrained(folder, safe_serialization=safe,
                                              max_shard_size=SHARD_SIZE if sharded else "50GB"))
    except Exception as error:
        raise Skipped(f"save_pretrained fails: {one_line(error)}") from None
    try:
        torch.manual_seed(0)
        reference = _quiet(lambda: cls.from_pretrained(folder, use_safetensors=safe))  # .bin shards: asked for
    except Exception as error:
        raise Skipped(f"from_pretrained fails on its own save: {one_line(error)}") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        with mz.meta_init():
            model = _quiet(lambda: cls.from_config(cls.load_config(folder)))
        report = mz.load(model, folder)
    model.eval()  # as from_pretrained returns its model
    as_the_next_forward_computes(reference)  # older weight_norm's weight: as both forwards will compute it
    for (owner, key), value in eager_module_tensors.items():  # from_pretrained leaves some on meta (zoo/pretrained.py)
        module = reference.get_submodule(owner)
        if isinstance(getattr(module, key, None), torch.Tensor) and getattr(module, key).is_meta:
            setattr(module, key, value)
            notes.append(f"from_pretrained leaves module {owner!r}'s tensor attribute {key!r} on meta")
    found = compare_models(model, reference)
    if report.missing or report.unexpected:
        found.append(f"report: missing {list(report.missing)[:5]}, unexpected {list(report.unexpected)[:5]}")
    found += compare_forwards(model, reference, generic_inputs(reference), _run, notes)
    if found:
        raise Different(found)
    return notes


def run_case(oracle: str, name: str, folder: Path) -> list[str]:
    if oracle == "deferred":
        from zoo import deferred

        build = builder(name)
        return [describe(name), *deferred.check(build, folder)]
    return check_load(name, folder)
