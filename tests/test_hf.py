"""Hugging Face models: what materialize builds and loads equals what from_pretrained gives."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

import materialize as mz

from conftest import hub_cache
import preforked

transformers = pytest.importorskip("transformers")

CLI = str(Path(sys.executable).parent / "materialize")


def _tiny(kind: str):
    """A tiny random model of a real architecture, and an input for its forward."""
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=99, n_positions=64)
        return transformers.GPT2LMHeadModel(config), {"input_ids": torch.arange(7)[None] % 99}
    if kind == "llama":
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=99, tie_word_embeddings=True)
        return transformers.LlamaForCausalLM(config), {"input_ids": torch.arange(7)[None] % 99}
    if kind == "bert":
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                         vocab_size=99, max_position_embeddings=64)
        return transformers.BertForMaskedLM(config), {"input_ids": torch.arange(7)[None] % 99}
    if kind == "t5":
        config = transformers.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, vocab_size=99, d_kv=8,
                                       decoder_start_token_id=0)
        ids = torch.arange(7)[None] % 99
        return transformers.T5ForConditionalGeneration(config), {"input_ids": ids, "decoder_input_ids": ids[:, :4]}
    if kind == "mixtral":  # experts saved as block_sparse_moe.experts.N.w1/w2/w3, stacked in the model
        config = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, vocab_size=99, num_local_experts=4, num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config), {"input_ids": torch.arange(7)[None] % 99}
    if kind == "qwen2_moe":  # experts saved as mlp.experts.N.gate_proj/up_proj/down_proj
        config = transformers.Qwen2MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                             shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, vocab_size=99, num_experts=3, num_experts_per_tok=2)
        return transformers.Qwen2MoeForCausalLM(config), {"input_ids": torch.arange(7)[None] % 99}
    if kind == "deepseek_v4":  # experts matched by regular-expression patterns; a broad ".norm." rename to yield
        _needs("DeepseekV4Config")
        config = transformers.DeepseekV4Config(
            vocab_size=99, hidden_size=32, moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            head_dim=16, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=16,
            index_n_heads=2, index_head_dim=16, index_topk=8, qk_rope_head_dim=8, sliding_window=8,
            max_position_embeddings=64, num_nextn_predict_layers=0)
        return transformers.DeepseekV4ForCausalLM(config), {"input_ids": torch.arange(7)[None] % 99}
    if kind == "gte":  # q, k, v saved fused as attention.qkv_proj (weight and bias), cut in equal parts by the model
        _needs("GteConfig")
        config = transformers.GteConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
                                        vocab_size=99, max_position_embeddings=64)
        return transformers.GteModel(config), {"input_ids": torch.arange(7)[None] % 99}
    if kind == "molmo2":  # att_proj split unevenly into q, k, v (grouped-query); two embeddings concatenated into one
        _needs("Molmo2TextConfig")
        config = transformers.Molmo2TextConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               intermediate_size=64, vocab_size=99, additional_vocab_size=5, pad_token_id=0, head_dim=8)
        return transformers.Molmo2TextModel(config), {"input_ids": torch.arange(7)[None] % 104}
    if kind == "inkling2":  # experts saved with gate and up rows interleaved (Interleave(dim=1)): read as a strided view;
        _needs("Inkling2TextConfig")  # since transformers 5.24 the head is saved padded to vocab_size (zero rows after 99)
        config = transformers.Inkling2TextConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, vocab_size=104, unpadded_vocab_size=99,
            swa_head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, d_rel=16)
        return transformers.Inkling2ForCausalLM(config), {"input_ids": torch.arange(7)[None] % 99}
    if kind == "step3p7":  # stacked gate and up concatenated along dim 1; the vision tower's fused in_proj cut into
        _needs("Step3p7Config")  # q, k, v, then q and k permuted per head for RoPE
        text = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    share_expert_dim=16, num_sliding_attention_heads=4, query_pre_attn_scalar=8,
                    mlp_layer_types=["dense", "sparse"], layer_types=["full_attention", "sliding_attention"], sliding_window=8)
        vision = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_hidden_layers=2, image_size=32, patch_size=8)
        config = transformers.Step3p7Config(text_config=text, vision_config=vision)
        return transformers.Step3p7ForConditionalGeneration(config), {"input_ids": torch.arange(7)[None] % 99}
    if kind == "ernie4_5_vl":  # one list of experts, split in order into text and vision stacks of different widths
        _needs("Ernie4_5_VLMoeConfig")
        text = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, moe_intermediate_size=[24, 16], moe_k=2, moe_num_experts=4, moe_num_shared_experts=1,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
        vision = dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=48, patch_size=8)
        config = transformers.Ernie4_5_VLMoeConfig(text_config=text, vision_config=vision)
        return transformers.Ernie4_5_VLMoeForConditionalGeneration(config), {"input_ids": torch.arange(7)[None] % 99}
    if kind == "marian":  # sinusoidal positions are not saved: declared missing, computed by the model
        config = transformers.MarianConfig(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2,
                                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                                           decoder_ffn_dim=48, max_position_embeddings=64, pad_token_id=0,
                                           decoder_start_token_id=0)
        ids = torch.arange(7)[None] % 99
        return transformers.MarianMTModel(config), {"input_ids": ids, "decoder_input_ids": ids[:, :4]}
    if kind == "whisper":  # its encoder's sinusoidal positions are a parameter the constructor freezes
        config = transformers.WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                            vocab_size=99, pad_token_id=1, bos_token_id=2, eos_token_id=3,
                                            decoder_start_token_id=4, num_mel_bins=8, max_source_positions=16,
                                            max_target_positions=16)
        return (transformers.WhisperForConditionalGeneration(config),
                {"input_features": torch.randn(1, 8, 32), "decoder_input_ids": torch.arange(4)[None] % 99})
    if kind == "gptj":  # 4.x saves kept each layer's causal mask (attn.bias) and fill value (attn.masked_bias)
        config = transformers.GPTJConfig(n_embd=32, n_layer=2, n_head=2, rotary_dim=8, vocab_size=99, n_positions=64)
        return transformers.GPTJForCausalLM(config), {"input_ids": torch.arange(12)[None] % 99}
    if kind == "gpt_neo":  # attn.attention.bias is still a computed buffer: causal (global) or windowed (local)
        config = transformers.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
                                           vocab_size=99, max_position_embeddings=64, window_size=4)
        return transformers.GPTNeoForCausalLM(config), {"input_ids": torch.arange(12)[None] % 99}
    if kind == "codegen":  # 4.x saves kept attn.causal_mask
        config = transformers.CodeGenConfig(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=99, n_positions=64, n_ctx=64)
        return transformers.CodeGenForCausalLM(config), {"input_ids": torch.arange(12)[None] % 99}
    if kind == "vit":
        config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                        image_size=32, patch_size=8, num_labels=3)
        return transformers.ViTForImageClassification(config), {"pixel_values": torch.randn(1, 3, 32, 32)}
    if kind == "deberta":  # q_bias and v_bias made fp32 by the model, whatever the dtype it is built in
        config = transformers.DebertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                            vocab_size=99, max_position_embeddings=64)
        return transformers.DebertaForMaskedLM(config), {"input_ids": torch.arange(7)[None] % 99}
    if kind == "hunyuan_moe":  # its router is an nn.Linear made fp32 by the model
        _needs("HunYuanMoEV1Config")
        config = transformers.HunYuanMoEV1Config(
            vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts=4, moe_topk=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        return transformers.HunYuanMoEV1ForCausalLM(config), {"input_ids": torch.arange(7)[None] % 99}
    raise AssertionError(kind)


def _needs(name: str) -> None:
    """Architectures newer than the installed transformers (hosts bring their own) are skipped, not failed."""
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")


def _save(model, folder: Path, *, as_bin: bool, dtype: torch.dtype) -> Path:
    model = model.to(dtype)
    model.save_pretrained(folder, max_shard_size="40KB")
    if as_bin:  # the same tensors as sharded torch files, as older saves have them
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        weight_map = {}
        for shard in sorted(set(index["weight_map"].values())):
            tensors = load_file(folder / shard)  # the names as saved, which may differ from the module's
            bin_name = shard.replace("model-", "pytorch_model-").replace(".safetensors", ".bin")
            torch.save(tensors, folder / bin_name)
            weight_map.update({n: bin_name for n in tensors})
            (folder / shard).unlink()
        (folder / "model.safetensors.index.json").unlink()
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


KINDS = ["gpt2", "llama", "bert", "t5", "vit", "mixtral", "qwen2_moe", "deepseek_v4", "gte", "molmo2", "inkling2",
         "step3p7", "ernie4_5_vl", "marian"]


@pytest.mark.parametrize("as_bin", [False, True], ids=["safetensors", "bin"])
@pytest.mark.parametrize("kind", KINDS)
def test_load_model_equals_from_pretrained(kind, as_bin, tmp_path):
    source, inputs = _tiny(kind)
    folder = _save(source, tmp_path / kind, as_bin=as_bin, dtype=torch.bfloat16)

    model, report = mz.load_model(folder)
    reference = type(source).from_pretrained(folder).eval()

    assert type(model) is type(reference)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype, name
        assert torch.equal(ours[name], value), name
    assert report.missing == [] and report.unexpected == []
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], reference(**inputs)[0])


@pytest.mark.parametrize("kind", ["whisper", "marian"])
def test_a_parameter_its_constructor_froze_stays_frozen_where_from_pretrained_unfreezes_it(kind, tmp_path):
    source, inputs = _tiny(kind)
    frozen = {name for name, p in source.named_parameters() if not p.requires_grad}
    folder = _save(source, tmp_path / kind, as_bin=False, dtype=torch.float32)

    model, _ = mz.load_model(folder)
    reference = type(source).from_pretrained(folder)

    ours = {name: p.requires_grad for name, p in model.named_parameters()}
    assert frozen and ours == {name: p.requires_grad for name, p in source.named_parameters()}  # as eagerly made
    theirs = {name: p.requires_grad for name, p in reference.named_parameters()}
    assert {name for name in ours if ours[name] != theirs[name]} == frozen  # the difference docs/huggingface.md lists
    for p in model.parameters():  # the docs' recipe for from_pretrained's flags
        p.requires_grad_(p.is_floating_point())
    assert {name: p.requires_grad for name, p in model.named_parameters()} == theirs


def test_tensors_carry_the_attributes_from_pretrained_gives_them_but_buffers_keep_eager_constructions(tmp_path):
    source, _ = _tiny("llama")
    folder = _save(source, tmp_path / "llama", as_bin=False, dtype=torch.float32)

    model, report = mz.load_model(folder)
    reference = type(source).from_pretrained(folder)

    theirs = dict(reference.named_parameters())
    assert all(p.__dict__ == theirs[n].__dict__ == {"_is_hf_initialized": True} for n, p in model.named_parameters())
    # Non-persistent buffers keep the marks transformers' register_buffer gave them (from_pretrained remakes them
    # bare): docs/huggingface.md.
    eager = {n: b.__dict__ for n, b in source.named_buffers()}
    assert {n: b.__dict__ for n, b in model.named_buffers()} == eager and eager["model.rotary_emb.inv_freq"]


def test_a_table_the_constructor_computes_is_bf16_rounded_in_a_bf16_build_and_exact_in_fp32_as_docs_say(tmp_path):
    source, _ = _tiny("gptj")  # embed_positions: a non-persistent sinusoidal table computed in construction
    table = lambda model: next(b for n, b in model.named_buffers() if n.endswith("embed_positions"))
    eager_table = table(source).clone()
    folder = _save(source, tmp_path / "gptj", as_bin=False, dtype=torch.bfloat16)

    bf16_build, _ = mz.load_model(folder)
    fp32_build, _ = mz.load_model(folder, dtype=torch.float32)

    assert not torch.equal(table(bf16_build).float(), eager_table)  # the open difference docs/huggingface.md lists
    assert torch.equal(table(fp32_build), eager_table)  # and what it says avoids it


def test_tied_embeddings_stay_tied(tmp_path):
    source, _ = _tiny("llama")
    folder = _save(source, tmp_path / "llama", as_bin=False, dtype=torch.float32)

    model, report = mz.load_model(folder)

    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert report.tied == [["model.embed_tokens.weight", "lm_head.weight"]]


def test_base_model_checkpoint_loads_into_a_head_model(tmp_path):
    head, inputs = _tiny("bert")
    head.bert.save_pretrained(tmp_path / "base")

    model, report = mz.load_model(tmp_path / "base", model="hf:BertForMaskedLM", strict=False)

    assert torch.equal(model.bert.embeddings.word_embeddings.weight, head.bert.embeddings.word_embeddings.weight)
    assert report.missing and all(name.startswith("cls.") for name in report.missing)
    assert all(not t.is_meta for t in model.state_dict().values())
    assert torch.isfinite(model.cls.predictions.transform.dense.weight).all()


def test_head_model_checkpoint_loads_into_its_base_model(tmp_path):
    head, _ = _tiny("bert")
    head.save_pretrained(tmp_path / "head")

    model, report = mz.load_model(tmp_path / "head", model="hf:BertModel", strict=False)

    assert torch.equal(model.embeddings.word_embeddings.weight, head.bert.embeddings.word_embeddings.weight)
    assert all(name.startswith("cls.") for name in report.unexpected)


def test_cli_loads_a_hugging_face_folder_without_a_model_spec(tmp_path):
    source, _ = _tiny("gpt2")
    folder = _save(source, tmp_path / "gpt2", as_bin=False, dtype=torch.float16)

    report = _cli_json_report(folder)

    assert report["format"] == "safetensors-sharded"
    assert report["dtypes"].get("float16") == len(report["loaded"])
    assert report["missing"] == [] and report["unexpected"] == []


@pytest.mark.parametrize("config, reason", [
    ({"architectures": ["FancyForCausalLM"], "model_type": "fancy",
      "auto_map": {"AutoConfig": "configuration_fancy.FancyConfig", "AutoModelForCausalLM": "modeling_fancy.FancyForCausalLM"}},
     "its model is the repository's own code (auto_map: modeling_fancy.FancyForCausalLM), which is never run here"),
    ({"architectures": ["FancyForCausalLM"], "model_type": "llama"},
     f"transformers has no model class 'FancyForCausalLM' (installed: transformers {transformers.__version__})"),
], ids=["remote-code", "unknown-class"])
def test_a_folder_transformers_cannot_build_says_how_to_load_it_anyway(tmp_path, config, reason):
    folder = tmp_path / "fancy"
    folder.mkdir()
    weights = {"w": torch.randn(3), "b": torch.randn(2)}
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    for code in ("configuration_fancy.py", "modeling_fancy.py"):
        (folder / code).write_text(f"open({str(marker)!r}, 'w').close()\n")

    # transformers asks on the terminal whether to run a repository's code unless told not to: say yes.
    done = preforked.run([CLI, str(folder)], capture_output=True, text=True, input="y\n")
    tensors, _ = mz.load_tensors(folder / "model.safetensors")  # the way out the message gives

    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (f"Error: {folder / 'config.json'}: {reason}; pass a model (--model package.module:callable), "
                           f"or load its tensors alone by passing the checkpoint itself ({folder / 'model.safetensors'})\n")
    assert not marker.exists()
    assert all(torch.equal(tensors[name], value) for name, value in weights.items())


def _cli_json_report(folder: Path) -> dict:
    """The CLI's --json report for a load of ``folder``, which must succeed."""
    done = preforked.run([CLI, str(folder), "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _offline_env(cache: Path) -> dict:
    return {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def test_hub_repo_id_loads_from_the_local_cache_offline(tmp_path):
    source, _ = _tiny("llama")
    folder = _save(source, tmp_path / "llama", as_bin=False, dtype=torch.bfloat16)
    cache = hub_cache(tmp_path, folder, "tiny-org/tiny-llama")

    done = preforked.run([CLI, "tiny-org/tiny-llama", "--json"], capture_output=True, text=True, env=_offline_env(cache))

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["checkpoint"].endswith("model.safetensors.index.json")
    assert "snapshots" in report["checkpoint"]
    assert report["bytes_read"] == sum(
        t.numel() * t.element_size() for n, t in source.state_dict().items() if n != "lm_head.weight"
    )


def test_missing_hub_repo_offline_is_one_clear_error(tmp_path):
    cache = tmp_path / "hub"
    cache.mkdir()

    done = preforked.run([CLI, "nobody/nothing"], capture_output=True, text=True, env=_offline_env(cache))

    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: nobody/nothing")
    assert "cache" in lines[0] and "offline" in lines[0]


def test_without_transformers_a_clear_error_names_the_extra(tmp_path):
    source, _ = _tiny("gpt2")
    folder = _save(source, tmp_path / "gpt2", as_bin=False, dtype=torch.float32)
    script = (
        "import sys\n"
        "sys.modules['transformers'] = None  # as if not installed\n"
        "import materialize as mz\n"
        "try:\n"
        f"    mz.load_model({str(folder)!r})\n"
        "except mz.ModelSpecError as error:\n"
        "    print(error)\n"
    )

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)

    assert "torch-materialize[hf]" in done.stdout, done.stderr


def test_stacked_experts_are_read_into_their_blocks_and_cast(tmp_path):
    source, _ = _tiny("mixtral")
    folder = _save(source, tmp_path / "moe", as_bin=False, dtype=torch.bfloat16)
    saved = _saved(folder)
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in saved  # the per-expert layout on disk

    model, report = mz.load_model(folder, dtype="fp32", check=True)

    experts = model.model.layers[1].mlp.experts
    for expert in range(4):
        w1, w3 = (saved[f"model.layers.1.block_sparse_moe.experts.{expert}.{w}.weight"] for w in ("w1", "w3"))
        assert torch.equal(experts.gate_up_proj[expert], torch.cat([w1, w3]).float())
        assert torch.equal(experts.down_proj[expert], saved[f"model.layers.1.block_sparse_moe.experts.{expert}.w2.weight"].float())
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in saved.values())
    assert report.unexpected == [] and report.missing == []


@pytest.mark.parametrize("pattern, name, number", [
    ("mlp.experts.*.gate_proj.weight", "model.layers.3.mlp.experts.12.gate_proj.weight", 12),  # a plain name
    (r"\.experts.*.w1.weight", "model.layers.0.ffn.experts.7.w1.weight", 7),  # a regular expression
    (r"\.experts.*.w1.weight", "model.layers.0.ffn.experts.x.w1.weight", None),
    ("experts.*", "experts.5", 5),
    ("experts.*.w.*.weight", "experts.1.w.2.weight", None),  # two numbers: not a stacking this loader reads
])
def test_the_expert_number_is_read_from_either_kind_of_pattern(pattern, name, number):
    from materialize.integrations.hf import _expert_number

    assert _expert_number(pattern, name) == number


def test_stacked_experts_are_copied_even_with_mmap(tmp_path):
    source, inputs = _tiny("qwen2_moe")
    folder = _save(source, tmp_path / "moe", as_bin=False, dtype=torch.float32)

    model, report = mz.load_model(folder, mmap=True)
    reference = type(source).from_pretrained(folder).eval()

    assert "model.layers.0.mlp.experts.gate_up_proj" not in report.mapped
    assert "model.layers.0.mlp.shared_expert.up_proj.weight" in report.mapped
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], reference(**inputs)[0])


