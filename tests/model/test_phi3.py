"""Phi-3 / Phi-4 at the model level: config.json and llama.cpp's GGUF (fused attn_qkv and ffn_up,
LongRoPE factor tensors, partial rotary, sliding window) read to the same ModelArch; logits
equal to HF transformers' in fp32 from safetensors and GGUF, for the plain, partial-rotary and
LongRoPE (Phi-4-mini-shaped) variants, and for YaRN on Qwen3; LongRoPE's factor set chosen by
the engine's context; refusals that name the field or tensor."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.fixtures.paged import PagedKV
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model
from transformers import AutoModelForCausalLM

from tokenbus.loader import load_arch, resolve_model
from tokenbus.worker.model_builder import load_model

ATOL = 1e-4
HAS_CC = shutil.which(os.environ.get("CC", "cc")) is not None
# Phi-4-mini's shape in small: LongRoPE over the first 3/4 of each head (head_dim 16: 12 dims,
# 6 factors per set), the original context 32 of 128 positions.
LONGROPE = dict(
    rope_scaling={
        "rope_type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
        "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
    },
    partial_rotary_factor=0.75,
    original_max_position_embeddings=32,
    max_position_embeddings=128,
)
YARN = dict(
    head_dim=32,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 16.0,
    },
)
VARIANTS = {
    "phi3": ("phi3", {}),
    "phi3-partial": ("phi3", dict(partial_rotary_factor=0.5)),
    "phi3-longrope": ("phi3", LONGROPE),
    "qwen3-yarn": ("qwen3", YARN),
}
PROMPT = [(7 * i + 101) % 40000 + 100 for i in range(40)]  # 40 > LongRoPE's original 32


def hf_logits(hf_dir, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def our_logits(path, ids: list[int], backend: str = "torch", **kwargs) -> torch.Tensor:
    src = resolve_model(str(path))
    model = load_model(src, load_arch(src), torch.float32, "cpu", backend, **kwargs)
    input_ids, ctx = PagedKV.for_model(model).step([("x", ids)])
    with torch.inference_mode():
        return model.compute_logits(model(input_ids, ctx))


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    hf_dir = cached_tiny_model(arch, **overrides)
    gguf_path = write_gguf(hf_dir, tmp_path_factory.mktemp("g") / "m.gguf", with_tokenizer=False)
    return hf_dir, gguf_path, hf_logits(hf_dir, PROMPT)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_logits_match_hf(variant, fmt, backend):
    if backend == "native" and not HAS_CC:
        pytest.skip("no C compiler: the native kernel cannot be built here")
    hf_dir, gguf_path, want = variant
    got = our_logits(hf_dir if fmt == "safetensors" else gguf_path, PROMPT, backend)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_config_and_gguf_give_one_arch(tmp_path):
    hf_dir = cached_tiny_model("phi3", **LONGROPE)
    gguf_path = write_gguf(hf_dir, tmp_path / "m.gguf", with_tokenizer=False)
    reader = gguf.GGUFReader(gguf_path)
    assert reader.fields["general.architecture"].contents() == "phi3"
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight", "rope_factors_long.weight"} <= names
    assert not names & {"blk.0.attn_q.weight", "blk.0.ffn_gate.weight"}
    from_config = load_arch(resolve_model(str(hf_dir)))
    from_gguf = load_arch(resolve_model(str(gguf_path)))
    assert (from_config.architecture, from_config.rotary_dim, from_config.head_dim) == (
        "phi3",
        12,
        16,
    )
    assert from_gguf.rotary_dim == 12
    for arch in (from_config, from_gguf):
        scaling = arch.rope_scaling
        assert scaling["rope_type"] == "longrope"
        assert scaling["original_max_position_embeddings"] == 32
        for key in ("long_factor", "short_factor"):  # fp32 in the GGUF, as in the table
            assert list(scaling[key]) == pytest.approx(LONGROPE["rope_scaling"][key], rel=1e-7)
    assert from_config.rope_scaling["factor"] == from_gguf.rope_scaling["factor"] == 4.0
    assert from_gguf.rope_scaling["attention_factor"] == pytest.approx(
        (1 + torch.tensor(4.0).log().item() / torch.tensor(32.0).log().item()) ** 0.5
    )


def test_transformers_4_config_layout(tmp_path):
    """Phi-4-mini's config.json as transformers 4.x writes it: rope_scaling, rope_theta and
    partial_rotary_factor at the top level."""
    hf_dir = cached_tiny_model("phi3", **LONGROPE)
    config = json.loads((hf_dir / "config.json").read_text())
    params = config.pop("rope_parameters")
    legacy = {
        **config,
        "rope_theta": params.pop("rope_theta"),
        "partial_rotary_factor": params.pop("partial_rotary_factor"),
        "rope_scaling": {**params, "type": params.pop("rope_type")},
    }
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    assert load_arch(resolve_model(str(tmp_path))) == load_arch(resolve_model(str(hf_dir)))


def test_longrope_factor_set_follows_the_engine_context():
    """An engine capped at the original context (max_model_len 32) turns by the short factors,
    as HF does for every sequence that short; the model's own 128 positions take the long ones,
    as HF does past 32 positions (test_logits_match_hf), so on a short sequence they differ."""
    hf_dir = cached_tiny_model("phi3", **LONGROPE)
    ids = PROMPT[:30]
    want = hf_logits(hf_dir, ids)  # 30 positions <= 32: HF's short factors
    torch.testing.assert_close(our_logits(hf_dir, ids, max_model_len=32), want, atol=ATOL, rtol=0)
    assert (our_logits(hf_dir, ids) - want).abs().max() > 1e-2  # long factors: not HF's here


def test_sliding_window_narrows_every_layer(tmp_path):
    """Phi-3's window is every layer's, from config.json and from the GGUF's
    phi3.attention.sliding_window (0: none); the context stays the model's."""
    hf_dir = cached_tiny_model("phi3", sliding_window=100)
    gguf_path = write_gguf(hf_dir, tmp_path / "m.gguf", with_tokenizer=False)
    for path in (hf_dir, gguf_path):
        arch = load_arch(resolve_model(str(path)))
        assert arch.sliding_windows == (100,) * arch.num_hidden_layers
        assert arch.max_position_embeddings == 512
    no_window = write_gguf(cached_tiny_model("phi3"), tmp_path / "n.gguf", with_tokenizer=False)
    arch = load_arch(resolve_model(str(no_window)))
    assert arch.sliding_windows == () and arch.max_position_embeddings == 512


