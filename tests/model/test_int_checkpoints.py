"""GPTQ and AWQ safetensors (loader/int_weights.py): each layout's packed integers read back as the
exact values they stand for (tests/fixtures/packed_checkpoint.py's fp32 twin), dequantized or
as GGUF Q4_1 / Q8_0 blocks that gguf-py's reference dequantizer reads as the same values; the
layouts no block holds come as fp32; malformed files refused by name."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.fixtures.packed_checkpoint import packed_checkpoint
from tests.fixtures.tiny_models import cached_tiny_model

from tokenbus.engine.setup import resolve_quantization
from tokenbus.loader import iter_weights, load_arch, resolve_model
from tokenbus.loader.gguf_loader import QuantizedWeight
from tokenbus.loader.int_weights import PackedScheme, packed_scheme

LAYOUTS = {
    "gptq-4bit-sym": dict(method="gptq"),
    "gptq-4bit-asym-v2": dict(method="gptq", sym=False, fmt="gptq_v2"),
    "gptq-4bit-asym": dict(method="gptq", sym=False),
    "gptq-4bit-row": dict(method="gptq", group_size=-1),
    "gptq-8bit-sym": dict(method="gptq", bits=8, group_size=64),
    "gptq-8bit-asym": dict(method="gptq", bits=8, sym=False),
    "gptq-act-order": dict(method="gptq", act_order=True),
    "awq": dict(method="awq", sym=False),
    "awq-64": dict(method="awq", sym=False, group_size=64),
    "ct-pack": dict(method="ct-pack"),
    "ct-pack-asym": dict(method="ct-pack", sym=False),
    "ct-pack-asym-channel": dict(method="ct-pack", sym=False, group_size=-1),
    "ct-pack-8bit": dict(method="ct-pack", bits=8, group_size=64),
    "ct-pack-act-order": dict(method="ct-pack", act_order=True),
    "ct-int": dict(method="ct-int", bits=8, group_size=-1),
}
# what a kept-quantized read gives each layout: GGUF blocks, or fp32 (no block holds it)
BLOCKS = {
    "gptq-8bit-asym": None,
    "gptq-act-order": None,
    "ct-pack-act-order": None,
    "gptq-8bit-sym": "Q8_0",
    "ct-pack-8bit": "Q8_0",
    "ct-int": "Q8_0",
}
# symmetric: m = -8s, and Q8_0's d = s, exact in fp16
EXACT = ("gptq-4bit-sym", "gptq-4bit-row", "gptq-8bit-sym", "ct-pack", "ct-pack-8bit", "ct-int")


def _stream(path, keep_quantized=False) -> dict:
    src = resolve_model(str(path))
    return dict(iter_weights(src, load_arch(src), keep_quantized))


def _as_floats(weight) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return weight
    qtype = gguf.GGMLQuantizationType(weight.qtype)
    values = gguf.quants.dequantize(weight.data.numpy(), qtype)
    return torch.from_numpy(values.reshape(weight.rows, weight.cols))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_reads_as_its_fp32_twin(tmp_path, layout):
    packed, twin = packed_checkpoint(cached_tiny_model("llama"), tmp_path / "m", **LAYOUTS[layout])
    want = _stream(twin)
    dense = _stream(packed)
    assert sorted(dense) == sorted(want)
    for name, tensor in want.items():
        assert dense[name].dtype == torch.float32 and torch.equal(dense[name], tensor), name
    kept = _stream(packed, keep_quantized=True)
    blocks = BLOCKS.get(layout, "Q4_1")
    for name, tensor in want.items():
        weight = kept[name]
        if not name.endswith("_proj.weight") or blocks is None:
            assert isinstance(weight, torch.Tensor) and torch.equal(weight, tensor), name
            continue
        assert isinstance(weight, QuantizedWeight), name
        assert gguf.GGMLQuantizationType(weight.qtype).name == blocks
        got = _as_floats(weight)
        if layout in EXACT:
            assert torch.equal(got, tensor), name
        else:  # m = -z * s rounded once to fp16
            assert (got - tensor).abs().max() <= 2**-11 * 15 * tensor.abs().max(), name


def test_qwen2_biases_pass_beside_the_packed_parts(tmp_path):
    packed, twin = packed_checkpoint(cached_tiny_model("qwen2"), tmp_path / "m", method="awq")
    got, want = _stream(packed), _stream(twin)
    assert "model.layers.0.self_attn.q_proj.bias" in got
    assert all(torch.equal(got[n], t) for n, t in want.items())


def test_moe_experts(tmp_path):
    src = cached_tiny_model("qwen3_moe", num_experts=4, moe_intermediate_size=64)
    packed, twin = packed_checkpoint(src, tmp_path / "m", method="gptq")
    got, want = _stream(packed), _stream(twin)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in got
    assert all(torch.equal(got[n], t) for n, t in want.items())


def test_malformed_files_are_refused_by_name(tmp_path):
    packed, _ = packed_checkpoint(cached_tiny_model("llama"), tmp_path / "m", method="gptq")
    weights = load_file(str(packed / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.qzeros"]
    save_file(weights, str(packed / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj: gptq parts without qzeros"):
        _stream(packed)
    weights["model.layers.1.mlp.up_proj.qzeros"] = torch.zeros(3, 16, dtype=torch.int32)
    save_file(weights, str(packed / "model.safetensors"))
    with pytest.raises(ValueError, match=r"up_proj: gptq scales \[2, 128\] and zeros \[3, 128\]"):
        _stream(packed)


def test_layouts_not_read_are_refused_by_field():
    def scheme(**quantization):
        return packed_scheme({"quantization_config": quantization}, "config.json")

    assert scheme(quant_method="gptq", bits=4, group_size=128) == PackedScheme(
        "gptq", 4, 128, zero_offset=1
    )
    assert scheme(quant_method="awq", bits=4, group_size=128, version="GEMM") == PackedScheme(
        "awq", 4, 128
    )
    assert scheme(quant_method="fp8") is None
    with pytest.raises(ValueError, match=r"bits 3 \(gptq\): \(4, 8\) read"):
        scheme(quant_method="gptq", bits=3)
    with pytest.raises(ValueError, match="version 'gemv' \\(awq\\) is not supported"):
        scheme(quant_method="awq", bits=4, version="gemv")
    with pytest.raises(ValueError, match="checkpoint_format 'marlin'"):
        scheme(quant_method="gptq", bits=4, checkpoint_format="marlin")
    with pytest.raises(ValueError, match="group_size 0"):
        scheme(quant_method="gptq", bits=4, group_size=0)
    with pytest.raises(ValueError, match="pack_dtype 'int16'"):
        scheme(quant_method="gptq", bits=4, pack_dtype="torch.int16")

    def compressed(fmt, **weights):
        groups = {"group_0": {"weights": {"type": "int", "num_bits": 4, **weights}}}
        return scheme(quant_method="compressed-tensors", format=fmt, config_groups=groups)

    w4a16 = compressed("pack-quantized", strategy="group", group_size=128, actorder="group")
    assert w4a16 == PackedScheme("pack-quantized", 4, 128, act_order=True, symmetric=True)
    assert compressed("float-quantized") is None  # FP8: loader/fp8.py
    with pytest.raises(ValueError, match="format 'marlin-24' .* is not supported"):
        compressed("marlin-24", strategy="group", group_size=128)
    with pytest.raises(ValueError, match=r"bits 4 \(int-quantized\): \(8,\) read"):
        compressed("int-quantized", strategy="channel")
    with pytest.raises(ValueError, match="weights strategy 'block'"):
        compressed("pack-quantized", strategy="block")


def test_interleaved_rotary_rows_move_with_their_blocks(tmp_path):
    """GLM-4's q/k rows are reordered from interleaved pairs to halves at load: a Q4_1 q_proj's
    rows of blocks move as the dense rows do."""
    packed, twin = packed_checkpoint(cached_tiny_model("glm4"), tmp_path / "m", method="gptq")
    want, kept = _stream(twin), _stream(packed, keep_quantized=True)
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ):
        assert isinstance(kept[name], QuantizedWeight)
        assert torch.equal(_as_floats(kept[name]), want[name]), name


def test_unpacked_compressed_tensors_zero_points(tmp_path):
    """Files written before compressed-tensors packed its zero points hold them as int8
    [out, groups], signed: read alike; another layout is refused by name."""
    packed, twin = packed_checkpoint(
        cached_tiny_model("llama"), tmp_path / "m", method="ct-pack", sym=False
    )
    weights = load_file(str(packed / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight_zero_point"
    unpacked_zeros = _unpack_rows(weights[name], 4, rows=64) - 8  # [64, 4] signed
    weights[name] = unpacked_zeros.to(torch.int8)
    save_file(weights, str(packed / "model.safetensors"))
    got, want = _stream(packed), _stream(twin)
    assert all(torch.equal(got[n], t) for n, t in want.items())
    weights[name] = unpacked_zeros.to(torch.int16)
    save_file(weights, str(packed / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj: weight_zero_point torch.int16 \\[64, 4\\]"):
        _stream(packed)


def _unpack_rows(words: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    per = 32 // bits
    values = [(words >> (bits * k)) & ((1 << bits) - 1) for k in range(per)]
    return torch.stack(values, dim=1).reshape(-1, words.shape[1])[:rows]


def test_auto_keeps_the_blocks_on_cpu(tmp_path):
    packed, twin = packed_checkpoint(cached_tiny_model("llama"), tmp_path / "m", method="awq")
    src = resolve_model(str(packed))
    assert load_arch(src) == load_arch(resolve_model(str(twin)))
    if shutil.which(os.environ.get("CC", "cc")) is not None:  # the kernels build
        assert resolve_quantization("auto", src, "cpu") == "q8_0"
    assert resolve_quantization("auto", src, "cuda:0") == "none"
    config = json.loads((packed / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq"
