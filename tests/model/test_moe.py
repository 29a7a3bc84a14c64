"""Sparse MoE: routing against HF's blocks (softmax, and LFM2-MoE's sigmoid scores), llama.cpp's
stacked expert tensors mapped to HF's per-expert names (blocks kept as views), and refusals that
name the field or tensor."""

from __future__ import annotations

import dataclasses
import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_gguf_moe import stack_experts
from tests.fixtures.tiny_models import TINY_QWEN3_MOE, cached_tiny_model

from tokenbus.loader import iter_weights, load_arch, resolve_model
from tokenbus.loader.gguf_loader import QuantizedWeight
from tokenbus.model.moe import SparseMoeBlock
from tokenbus.model.parallel import TensorParallel


def _load_hf_block(ours: SparseMoeBlock, hf, family: str, named: dict) -> None:
    """HF's MoE block's weights into ours: `named` (its router's and the rest but the experts,
    under our names) and each expert's halves of HF's stacked gate_up_proj and its down_proj;
    our loaders take exactly those names."""
    inter = hf.experts.gate_up_proj.shape[1] // 2
    named = dict(named)
    for e in range(hf.experts.gate_up_proj.shape[0]):
        gate_up, down = hf.experts.gate_up_proj[e], hf.experts.down_proj[e]
        named[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[:inter]
        named[f"mlp.experts.{e}.up_proj.weight"] = gate_up[inter:]
        named[f"mlp.experts.{e}.down_proj.weight"] = down
    loaders = ours.weight_loaders("mlp.", family)
    assert set(loaders) == set(named)
    for name, tensor in named.items():
        loaders[name](name, tensor.detach())


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_block_matches_hf_sparse_moe_block(norm_topk_prob):
    """Our routing (softmax, top k, optional renormalisation) and grouped expert step equal
    HF's Qwen3MoeSparseMoeBlock on the same weights, in fp32."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=64, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        norm_topk_prob=norm_topk_prob,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5)
    hf_dir = cached_tiny_model("qwen3_moe", **TINY_QWEN3_MOE)
    arch = dataclasses.replace(
        load_arch(resolve_model(str(hf_dir))), num_experts_per_tok=3, norm_topk_prob=norm_topk_prob
    )
    ours = SparseMoeBlock(arch)
    _load_hf_block(ours, hf, "qwen3_moe", {"mlp.gate.weight": hf.gate.weight})
    x = torch.randn(37, 64)
    with torch.no_grad():
        want = hf(x.unsqueeze(0))[0]
        torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_stacked_gguf_experts_map_to_hf_names(tmp_path, family):
    """llama.cpp's blk.N.ffn_{gate,up,down}_exps [E, out, in] become E per-expert HF tensors:
    F32 equal to the safetensors ones; Q8_0 kept as views of the stacked blocks."""
    config = TINY_QWEN3_MOE if family == "qwen3_moe" else dict(num_local_experts=4)
    hf_dir = cached_tiny_model(family, **config)
    hf = load_file(str(hf_dir / "model.safetensors"))
    src = resolve_model(str(write_gguf(hf_dir, tmp_path / "f32.gguf", with_tokenizer=False)))
    arch = load_arch(src)
    ours = dict(iter_weights(src, arch))
    assert set(ours) == set(hf)
    for name in [n for n in hf if ".experts." in n or n.endswith(".gate.weight")]:
        torch.testing.assert_close(ours[name], hf[name], atol=0, rtol=0)
    src = resolve_model(str(write_gguf(hf_dir, tmp_path / "q8.gguf", "Q8_0", False)))
    quantized = dict(iter_weights(src, arch, keep_quantized=True))
    scope = "mlp" if family == "qwen3_moe" else "block_sparse_moe"
    first, second = (f"model.layers.0.{scope}.experts.{e}." for e in (0, 1))
    w = "gate_proj" if family == "qwen3_moe" else "w1"
    a, b = quantized[f"{first}{w}.weight"], quantized[f"{second}{w}.weight"]
    assert isinstance(a, QuantizedWeight) and a.qtype == gguf.GGMLQuantizationType.Q8_0
    # one stacked mapping: expert 1's rows follow expert 0's
    assert b.data.data_ptr() == a.data.data_ptr() + a.data.numel()


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_fused_gate_up_experts_map_to_the_same_names(tmp_path, qtype):
    """A GGUF written with --fuse-gate-up-exps (ffn_gate_up_exps [E, 2I, hidden]) gives each
    expert's gate and up as the unfused file does, blocks kept as blocks."""
    hf_dir = cached_tiny_model("qwen3_moe", **TINY_QWEN3_MOE)
    weights = {}
    for fused in (False, True):
        path = write_gguf(hf_dir, tmp_path / f"{fused}.gguf", qtype, False, fused)
        src = resolve_model(str(path))
        weights[fused] = dict(iter_weights(src, load_arch(src), keep_quantized=True))
    assert set(weights[True]) == set(weights[False])
    for name, tensor in weights[False].items():
        fused = weights[True][name]
        if isinstance(tensor, QuantizedWeight):
            assert (fused.qtype, fused.cols) == (tensor.qtype, tensor.cols)
            fused, tensor = fused.data, tensor.data
        torch.testing.assert_close(fused, tensor, atol=0, rtol=0)


def test_stack_experts_is_llama_cpps_layout():
    hf = load_file(str(cached_tiny_model("qwen3_moe", **TINY_QWEN3_MOE) / "model.safetensors"))
    stacked = stack_experts(hf)["model.layers.0.ffn_down_exps.weight"]
    assert stacked.shape == (8, 64, 32)
    torch.testing.assert_close(stacked[3], hf["model.layers.0.mlp.experts.3.down_proj.weight"])


def test_shared_experts_config_is_refused_by_name(tmp_path):
    hf_dir = shutil.copytree(cached_tiny_model("qwen3_moe", **TINY_QWEN3_MOE), tmp_path / "m")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(
        json.dumps({**config, "shared_expert_intermediate_size": 64})
    )
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        load_arch(resolve_model(str(hf_dir)))


def test_olmoe_clip_qkv_is_refused_by_name(tmp_path):
    hf_dir = shutil.copytree(cached_tiny_model("olmoe", num_experts=4), tmp_path / "m")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "clip_qkv": 8.0}))
    with pytest.raises(ValueError, match="clip_qkv"):
        load_arch(resolve_model(str(hf_dir)))


