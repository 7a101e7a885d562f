"""Hugging Face models: their names, dtypes and inits as transformers knows them.

Needs the optional extra ``torch-materialize[hf]`` (transformers). Only what
transformers itself decides is taken from it: its key renames and base-model
prefix, the dtypes it keeps some tensors in, the differences it lets a model
have with its checkpoints, and its ``_init_weights`` for tensors a checkpoint
lacks. Everything else (allocation, reading, ties, buffers) is the ordinary
load. The skeleton itself, from ``config.json``, is built by
:mod:`materialize.skeleton.hfbuild`; this module builds nothing, and asks
neither the planner nor the skeleton (it makes the types they read:
:mod:`materialize.options`, :mod:`materialize.checkpoint.targets`).
"""

from __future__ import annotations

import math
import re
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from torch import nn

from ..checkpoint import TensorInfo
from ..checkpoint.base import is_extra_state
from ..checkpoint.targets import Chunks, Deinterleave, Rearranged, StackSlot, Transposed
from ..errors import CheckpointError
from ..options import DtypeRule, Tolerated


def hf_dtype_rule(model: nn.Module) -> Optional[DtypeRule]:
    """The dtypes transformers gives tensors whatever their checkpoint's, as its ``from_pretrained`` does.

    A tensor whose name matches ``_keep_in_fp32_modules_strict`` (a router's
    ``e_score_correction_bias``, DeepSeek-V4's norms and sinks) is upcast to
    fp32 where it would be fp16 or bf16; one matching ``_keep_in_fp32_modules``
    (T5's ``wo``) where it would be fp16. A pattern matches anywhere in the
    name, ``*`` standing for any run of characters, as in transformers.
    Otherwise a floating tensor the model creates in a dtype of its own,
    apart from the dtype it was built in (DeBERTa's ``q_bias``, wav2vec2's
    ``codevectors``, HunYuan's fp32 router), keeps that dtype. The dtype it
    was built in is the one most of its parameters have: telling the two
    apart needs a skeleton built in the load's dtype, as :func:`~materialize.skeleton.hfbuild.build_hf`
    builds it (under torch's fp32 default, an fp32 tensor is like any other).
    """
    strict = _name_patterns(getattr(model, "_keep_in_fp32_modules_strict", None), wildcards=True)
    half_only = _name_patterns(getattr(model, "_keep_in_fp32_modules", None), wildcards=True)
    own = _own_dtypes(model)
    if strict is None and half_only is None and not own:
        return None

    def rule(name: str, dtype: torch.dtype) -> torch.dtype:
        if dtype in (torch.float16, torch.bfloat16) and strict is not None and strict.search(name):
            return torch.float32
        if dtype == torch.float16 and half_only is not None and half_only.search(name):
            return torch.float32
        return own.get(name, dtype)

    return rule


