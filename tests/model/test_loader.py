"""Loaders: sources, shapes, safetensors (sharded too) and GGUF weights, tokenizers, strict
errors (the GGUF tokenizer cache: test_tokenizer_cache.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.fixtures.gguf_names import llama_cpp_permute
from tests.fixtures.paged import PagedKV
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model, make_tiny_model, smollm2_tokenizer_dir

from tokenbus.loader import (
    ModelSource,
    iter_weights,
    load_arch,
    load_generation_config,
    load_tokenizer,
    resolve_model,
)
from tokenbus.loader.hf_loader import HF_ROPE_TYPES, arch_from_hf_config
from tokenbus.loader.qk_rows import permute_qk, unpermute_qk
from tokenbus.model.layers.rotary import ROPE_TYPES
from tokenbus.model_arch import ModelArch
from tokenbus.worker.model_builder import load_model

IDS = [101, 202, 303, 404, 505, 606, 707, 808, 909, 1010, 1111]


def logits_of(src: ModelSource, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Prefill IDS[:-3] then decode the rest one by one; logits of every position."""
    model = load_model(src, load_arch(src), dtype, "cpu")
    kv = PagedKV.for_model(model, dtype=dtype)
    rows = []
    with torch.inference_mode():
        for batch in [[("r", IDS[:-3])]] + [[("r", [t])] for t in IDS[-3:]]:
            input_ids, ctx = kv.step(batch)
            rows.append(model.compute_logits(model(input_ids, ctx)))
    return torch.cat(rows)


def hf_weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


# ----------------------------------------------------------------------------- sources, shapes


def test_resolve_model_kinds(tmp_path):
    default = resolve_model(None)
    assert default.kind == "gguf" and default.path.name.endswith(".gguf") and default.path.is_file()
    assert resolve_model("SmolLM2") == default
    hf_dir = cached_tiny_model("llama")
    assert resolve_model(str(hf_dir)) == ModelSource("hf", hf_dir.resolve())
    gguf_path = write_gguf(hf_dir, tmp_path / "tiny.gguf", with_tokenizer=False)
    assert resolve_model(str(gguf_path)) == ModelSource("gguf", gguf_path.resolve())
    # a dir with one .gguf
    assert resolve_model(str(tmp_path)) == ModelSource("gguf", gguf_path.resolve())
    with pytest.raises(ValueError, match="no/such/model.*not found"):
        resolve_model("no/such/model")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="notes.txt.*not a model"):
        resolve_model(str(tmp_path / "notes.txt"))


@pytest.mark.parametrize("arch_name", ["llama", "qwen2", "mistral"])
def test_load_arch_from_config_and_gguf_agree(tmp_path, arch_name):
    hf_dir = cached_tiny_model(arch_name)
    arch = load_arch(resolve_model(str(hf_dir)))
    assert arch == ModelArch(
        architecture=arch_name,
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=arch_name == "qwen2",
        hidden_act="silu",
        bos_token_id=1,
        eos_token_ids=(2,),
        # MistralConfig's default window (past this model's context; a GGUF does not carry it)
        sliding_windows=(4096, 4096) if arch_name == "mistral" else (),
    )
    gguf_arch = load_arch(
        resolve_model(str(write_gguf(hf_dir, tmp_path / "m.gguf", with_tokenizer=False)))
    )
    # llama.cpp writes Mistral as "llama"; a GGUF's eps is stored as float32
    assert gguf_arch.architecture == ("llama" if arch_name == "mistral" else arch_name)
    assert gguf_arch.rms_norm_eps == pytest.approx(1e-5)
    fields = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rope_theta",
        "rope_scaling",
        "tie_word_embeddings",
        "attention_bias",
    )
    expected = {f: getattr(arch, f) for f in fields}
    assert {f: getattr(gguf_arch, f) for f in expected} == expected