@pytest.mark.skipif(not HAS_CC, reason="the GGUF block kernels need a C compiler")
@pytest.mark.parametrize("variant_name", ["phi3", "phi3-partial"])
def test_quantized_fused_tensors_and_the_c_layer(tmp_path, variant_name):
    """Q8_0 attn_qkv / ffn_up are cut into their parts as blocks and stacked back into one
    kernel weight each; the kernel plan gives both the C decode layers, partial rotary
    included (tests/model/test_decode_layer.py checks them against the layer-by-layer path)."""
    arch, overrides = VARIANTS[variant_name]
    hf_dir = cached_tiny_model(arch, **overrides)
    src = resolve_model(str(write_gguf(hf_dir, tmp_path / "q.gguf", "Q8_0", with_tokenizer=False)))
    model = load_model(src, load_arch(src), torch.float32, "cpu", "native", quantization="gguf")
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.backend == "gguf" and model.layers[0].mlp.gate_up_proj.backend == "gguf"
    assert model.decodes_in_c
    input_ids, ctx = PagedKV.for_model(model).step([("x", PROMPT)])
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, ctx))
    assert (logits - hf_logits(hf_dir, PROMPT)).abs().max() < 0.2  # Q8_0's rounding


# ----------------------------------------------------------------------------- refusals


def edited_config(tmp_path, arch: str, **fields):
    hf_dir = shutil.copytree(cached_tiny_model(arch), tmp_path / "m")
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(fields)
    (hf_dir / "config.json").write_text(json.dumps(config))
    return resolve_model(str(hf_dir))


def test_partial_rotary_refused_outside_phi3(tmp_path):
    src = edited_config(tmp_path, "qwen3", partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported for qwen3"):
        load_arch(src)


def test_longrope_without_its_factors_is_named(tmp_path):
    params = {"type": "su", "rope_theta": 1e4, "short_factor": [1.0] * 8}
    src = edited_config(tmp_path, "phi3", rope_parameters=params)
    with pytest.raises(ValueError, match=r"rope type 'longrope' needs \['long_factor'\]"):
        load_arch(src)


def copy_gguf(src, dst, skip=(), add=lambda writer: None):
    """`src` rewritten to `dst` without the keys and tensors named in `skip`, plus `add`'s."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", *skip):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    add(writer)
    for tensor in reader.tensors:
        if tensor.name not in skip:
            writer.add_tensor(tensor.name, tensor.data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return resolve_model(str(dst))


def test_gguf_with_one_rope_factor_tensor_is_named(tmp_path):
    hf_dir = cached_tiny_model("phi3", **LONGROPE)
    path = write_gguf(hf_dir, tmp_path / "m.gguf", with_tokenizer=False)
    src = copy_gguf(path, tmp_path / "cut.gguf", skip=("rope_factors_short.weight",))
    with pytest.raises(ValueError, match="LongRoPE needs both rope_factors_long.weight and"):
        load_arch(src)


def test_gguf_partial_rotary_refused_outside_phi3(tmp_path):
    path = write_gguf(cached_tiny_model("llama"), tmp_path / "m.gguf", with_tokenizer=False)
    src = copy_gguf(
        path,
        tmp_path / "partial.gguf",
        skip=("llama.rope.dimension_count",),
        add=lambda writer: writer.add_rope_dimension_count(8),
    )
    with pytest.raises(ValueError, match=r"partial rotary \(llama.rope.dimension_count 8 != head"):
        load_arch(src)


def test_gguf_fused_tensor_of_the_wrong_size_is_named(tmp_path):
    hf_dir = shutil.copytree(cached_tiny_model("phi3"), tmp_path / "m")
    weights = load_file(str(hf_dir / "model.safetensors"))
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    weights[qkv] = weights[qkv][:-16].contiguous()
    save_file(weights, str(hf_dir / "model.safetensors"))
    for path in (hf_dir, write_gguf(hf_dir, tmp_path / "m.gguf", with_tokenizer=False)):
        src = resolve_model(str(path))
        with pytest.raises(ValueError, match=rf"weight {qkv}: expected 128 rows \[64, 32, 32\]"):
            load_model(src, load_arch(src), torch.float32, "cpu")


def test_gguf_yarn_keys_without_a_transformers_meaning_are_named(tmp_path):
    hf_dir = cached_tiny_model("qwen3", **YARN)
    path = tmp_path / "m.gguf"
    write_gguf(hf_dir, path, with_tokenizer=False)
    arch = load_arch(resolve_model(str(path)))
    assert arch.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 16.0,
    }
    src = copy_gguf(
        path, tmp_path / "ext.gguf", add=lambda writer: writer.add_rope_scaling_yarn_ext_factor(0.5)
    )
    with pytest.raises(
        ValueError, match=r"qwen3.rope.scaling.yarn_ext_factor=0.5 is not supported"
    ):
        load_arch(src)