def test_a_missing_expert_is_one_clear_error_naming_a_stacked_tensor(tmp_path):
    source, _ = _tiny("mixtral")
    folder = _save(source, tmp_path / "moe", as_bin=False, dtype=torch.float32)
    _rewrite_tensor(folder, "model.layers.0.block_sparse_moe.experts.2.w3.weight", None)

    with pytest.raises(mz.CheckpointError) as caught:
        mz.load_model(folder)
    done = preforked.run([CLI, str(folder)], capture_output=True, text=True)

    message = str(caught.value)
    assert "model.layers.0.block_sparse_moe.experts.2.w1.weight" in message and "model.layers.0.mlp.experts.gate_up_proj" in message
    assert str(folder) in message
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1
    assert "experts.2.w1.weight" in done.stderr


def test_stacked_experts_cannot_stay_on_disk(tmp_path):
    source, _ = _tiny("mixtral")
    folder = _save(source, tmp_path / "moe", as_bin=False, dtype=torch.float32)

    with pytest.raises(mz.DeviceError) as caught:
        mz.load_model(folder, device_map={"model.layers.1": "disk", "": "cpu"})

    assert "model.layers.1.mlp.experts.gate_up_proj" in str(caught.value) and "stacked" in str(caught.value)


def test_the_cli_loads_a_mixture_of_experts_folder(tmp_path):
    source, _ = _tiny("qwen2_moe")
    folder = _save(source, tmp_path / "moe", as_bin=True, dtype=torch.bfloat16)

    report = _cli_json_report(folder)

    assert "model.layers.1.mlp.experts.down_proj" in report["loaded"]
    assert report["missing"] == [] and report["unexpected"] == []


