"""An unmerged LoRA save (peft's names) is said as one: what it is and to merge it first, never a rename
nor strict=False, which would load the base weights alone.

The checkpoints are written here with peft's names, made from a tiny model's own names and each of
peft's adapter tensor names (``LoraLayer.adapter_layer_names`` and DoRA's ``lora_magnitude_vector``),
in the three forms a user meets: ``save_pretrained``'s ``adapter_model.safetensors`` (the adapter
alone, ``base_model.model.`` before each name, the adapter's name left out), a ``PeftModel``'s
``state_dict()`` (the base weights under ``base_layer`` beside the adapters, each under ``default``),
and the wrapped model's own ``state_dict()`` (the same without ``base_model.model.``). peft itself is
not needed: the names are what is tested.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from torch import nn

import materialize as mz
from materialize.planning.adapterhints import ADAPTER_SEGMENTS, adapter_words
from materialize_cli.main import main

MODEL_SCRIPT = '''\
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.q_proj = nn.Linear(8, 8)
        self.v_proj = nn.Linear(8, 8)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.lm_head = nn.Linear(8, 16, bias=False)


def make():
    return Tiny()
'''
RANK = 2
# Each kind of adapter peft saves, with the modules it adapts and its tensors' names after the module's,
# as a PeftModel's state_dict names them (adapter "default") and as save_pretrained writes them.
ADAPTERS = {
    "lora": (("q_proj", "v_proj"), {"lora_A.default.weight": "lora_A.weight", "lora_B.default.weight": "lora_B.weight"}),
    "lora embedding": (("embed_tokens",), {"lora_embedding_A.default": "lora_embedding_A",
                                           "lora_embedding_B.default": "lora_embedding_B"}),
    "dora": (("q_proj", "v_proj"), {"lora_A.default.weight": "lora_A.weight", "lora_B.default.weight": "lora_B.weight",
                                    "lora_magnitude_vector.default.weight": "lora_magnitude_vector"}),
}
FORMS = ("adapter_model.safetensors", "PeftModel.state_dict()", "wrapped model's state_dict()")


def _model(tmp: Path) -> tuple[nn.Module, str]:
    import runpy

    (tmp / "tiny.py").write_text(MODEL_SCRIPT)
    return runpy.run_path(str(tmp / "tiny.py"))["make"](), f"{tmp / 'tiny.py'}:make"


def _adapter_tensor(module: nn.Module, suffix: str) -> torch.Tensor:
    """A tensor of the shape peft gives ``suffix``'s adapter tensor of ``module``."""
    rows, columns = (module.num_embeddings, module.embedding_dim) if isinstance(module, nn.Embedding) else \
        (module.in_features, module.out_features)
    kind = suffix.split(".")[0]
    shape = {"lora_A": (RANK, rows), "lora_B": (columns, RANK), "lora_embedding_A": (RANK, rows),
             "lora_embedding_B": (columns, RANK), "lora_magnitude_vector": (columns,)}[kind]
    return torch.randn(shape)


def peft_save(model: nn.Module, adapter: str, form: str) -> dict[str, torch.Tensor]:
    """What peft would save of ``model`` with ``adapter`` on its modules, in ``form``."""
    targets, suffixes = ADAPTERS[adapter]
    adapted = {name: module for name, module in model.named_modules() if name.rpartition(".")[2] in targets}
    torch.manual_seed(0)
    if form == "adapter_model.safetensors":
        return {f"base_model.model.{name}.{saved}": _adapter_tensor(module, saved)
                for name, module in adapted.items() for saved in suffixes.values()}
    prefix = "base_model.model." if form == "PeftModel.state_dict()" else ""
    state = {}
    for name, tensor in model.state_dict().items():
        module, _, attr = name.rpartition(".")
        state[f"{prefix}{module}.base_layer.{attr}" if module in adapted else prefix + name] = tensor.clone()
    for name, module in adapted.items():
        state.update({f"{prefix}{name}.{suffix}": _adapter_tensor(module, suffix) for suffix in suffixes})
    return state


CASES = [(adapter, form) for adapter in ADAPTERS for form in FORMS]