def test_gguf_shared_expert_tensor_and_missing_metadata_are_named(tmp_path):
    from tests.fixtures.tiny_gguf import _write_metadata

    config = json.loads(
        (cached_tiny_model("qwen3_moe", **TINY_QWEN3_MOE) / "config.json").read_text()
    )

    def write(path, used_count: bool, extra: str | None):
        writer = gguf.GGUFWriter(str(path), "qwen3moe")
        _write_metadata(writer, config)
        writer.add_expert_count(8)
        writer.add_expert_feed_forward_length(32)
        if used_count:
            writer.add_expert_used_count(2)
        writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
        if extra:
            writer.add_tensor(extra, np.zeros((4, 64), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return resolve_model(str(path))

    with pytest.raises(ValueError, match="blk.0.ffn_gate_shexp.weight: shared experts"):
        load_arch(write(tmp_path / "a.gguf", True, "blk.0.ffn_gate_shexp.weight"))
    with pytest.raises(ValueError, match="qwen3moe.expert_used_count"):
        load_arch(write(tmp_path / "b.gguf", False, None))


def test_expert_parallel_split_must_divide_the_experts():
    arch = load_arch(resolve_model(str(cached_tiny_model("qwen3_moe", **TINY_QWEN3_MOE))))
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the 8 experts"):
        SparseMoeBlock(arch, TensorParallel(rank=0, size=3))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SparseMoeBlock(dataclasses.replace(arch, num_experts_per_tok=9))
    half = SparseMoeBlock(arch, TensorParallel(rank=1, size=2))
    assert (half.first_expert, len(half.experts)) == (4, 4)
    assert "mlp.experts.4.up_proj.weight" in half.weight_loaders("mlp.", "qwen3_moe")
    assert "mlp.experts.0.up_proj.weight" in half.skipped_names("mlp.", "qwen3_moe")


def test_selection_bias_chooses_and_stays_fp32():
    """ERNIE's bias moves the choice, not the weights (the chosen experts' probabilities), and
    a bf16 model keeps it fp32, as HF does."""
    arch = load_arch(resolve_model(str(cached_tiny_model("qwen3_moe", **TINY_QWEN3_MOE))))
    block = SparseMoeBlock(dataclasses.replace(arch, moe_selection_bias=True, norm_topk_prob=False))
    with torch.no_grad():  # the router is made empty: whatever memory held, NaN included
        block.gate.weight.normal_()
    x = torch.randn(5, arch.hidden_size)
    probs = torch.softmax(block.gate(x).float(), dim=-1)
    with torch.no_grad():
        block.selection_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 4.0]))
    weights, expert_ids = block.route(x)
    assert sorted(expert_ids[0].tolist()) == [3, 7]  # the biased ones, whatever their logits
    torch.testing.assert_close(weights, probs.gather(-1, expert_ids))
    block.to(torch.bfloat16)
    assert block.selection_bias.dtype == torch.float32
    assert block.gate.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("bias", "norm_topk_prob", "scale"), [(True, True, 1.0), (False, False, 2.5)]
)
def test_sigmoid_routing_matches_hf_lfm2_moe_block(bias, norm_topk_prob, scale):
    """LFM2-MoE's routing (each expert's sigmoid, the top k by score + expert bias, weighed by
    the scores, renormalised or not, scaled) and expert step equal HF's Lfm2MoeSparseMoeBlock on
    the same weights, in fp32."""
    from transformers import Lfm2MoeConfig
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeSparseMoeBlock

    from tokenbus.model.moe import SELECTION_BIAS_NAME

    config = Lfm2MoeConfig(
        hidden_size=64, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        use_expert_bias=bias, norm_topk_prob=norm_topk_prob, routed_scaling_factor=scale,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Lfm2MoeSparseMoeBlock(config)
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5)
        if bias:
            hf.expert_bias.copy_(0.3 * torch.randn(8))
    arch = dataclasses.replace(
        load_arch(resolve_model(str(cached_tiny_model("qwen3_moe", **TINY_QWEN3_MOE)))),
        num_experts_per_tok=3,
        norm_topk_prob=norm_topk_prob,
        moe_selection_bias=bias,
        moe_scoring="sigmoid",
        moe_norm_eps=1e-6,
        routed_scaling_factor=scale,
    )
    ours = SparseMoeBlock(arch)
    named = {"mlp.gate.weight": hf.gate.weight}
    if bias:
        named[f"mlp.{SELECTION_BIAS_NAME}"] = hf.expert_bias
    _load_hf_block(ours, hf, "lfm2_moe", named)
    x = torch.randn(37, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x.unsqueeze(0))[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("eps", [0.01, 0.3])
def test_sparsemixer_routing_equals_hf_s(eps):
    """PhiMoE's two experts chosen one by one and their weights equal HF's sparsemixer at
    inference, bit for bit in fp32: on random logits, on logits of one sign (the relative gap's
    divisor then the best logit or |s|), and with ties for the best (the first one wins)."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer as hf_sparsemixer

    from tokenbus.model.moe import sparsemixer

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 16, generator=generator)
    ties = torch.randn(8, 16, generator=generator).round(decimals=1)
    ties[:, 3] = ties[:, 9] = ties.max(dim=-1).values + 0.5
    for scores in (logits, logits.abs() + 0.1, -logits.abs() - 0.1, ties):
        want_weights, want_ids = hf_sparsemixer(scores, jitter_eps=eps, training=False)
        weights, ids = sparsemixer(scores, eps)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    assert (sparsemixer(ties, eps)[1][:, 0] == 3).all()


def test_sparsemixer_takes_two_experts_only():
    arch = load_arch(resolve_model(str(cached_tiny_model("qwen3_moe", **TINY_QWEN3_MOE))))
    with pytest.raises(ValueError, match="sparsemixer routing takes 2 experts a token, not 3"):
        SparseMoeBlock(dataclasses.replace(arch, moe_scoring="sparsemixer", num_experts_per_tok=3))


def test_unknown_scoring_is_refused_by_name(tmp_path):
    from tokenbus.loader.lfm2_config import lfm2_gguf_fields

    arch = load_arch(resolve_model(str(cached_tiny_model("qwen3_moe", **TINY_QWEN3_MOE))))
    with pytest.raises(ValueError, match="moe_scoring: 'sqrtsoftplus' is not supported"):
        SparseMoeBlock(dataclasses.replace(arch, moe_scoring="sqrtsoftplus"))
    meta = {
        "lfm2moe.attention.head_count_kv": [0, 2],
        "lfm2moe.shortconv.l_cache": 3,
        "lfm2moe.expert_gating_func": 4,  # llama.cpp's sqrt-softplus
    }
    with pytest.raises(ValueError, match="lfm2moe.expert_gating_func must be 1"):
        lfm2_gguf_fields(meta, "lfm2moe", 2, tmp_path / "m.gguf")
    meta["lfm2moe.expert_gating_func"] = 2
    assert lfm2_gguf_fields(meta, "lfm2moe", 2, tmp_path / "m.gguf")["moe_scoring"] == "sigmoid"


@pytest.mark.parametrize(("groups", "kept"), [(1, 1), (4, 2)])
def test_grouped_sigmoid_routing_matches_hf_glm4_moe_block(groups, kept):
    """GLM-4.5's MoE block (DeepSeek-V3's router: each expert's sigmoid, the top k by score +
    bias within the best groups, renormalised with 1e-20, scaled; an ungated shared MLP) equals
    HF's Glm4MoeMoE on the same weights, in fp32."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    config = Glm4MoeConfig(
        hidden_size=64, n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=32,
        n_shared_experts=2, n_group=groups, topk_group=kept, routed_scaling_factor=2.5,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Glm4MoeMoE(config)
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5)
        hf.gate.e_score_correction_bias.copy_(0.3 * torch.randn(16))
    arch = dataclasses.replace(
        load_arch(resolve_model(str(cached_tiny_model("glm4_moe")))),
        num_experts=16,
        num_experts_per_tok=3,
        shared_expert_intermediate_size=64,
        moe_groups=groups,
        moe_topk_groups=kept,
    )
    ours = SparseMoeBlock(arch)
    named = {
        "mlp.gate.weight": hf.gate.weight,
        "mlp.gate.e_score_correction_bias": hf.gate.e_score_correction_bias,
        **{f"mlp.shared_experts.{n}": w for n, w in hf.shared_experts.named_parameters()},
    }
    _load_hf_block(ours, hf, "glm4_moe", named)
    x = torch.randn(37, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x.unsqueeze(0))[0], atol=1e-5, rtol=1e-5)
        if groups > 1:  # the limit matters: without it some token takes another expert
            ours.groups = 1
            _, unlimited = ours.route(x)
            ours.groups = groups
            _, limited = ours.route(x)
            assert not torch.equal(limited.sort().values, unlimited.sort().values)


def test_bad_expert_groups_are_refused_by_name():
    arch = load_arch(resolve_model(str(cached_tiny_model("glm4_moe"))))  # 8 experts, 2 a token
    for groups in (3, 8):  # 8 / 3 is not whole; groups of one expert have no two best
        with pytest.raises(ValueError, match=f"n_group: {groups} must split the 8 experts"):
            SparseMoeBlock(dataclasses.replace(arch, moe_groups=groups, moe_topk_groups=1))
    for kept in (0, 5):
        with pytest.raises(ValueError, match=f"topk_group: {kept} must be in"):
            SparseMoeBlock(dataclasses.replace(arch, moe_groups=4, moe_topk_groups=kept))
    arch = dataclasses.replace(arch, num_experts_per_tok=3, moe_groups=4, moe_topk_groups=1)
    with pytest.raises(ValueError, match="must hold the 3 experts a token takes"):
        SparseMoeBlock(arch)
