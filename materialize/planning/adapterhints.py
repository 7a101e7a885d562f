"""An unmerged LoRA save, said as one in a mismatch error: what it is and what to do, never a rename.

peft (Hugging Face's parameter-efficient fine-tuning) wraps each layer it
adapts: the layer's own tensors move under ``base_layer``, and the
adapter's sit beside them under peft's ``LoraLayer.adapter_layer_names``
(``lora_A``, ``lora_B``, ``lora_embedding_A``, ``lora_embedding_B``) and
DoRA's ``lora_magnitude_vector``, one entry per adapter (``default``); a
``PeftModel``'s names start with ``base_model.model.``. Its
``save_pretrained`` writes the adapter's tensors alone
(``adapter_model.safetensors``, the adapter's name left out:
``base_model.model.layers.0.q_proj.lora_A.weight``); a ``state_dict()`` of
the wrapped model holds the base weights too, under ``base_layer``.

Neither is the weights of the model it adapts: an adapted layer's weight
is ``base_layer.weight`` plus the scaled product ``lora_B @ lora_A`` (DoRA
rescales it by its magnitude vector), a sum no rename makes, and
``strict=False`` would load the base weights alone and drop the
fine-tune. So where a checkpoint's tensors the model lacks carry these
names (and the model has none of them), the mismatch error says what the
checkpoint is and what to do (merge the adapters with peft's
``merge_and_unload()`` and save the merged model, or build the model with
peft) and offers neither a rename nor ``strict=False``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..errors import summarize_names

# peft's LoraLayer.adapter_layer_names (peft/tuners/lora/layer.py), and DoRA's magnitude (LoraLayer.lora_magnitude_vector).
ADAPTER_LAYER_NAMES = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
DORA_NAMES = ("lora_magnitude_vector",)
ADAPTER_SEGMENTS = frozenset(ADAPTER_LAYER_NAMES + DORA_NAMES)
BASE_LAYER = "base_layer"  # where peft's wrapper keeps the adapted layer's own tensors


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is a peft adapter tensor's: a segment of it is one of peft's adapter layer names."""
    return any(segment in ADAPTER_SEGMENTS for segment in name.split("."))


def adapter_words(unexpected: Sequence[str], model_names: Iterable[str]) -> str:
    """What the checkpoint is and what to do, where its tensors the model lacks (``unexpected``) include
    peft adapter tensors and the model (``model_names``, asked only then) has none; else ``""``."""
    adapters = [name for name in unexpected if is_adapter_name(name)]
    if not adapters or any(is_adapter_name(name) for name in model_names):
        return ""
    kinds = sorted({segment for name in adapters for segment in name.split(".") if segment in ADAPTER_SEGMENTS})
    unmerged = any(BASE_LAYER in name.split(".") for name in unexpected)
    if unmerged:
        what = (f"a model saved with its LoRA adapters unmerged (peft): each adapted layer's weight is split into "
                f"'{BASE_LAYER}' and {len(adapters)} adapter tensors ({', '.join(kinds)}), e.g. "
                f"{summarize_names(adapters, limit=2)}")
        merge = "merged = peft_model.merge_and_unload() on the PeftModel you trained"
    else:
        what = (f"a LoRA adapter (peft's adapter_model.safetensors): {len(adapters)} adapter tensors "
                f"({', '.join(kinds)}), e.g. {summarize_names(adapters, limit=2)}, the low-rank updates of a base "
                f"model's layers, not the model's weights")
        merge = ("merged = PeftModel.from_pretrained(base_model, adapter_folder).merge_and_unload(), base_model "
                 "holding the base model's own weights")
    return (f"the checkpoint is {what}; no rename makes a model's weights of them (each adapted weight is the base "
            f"weight plus the scaled lora_B @ lora_A), and loading the base weights alone would drop the fine-tune. "
            f"Merge the adapters first: with peft, {merge}; save merged.state_dict() (or merged.save_pretrained) "
            f"and load that. Or build the model with peft (get_peft_model, PeftModel) so that it holds these tensors")