def test_fused_tensors_are_cut_into_the_models_tensors_and_stay_mapped(tmp_path):
    source, inputs = _tiny("molmo2")
    folder = _save(source, tmp_path / "molmo2", as_bin=False, dtype=torch.float32)
    saved = _saved(folder)
    fused = saved["layers.1.self_attn.att_proj.weight"]  # q (32 rows), k (16), v (16)
    assert "layers.1.self_attn.q_proj.weight" not in saved

    model, report = mz.load_model(folder, mmap=True)

    attention = model.layers[1].self_attn
    assert torch.equal(attention.q_proj.weight, fused[:32])
    assert torch.equal(attention.k_proj.weight, fused[32:48]) and torch.equal(attention.v_proj.weight, fused[48:])
    assert {"layers.1.self_attn.q_proj.weight", "layers.1.self_attn.v_proj.weight"} <= set(report.mapped)
    assert "embed_tokens.weight" not in report.mapped  # concatenated from two tensors: copied
    assert torch.equal(model.embed_tokens.weight, torch.cat([saved["wte.embedding"], saved["wte.new_embedding"]]))


def test_a_fused_tensor_of_the_wrong_size_is_one_clear_error_naming_it(tmp_path):
    source, _ = _tiny("molmo2")
    folder = _save(source, tmp_path / "molmo2", as_bin=False, dtype=torch.float32)
    name = "layers.0.self_attn.att_proj.weight"
    _rewrite_tensor(folder, name, _saved(folder)[name][:60].clone())

    done = preforked.run([CLI, str(folder)], capture_output=True, text=True)

    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "layers.0.self_attn.att_proj.weight" in done.stderr and "has 60 rows" in done.stderr
    assert str(folder) in done.stderr and done.stdout == ""


