"""The transformers classes of the zoo: every class the auto mappings register, built from a tiny config."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
from torch import nn

from zoo.outcomes import Skipped, one_line
from zoo.tiny import LEVELS, first_that_builds, tiny_config

# A tiny model past this many parameters is not tiny: the rules missed its sizes. Skipped, with its count.
MAX_PARAMETERS = 30_000_000


@functools.lru_cache(maxsize=None)
def registered_classes() -> dict[str, str]:
    """Every model class name in transformers' auto mappings, with the model type (config) it is mapped from."""
    from transformers.models.auto import modeling_auto

    found: dict[str, str] = {}
    for table in sorted(name for name in dir(modeling_auto) if name.startswith("MODEL") and name.endswith("_MAPPING_NAMES")):
        for model_type, names in sorted(getattr(modeling_auto, table).items()):
            for name in names if isinstance(names, (list, tuple)) else [names]:
                found.setdefault(name, model_type)
    return dict(sorted(found.items()))


def model_class(name: str) -> type:
    import transformers

    try:
        return getattr(transformers, name)
    except Exception as error:  # a class whose module needs a package this environment lacks
        raise Skipped(f"transformers.{name} cannot be imported here: {one_line(error)}") from None


def config_class(model_type: str) -> type:
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def _quiet(build: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformers

        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            return build()
        finally:
            transformers.logging.set_verbosity(verbosity)


def config_classes(name: str) -> list[type]:
    """The mapping's config class, then the class's own where it differs (a text model under a multimodal type)."""
    mapped = config_class(registered_classes()[name])
    try:
        own = getattr(model_class(name), "config_class", None)
    except ImportError as error:  # a placeholder class for a backend this environment lacks (torchaudio...)
        raise Skipped(f"transformers.{name} needs what is not installed here: {one_line(error)}") from None
    return [mapped] + ([own] if isinstance(own, type) and own is not mapped and own.model_type else [])


@functools.lru_cache(maxsize=None)
def tiny_level(name: str) -> tuple[type, int]:
    """The config class and first level of :data:`zoo.tiny.LEVELS` that build the class on meta, small enough."""
    cls = model_class(name)

    def make(config_type: type, level: int) -> Callable[[], nn.Module]:
        return lambda: _quiet(lambda: cls(_quiet(lambda: tiny_config(config_type, level))))

    return first_that_builds(name, ((LEVELS[level], (c, level), make(c, level)) for level in range(len(LEVELS))
                                    for c in config_classes(name)), MAX_PARAMETERS)


def builder(name: str) -> Callable[[], nn.Module]:
    """What eager construction of the class's tiny model is; raises :class:`Skipped` where there is none."""
    config_type, level = tiny_level(name)
    cls = model_class(name)

    def build() -> nn.Module:
        return _quiet(lambda: cls(tiny_config(config_type, level)))

    return build


def describe_config(name: str) -> str:
    config_type, level = tiny_level(name)
    return f"{config_type.__name__}, {LEVELS[level]}"
