"""FP8 safetensors (loader/fp8.py): each released scheme's matrices read back as the exact fp32
weights they stand for (tests/fixtures/fp8_checkpoint.py's twin, which transformers' own FP8
reader gives too), the rest of the checkpoint unchanged, and malformed files refused by name."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.fixtures.fp8_checkpoint import fp8_checkpoint
from tests.fixtures.tiny_models import cached_tiny_model

from tokenbus.engine.setup import resolve_quantization
from tokenbus.loader import iter_weights, load_arch, resolve_model
from tokenbus.loader.fp8 import Fp8Scheme, dequantize, dequantized_fp8, fp8_scheme
from tokenbus.loader.quant_config import prequantized

SCHEMES = [
    ("fp8", (32, 32)),  # Qwen3-FP8's layout at a tiny model's scale: 2 x 2 blocks of q_proj
    ("fp8", (48, 40)),  # sides the blocks do not divide: the grid rounded up
    ("fp8", None),  # one scale a matrix
    ("compressed-channel", None),
    ("compressed-tensor", None),
    ("fbgemm", None),
]


def _stream(path) -> dict[str, torch.Tensor]:
    src = resolve_model(str(path))
    weights = dict(iter_weights(src, load_arch(src)))
    assert all(isinstance(t, torch.Tensor) for t in weights.values())
    return weights


def _assert_reads_as_twin(fp8, twin) -> None:
    got, want = _stream(fp8), _stream(twin)
    assert sorted(got) == sorted(want)  # activation and KV scales dropped, no scale left over
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype == torch.float32, name
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize(("scheme", "block"), SCHEMES)
def test_each_scheme_reads_as_its_fp32_twin(tmp_path, scheme, block):
    fp8, twin = fp8_checkpoint(cached_tiny_model("llama"), tmp_path / "m", scheme, block)
    _assert_reads_as_twin(fp8, twin)
    assert load_arch(resolve_model(str(fp8))) == load_arch(resolve_model(str(twin)))


def test_moe_experts_and_router(tmp_path):
    """Qwen3-MoE-FP8's layout: every expert's projections FP8, the router (mlp.gate) not."""
    src = cached_tiny_model("qwen3_moe", num_experts=4, moe_intermediate_size=64)
    fp8, twin = fp8_checkpoint(src, tmp_path / "m", "fp8", (32, 32))
    names = load_file(str(fp8 / "model-00001-of-00002.safetensors"))
    assert names["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert names["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    _assert_reads_as_twin(fp8, twin)


def test_the_twin_is_what_transformers_reads(tmp_path):
    """The fixture's arithmetic is transformers' (its FP8 reader dequantizes on a CPU): so the
    twin, and our reader that equals it, read `weight_scale_inv` as transformers does."""
    from transformers import AutoModelForCausalLM

    fp8, twin = fp8_checkpoint(cached_tiny_model("llama"), tmp_path / "m", "fp8", (32, 32))
    theirs = AutoModelForCausalLM.from_pretrained(str(fp8), dtype=torch.float32).state_dict()
    ours = load_file(str(twin / "model.safetensors"))
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name


def test_scales_by_tensor_row_and_block():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]).to(torch.float8_e4m3fn)
    dense = values.float()
    one = Fp8Scheme()
    assert torch.equal(dequantize(values, torch.tensor([2.0]), one, "w"), dense * 2)
    rows = torch.tensor([[2.0], [3.0]])
    assert torch.equal(dequantize(values, rows, one, "w"), dense * rows)
    blocks = torch.tensor([[2.0, 3.0]])  # [2 x 2] blocks: columns 0-1, then 2 alone
    want = dense * torch.tensor([[2.0, 2.0, 3.0]])
    assert torch.equal(dequantize(values, blocks, Fp8Scheme((2, 2)), "w"), want)
    # a row's scales beside a block size (a compressed-tensors config mixing strategies)
    assert torch.equal(dequantize(values, rows, Fp8Scheme((2, 2)), "w"), dense * rows)
    stacked = torch.stack([values, values])  # experts in one tensor, a scale grid each
    scales = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    got = dequantize(stacked, scales, Fp8Scheme((2, 2)), "w")
    assert torch.equal(got[1], dense * torch.tensor([[3.0, 3.0, 4.0]]))
    with pytest.raises(ValueError, match=r"weight w: scales \[3, 1, 2\] do not cover"):
        dequantize(stacked, torch.ones(3, 1, 2), Fp8Scheme((2, 2)), "w")  # 3 grids, 2 experts
    with pytest.raises(ValueError, match=r"scales \[3, 1\] do not cover FP8 values \[2, 3\]"):
        dequantize(values, torch.ones(3, 1), one, "w")
    with pytest.raises(ValueError, match=r"in blocks of \[1, 1\]"):
        dequantize(values, blocks, Fp8Scheme((1, 1)), "w")


def _damaged(tmp_path, change) -> str:
    fp8, _ = fp8_checkpoint(cached_tiny_model("llama"), tmp_path / "m", "fp8", (32, 32))
    shard = fp8 / "model-00002-of-00002.safetensors"
    weights = change(load_file(str(shard)))
    save_file(weights, str(shard))
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())
    index["weight_map"] = {
        n: s for n, s in index["weight_map"].items() if "00001" in s or n in weights
    }
    (fp8 / "model.safetensors.index.json").write_text(json.dumps(index))
    return fp8


def test_malformed_files_are_refused_by_name(tmp_path):
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    without_scale = _damaged(tmp_path / "a", lambda w: {n: t for n, t in w.items() if n != name})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight: FP8 values without"):
        _stream(without_scale)
    wrong_shape = _damaged(tmp_path / "b", lambda w: {**w, name: torch.ones(3, 3)})
    with pytest.raises(ValueError, match=f"weight {name}: scales \\[3, 3\\] do not cover"):
        _stream(wrong_shape)
    stray = _damaged(tmp_path / "c", lambda w: {**w, "model.norm.weight_scale": torch.ones(1)})
    with pytest.raises(ValueError, match="model.norm.weight_scale: a scale without FP8 values"):
        _stream(stray)


def test_scales_pair_by_name_whatever_the_tensor():
    """`<name>_scale_inv` scales any FP8 tensor `<name>` (experts stacked in one tensor); a
    model's own `*_scale` parameter passes; an FP8 tensor left without a scale is refused."""
    values = torch.ones(2, 2).to(torch.float8_e4m3fn)
    stream = [
        ("m.experts.gate_up_proj", torch.stack([values, values])),
        ("m.layer_scale", torch.ones(1)),
        ("m.experts.gate_up_proj_scale_inv", torch.tensor([[[2.0]], [[3.0]]])),
        ("m.attn.k_proj.k_scale", torch.ones(())),
    ]
    got = dict(dequantized_fp8(stream, Fp8Scheme()))
    assert sorted(got) == ["m.experts.gate_up_proj", "m.layer_scale"]
    assert torch.equal(got["m.experts.gate_up_proj"][1], torch.full((2, 2), 3.0))
    with pytest.raises(ValueError, match="weight m.q_proj.weight: FP8 values without"):
        list(dequantized_fp8([*stream, ("m.q_proj.weight", values)], Fp8Scheme()))