def test_a_quantized_model_is_one_clear_error_naming_its_method(tmp_path):
    source, _ = _tiny("llama")
    folder = _save(source, tmp_path / "llama", as_bin=False, dtype=torch.bfloat16)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))

    with pytest.raises(mz.ModelSpecError) as caught:
        mz.load_model(folder)
    done = preforked.run([CLI, str(folder)], capture_output=True, text=True)

    assert "'fp8'" in str(caught.value) and str(folder / "config.json") in str(caught.value)
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1 and "quantized" in done.stderr


def test_with_transformers_4_its_own_key_renames_apply(tmp_path, monkeypatch):
    """transformers 4.x has no conversion API: a class's old-layout mapping and its key fixes rename instead.

    4.x is not installed here: its two hooks are given to the class as 4.57 defines them (checked by hand
    against a real 4.57 on BERT's gamma/beta and Llava's old layout).
    """
    def fix_key(key: str) -> tuple[str, bool]:
        if key.endswith("LayerNorm.gamma"):
            return key.replace("LayerNorm.gamma", "LayerNorm.weight"), True
        if key.endswith("LayerNorm.beta"):
            return key.replace("LayerNorm.beta", "LayerNorm.bias"), True
        return key, False

    source, _ = _tiny("bert")
    folder = _save(source, tmp_path / "bert", as_bin=False, dtype=torch.float32)
    monkeypatch.setitem(sys.modules, "transformers.conversion_mapping", None)  # the 5.x API is absent
    monkeypatch.setattr(transformers.BertForMaskedLM, "_fix_state_dict_key_on_load", staticmethod(fix_key), raising=False)
    monkeypatch.setattr(transformers.BertForMaskedLM, "_checkpoint_conversion_mapping", {r"^encoder_v1\.": "bert.encoder."},
                        raising=False)
    for name, value in _saved(folder).items():
        old = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        old = old.replace("bert.encoder.", "encoder_v1.")
        if old != name:
            _rewrite_tensor(folder, name, None)
            _add_tensor(folder, old, value)

    model, report = mz.load_model(folder)

    assert report.missing == [] and report.unexpected == []
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def _add_tensor(folder: Path, name: str, value: torch.Tensor) -> None:
    from safetensors.torch import save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = f"extra-{name}.safetensors"
    save_file({name: value.contiguous()}, folder / shard, metadata={"format": "pt"})
    index["weight_map"][name] = shard
    index_path.write_text(json.dumps(index))


