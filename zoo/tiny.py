"""A tiny configuration of any transformers configuration class, shrunk by rules over attribute names.

No model has a hand-written config here: :func:`tiny_config` takes the class's defaults (``to_dict()``),
rewrites every value whose name says what it is (a width, a layer count, a head count, experts, the
vocabulary, an image or audio size) and builds the class again from the result, so that ``__init__``
derives what it derives from them. Nested sub-configs (``text_config``, ``vision_config``,
``backbone_config``, encoder/decoder...) are plain dicts in ``to_dict()`` and are shrunk by the same rules.

The rules keep the relations models check: heads divide widths (width 32, 4 heads of 8, or 2 per stage
where widths grow per stage), key/value heads divide heads (2 of 4 where the defaults group queries, 4
where they do not), experts per token are fewer than experts, and lists as long as the old layer count
(``layer_types``) are cut to the new one. Token ids past the new vocabulary are moved into it, equal ids
staying equal.

A model whose construction fails at the smallest level is retried at the next (see :data:`LEVELS`): the
second keeps image and audio sizes and the vocabulary as the defaults have them, the third also keeps
per-stage lists. What fails at every level is skipped by the oracles with its reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, Optional

WIDTH = 32
INTERMEDIATE = 64
HEAD_DIM = 8
HEADS = 4
KV_HEADS_GROUPED = 2
LAYERS = 2
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
VOCAB = 128
POSITIONS = 512
LORA_RANK = 16

# name patterns; a name is matched whole (re.fullmatch) after the sub-config it sits in is known
_INTERMEDIATE = re.compile(r".*(intermediate_size|ffn_dim|d_ff|n_inner|mlp_dim|ffn_hidden_size|intermediate_dim|"
                           r"decoder_intermediate_size|iou_head_hidden_dim)")
_HEAD_DIM = re.compile(r"(.*_)?(head_dim|d_kv|d_head|head_size|attention_head_size)")
_LORA = re.compile(r".*lora_rank")
_KV_HEADS = re.compile(r".*(key_value_heads|kv_heads)")
_HEADS = re.compile(r"(.*_)?(num_attention_heads|n_head|n_heads|num_heads|attention_heads|encoder_attention_heads|"
                    r"decoder_attention_heads|num_key_heads|num_value_heads)")
_WIDTH = re.compile(r"(.*_)?(hidden_size|d_model|n_embd|n_embed|embed_dim|embedding_size|embedding_dim|hidden_dim|"
                    r"projection_dim|dim|d_embed|word_embed_proj_dim|proj_dim|hidden_channels)")
_LAYERS = re.compile(r"(.*_)?(num_hidden_layers|num_layers|n_layer|n_layers|layers|depth|num_blocks|"
                     r"max_window_layers|num_decoder_layers|num_encoder_layers)")
_FEW = re.compile(r"(first_k_dense_replace|num_kv_shared_layers|n_shared_experts|num_shared_experts|"
                  r"moe_num_shared_experts|n_group|topk_group|num_nextn_predict_layers|pretraining_tp)")
_EXPERTS = re.compile(r"(num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_experts_total)")
_PER_TOKEN = re.compile(r"(num_experts_per_tok|top_k|moe_topk|moe_k|num_selected_experts|router_top_k)")
_VOCAB = re.compile(r"(.*_)?vocab_size")
_KEEP_VOCAB = re.compile(r"(type_vocab_size|.*relative.*|.*bucket.*)")
_POSITIONS = re.compile(r"(max_position_embeddings|n_positions|n_ctx)")
_TOKEN_ID = re.compile(r".*(token_id|token_index|_token_ids?)")
_LIST_WIDTHS = re.compile(r".*(hidden_sizes|embed_dims?|dims|conv_dim|tdnn_dim|channels|neck_hidden_sizes|"
                          r"stage_out_channels|stage_in_channels|stage_mid_channels|encoder_in_channels|"
                          r"decoder_in_channels|backbone_channel_list|hidden_channels)")
_LIST_HEADS = re.compile(r".*(num_heads|num_attention_heads|heads)")
_LIST_DEPTHS = re.compile(r".*(depths|stage_num_blocks|num_layers|layers_per_block)")
_LAYER_INDEXES = re.compile(r".*(indexes|indices|_layer_ids?)")
_IMAGE = re.compile(r"(.*_)?image_size")
_PATCH = re.compile(r"(.*_)?patch_size")
_NEVER = re.compile(r".*(label|_id2|num_labels|num_channels|in_channels|audio_channels|input_channels|"
                    r"sampling_rate|num_mel_bins|max_source_positions|kernel|stride|window|sliding|padding|"
                    r"num_queries|num_classes|scale|rope|ratio|factor|hop_length|n_fft|chunk|theta|seed|step)")

LEVELS = ("tiny", "tiny, default image/audio sizes and vocabulary", "tiny widths, default per-stage lists")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_int(v) for v in value)


def _is_config(value: Any) -> bool:
    return isinstance(value, dict) and ("model_type" in value or "architectures" in value)


def shrink(values: dict[str, Any], level: int = 0) -> dict[str, Any]:
    """``values`` (a config's ``to_dict()``) with every size the rules know made tiny; nested configs too."""
    out = dict(values)
    # A backbone names the stages it returns (out_features, out_indices): its layers stay as many.
    backbone = bool(values.get("out_features") or values.get("out_indices"))
    old_layers = {name: v for name, v in values.items()
                  if isinstance(name, str) and _int(v) and _LAYERS.fullmatch(name) and v > LAYERS and not backbone}
    heads = values.get("num_attention_heads")
    for name, value in values.items():
        if not isinstance(name, str) or name.startswith("_") or value is None:
            continue  # id2label's keys are ints
        if _is_config(value):
            out[name] = shrink(value, level)
        elif isinstance(value, list) and value and all(_is_config(v) for v in value):
            out[name] = [shrink(v, level) for v in value]
        elif _int(value) and not (backbone and _LAYERS.fullmatch(name)):
            out[name] = _shrink_int(name, value, heads, level)
        elif _ints(value) and level < 2:
            out[name] = _shrink_list(name, value, values)
    new_layers = min(out[n] for n in old_layers) if old_layers else None
    for name, value in [(n, v) for n, v in values.items() if isinstance(n, str)]:  # per-layer lists follow the layer count they were as long as
        if isinstance(value, list) and old_layers and len(value) in old_layers.values() and new_layers:
            if not (_ints(value) and _LAYER_INDEXES.fullmatch(name)):
                out[name] = list(out[name])[:new_layers]
        if _ints(value) and _LAYER_INDEXES.fullmatch(name) and old_layers and level < 2 and not backbone:
            cut = sorted({min(v, new_layers - 1) if v >= 0 else v for v in value})
            out[name] = cut
    if "mrope_section" in str(values.get("rope_parameters")) and isinstance(values.get("rope_parameters"), dict):
        out["rope_parameters"] = _mrope(values["rope_parameters"])
    if "qk_head_dim" in out and "qk_nope_head_dim" in out and "qk_rope_head_dim" in out:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    if out.get("use_pretrained_backbone"):
        out["use_pretrained_backbone"] = False  # nothing is downloaded, ever
    return out


def _shrink_int(name: str, value: int, heads: Optional[int], level: int) -> int:
    if _NEVER.fullmatch(name) or value <= 0:
        return value
    if _TOKEN_ID.fullmatch(name):
        return value  # moved by remap_token_ids, over the whole tree at once
    if _FEW.fullmatch(name):
        return min(value, 1)
    if _PER_TOKEN.fullmatch(name):
        return min(value, EXPERTS_PER_TOKEN)
    if _EXPERTS.fullmatch(name):
        return min(value, EXPERTS)
    if _LORA.fullmatch(name):
        return min(value, LORA_RANK)
    if _HEAD_DIM.fullmatch(name):
        return min(value, HEAD_DIM)
    if _KV_HEADS.fullmatch(name):
        grouped = heads is not None and value < heads
        return min(value, KV_HEADS_GROUPED if grouped else HEADS)
    if _HEADS.fullmatch(name):
        return min(value, HEADS)
    if _INTERMEDIATE.fullmatch(name):
        return min(value, INTERMEDIATE)
    if _LAYERS.fullmatch(name):
        return min(value, LAYERS)
    if _VOCAB.fullmatch(name) and not _KEEP_VOCAB.fullmatch(name):
        return value if level >= 1 else min(value, VOCAB)
    if _POSITIONS.fullmatch(name):
        return min(value, POSITIONS)
    if _WIDTH.fullmatch(name):
        return min(value, WIDTH)
    if name == "rotary_dim":
        return min(value, HEAD_DIM // 2)
    if _IMAGE.fullmatch(name) and level == 0:
        return min(value, 64)
    return value


def _shrink_list(name: str, value: list[int], siblings: dict[str, Any]) -> list[int]:
    if _NEVER.fullmatch(name) or _TOKEN_ID.fullmatch(name) or _LAYER_INDEXES.fullmatch(name):
        return value
    if _LIST_DEPTHS.fullmatch(name):
        return [min(v, 1) for v in value]
    if _LIST_HEADS.fullmatch(name):
        return [min(v, 2) for v in value]
    if _LIST_WIDTHS.fullmatch(name):  # keep their ratios where they grow (2 heads per stage divide each)
        if len(set(value)) == 1:
            return [min(value[0], WIDTH)] * len(value)
        smallest = min(v for v in value if v > 0)
        return [max(2, (v * 16) // smallest) if v > 0 else v for v in value] if smallest > 16 else value
    return value


def _mrope(rope: dict[str, Any]) -> dict[str, Any]:
    sections = rope["mrope_section"]
    half = HEAD_DIM // 2
    new = [max(1, half * s // sum(sections)) for s in sections]
    new[-1] += half - sum(new)
    return {**rope, "mrope_section": new}


def remap_token_ids(values: dict[str, Any], vocab: int = VOCAB) -> dict[str, Any]:
    """Token ids past ``vocab`` moved below it, each old id to one new one (equal ids stay equal)."""
    seen: dict[int, int] = {}

    def new_id(old: int) -> int:
        if old < vocab // 2:
            return old
        if old not in seen:
            seen[old] = vocab - 1 - len(seen)
        return seen[old]

    def walk(d: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name, value in d.items():
            if not isinstance(name, str):
                out[name] = value
            elif isinstance(value, dict):
                out[name] = walk(value)
            elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                out[name] = [walk(v) for v in value]
            elif _TOKEN_ID.fullmatch(name) and _int(value):
                out[name] = new_id(value)
            elif _TOKEN_ID.fullmatch(name) and _ints(value):
                out[name] = [new_id(v) for v in value]
            else:
                out[name] = value
        return out

    return walk(values)


def smallest_vocab(values: dict[str, Any]) -> Optional[int]:
    found = [v for k, v in values.items() if isinstance(k, str) and _VOCAB.fullmatch(k) and not _KEEP_VOCAB.fullmatch(k) and _int(v)]
    for value in values.values():
        if isinstance(value, dict):
            inner = smallest_vocab(value)
            if inner is not None:
                found.append(inner)
    return min(found) if found else None


def tiny_values(config_class: type, level: int = 0) -> dict[str, Any]:
    """The keyword arguments of a tiny ``config_class`` at ``level``."""
    values = config_class().to_dict()
    for key in ("transformers_version", "architectures", "_name_or_path", "model_type"):
        values.pop(key, None)
    small = shrink(values, level)
    vocab = smallest_vocab(small)
    return remap_token_ids(small, vocab) if vocab else small


def tiny_config(config_class: type, level: int = 0) -> Any:
    return config_class(**tiny_values(config_class, level))


def first_that_builds(name: str, attempts: Iterable[tuple[str, Any, Callable[[], Any]]], max_parameters: int) -> Any:
    """The key of the first of ``attempts`` (``(level's words, key, make)``) whose ``make()`` builds on meta with
    at most ``max_parameters`` parameters; :class:`zoo.outcomes.Skipped` naming each level's reason where none
    does."""
    import torch

    from zoo.outcomes import Skipped, one_line

    reasons = []
    for label, key, make in attempts:
        try:
            with torch.device("meta"):
                model = make()
        except Exception as error:  # noqa: BLE001 - the reasons are the skip's
            reasons.append(f"[{label}] {one_line(error, 200)}")
            continue
        count = sum(p.numel() for p in model.parameters())
        if count > max_parameters:
            reasons.append(f"[{label}] {count:,} parameters (more than {max_parameters:,})")
            continue
        return key
    raise Skipped(f"{name} builds at no tiny level: " + "; ".join(reasons))