def _own_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Floating tensors of ``model`` in another dtype than the one most of its parameters are in, by name."""
    tensors = model.state_dict(keep_vars=True)
    weights: Counter[torch.dtype] = Counter()
    for parameter in {id(p): p for p in model.parameters()}.values():
        if parameter.is_floating_point():
            weights[parameter.dtype] += parameter.numel()
    if not weights:
        return {}
    built_in = weights.most_common(1)[0][0]
    return {name: tensor.dtype for name, tensor in tensors.items()
            if tensor is not None and tensor.is_floating_point() and tensor.dtype != built_in}


def forget_ties(model: nn.Module, untied: list[list[str]]) -> None:
    """Drop from transformers' record of tied names the ties a load left apart, as ``from_pretrained`` does.

    Otherwise ``save_pretrained`` would save one of them and its next load tie them again.
    """
    ties = getattr(model, "all_tied_weights_keys", None)
    if not isinstance(ties, dict):
        return
    for group in untied:
        names = set(group)
        for target in [target for target, source in ties.items() if target in names and source in names]:
            ties.pop(target)


def hf_tolerated(model: nn.Module) -> Tolerated:
    """The differences transformers lets a model have with its checkpoints without a word.

    Missing tensors matching ``_keys_to_ignore_on_load_missing`` (Marian's
    sinusoidal positions, computed by the model) and unexpected ones matching
    ``_keys_to_ignore_on_load_unexpected`` (GPT-2's saved attention masks),
    plus what older checkpoints hold and models now compute: per-layer
    ``rotary_emb.inv_freq`` and ``position_ids`` (Llama-2 and BERT-era
    saves), where the model has such buffers. As ``from_pretrained`` reads
    these lists, children's included; a regular expression searched anywhere
    in the name.
    """
    buffers = [name for name, _ in model.named_buffers()]
    unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        unexpected.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        unexpected.add(r"(^|\.)position_ids$")
    missing = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())
    modules = {name for name, _ in model.named_modules()}
    return Tolerated(missing=_name_patterns(missing), unexpected=_name_patterns(unexpected),
                     unexpected_tensor=lambda name, info: _is_saved_attention_mask(name, info, modules) or
                     _is_training_extra_state(name, modules),
                     computed_buffers_stand=True)


def _is_training_extra_state(model_name: str, modules: set[str]) -> bool:
    """A training framework's extra state saved beside a module of the model (TransformerEngine's FP8
    scaling metadata, ``<module>._extra_state``, in checkpoints exported from NeMo or Megatron): the
    model's own module keeps none (a module that does takes it, see :mod:`materialize.planning.extrastate`),
    and from_pretrained leaves it out too."""
    return is_extra_state(model_name) and model_name.rpartition(".")[0] in modules


# Attention masks that transformers 4.x kept as persistent buffers and so saved
# (GPT-J's and GPT-Neo's causal `bias` and `masked_bias`, CodeGen's
# `causal_mask`); today's models compute them, and from_pretrained drops them
# with a warning. Their hub checkpoints still hold them. Where the installed
# transformers declares such names ignorable (5.24's GPT-J, by name alone,
# whatever the shape), its declaration decides, as in from_pretrained; this
# rule only adds the masks it does not declare.
_SAVED_MASK_LEAVES = ("bias", "causal_mask")
_SAVED_MASK_FILL_LEAF = "masked_bias"


def _is_saved_attention_mask(model_name: str, info: TensorInfo, modules: set[str]) -> bool:
    """An old save's attention mask: its owner a module of the model, and shaped as a mask, not a weight.

    A causal mask is ``[1, 1, n, n]`` (a real bias is one-dimensional); the
    fill value is one element. Anything else of these names stays unexpected.
    """
    owner, _, leaf = model_name.rpartition(".")
    if owner not in modules:
        return False
    shape = tuple(info.shape)
    if leaf == _SAVED_MASK_FILL_LEAF:
        return math.prod(shape) == 1
    return leaf in _SAVED_MASK_LEAVES and len(shape) == 4 and shape[:2] == (1, 1) and shape[2] == shape[3]


def _name_patterns(patterns: Any, *, wildcards: bool = False) -> Optional[re.Pattern]:
    """One expression searching for any of ``patterns`` (regular expressions; with ``wildcards``, ``*`` is any run)."""
    if not isinstance(patterns, (list, tuple, set, frozenset)) or not patterns:
        return None
    names = sorted(p for p in patterns if isinstance(p, str) and p)
    return re.compile("|".join(f"(?:{p.replace('*', '.*') if wildcards else p})" for p in names)) if names else None


def mark_loaded(model: nn.Module, names: list[str]) -> None:
    """Flag each tensor filled from the checkpoint as ``from_pretrained`` flags it (``_is_hf_initialized``), so
    transformers' own init (``init_weights``, ``post_init``, a resize) leaves its values alone."""
    for name in names:
        owner, _, attr = name.rpartition(".")
        tensor = getattr(model.get_submodule(owner) if owner else model, attr, None)
        if isinstance(tensor, torch.Tensor):
            tensor._is_hf_initialized = True