def test_the_cases_cover_every_adapter_name_of_peft():
    saved = {name for adapter in ADAPTERS for form in FORMS
             for name in peft_save(_model_with_no_file(), adapter, form)}
    assert {segment for name in saved for segment in name.split(".")} >= ADAPTER_SEGMENTS


def _model_with_no_file() -> nn.Module:
    namespace: dict = {}
    exec(MODEL_SCRIPT, namespace)  # noqa: S102 - the test's own model
    return namespace["make"]()


def _said_as_an_adapter(message: str, form: str) -> None:
    assert "merge_and_unload()" in message and "get_peft_model" in message, message
    what = "a LoRA adapter (peft's adapter_model.safetensors)" if form == "adapter_model.safetensors" else \
        "a model saved with its LoRA adapters unmerged"
    assert what in message, message
    # Neither a rename nor strict=False: each would load something that is not the fine-tuned model.
    for offered in ("strict=False", "--no-strict", "key_map=", "(CLI:", "--rename", "--strip-prefix", "ignore_unexpected"):
        assert offered not in message, (offered, message)


@pytest.mark.parametrize("adapter, form", CASES)
def test_an_unmerged_lora_save_is_said_as_one_by_the_library(tmp_path, adapter, form):
    model, _ = _model(tmp_path)
    save_file(peft_save(model, adapter, form), str(tmp_path / "adapter.safetensors"))
    with mz.meta_init():
        skeleton, _ = _model(tmp_path)

    with pytest.raises(mz.KeyMismatchError) as caught:
        mz.load(skeleton, tmp_path / "adapter.safetensors")

    _said_as_an_adapter(str(caught.value), form)
    assert not caught.value.architecture_differs  # the model is the right one: the file is not its weights


@pytest.mark.parametrize("adapter, form", CASES)
def test_an_unmerged_lora_save_is_one_error_line_at_the_cli(tmp_path, adapter, form):
    model, spec = _model(tmp_path)
    save_file(peft_save(model, adapter, form), str(tmp_path / "adapter_model.safetensors"))

    done = CliRunner().invoke(main, [str(tmp_path / "adapter_model.safetensors"), "--model", spec])

    line = done.stderr.strip()
    assert done.exit_code == 1 and line.startswith("Error: ") and "\n" not in line, done.output
    _said_as_an_adapter(line, form)
    assert "is --model the architecture" not in line


def test_an_adapter_file_loaded_with_no_strict_is_still_said_as_an_adapter(tmp_path):
    model, spec = _model(tmp_path)
    save_file(peft_save(model, "lora", FORMS[0]), str(tmp_path / "adapter_model.safetensors"))

    done = CliRunner().invoke(main, [str(tmp_path / "adapter_model.safetensors"), "--model", spec, "--no-strict"])

    assert done.exit_code == 1 and "nothing would be loaded" in done.stderr, done.output
    assert "a LoRA adapter (peft's adapter_model.safetensors)" in done.stderr and "merge_and_unload()" in done.stderr
    assert "(CLI:" not in done.stderr


def test_a_model_built_with_peft_names_is_no_adapter_error():
    """A model that holds adapter tensors itself (built with peft) gets the usual words for what differs."""
    unexpected = ["base_model.model.layers.0.q_proj.lora_A.default.weight"]
    assert adapter_words(unexpected, ["layers.0.q_proj.lora_A.default.weight"]) == ""
    assert adapter_words(["layers.0.q_proj.weight"], ["layers.0.q_proj.base_layer.weight"]) == ""  # no adapter tensor
    assert "LoRA adapter" in adapter_words(unexpected, ["layers.0.q_proj.weight"])


def test_an_unmerged_save_loaded_with_no_strict_warns_that_the_fine_tune_is_left_out(tmp_path):
    model, spec = _model(tmp_path)
    save_file(peft_save(model, "lora", FORMS[2]), str(tmp_path / "model.safetensors"))

    done = CliRunner().invoke(main, [str(tmp_path / "model.safetensors"), "--model", spec, "--no-strict"])

    assert done.exit_code == 0, done.output
    warned = [line for line in done.stderr.splitlines() if line.startswith("Warning: ") and "LoRA adapter" in line]
    assert warned and "leaves out" in warned[0] and "without the fine-tune" in warned[0], done.stderr
    assert "merge_and_unload()" in warned[0]
