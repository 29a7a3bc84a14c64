"""bitsandbytes safetensors (loader/bnb.py) against bitsandbytes itself: linears it writes
here (tests/fixtures/bnb_reference.py: a tiny Llama saved by transformers with load_in_4bit,
NF4 with double quantization, and with load_in_8bit; an FP4 matrix and a bf16 matrix's NF4 of
its quantize_4bit), beside the values its own dequantize_4bit and int8_vectorwise_dequant give
(`reference.<linear>`). The reader gives those values bit for bit; int8 rows kept as Q8_0 read
back within d's fp16 rounding; whole tiny models written alike (tests/fixtures/bnb_checkpoint.py)
read as their fp32 twins."""

from __future__ import annotations

import gguf
import pytest
import torch
from tests.fixtures.bnb_checkpoint import bnb_checkpoint
from tests.fixtures.bnb_reference import bnb_reference
from tests.fixtures.tiny_models import cached_tiny_model

from tokenbus.engine.setup import resolve_quantization
from tokenbus.loader import iter_weights, load_arch, resolve_model
from tokenbus.loader.bnb import BnbScheme, bnb_dequantized, bnb_scheme
from tokenbus.loader.gguf_loader import QuantizedWeight

FOUR_BIT = (
    "model.layers.0.self_attn.q_proj",  # NF4, double quantization, a float32 state
    "model.layers.0.mlp.down_proj",
    "model.layers.1.mlp.up_proj",  # FP4, fp32 absmax
    "model.layers.1.self_attn.o_proj",  # NF4 of a bf16 matrix: its values cast to bf16
)
EIGHT_BIT = ("model.layers.0.self_attn.k_proj",)


def _golden(linears) -> tuple[list, dict[str, torch.Tensor]]:
    tensors = bnb_reference()
    parts = [(n, t) for n, t in tensors.items() if n.startswith(linears)]
    return parts, {f"{n}.weight": tensors[f"reference.{n}"] for n in linears}


def test_four_bit_codes_read_as_bitsandbytes_dequantizes_them():
    parts, want = _golden(FOUR_BIT)  # NF4 double-quantized, and FP4 with fp32 absmax
    got = dict(bnb_dequantized(parts, BnbScheme(4), keep_quantized=True))
    assert sorted(got) == sorted(want)
    for name, values in want.items():
        assert torch.equal(got[name], values), name


def test_int8_rows_read_as_bitsandbytes_dequantizes_them():
    parts, want = _golden(EIGHT_BIT)
    got = dict(bnb_dequantized(parts, BnbScheme(8), keep_quantized=False))
    assert sorted(got) == sorted(want)  # weight_format dropped
    for name, values in want.items():
        assert torch.equal(got[name], values), name
    kept = dict(bnb_dequantized(parts, BnbScheme(8), keep_quantized=True))
    for name, values in want.items():
        weight = kept[name]
        assert (
            isinstance(weight, QuantizedWeight) and weight.qtype == gguf.GGMLQuantizationType.Q8_0
        )
        back = gguf.quants.dequantize(weight.data.numpy(), gguf.GGMLQuantizationType.Q8_0)
        back = torch.from_numpy(back.reshape(weight.rows, weight.cols))
        assert (back - values).abs().max() <= 2**-11 * values.abs().max()


@pytest.mark.parametrize(("bits", "nested"), [(4, True), (4, False), (8, False)])
def test_tiny_models_read_as_their_twins(tmp_path, bits, nested):
    packed, twin = bnb_checkpoint(cached_tiny_model("llama"), tmp_path / "m", bits, nested)
    src, twin_src = resolve_model(str(packed)), resolve_model(str(twin))
    got = dict(iter_weights(src, load_arch(src)))
    want = dict(iter_weights(twin_src, load_arch(twin_src)))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], t) for n, t in want.items())
    assert load_arch(src) == load_arch(twin_src)
    assert resolve_quantization("auto", src, "cuda:0") == "none"


def test_codes_stored_as_another_dtype():
    """bnb_4bit_quant_storage: the codes' bytes viewed as bf16 ([n / 4, 1]) read as uint8."""
    parts, want = _golden(FOUR_BIT[:1])
    as_bf16 = {
        n: t.flatten().view(torch.bfloat16).view(-1, 1)
        for n, t in parts
        if n.endswith("_proj.weight")
    }
    stored = [(n, as_bf16.get(n, t)) for n, t in parts]
    got = dict(bnb_dequantized(stored, BnbScheme(4, "bfloat16"), keep_quantized=False))
    assert all(torch.equal(got[n], t) for n, t in want.items())
    config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    config["bnb_4bit_quant_storage"] = "bfloat16"
    assert bnb_scheme({"quantization_config": config}, "c") == BnbScheme(4, "bfloat16")


def test_configs_and_parts_refused_by_name():
    assert bnb_scheme(
        {"quantization_config": {"quant_method": "bitsandbytes", "_load_in_4bit": True}}, "c"
    ) == BnbScheme(4)
    assert bnb_scheme({"quantization_config": {"quant_method": "gptq"}}, "c") is None
    with pytest.raises(ValueError, match="loads neither 4- nor 8-bit"):
        bnb_scheme({"quantization_config": {"quant_method": "bitsandbytes"}}, "c")
    parts, _ = _golden(FOUR_BIT[:1])
    without_map = [(n, t) for n, t in parts if not n.endswith(".weight.quant_map")]
    with pytest.raises(ValueError, match=r"q_proj.weight: bitsandbytes parts \['absmax'"):
        list(bnb_dequantized(without_map, BnbScheme(4), keep_quantized=False))
    unnested = [(n, t.float() if n.endswith(".weight.absmax") else t) for n, t in parts]
    with pytest.raises(ValueError, match="absmax torch.float32 with double quantization"):
        list(bnb_dequantized(unnested, BnbScheme(4), keep_quantized=False))
    int8, _ = _golden(EIGHT_BIT)
    tiled = [(n, torch.tensor(1, dtype=torch.uint8) if "format" in n else t) for n, t in int8]
    with pytest.raises(ValueError, match="k_proj.weight_format: bitsandbytes weight_format 1"):
        list(bnb_dequantized(tiled, BnbScheme(8), keep_quantized=False))