def is_hf_model(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # never import it just to ask
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def hf_key_map(model: nn.Module) -> Callable[[str], Union[str, StackSlot, Chunks, Transposed, Rearranged]]:
    """Checkpoint name -> model name, with transformers' own renames and base-model prefix.

    transformers' tensor conversions that keep every byte in a contiguous
    run are followed (see :mod:`materialize.planning.stacking`): per-expert tensors
    stacked into one (``MergeModulelist(dim=0)``, optionally followed by
    ``Concatenate(dim=1)``: Mixtral, Qwen-MoE, DeepSeek, OLMoE and the others
    sharing their layout) and tensors concatenated along their first or
    second dimension map to a :class:`StackSlot`; a fused tensor cut along its first
    dimension (``Chunk(dim=0)`` or ``Split(dim=0)``: GTE's ``qkv_proj``) maps
    to :class:`Chunks`; a tensor saved with two dimensions swapped
    (``Transpose``: Qwen3-VL-MoE's stacked experts) maps to
    :class:`Transposed`; pairs interleaved along a dimension (``Interleave``:
    Inkling's experts) or per attention head (``PermuteForRope``: the vision
    towers of Kimi-K2.5, Step3.5, Mistral-Large-4, alone or after a
    ``Chunk(dim=0)``) map to :class:`Rearranged` (or :class:`Chunks` that
    rearrange their parts): strided views of the file, read in place. A
    vocabulary saved padded (``Inkling2UnpadVocab``) maps to :class:`Chunks`
    of its leading rows.
    ERNIE-4.5-VL's one list of experts split between a text and a vision
    stack maps each expert to a :class:`StackSlot` of its stack. A name
    that needs any other conversion (concatenations along a later dimension,
    model-specific ops) cannot be read directly; it is reported as such.
    """
    model_shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict(keep_vars=True).items()}
    model_names = set(model_shapes)
    prefix = getattr(model, "base_model_prefix", "") or ""
    renamings, converters = _conversions(model)
    config = getattr(model, "config", None)

    def with_prefix(renamed: str) -> str:
        if renamed in model_names or not prefix:
            return renamed
        if renamed.startswith(prefix + ".") and renamed[len(prefix) + 1:] in model_names:
            return renamed[len(prefix) + 1:]  # a head model's checkpoint into its base model
        if f"{prefix}.{renamed}" in model_names:
            return f"{prefix}.{renamed}"  # a base model's checkpoint into a head model
        return renamed

    def rename(name: str) -> Union[str, StackSlot, Chunks, Transposed, Rearranged]:
        renamed = name
        for renaming in renamings:
            renamed, _ = renaming.rename_source_key(renamed)
        as_saved = with_prefix(name)
        for converter in converters:
            target, pattern = converter.rename_source_key(renamed)
            if pattern is None:
                continue
            if with_prefix(target) not in model_names and as_saved in model_names:
                return as_saved  # as transformers does: a rename that misses the model yields to the name as saved
            slot = _conversion_slot(converter, pattern, name, renamed, target, with_prefix, model_shapes, config)
            if slot is None:
                raise CheckpointError(
                    f"needs transformers' weight conversion {type(converter).__name__} ({pattern}: "
                    f"{', '.join(map(repr, converter.operations))}), which this loader does not apply; "
                    "load this model with transformers' from_pretrained",
                    tensor=name,
                )
            return slot
        result = with_prefix(renamed)
        # A broad rename (DeepSeek-V4's ``.norm.`` to ``.kv_norm.``) may also catch a name the model holds as saved.
        return as_saved if result not in model_names and as_saved in model_names else result

    return rename