def test_conversions_that_move_bytes_around_are_refused_by_name(tmp_path, monkeypatch):
    from transformers.core_model_loading import Interleave, Transpose, WeightConverter

    from materialize.integrations import hf

    source, _ = _tiny("llama")
    folder = _save(source, tmp_path / "llama", as_bin=False, dtype=torch.float32)
    interleaved = WeightConverter(source_patterns="mlp.down_proj.weight", target_patterns="mlp.down_proj.weight",
                                  operations=[Interleave(dim=1), Transpose(0, 1)])  # a chain no view follows
    monkeypatch.setattr(hf, "_conversions", lambda model: ([], [interleaved]))

    with pytest.raises(mz.CheckpointError) as caught:
        mz.load_model(folder)

    message = str(caught.value)
    assert str(folder) in message and "mlp.down_proj.weight" in message and "Interleave" in message
    assert "from_pretrained" in message


@pytest.mark.parametrize("check_dims", [False, True])
def test_tensors_saved_transposed_are_read_block_by_block_into_place(tmp_path, monkeypatch, check_dims):
    from transformers.core_model_loading import Transpose, WeightConverter

    from materialize.io import engine
    from materialize.integrations import hf

    source, inputs = _tiny("llama")
    folder = _save(source, tmp_path / "llama", as_bin=False, dtype=torch.float32)
    name = "model.layers.1.mlp.down_proj.weight"  # [32, 64] in the model
    _rewrite_tensor(folder, name, _saved(folder)[name].t().contiguous())  # [64, 32] on disk
    swap = WeightConverter(source_patterns="mlp.down_proj.weight", target_patterns="mlp.down_proj.weight",
                           operations=[Transpose(0, 1, check_dims=check_dims)])
    monkeypatch.setattr(hf, "_conversions", lambda model: ([], [swap]))
    monkeypatch.setattr(engine, "STRIDED_BLOCK_BYTES", 1000)  # several blocks per tensor

    if not check_dims:  # every down_proj is transposed: layer 0's, saved the model's way, then has the wrong shape
        with pytest.raises(mz.ShapeMismatchError, match="model.layers.0.mlp.down_proj.weight"):
            mz.load_model(folder)
        return
    model, report = mz.load_model(folder, dtype="fp64", check=True)

    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value.double()), key
    with torch.no_grad():
        assert torch.allclose(model(**inputs)[0], source.double()(**inputs)[0])


def test_tensors_saved_interleaved_or_rope_permuted_are_read_as_views_into_place(tmp_path, monkeypatch):
    from transformers.core_model_loading import Interleave, PermuteForRope, WeightConverter

    from materialize.io import engine
    from materialize.integrations import hf

    source, inputs = _tiny("llama")
    folder = _save(source, tmp_path / "llama", as_bin=False, dtype=torch.float32)
    heads = source.config.num_attention_heads
    interleave = WeightConverter(source_patterns="mlp.down_proj.weight", target_patterns="mlp.down_proj.weight",
                                 operations=[Interleave(dim=1)])
    permute = WeightConverter(source_patterns="self_attn.q_proj.weight", target_patterns="self_attn.q_proj.weight",
                              operations=[PermuteForRope()])
    saved = _saved(folder)
    for layer in range(source.config.num_hidden_layers):  # written as a checkpoint of the other layout would be
        down, q = f"model.layers.{layer}.mlp.down_proj.weight", f"model.layers.{layer}.self_attn.q_proj.weight"
        _rewrite_tensor(folder, down, Interleave(dim=1, inverse=True).convert({down: saved[down]}, [down], [down])[down])
        _rewrite_tensor(folder, q, PermuteForRope(inverse=True).convert({q: [saved[q]]}, [q], [q], config=source.config)[q])
    assert not torch.equal(_saved(folder)[down], saved[down]) and heads > 1
    monkeypatch.setattr(hf, "_conversions", lambda model: ([], [interleave, permute]))
    monkeypatch.setattr(engine, "STRIDED_BLOCK_BYTES", 1000)  # several blocks per tensor

    model, _ = mz.load_model(folder, dtype="fp64", check=True)

    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value.double()), key
    with torch.no_grad():
        assert torch.allclose(model(**inputs)[0], source.double()(**inputs)[0])