def test_qwen3_arch_from_config_and_gguf(tmp_path):
    """Qwen3's head_dim comes from the config (Qwen3Config's default 128, not 64 / 4); llama.cpp
    writes it as qwen3.attention.key_length, and the q/k norms as attn_q_norm / attn_k_norm."""
    hf_dir = cached_tiny_model("qwen3", tie_word_embeddings=True)
    arch = load_arch(resolve_model(str(hf_dir)))
    assert (arch.architecture, arch.head_dim, arch.attention_bias, arch.tie_word_embeddings) == (
        "qwen3",
        128,
        False,
        True,
    )
    path = write_gguf(hf_dir, tmp_path / "m.gguf", with_tokenizer=False)
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "qwen3"
    assert reader.fields["qwen3.attention.key_length"].contents() == 128
    assert {"blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= {
        t.name for t in reader.tensors
    }
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied: no LM head tensor
    gguf_arch = load_arch(resolve_model(str(path)))
    # fp32 eps in a GGUF; no token ids without the tokenizer's metadata
    same = dict(rms_norm_eps=arch.rms_norm_eps, bos_token_id=1, eos_token_ids=(2,))
    assert dataclasses.replace(gguf_arch, **same) == arch


def test_hf_tokenizer_and_generation_config():
    src = resolve_model(str(cached_tiny_model("llama")))
    tokenizer = load_tokenizer(src)
    assert len(tokenizer) == 49152 and tokenizer.chat_template
    assert load_generation_config(src)["eos_token_id"] == 2
    # an explicit tokenizer directory
    other = load_tokenizer(src, tokenizer=str(smollm2_tokenizer_dir()))
    assert other.encode("Hello world") == tokenizer.encode("Hello world")
    with pytest.raises(ValueError, match="tokenizer.*missing-tok"):
        load_tokenizer(src, tokenizer="missing-tok")


def test_rope_types_understood_by_loader_are_built_by_model():
    assert set(HF_ROPE_TYPES) <= set(ROPE_TYPES)


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("arch_name", ["llama", "qwen2", "qwen3", "smollm3", "granite", "olmo2"])
def test_f32_gguf_and_safetensors_give_identical_logits(tmp_path, arch_name):
    hf_dir = cached_tiny_model(arch_name)
    gguf_src = resolve_model(
        str(write_gguf(hf_dir, tmp_path / "m.gguf", "F32", with_tokenizer=False))
    )
    assert torch.equal(logits_of(gguf_src), logits_of(resolve_model(str(hf_dir))))


def test_llama3_rope_gguf_matches_safetensors(tmp_path):
    """A llama3-rope model's GGUF carries llama.cpp's rope_freqs tensor instead of the config."""
    hf_dir = cached_tiny_model(
        "llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    gguf_src = resolve_model(str(write_gguf(hf_dir, tmp_path / "m.gguf", with_tokenizer=False)))
    assert load_arch(gguf_src).rope_scaling["rope_type"] == "freq_factors"
    torch.testing.assert_close(
        logits_of(gguf_src), logits_of(resolve_model(str(hf_dir))), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    "qtype,logits_atol",
    [("F16", 0.02), ("BF16", 0.2), ("Q8_0", 0.2), ("Q4_0", None), ("Q4_1", None)],
)
def test_dequantized_weights_equal_gguf_round_trip(tmp_path, qtype, logits_atol):
    """Every tensor equals gguf.quants' quantize->dequantize of the HF tensor (q/k un-permuted)."""
    hf_dir = cached_tiny_model("llama")
    src = resolve_model(str(write_gguf(hf_dir, tmp_path / "m.gguf", qtype, with_tokenizer=False)))
    loaded = dict(iter_weights(src, load_arch(src)))
    original = hf_weights(hf_dir)
    assert loaded.keys() == original.keys()
    qtype_enum = gguf.GGMLQuantizationType[qtype]
    for name, tensor in original.items():
        data = tensor.numpy()
        round_trip = data if data.ndim == 1 else gguf.quants.quantize(data, qtype_enum)
        expected = data if data.ndim == 1 else gguf.quants.dequantize(round_trip, qtype_enum)
        assert np.array_equal(loaded[name].numpy(), expected), name
    if logits_atol is not None:  # and the model runs on them, off by quantization error only
        torch.testing.assert_close(
            logits_of(src), logits_of(resolve_model(str(hf_dir))), atol=logits_atol, rtol=0
        )


def test_qk_permutation_is_llama_cpps_and_is_undone():
    # 8 heads, head_dim 16
    weight = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    permuted = permute_qk(weight, 8)
    assert torch.equal(permuted, llama_cpp_permute(weight, 8))
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_qk(permuted, 8), weight)
    bias = torch.arange(2 * 16, dtype=torch.float32)
    assert torch.equal(unpermute_qk(permute_qk(bias, 2), 2), bias)
    # the first head's rows 0..7 (first halves) and 8..15 (second halves) become interleaved pairs
    assert permuted[:4, 0].tolist() == [0.0, 24.0, 3.0, 27.0]