def test_other_quantization_configs_are_refused_by_field(tmp_path):
    path = "config.json"
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    assert fp8_scheme({"quantization_config": int4}, path) is None  # loader/int_weights.py's
    ints = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"weights": {"type": "int", "num_bits": 8}}},
    }
    with pytest.raises(ValueError, match=r"config_groups.group_0.weights .*\('int', 8, None\)"):
        fp8_scheme({"quantization_config": ints}, path)
    with pytest.raises(ValueError, match=r"block size \[128\] is not \[rows, cols\]"):
        fp8_scheme({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, 0)
    assert fp8_scheme({"quantization_config": {"quant_method": "gptq"}}, path) is None
    block = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "g": {
                "weights": {
                    "type": "float",
                    "num_bits": 8,
                    "strategy": "block",
                    "block_structure": [128, 128],
                }
            }
        },
    }
    assert fp8_scheme({"quantization_config": block}, path) == Fp8Scheme((128, 128))
    # FineGrainedFP8's default where a config names no block size; an explicit null: none
    assert fp8_scheme({"quantization_config": {"quant_method": "fp8"}}, path) == Fp8Scheme(
        (128, 128)
    )
    no_blocks = {"quant_method": "fp8", "weight_block_size": None}
    assert fp8_scheme({"quantization_config": no_blocks}, path) == Fp8Scheme()
    sparse = {**block, "sparsity_config": {"format": "sparse-24-bitmask"}}
    with pytest.raises(ValueError, match="sparsity_config format 'sparse-24-bitmask'"):
        prequantized({"quantization_config": sparse}, path)
    rotated = {**block, "transform_config": {"config_groups": {"u": {}}}}
    with pytest.raises(ValueError, match="transform_config"):
        prequantized({"quantization_config": rotated}, path)
    dense_sparsity = {**block, "sparsity_config": {"format": "dense"}}
    assert prequantized({"quantization_config": dense_sparsity}, path)


def test_auto_rounds_fp8_to_q8_0_on_cpu(tmp_path):
    fp8, twin = fp8_checkpoint(cached_tiny_model("llama"), tmp_path / "m", "fp8", (32, 32))
    src = resolve_model(str(fp8))
    assert resolve_quantization("auto", resolve_model(str(twin)), "cpu") == "none"
    if shutil.which(os.environ.get("CC", "cc")) is not None:
        assert resolve_quantization("auto", src, "cpu") == "q8_0"
    assert resolve_quantization("auto", src, "cpu", tp=2) == "none"  # blocks do not split
    assert resolve_quantization("auto", src, "cuda:0") == "none"  # dequantized to bf16 there
    assert resolve_quantization("none", src, "cpu") == "none"
    with pytest.raises(ValueError, match="'gguf': the model is not a GGUF file .*safetensors"):
        resolve_quantization("gguf", src, "cpu")