@pytest.mark.parametrize("dim", [0, 1])
def test_a_fused_tensor_deinterleaved_into_halves_equals_transformers_ops(tmp_path, monkeypatch, dim):
    from transformers.core_model_loading import Chunk, Interleave, WeightConverter

    from materialize.integrations import hf

    source, _ = _tiny("llama")
    folder = _save(source, tmp_path / "llama", as_bin=False, dtype=torch.float32)
    gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    shape = list(source.state_dict()[gate].shape)
    shape[dim] *= 2
    fused = torch.randn(shape)
    _rewrite_tensor(folder, up, None)
    _rewrite_tensor(folder, gate, None)
    _rewrite_tensor(folder, "model.layers.0.mlp.w13.weight", fused, shard_of="model.layers.0.mlp.down_proj.weight")
    split = WeightConverter(source_patterns="mlp.w13.weight", target_patterns=["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                            operations=[Interleave(dim=dim), Chunk(dim=dim)])
    monkeypatch.setattr(hf, "_conversions", lambda model: ([], [split]))
    expected = Interleave(dim=dim).convert({"w": fused}, ["w"], ["w"])["w"]
    expected = Chunk(dim=dim).convert({"w": expected}, ["w"], ["gate", "up"])

    model, report = mz.load_model(folder, check=True)

    assert torch.equal(model.state_dict()[gate], expected["gate"]) and torch.equal(model.state_dict()[up], expected["up"])
    assert report.missing == [] and report.unexpected == []


@pytest.mark.parametrize("kind, pattern, value", [
    ("gpt2", "transformer.h.{}.attn.bias", torch.ones(1, 1, 8, 8).tril()),  # old saves kept the causal mask
    ("llama", "model.layers.{}.self_attn.rotary_emb.inv_freq", torch.ones(4)),  # Llama-2-era saves, per layer
])
def test_tensors_transformers_declares_expected_extras_are_ignored_not_unexpected(tmp_path, kind, pattern, value):
    source, inputs = _tiny(kind)
    folder = _save(source, tmp_path / kind, as_bin=False, dtype=torch.float32)
    anchor = next(iter(_saved(folder)))
    added = [pattern.format(layer) for layer in range(2)]
    for name in added:
        _rewrite_tensor(folder, name, value, shard_of=anchor)

    model, report = mz.load_model(folder)

    assert report.unexpected == [] and sorted(report.ignored) == sorted(added)
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], source.eval()(**inputs)[0])


_NO_MASK = torch.ones(1, 1, 64, 64, dtype=torch.bool)  # a saved mask that masks nothing: loaded, every forward would change


@pytest.mark.parametrize("kind, saved", [
    ("gptj", {"transformer.h.{}.attn.bias": _NO_MASK, "transformer.h.{}.attn.masked_bias": torch.tensor(-1e9)}),
    ("gpt_neo", {"transformer.h.{}.attn.attention.bias": _NO_MASK, "transformer.h.{}.attn.attention.masked_bias": torch.tensor(-1e9)}),
    ("codegen", {"transformer.h.{}.attn.causal_mask": _NO_MASK}),
    ("gpt2", {"transformer.h.{}.attn.masked_bias": torch.tensor(-1e4)}),  # GPT-2 declares only attn.bias
])
def test_attention_masks_older_saves_hold_are_ignored_as_from_pretrained_ignores_them(tmp_path, kind, saved):
    source, inputs = _tiny(kind)
    folder = _save(source, tmp_path / kind, as_bin=False, dtype=torch.float32)
    anchor = next(iter(_saved(folder)))
    added = [pattern.format(layer) for pattern in saved for layer in range(2)]
    for pattern, value in saved.items():
        for layer in range(2):
            _rewrite_tensor(folder, pattern.format(layer), value, shard_of=anchor)

    model, report = mz.load_model(folder)
    reference = type(source).from_pretrained(folder).eval()

    assert report.unexpected == [] and sorted(report.ignored) == sorted(added)
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], reference(**inputs)[0])
        assert torch.equal(model(**inputs)[0], source.eval()(**inputs)[0])


@pytest.mark.parametrize("name, value", [
    ("transformer.h.0.attn.bias", torch.ones(32)),  # shaped as a weight's bias, not a mask
    ("transformer.h.0.attn.masked_bias", torch.ones(2)),
    ("transformer.h.0.stray.causal_mask", _NO_MASK),  # no such module
])
def test_tensors_named_as_old_masks_but_not_shaped_or_placed_as_one_are_unexpected_where_from_pretrained_says_so(
        tmp_path, name, value):
    # The installed transformers decides: 5.24 declares GPT-J's attn.bias and attn.masked_bias ignorable whatever
    # their shape (_keys_to_ignore_on_load_unexpected), 5.23 declared nothing and the shape rule alone judged.
    source, _ = _tiny("gptj")
    folder = _save(source, tmp_path / "gptj", as_bin=False, dtype=torch.float32)
    _rewrite_tensor(folder, name, value, shard_of=next(iter(_saved(folder))))
    reference, info = type(source).from_pretrained(folder, output_loading_info=True)

    if name in info["unexpected_keys"]:
        with pytest.raises(mz.KeyMismatchError, match=re.escape(name)):
            mz.load_model(folder)
    else:  # ignored by from_pretrained: ignored here too, and said so in the report, never loaded
        model, report = mz.load_model(folder)
        assert report.ignored == [name] and report.unexpected == []
        assert model.state_dict().keys() == reference.state_dict().keys()
        for key, expected in reference.state_dict().items():
            assert torch.equal(model.state_dict()[key], expected), key