def test_sharded_safetensors_with_index(tmp_path):
    hf_dir = cached_tiny_model("qwen2")
    sharded = tmp_path / "sharded"
    shutil.copytree(hf_dir, sharded)
    weights = hf_weights(sharded)
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[:10],
        "model-00002-of-00002.safetensors": names[10:],
    }
    for file, shard_names in shards.items():
        save_file({n: weights[n] for n in shard_names}, str(sharded / file))
    index = {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(
        logits_of(resolve_model(str(sharded))), logits_of(resolve_model(str(hf_dir)))
    )
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors not found"):
        logits_of(resolve_model(str(sharded)))


# ----------------------------------------------------------------------------- bad input


def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_arch(resolve_model(str(path)))


def test_unsupported_hf_architecture_is_named(tmp_path):
    hf_dir = shutil.copytree(cached_tiny_model("llama"), tmp_path / "m")
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture 'gpt2'"):
        load_arch(resolve_model(str(hf_dir)))


def test_qwen3_config_fields_not_implemented_are_named(tmp_path):
    hf_dir = shutil.copytree(cached_tiny_model("qwen3"), tmp_path / "m")
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported rope type 'dynamic'"):
        load_arch(resolve_model(str(hf_dir)))


def test_qwen3_gguf_tensors_strictly_mapped(tmp_path):
    """A Qwen3 GGUF without its q/k norms is refused naming them; a llama GGUF that carries
    them is refused naming the tensor it does not take."""
    qwen3 = cached_tiny_model("qwen3", head_dim=32)
    stripped = shutil.copytree(qwen3, tmp_path / "stripped")
    weights = hf_weights(stripped)
    for name in [n for n in weights if "q_norm" in n]:
        del weights[name]
    save_file(weights, str(stripped / "model.safetensors"))
    src = resolve_model(str(write_gguf(stripped, tmp_path / "a.gguf", with_tokenizer=False)))
    with pytest.raises(ValueError, match=r"missing weights: model.layers.0.self_attn.q_norm"):
        load_model(src, load_arch(src), torch.float32, "cpu")
    config = json.loads((stripped / "config.json").read_text())
    (stripped / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    save_file(hf_weights(qwen3), str(stripped / "model.safetensors"))
    src = resolve_model(str(write_gguf(stripped, tmp_path / "b.gguf", with_tokenizer=False)))
    with pytest.raises(
        ValueError, match=r"unexpected weight model.layers.0.self_attn.[qk]_norm.weight for llama"
    ):
        load_model(src, load_arch(src), torch.float32, "cpu")


def test_unsupported_gguf_quant_type_is_named(tmp_path):
    path = write_gguf(cached_tiny_model("llama"), tmp_path / "m.gguf", "Q8_1", with_tokenizer=False)
    src = resolve_model(str(path))
    with pytest.raises(ValueError, match="tensor output.weight has unsupported type Q8_1"):
        load_model(src, load_arch(src), torch.float32, "cpu")


def test_truncated_safetensors_is_named(tmp_path):
    hf_dir = shutil.copytree(cached_tiny_model("llama"), tmp_path / "m")
    weights = hf_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    src = resolve_model(str(hf_dir))
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(src, load_arch(src), torch.float32, "cpu")


@pytest.mark.parametrize("keep_bytes", [100, 500_000, -100])
def test_truncated_gguf_is_named(tmp_path, keep_bytes):
    path = write_gguf(cached_tiny_model("llama"), tmp_path / "m.gguf", "Q8_0", with_tokenizer=False)
    path.write_bytes(path.read_bytes()[:keep_bytes])
    with pytest.raises(ValueError, match="m.gguf"):
        src = resolve_model(str(path))
        load_model(src, load_arch(src), torch.float32, "cpu")


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda w: w.pop("model.layers.1.mlp.down_proj.weight"),
            "missing weights: model.layers.1.mlp.down_proj.weight",
        ),
        (
            lambda w: w.__setitem__("model.layers.2.mlp.up_proj.weight", torch.zeros(128, 64)),
            "unexpected weight model.layers.2.mlp.up_proj.weight",
        ),
        (
            lambda w: w.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(16, 64)),
            r"model.layers.0.self_attn.k_proj.weight: expected shape \[32, 64\], got \[16, 64\]",
        ),
        (
            lambda w: w.__setitem__("model.norm.weight", torch.zeros(65)),
            r"model.norm.weight: expected shape \[64\]",
        ),
    ],
    ids=["missing", "unexpected", "misshaped-fused", "misshaped"],
)
def test_strict_weight_names_and_shapes(tmp_path, edit, message):
    hf_dir = shutil.copytree(cached_tiny_model("llama"), tmp_path / "m")
    weights = hf_weights(hf_dir)
    edit(weights)
    save_file(weights, str(hf_dir / "model.safetensors"))
    src = resolve_model(str(hf_dir))
    with pytest.raises(ValueError, match=message):
        load_model(src, load_arch(src), torch.float32, "cpu")