def _conversion_slot(
    converter: Any, pattern: str, name: str, renamed: str, target: str, with_prefix: Callable[[str], str],
    model_shapes: dict[str, tuple[int, ...]], config: Any = None,
) -> Union[str, StackSlot, Chunks, Transposed, Rearranged, None]:
    """Where one checkpoint tensor goes under ``converter``, or None for a conversion that moves bytes around.

    ``target`` is ``renamed`` with the converter's first target pattern in
    place of ``pattern``, as transformers renames it.
    """
    operations = converter.operations
    if len(operations) == 1 and type(operations[0]).__name__ == "Transpose" and len(converter.target_patterns) == 1:
        swap = operations[0]
        target = with_prefix(target)
        unless = model_shapes.get(target) if getattr(swap, "check_dims", False) else None
        return Transposed(target, swap.dim0, swap.dim1, unless_shape=unless)
    kinds = [(type(op).__name__, getattr(op, "dim", None), getattr(op, "num_shards_attribute", None))
             for op in operations]
    names = [kind for kind, _, _ in kinds]
    if kinds in ([("MergeModulelist", 0, None)], [("MergeModulelist", 0, None), ("Concatenate", 1, None)]):
        index = _expert_number(pattern, renamed)
        if index is None:
            return None
        return StackSlot(target=with_prefix(target), index=index,
                         group=converter.source_patterns.index(pattern), pattern=pattern)
    if names == ["ErnieFuseAndSplitTextVisionExperts"]:
        return _split_expert_slot(converter, pattern, renamed, target, with_prefix, model_shapes)
    if kinds in ([("Concatenate", 0, None)], [("Concatenate", 1, None)]) and len(converter.target_patterns) == 1 \
            and "*" not in pattern:
        return StackSlot(target=with_prefix(target), index=0, group=converter.source_patterns.index(pattern),
                         pattern=pattern, new_dim=False, along_rows=kinds[0][1] == 1)
    patterns = converter.target_patterns
    one_source = len(converter.source_patterns) == 1
    if one_source and len(patterns) == 1 and names == ["Inkling2UnpadVocab"]:
        return _leading_rows(operations[0], with_prefix(target), model_shapes)
    if one_source and len(patterns) == 1 and names in (["Interleave"], ["PermuteForRope"]):
        how = _deinterleave(operations[0], converter.source_patterns[0], config)
        return with_prefix(target) if how is None else Rearranged(with_prefix(target), how)
    cuts = kinds in ([("Chunk", 0, None)], [("Split", 0, None)])
    permuted = names == ["Chunk", "PermuteForRope"] and kinds[0] == ("Chunk", 0, None)
    interleaved = (names == ["Interleave", "Chunk"] and kinds[0][1] == kinds[1][1]
                   and kinds[1][2] is None and len(patterns) == 2)
    if not (cuts or permuted or interleaved) or not one_source or any("*" in t or "\\" in t for t in patterns):
        return None
    # transformers names the other parts by the same replacement (its Split does too)
    targets = tuple(with_prefix(target.replace(patterns[0], other)) for other in patterns)
    if interleaved:
        return Chunks(targets, interleaved=_deinterleave(operations[0], pattern, config))
    if permuted:  # each part as the permutation sees it: named by its target pattern
        return Chunks(targets, rearrange=tuple(_deinterleave(operations[1], part, config) for part in patterns))
    if kinds[0][0] == "Chunk":
        return Chunks(targets)
    unknown = [t for t in targets if not model_shapes.get(t)]
    if unknown:
        raise CheckpointError(f"is split into {', '.join(map(repr, targets))}, and the model has no "
                              f"{', '.join(map(repr, unknown))} to size its part", tensor=name)
    return Chunks(targets, rows=tuple(model_shapes[t][0] for t in targets))


def _leading_rows(operation: Any, target: str, model_shapes: dict[str, tuple[int, ...]]) -> Optional[Chunks]:
    """A vocabulary padded in the checkpoint: the model's rows are its first ones, the padding is not read.

    transformers slices the saved tensor to the model's row count; so does
    this, as a run of the file. A saved tensor shorter than the model's is
    an error naming both counts (see :func:`materialize.planning.stacking.cut`).
    """
    shape = model_shapes.get(target)
    if getattr(operation, "inverse", False) or not shape:
        return None
    return Chunks((target,), rows=(shape[0],), rest_unread=True)


def _split_expert_slot(
    converter: Any, pattern: str, renamed: str, target: str, with_prefix: Callable[[str], str],
    model_shapes: dict[str, tuple[int, ...]],
) -> Optional[StackSlot]:
    """ERNIE-4.5-VL: one expert list split in order between the model's stacks (text experts, then vision).

    transformers cuts the list into as many equal runs as there are targets;
    each run is stacked like Mixtral's experts. An expert's stack is found
    by counting the experts of the stacks before it in the model.
    """
    operation = converter.operations[0]
    index = _expert_number(pattern, renamed)
    patterns = converter.target_patterns
    if index is None or getattr(operation, "stack_dim", 0) != 0 or getattr(operation, "concat_dim", 1) != 1 \
            or any("*" in t or "\\" in t for t in patterns):
        return None
    first = 0
    for other in patterns:
        stacked = with_prefix(target.replace(patterns[0], other))
        experts = (model_shapes.get(stacked) or (0,))[0]
        if index < first + experts or other == patterns[-1]:
            return StackSlot(target=stacked, index=index - first, group=converter.source_patterns.index(pattern),
                             pattern=pattern)
        first += experts
    return None