def test_old_mask_shape_rule_holds_where_the_model_declares_nothing_to_ignore(tmp_path, monkeypatch):
    # The rule of materialize.integrations.hf for 4.x saves, independent of what the installed GPT-J declares.
    source, _ = _tiny("gptj")
    folder = _save(source, tmp_path / "gptj", as_bin=False, dtype=torch.float32)
    anchor = next(iter(_saved(folder)))
    _rewrite_tensor(folder, "transformer.h.0.attn.bias", _NO_MASK, shard_of=anchor)
    monkeypatch.setattr(transformers.GPTJPreTrainedModel, "_keys_to_ignore_on_load_unexpected", None)  # heads and base

    model, report = mz.load_model(folder)
    assert report.ignored == ["transformer.h.0.attn.bias"]

    _rewrite_tensor(folder, "transformer.h.0.attn.bias", torch.ones(32), shard_of=anchor)  # a weight's bias, no mask
    with pytest.raises(mz.KeyMismatchError, match=re.escape("transformer.h.0.attn.bias")):
        mz.load_model(folder)


def test_plan_lists_what_the_model_ignores(tmp_path):
    source, _ = _tiny("gptj")
    folder = _save(source, tmp_path / "gptj", as_bin=False, dtype=torch.float32)
    _rewrite_tensor(folder, "transformer.h.1.attn.masked_bias", torch.tensor(-1e4), shard_of=next(iter(_saved(folder))))

    summary = mz.plan(None, folder).to_dict()

    assert summary["ignored"] == ["transformer.h.1.attn.masked_bias"] and summary["unexpected"] == []


def test_a_training_frameworks_extra_state_beside_the_models_modules_is_ignored_as_from_pretrained_ignores_it(tmp_path):
    # Checkpoints exported from NeMo or Megatron keep TransformerEngine's FP8 metadata as <module>._extra_state.
    source, inputs = _tiny("llama")
    folder = _save(source, tmp_path / "llama", as_bin=False, dtype=torch.float32)
    anchor = next(iter(_saved(folder)))
    added = ["model.layers.0.mlp.down_proj._extra_state", "model.layers.1.self_attn.q_proj._extra_state"]
    for name in added:
        _rewrite_tensor(folder, name, torch.arange(5, dtype=torch.uint8), shard_of=anchor)
    _rewrite_tensor(folder, "model.layers.0.nowhere._extra_state", torch.zeros(0, dtype=torch.uint8), shard_of=anchor)

    with pytest.raises(mz.KeyMismatchError) as caught:  # beside no module of the model: still unexpected
        mz.load_model(folder)
    assert caught.value.unexpected == ["model.layers.0.nowhere._extra_state"]

    _rewrite_tensor(folder, "model.layers.0.nowhere._extra_state", None, shard_of=anchor)
    model, report = mz.load_model(folder)

    assert report.unexpected == [] and sorted(report.ignored) == sorted(added)
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], source.eval()(**inputs)[0])


def test_an_extra_tensor_the_model_does_not_declare_is_still_unexpected(tmp_path):
    source, _ = _tiny("llama")
    folder = _save(source, tmp_path / "llama", as_bin=False, dtype=torch.float32)
    _rewrite_tensor(folder, "model.layers.0.mlp.stray.weight", torch.ones(3), shard_of=next(iter(_saved(folder))))

    with pytest.raises(mz.KeyMismatchError, match="model.layers.0.mlp.stray.weight"):
        mz.load_model(folder)


def test_a_head_saved_padded_past_the_vocabulary_loads_its_leading_rows_as_from_pretrained(tmp_path):
    source, inputs = _tiny("inkling2")
    folder = _save(source, tmp_path / "inkling2", as_bin=False, dtype=torch.float32)
    saved = _saved(folder)["model.llm.unembed.weight"]
    if saved.shape[0] == source.lm_head.weight.shape[0]:
        pytest.skip(f"transformers {transformers.__version__} saves Inkling2's head unpadded")
    assert saved.shape[0] == 104 and not saved[99:].any()

    model, report = mz.load_model(folder)
    reference = type(source).from_pretrained(folder).eval()

    assert model.lm_head.weight.shape == (99, 32) and report.unexpected == [] and report.missing == []
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
    assert torch.equal(model.lm_head.weight, source.lm_head.weight)
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], reference(**inputs)[0])

    _rewrite_tensor(folder, "model.llm.unembed.weight", saved[:90].clone())  # shorter than the model's head
    with pytest.raises(mz.CheckpointError, match=r"model\.llm\.unembed\.weight.*90 rows"):
        mz.load_model(folder)


def _saved(folder: Path) -> dict[str, torch.Tensor]:
    saved = {}
    for shard in folder.glob("*.safetensors"):
        saved.update(load_file(shard))
    return saved


def _rewrite_tensor(folder: Path, name: str, value: Optional[torch.Tensor], shard_of: Optional[str] = None) -> None:
    """Replace one tensor of a sharded save (None: drop it), index included; a new one goes where ``shard_of`` is."""
    from safetensors.torch import save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard_name = index["weight_map"][shard_of or name]
    shard = folder / shard_name
    tensors = load_file(shard)
    if value is None:
        del tensors[name], index["weight_map"][name]
    else:
        tensors[name] = value
        index["weight_map"][name] = shard_name
    save_file(tensors, shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


def test_device_map_with_disk_offload_matches_from_pretrained(tmp_path):
    source, inputs = _tiny("llama")
    folder = _save(source, tmp_path / "llama", as_bin=False, dtype=torch.float32)

    model, report = mz.load_model(folder, device_map="sequential", max_memory={"cpu": 60_000})
    reference = type(source).from_pretrained(folder).eval()

    assert report.bytes_by_device.get("disk", 0) > 0 and report.mapped
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], reference(**inputs)[0])