def test_make_tiny_model_overrides(tmp_path):
    path = make_tiny_model(
        tmp_path / "m", arch="qwen2", seed=3, num_hidden_layers=3, tie_word_embeddings=True
    )
    arch = load_arch(resolve_model(str(path)))
    assert arch.num_hidden_layers == 3 and arch.tie_word_embeddings and arch.attention_bias
    assert "lm_head.weight" not in hf_weights(path)


def _windowed_config(model_type: str, **fields) -> dict:
    base = dict(
        model_type=model_type,
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        sliding_window=8,
    )
    return {**base, **fields}


@pytest.mark.parametrize(
    ("config", "windows"),
    [
        (_windowed_config("mistral"), (8, 8, 8, 8)),
        (_windowed_config("mistral", sliding_window=None), ()),
        # Qwen2 / Qwen3 use the window only with use_sliding_window
        (_windowed_config("qwen2"), ()),
        (
            _windowed_config("qwen2", use_sliding_window=True, max_window_layers=2),
            (None, None, 8, 8),
        ),
        (
            _windowed_config(
                "qwen3",
                use_sliding_window=True,
                layer_types=["sliding_attention", "full_attention"] * 2,
            ),
            (8, None, 8, None),
        ),
        (_windowed_config("llama"), ()),  # Llama has no window
        # SmolLM3: with use_sliding_window, its NoPE layers slide (SmolLM3Config's layer_types)
        (_windowed_config("smollm3"), ()),
        (_windowed_config("smollm3", use_sliding_window=True), (None, None, None, 8)),
        (
            _windowed_config("smollm3", use_sliding_window=True, no_rope_layers=[0, 1, 1, 1]),
            (8, None, None, None),
        ),
    ],
)
def test_sliding_windows_per_layer(config, windows):
    from tokenbus.core.kv.hybrid import layer_windows
    from tokenbus.loader.hf_loader import arch_from_hf_config

    arch = arch_from_hf_config(config, Path("cfg"))
    assert arch.sliding_windows == windows
    assert arch.max_position_embeddings == 2048  # never capped at the window
    assert layer_windows(arch) == list(windows or (None,) * 4)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"sliding_window": -1}, "sliding_window must be a positive integer"),
        ({"sliding_window": 8.5}, "sliding_window must be a positive integer"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types must name"),
        ({"layer_types": ["chunked_attention"] * 4}, "layer_types must name"),
    ],
)
def test_bad_sliding_window_is_refused(fields, message):
    from tokenbus.loader.hf_loader import arch_from_hf_config

    config = _windowed_config("qwen2", use_sliding_window=True, **fields)
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(config, Path("cfg"))


def test_smollm3_nope_layers_from_config_and_gguf(tmp_path):
    """config.json's no_rope_layers (1: rotary), or every no_rope_layer_interval-th layer; a
    GGUF carries no such metadata and llama.cpp takes every fourth, as SmolLM3's default."""
    from tokenbus.loader.hf_loader import arch_from_hf_config

    hf_dir = cached_tiny_model("smollm3", num_hidden_layers=8)
    assert load_arch(resolve_model(str(hf_dir))).nope_layers == (3, 7)
    gguf = write_gguf(hf_dir, tmp_path / "smollm3.gguf", with_tokenizer=False)
    gguf_arch = load_arch(resolve_model(str(gguf)))
    assert (gguf_arch.architecture, gguf_arch.nope_layers) == ("smollm3", (3, 7))
    config = _windowed_config("smollm3", no_rope_layer_interval=2)
    assert arch_from_hf_config(config, Path("cfg")).nope_layers == (1, 3)
    assert arch_from_hf_config(_windowed_config("llama"), Path("cfg")).nope_layers == ()
    for bad in ([1, 1, 0], [1, 2, 1, 0]):
        with pytest.raises(ValueError, match="no_rope_layers must hold"):
            arch_from_hf_config(_windowed_config("smollm3", no_rope_layers=bad), Path("cfg"))