def _deinterleave(operation: Any, pattern: str, config: Any) -> Optional[Deinterleave]:
    """transformers' ``Interleave`` or ``PermuteForRope`` as a :class:`Deinterleave`; None where it moves nothing.

    ``PermuteForRope`` permutes only tensors whose pattern names one of its
    ``permute_layer_names``, in blocks of the head count of its (sub)config,
    and only tensors of one or two dimensions, as transformers applies it.
    """
    inverse = bool(getattr(operation, "inverse", False))
    if type(operation).__name__ == "Interleave":
        return Deinterleave(dim=operation.dim, inverse=inverse)
    layers = getattr(operation, "permute_layer_names", None)
    if layers is not None and not any(layer in pattern for layer in layers):
        return None
    subconfig_key = getattr(operation, "subconfig_key", None)
    if subconfig_key is not None:
        config = getattr(config, subconfig_key, config)
    heads = getattr(config, "num_attention_heads", 1)
    return Deinterleave(dim=0, groups=int(heads), inverse=inverse, ranks=(1, 2))


def _expert_number(pattern: str, renamed: str) -> Optional[int]:
    """What the one ``*`` of a stacking pattern stands for in ``renamed``: the expert's number.

    transformers reads source patterns as regular expressions whose ``*.``
    is any run of characters before a dot (``\\.experts.*.w1.weight``), and
    also writes plain names with a ``*`` (``mlp.experts.*.gate_proj.weight``);
    both are read here with the ``*`` as a number.
    """
    if pattern.count("*") != 1:
        return None
    expression = pattern.replace("*.", r"(\d+)\.") if "*." in pattern else re.escape(pattern).replace(r"\*", r"(\d+)")
    try:
        found = re.search(expression, renamed)
    except re.error:
        return None
    return int(found.group(1)) if found else None


class _RenamingOf4x:
    """transformers 4.x's key renames, in the interface of 5.x's ``WeightRenaming``.

    A class's ``_checkpoint_conversion_mapping`` (the older layout of VLMs
    such as Llava: first matching pattern wins), then the model's
    ``_fix_state_dict_key_on_load`` (``LayerNorm.gamma`` to ``.weight``,
    weight-norm parametrizations), as its ``from_pretrained`` applies them.
    """

    def __init__(self, model: nn.Module) -> None:
        self._patterns = dict(getattr(model, "_checkpoint_conversion_mapping", None) or {})
        self._fix = getattr(model, "_fix_state_dict_key_on_load", None)

    def rename_source_key(self, key: str) -> tuple[str, None]:
        for pattern, replacement in self._patterns.items():
            key, replaced = re.subn(pattern, replacement, key)
            if replaced:
                break
        if self._fix is not None:
            fixed = self._fix(key)
            key = fixed[0] if isinstance(fixed, tuple) else fixed
        return key, None


def _conversions(model: nn.Module) -> tuple[list, list]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # transformers 4.x: its own renames, and no tensor conversions
        return [_RenamingOf4x(model)], []
    transforms = get_model_conversion_mapping(model)
    return (
        [t for t in transforms if isinstance(t, WeightRenaming)],
        [t for t in transforms if isinstance(t, WeightConverter)],
    )


def hf_init(model: nn.Module) -> Callable[[nn.Module], None]:
    """Initialize one module with the ``_init_weights`` of the transformers model that contains it.

    The function returned also has ``name_for(module)``: which model's ``_init_weights`` that is, in words
    (``"LlamaForCausalLM._init_weights"``), for an error about what it left unwritten (a module it does
    not know: see :mod:`materialize.io.checkedinit`).
    """
    transformers = sys.modules["transformers"]
    owner: dict[int, nn.Module] = {}

    def visit(module: nn.Module, current: nn.Module) -> None:
        if isinstance(module, transformers.PreTrainedModel):
            current = module
        owner[id(module)] = current
        for child in module.children():
            visit(child, current)

    visit(model, model)

    def init(module: nn.Module) -> None:
        owner.get(id(module), model)._init_weights(module)

    init.name_for = lambda module: f"{type(owner.get(id(module), model)).__name__}._init_weights"
    return init