def test_an_auto_class_spec_builds_from_the_folders_config(tmp_path):
    source, inputs = _tiny("gpt2")
    folder = _save(source, tmp_path / "gpt2", as_bin=False, dtype=torch.float32)

    model, _ = mz.load_model(folder, model="hf:AutoModelForCausalLM")

    assert type(model) is type(source)
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], source.eval()(**inputs)[0])


def test_build_and_load_model_take_a_hub_id_from_the_cache(tmp_path):
    source, _ = _tiny("bert")
    folder = _save(source, tmp_path / "bert", as_bin=False, dtype=torch.float32)
    cache = hub_cache(tmp_path, folder, "tiny-org/tiny-bert")
    script = (
        "import materialize as mz, torch\n"
        "skeleton = mz.build('tiny-org/tiny-bert')\n"
        "assert all(p.is_meta for p in skeleton.parameters())\n"
        "model, report = mz.load_model('tiny-org/tiny-bert', revision='main')\n"
        "print(type(skeleton).__name__, type(model).__name__, len(report.loaded))\n"
    )

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_offline_env(cache))

    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["BertForMaskedLM", "BertForMaskedLM"]


@pytest.mark.parametrize("kind, saved_as, cast", [
    ("t5", torch.float16, None),  # _keep_in_fp32_modules: T5's "wo" stays fp32 where the rest is fp16
    ("t5", torch.float32, "fp16"),  # and where a cast makes the rest fp16
    ("t5", torch.bfloat16, None),  # but not in bf16: that list is for fp16 only
    ("deepseek_v4", torch.float32, "bf16"),  # _keep_in_fp32_modules_strict: norms and sinks stay fp32 in bf16 too
])
def test_tensors_transformers_keeps_in_fp32_are_kept_so(kind, saved_as, cast, tmp_path):
    source, inputs = _tiny(kind)
    folder = _save(source, tmp_path / kind, as_bin=False, dtype=saved_as)

    model, _ = mz.load_model(folder, dtype=cast)
    reference = type(source).from_pretrained(folder, dtype=getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[cast])
                                             if cast else "auto").eval()

    ours, theirs = model.state_dict(), reference.state_dict()
    assert {name: value.dtype for name, value in ours.items()} == {name: value.dtype for name, value in theirs.items()}
    floating = {value.dtype for value in theirs.values() if value.is_floating_point()}
    assert len(floating) == (1 if saved_as == torch.bfloat16 and kind == "t5" else 2)  # the case is not vacuous
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


@pytest.mark.parametrize("kind, own, runs", [
    ("deberta", "attention.self.q_bias", False),  # its forward fails in bf16 in transformers too: fp32 bias, bf16 input
    ("hunyuan_moe", "mlp.gate.wg.weight", True),  # routing in fp32 changes the logits
])
@pytest.mark.parametrize("cast", [None, "fp16"])
def test_tensors_a_model_makes_in_a_dtype_of_its_own_keep_it_as_from_pretrained_keeps_them(kind, own, runs, cast, tmp_path):
    source, inputs = _tiny(kind)
    folder = _save(source, tmp_path / kind, as_bin=False, dtype=torch.bfloat16)

    model, _ = mz.load_model(folder, dtype=cast)
    reference = type(source).from_pretrained(folder, dtype=torch.float16 if cast else "auto").eval()

    ours, theirs = model.state_dict(), reference.state_dict()
    assert {name: value.dtype for name, value in ours.items()} == {name: value.dtype for name, value in theirs.items()}
    own_names = [name for name in theirs if own in name]
    assert own_names and all(theirs[name].dtype == torch.float32 for name in own_names)  # the case is not vacuous
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
    if runs:
        with torch.no_grad():
            assert torch.equal(model(**inputs).logits, reference(**inputs).logits)


@pytest.mark.parametrize("own_lm_head", [True, False])
def test_a_config_tying_embeddings_over_a_checkpoint_holding_its_own_lm_head_loads_as_from_pretrained(own_lm_head, tmp_path):
    source, inputs = _tiny("llama")  # built tied: one tensor under both names
    source.lm_head.weight = torch.nn.Parameter(source.model.embed_tokens.weight.detach().clone())
    if own_lm_head:
        torch.nn.init.normal_(source.lm_head.weight)
    folder = tmp_path / "llama"
    source.config.tie_word_embeddings = False
    source.to(torch.bfloat16).save_pretrained(folder)  # both tensors, as T5 v1.1 and older VLM saves hold them
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = True  # what the config says (or transformers 5 assumes) all the same
    (folder / "config.json").write_text(json.dumps(config))

    model, report = mz.load_model(folder)
    reference = transformers.LlamaForCausalLM.from_pretrained(folder).eval()

    assert (model.lm_head.weight is model.model.embed_tokens.weight) is (not own_lm_head)
    assert (reference.lm_head.weight is reference.model.embed_tokens.weight) is (not own_lm_head)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reference(**inputs).logits)
    assert bool(report.untied) is own_lm_head
    model.save_pretrained(tmp_path / "again")  # the tie left apart is not saved as one
    again, _ = mz.load_model(tmp_path / "again")
    assert torch.equal(again.lm_head.weight, reference.lm_head.weight)


def test_a_config_whose_model_type_transformers_renamed_is_read_by_its_class(tmp_path):
    source, inputs = _tiny("llama")
    folder = _save(source, tmp_path / "llama", as_bin=False, dtype=torch.bfloat16)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "llama-v0"  # as LFM2-VL's "lfm2-vl", saved before transformers renamed it "lfm2_vl"
    (folder / "config.json").write_text(json.dumps(config))
    reference = transformers.LlamaForCausalLM.from_pretrained(folder).eval()

    model, _ = mz.load_model(folder)

    assert type(model) is transformers.LlamaForCausalLM
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(mz.ModelSpecError, match=r"config\.json: cannot read its config\.json: .*llama-v0"):
        mz.load_model(folder)
