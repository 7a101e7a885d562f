"""A transformers model's skeleton, built on meta from its ``config.json``.

It is a skeleton like any other spec's (:func:`~.spec.build`): built on meta
(:func:`~.meta.meta_init`), in the load's dtype and bounded by the checkpoint
it is built for (:func:`~.buildmode.building`), so it is built here, beside
them. Left in :mod:`materialize.integrations.hf` with those two handed in by
each caller, every caller (a load of a folder, an ``hf:`` spec,
``build(folder)``) would have to know how a skeleton is built; here they ask
for one. :mod:`~materialize.integrations.hf` keeps what transformers decides
about a load (renames, dtypes, inits), which the planner asks without
building anything.

Needs the optional extra ``torch-materialize[hf]`` (transformers). Only the
model class (from ``architectures`` or an ``hf:AutoModelForX`` spec) and
its config are taken from transformers; remote code is never run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..checkpoint import Checkpoint
from ..checkpoint.confine import allowed_roots, confine
from ..errors import CheckpointError, MaterializeError, ModelSpecError, ModelSpecUsageError, first_line, torchvision_mismatch
from ..sizes import format_bytes
from .buildmode import BuildBounds, building
from .meta import meta_init

CONFIG_NAME = "config.json"
HF_SPEC_PREFIX = "hf:"
# A build may register or copy this many tensors per tensor of its checkpoint, plus TENSOR_FLOOR: a model
# registers each of its checkpoint's tensors about once, plus a few buffers it computes (per-layer rotary
# frequencies, masks); its checkpoint may also hold each expert apart where the model stacks them.
TENSORS_PER_CHECKPOINT_TENSOR = 4
TENSOR_FLOOR = 10_000
# Tensors not on meta a build may hold at once, beyond its checkpoint's bytes (each tensor counted at the
# larger of its itemsize and the build dtype's): computed buffers (position ids, rotary tables, masks) of
# models whose checkpoint is small beside their context length.
REAL_BYTES_FLOOR = 256 << 20


def read_config(path: Path) -> Any:
    """``path``'s JSON (a ``config.json``), or a :class:`ModelSpecError` naming it where it cannot be read.

    Every read of a config goes through here: a file nested deeper than
    Python's recursion limit, invalid JSON or bytes that are not UTF-8 are
    one error naming the file, never a raw ``RecursionError``.
    """
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except RecursionError:
        raise ModelSpecError("cannot be read: its JSON is nested deeper than Python's recursion limit", path=path) from None
    except UnicodeError as exc:
        raise ModelSpecError(f"cannot be read: not UTF-8 ({first_line(exc)})", path=path) from None
    except ValueError as exc:
        raise ModelSpecError(f"cannot be read: not valid JSON ({first_line(exc)})", path=path) from None


def is_hf_folder(path: Path) -> bool:
    """Whether ``path`` is a folder holding a ``config.json``; refused where that is a symlink leading out of it."""
    if not (path.is_dir() and (path / CONFIG_NAME).is_file()):
        return False
    confine(path / CONFIG_NAME, allowed_roots(path), what=f"'{CONFIG_NAME}'", about=path)
    return True


def is_transformers_folder(path: Path) -> bool:
    """A folder whose ``config.json`` describes a transformers model.

    Other libraries write a ``config.json`` of their own beside the weights
    (timm: ``architecture``; diffusers: ``_class_name``), which transformers
    cannot build; without a model spec, those folders load as plain
    checkpoints. transformers' own configs name a ``model_type`` (older ones
    at least their ``architectures``); an unreadable one counts as
    transformers', so that building it reports what is wrong with it.
    """
    if not is_hf_folder(path):
        return False
    try:
        config = read_config(path / CONFIG_NAME)
    except (OSError, MaterializeError):
        return True
    return not isinstance(config, dict) or "model_type" in config or "architectures" in config


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelSpecError(
            "building a model from config.json needs transformers: pip install 'torch-materialize[hf]'"
        ) from None
    return transformers


def build_hf(folder: Path, *, model_class: Optional[str] = None, dtype: Optional[torch.dtype] = None,
             checkpoint: Optional[Checkpoint] = None) -> nn.Module:
    """A transformers model for ``folder``'s ``config.json``, parameters on meta.

    ``model_class`` is a transformers class name (``"AutoModelForCausalLM"``,
    ``"BertModel"``); by default the config's first ``architectures`` entry,
    else ``AutoModel``. Remote code is never run.

    The model is built with ``dtype`` as torch's default dtype (by default
    the config's ``dtype``), as ``from_pretrained`` builds it: buffers it
    computes come out in that dtype, and tensors the model creates in a dtype
    of its own (a DeBERTa ``q_bias``, a HunYuan router made fp32) stand out,
    so that a load keeps them so (see :func:`hf_dtype_rule`). torch's default
    dtype is one per process and is left alone: the build runs in a mode of
    its own thread (:func:`~materialize.skeleton.buildmode.building`), where
    what torch would make in its default dtype is made in ``dtype``
    (integers promoted to a float, ``arange(n) / n``, are cast to it as they
    come out), so dtypes are those ``torch.set_default_dtype`` would give.

    With ``checkpoint`` (the one the model is built for), the build is
    bounded by it, so that a config asking for millions of layers or a buffer
    of gigabytes is refused early, naming the config's largest sizes: it may
    register (or copy) at most :data:`TENSORS_PER_CHECKPOINT_TENSOR` tensors
    per checkpoint tensor plus :data:`TENSOR_FLOOR`, and hold at most the
    checkpoint's bytes plus :data:`REAL_BYTES_FLOOR` in tensors not on meta
    at once, each allocation asked before it is made.
    """
    try:
        return _build_hf(folder, model_class, dtype, checkpoint)
    except ImportError as exc:  # transformers' lazy import of the model's code, or of what that code imports
        raise ModelSpecError(f"transformers cannot import the code of this model: {first_line(exc)}"
                             f"{torchvision_mismatch(exc)}", path=folder / CONFIG_NAME) from None


def _build_hf(folder: Path, model_class: Optional[str], dtype: Optional[torch.dtype],
              checkpoint: Optional[Checkpoint]) -> nn.Module:
    saved = read_config(folder / CONFIG_NAME) if is_hf_folder(folder) else None  # unreadable: refused here, saying why
    if not is_transformers_folder(folder):
        raise ModelSpecError(
            "names no model_type or architectures: not a transformers model's config "
            "(timm and diffusers write their own); pass a model (--model SPEC), or load without one for its tensors",
            path=folder / CONFIG_NAME,
        )
    transformers = _transformers()
    try:
        # Never None: transformers would then ask on the terminal whether to run the repository's code.
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, RecursionError) as exc:
        config = _config_of_class(transformers, folder, model_class)
        if config is None:
            raise _unbuildable(folder, f"cannot read its config.json: {first_line(exc)}") from None
    _refuse_quantized(config, folder)
    name = model_class or next(iter(getattr(config, "architectures", None) or []), "AutoModel")
    cls = getattr(transformers, name, None)
    if cls is None:
        raise _unbuildable(folder, f"transformers has no model class {name!r} (installed: transformers {transformers.__version__})")
    built_in = dtype or _config_dtype(config)
    if built_in is not None and (not built_in.is_floating_point or built_in.itemsize < 2):
        built_in = None
    bounds = _bounds(checkpoint, built_in, folder, saved) if checkpoint is not None else None
    with meta_init(), building(built_in, bounds):
        try:
            model = cls.from_config(config) if name.startswith("Auto") else cls(config)
        except MaterializeError:
            raise
        except Exception as exc:  # a class that does not fit the config (LlamaForCausalLM on a Qwen2 config)
            own = next(iter(getattr(config, "architectures", None) or []), None)
            fits = (f"; its config names {own}: pass model='hf:{own}' (CLI: --model hf:{own})"
                    if model_class and own and own != name and hasattr(transformers, own) else "")
            raise (ModelSpecUsageError if model_class else ModelSpecError)(
                f"{name} cannot be built from this config (model_type {getattr(config, 'model_type', '?')!r}): "
                f"{type(exc).__name__}: {first_line(exc)}{fits}", path=folder / CONFIG_NAME) from None
    return model.eval()


def _unbuildable(folder: Path, reason: str) -> ModelSpecError:
    """Why transformers cannot build the folder's model, and the ways to load it all the same.

    A model whose class is the repository's own code (``auto_map``) is named
    as such: that code is never run here.
    """
    try:
        custom = read_config(folder / CONFIG_NAME).get("auto_map")
    except (OSError, MaterializeError, AttributeError):
        custom = None
    if isinstance(custom, dict) and custom:
        code = next((value for key, value in custom.items() if key.startswith("AutoModel")), next(iter(custom.values())))
        reason = f"its model is the repository's own code (auto_map: {code}), which is never run here"
    try:
        from ..checkpoint import pick_from_folder

        alone = f" ({pick_from_folder(folder)})"
    except (OSError, CheckpointError):
        alone = ""
    return ModelSpecError(
        f"{reason.rstrip('.')}; pass a model (--model package.module:callable), or load its tensors alone by passing the "
        f"checkpoint itself{alone}",
        path=folder / CONFIG_NAME,
    )


def _config_of_class(transformers: Any, folder: Path, model_class: Optional[str]) -> Any:
    """The config as the model class reads it, where AutoConfig does not know its ``model_type``.

    transformers renames model types now and then (LFM2-VL's ``lfm2-vl`` is
    ``lfm2_vl`` in 5.x); configs saved before still name the class, whose
    own config class reads them, as its ``from_pretrained`` does. None where
    that fails too.
    """
    try:
        saved = read_config(folder / CONFIG_NAME)
        name = model_class or next(iter(saved.get("architectures") or []), None)
        config_class = getattr(getattr(transformers, name, None), "config_class", None) if isinstance(name, str) else None
        if config_class is None:
            return None
        return config_class.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def _config_dtype(config: Any) -> Optional[torch.dtype]:
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)  # 5.x, 4.x
    dtype = getattr(torch, named, None) if isinstance(named, str) else named
    return dtype if isinstance(dtype, torch.dtype) else None


def _bounds(checkpoint: Checkpoint, dtype: Optional[torch.dtype], folder: Path, saved: Any) -> BuildBounds:
    """What building for ``checkpoint`` may make (see :func:`build_hf`), refused naming the config's largest sizes."""
    itemsize = (dtype or torch.get_default_dtype()).itemsize
    infos = list(checkpoint.values())
    held = sum(info.numel * max(info.itemsize, itemsize) for info in infos)
    max_tensors = TENSORS_PER_CHECKPOINT_TENSOR * len(infos) + TENSOR_FLOOR

    def refuse(what: str) -> ModelSpecError:
        sizes = ", ".join(f"{name}={value}" for name, value in _largest_sizes(saved))
        return _unbuildable(folder, (
            f"{what}, where its checkpoint holds {len(infos):,} tensors of {format_bytes(checkpoint.nbytes)} (a build "
            f"may make {TENSORS_PER_CHECKPOINT_TENSOR} tensors per checkpoint tensor plus {TENSOR_FLOOR:,}, and hold the "
            f"checkpoint's bytes plus {format_bytes(REAL_BYTES_FLOOR)} off meta): the config asks for a larger model than "
            f"its checkpoint{f' (its largest sizes: {sizes})' if sizes else ''}; fix that field of config.json"))

    return BuildBounds(max_tensors=max_tensors, max_real_bytes=held + REAL_BYTES_FLOOR, refuse=refuse)


def _largest_sizes(config: Any, count: int = 2) -> list[tuple[str, int]]:
    """The ``count`` largest integers of a config (dotted names into nested configs): what a build makes many
    or large of (layers, positions, widths). Token ids are numbers, not sizes, and are left out."""
    found: list[tuple[int, str]] = []
    stack = [("", config)]
    while stack:
        prefix, node = stack.pop()
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                stack.append((f"{name}.", value))
            elif isinstance(value, int) and not isinstance(value, bool) and "token_id" not in str(key):
                found.append((value, name))
    found.sort(key=lambda item: (-item[0], item[1]))
    return [(name, value) for value, name in found[:count]]


def _refuse_quantized(config: Any, folder: Path) -> None:
    """A quantized checkpoint holds packed integers and scales that only its quantizer's layers understand."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    raise ModelSpecError(
        f"the model is quantized (quantization_config, quant_method {str(method or 'unknown')!r}); its checkpoint "
        "holds packed weights and scales for the quantizer's own layers, which this loader does not build; "
        "load it with transformers' from_pretrained, or pass --model with a matching skeleton",
        path=folder / CONFIG_NAME,
    )