@pytest.mark.parametrize("family", ["granite", "granitemoe"])
def test_granite_multipliers_from_config_and_gguf(tmp_path, family):
    """GraniteConfig's (and GraniteMoeConfig's) four multipliers; llama.cpp writes them as
    *_scale keys (an absent attention scale is llama.cpp's 1 / sqrt(head_dim))."""
    hf_dir = cached_tiny_model(family)
    want = (12.0, 0.22, 1 / 16, 8.0)
    for path in (hf_dir, write_gguf(hf_dir, tmp_path / f"{family}.gguf", with_tokenizer=False)):
        arch = load_arch(resolve_model(str(path)))
        got = (
            arch.embedding_multiplier,
            arch.residual_multiplier,
            arch.attention_multiplier,
            arch.logits_scaling,
        )
        assert arch.architecture == family and got == pytest.approx(want)
    llama = load_arch(resolve_model(str(cached_tiny_model("llama"))))
    assert (llama.embedding_multiplier, llama.residual_multiplier) == (1.0, 1.0)
    assert (llama.attention_multiplier, llama.logits_scaling) == (None, 1.0)


def test_olmo2_and_olmo3_from_config_and_gguf(tmp_path):
    """OLMo 2 has no window. OLMo 3's local layers have one and, its YaRN being the global
    layers', their own unscaled table: from config.json in both transformers layouts (the 4.x
    one with Olmo3Config's default window and pattern) and from llama.cpp's GGUF (olmo2 with
    a window and local-layer flags)."""
    olmo2 = cached_tiny_model("olmo2")
    for path in (olmo2, write_gguf(olmo2, tmp_path / "olmo2.gguf", with_tokenizer=False)):
        arch = load_arch(resolve_model(str(path)))
        assert arch.architecture == "olmo2" and arch.sliding_windows == ()
        assert arch.rope_local_theta is None
    olmo3 = cached_tiny_model("olmo3")
    for path in (olmo3, write_gguf(olmo3, tmp_path / "olmo3.gguf", with_tokenizer=False)):
        arch = load_arch(resolve_model(str(path)))
        assert arch.architecture == "olmo3" and arch.sliding_windows == (32, 32, 32, None)
        assert (arch.rope_scaling["rope_type"], arch.rope_scaling["factor"]) == ("yarn", 4.0)
        assert arch.rope_theta == arch.rope_local_theta == 500000.0
    config = json.loads((olmo3 / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "sliding_window"):
        config.pop(key)
    config.update(
        num_hidden_layers=8,
        rope_theta=1e6,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    )
    arch = arch_from_hf_config(config, Path("cfg"))
    assert arch.sliding_windows == ((4096,) * 3 + (None,)) * 2
    assert (arch.rope_theta, arch.rope_local_theta, arch.rope_scaling["factor"]) == (1e6, 1e6, 8.0)
    all_global = dict(config, layer_types=["full_attention"] * 8)  # no local layer: one table
    arch = arch_from_hf_config(all_global, Path("cfg"))
    assert (arch.sliding_windows, arch.rope_local_theta) == ((), None)
    del config["rope_scaling"]  # one table serves both kinds
    assert arch_from_hf_config(config, Path("cfg")).rope_local_theta is None


def test_gpt_oss_gguf_ends_at_call_as_well_as_return(tmp_path):
    """A harmony turn ends at <|return|> (the GGUF's EOS) or <|call|> (a tool call): both stop,
    as in generation_config.json and llama.cpp; they are found in the file's token strings."""
    from tokenbus.loader.gguf_file import read_gguf, string_ids
    from tokenbus.loader.gguf_loader import _eos_token_ids

    tokens = ["a", "<|return|>", "é", "<|end|>", "<|call|>"] + [f"t{i}" for i in range(2000)]
    for arch, want in (("gpt-oss", (1, 4)), ("llama", (1,))):
        path = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_token_list(tokens)
        writer.add_eos_token_id(1)
        writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        gf = read_gguf(path)
        assert _eos_token_ids(gf) == want
    wanted = ("é", "<|call|>", "t1999", "absent")
    assert string_ids(gf, "tokenizer.ggml.tokens", wanted) == {"é": 2, "<|call|>": 4, "t1999": 2004}
    assert string_ids(gf, "general.architecture", wanted) == {}  # not a skipped string array
