"""gpt-oss end to end against HF transformers, fp32 on CPU: a tiny random model (4 experts of 32,
top 2; windows of 32 on the even layers; its released YaRN, unrounded) from safetensors (HF's
stacked, interleaved experts) and from a GGUF in llama.cpp's naming gives HF's greedy tokens,
with logprobs within tolerance, through prefix-cache hits, chunked prefill, preemption and two
expert-parallel ranks. Its sinks are drawn large enough to change HF's tokens, so a path that
drops them fails; a model whose clamp bites shows the clamped SwiGLU."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.e2e.oracle import (
    assert_matches_hf,
    assert_same_or_near_tie,
    greedy_outputs,
    hf_greedy_logprobs,
    load_hf,
)
from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10
ENGINE = dict(kv_cache_dtype="float32")
WINDOW = 32


def _with_weights(src, dst, change) -> str:
    """A copy of the HF model at `src` with `change(name, tensor)` applied to its tensors."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    weights = {name: change(name, tensor) for name, tensor in weights.items()}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _sinks(value):
    def change(name, tensor):
        return value(tensor) if name.endswith("self_attn.sinks") else tensor

    return change


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The tiny model with sinks around 1 (the fixture's are 0.2-scale noise): e^sink then
    weighs like a key's e^score, so the sinks decide tokens."""
    generator = torch.Generator().manual_seed(7)
    bigger = _sinks(lambda t: 1.0 + torch.randn(t.shape, generator=generator))
    return _with_weights(cached_tiny_model("gpt_oss"), tmp_path_factory.mktemp("oss") / "m", bigger)


@pytest.fixture(scope="module")
def gguf_file(hf_dir, tmp_path_factory):
    return write_gguf(hf_dir, tmp_path_factory.mktemp("oss-gguf") / "tiny-f32.gguf", "F32")


@pytest.fixture(params=["safetensors", "gguf"])
def model_path(request, hf_dir, gguf_file):
    return hf_dir if request.param == "safetensors" else gguf_file


@pytest.fixture(scope="module")
def prompts():
    prefix = random_prompts(1, 40, 40, seed=31)[0]  # 2 full blocks + 8 tokens, past the window
    return random_prompts(3, 1, 50, seed=32) + [prefix + t for t in random_prompts(3, 1, 20, 33)]


def _reference(model_dir, prompts):
    hf = load_hf(str(model_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    return _reference(hf_dir, prompts)


def generate(llm, prompts, logprobs=1):
    return greedy_outputs(llm, prompts, MAX_TOKENS, logprobs)


def test_arch_reads_gpt_oss(model_path):
    from tokenbus.loader import load_arch, resolve_model

    arch = load_arch(resolve_model(str(model_path)))
    assert arch.architecture == "gpt_oss"
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (4, 2, 32)
    assert arch.norm_topk_prob  # softmax over the top k logits
    assert arch.sliding_windows == (WINDOW, None)  # the even layers slide
    assert (arch.swiglu_limit, arch.swiglu_alpha) == (7.0, 1.702)
    assert arch.attention_bias
    assert arch.rope_scaling["rope_type"] == "yarn"
    assert arch.rope_scaling["truncate"] is False  # the GGUF's too: as the model was trained
    assert (arch.rope_scaling["factor"], arch.rope_theta) == (32.0, 150000.0)


def test_the_sinks_change_hfs_tokens(hf_dir, prompts, hf_reference, tmp_path):
    """Guards the tests below: without its sinks the model answers otherwise, so a path that
    ignored them could not give HF's tokens."""
    sinkless = _with_weights(hf_dir, tmp_path / "m", _sinks(lambda t: torch.full_like(t, -1e4)))
    assert [tokens for tokens, _ in _reference(sinkless, prompts)] != [
        tokens for tokens, _ in hf_reference
    ]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_batch_with_shared_prefixes(model_path, prompts, hf_reference, backend):
    llm = make_llm(model_path, enable_prefix_caching=True, attention_backend=backend, **ENGINE)
    assert_matches_hf(generate(llm, prompts), hf_reference)
    assert llm.engine.stats_totals["prefix_cache_hits"] == 2 * 32
    assert_engine_clean(llm)


def test_tiny_token_budget_forces_chunking(model_path, prompts, hf_reference):
    llm = make_llm(model_path, max_num_batched_tokens=16, long_prefill_token_threshold=8, **ENGINE)
    assert_matches_hf(generate(llm, prompts), hf_reference)
    assert_engine_clean(llm)


def test_small_kv_pool_forces_preemptions(model_path, prompts, hf_reference):
    # two KV groups (a local layer, a global one): 16 blocks hold one request, not six
    llm = make_llm(model_path, num_kv_blocks=16, max_model_len=96, **ENGINE)
    assert_matches_hf(generate(llm, prompts), hf_reference)
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_engine_clean(llm)


def test_the_clamp_of_the_experts(prompts, tmp_path):
    """A limit that clamps most gate and up values: HF's tokens still (a model computing plain
    SwiGLU, or clamping one side only, answers otherwise)."""
    hf_dir = cached_tiny_model("gpt_oss", swiglu_limit=0.25)
    reference = _reference(hf_dir, prompts[:3])
    llm = make_llm(hf_dir, **ENGINE)
    assert llm.engine.client.engine_core.executor.worker.model.arch.swiglu_limit == 0.25
    assert_matches_hf(generate(llm, prompts[:3]), reference)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantized_experts_match_the_dequantized_file(hf_dir, prompts, tmp_path, qtype):
    """Experts (and their biases, kept fp32) in GGUF blocks, each decode step's layers in C,
    give the tokens of the same file dequantized at load."""
    path = write_gguf(hf_dir, tmp_path / f"tiny-{qtype}.gguf", qtype)
    results = {}
    for quantization in ("gguf", "none"):
        llm = make_llm(path, quantization=quantization, quant_activations="fp32", **ENGINE)
        model = llm.engine.client.engine_core.executor.worker.model
        assert (model.quant_kernels is not None) == (quantization == "gguf")
        assert model.decodes_in_c == (quantization == "gguf")  # the whole layer in one C call
        results[quantization] = generate(llm, prompts, logprobs=5)
        assert_engine_clean(llm)
    for ours, dense in zip(results["gguf"], results["none"]):
        assert_same_or_near_tie(ours.token_ids, dense.token_ids, ours.logprobs)


@pytest.mark.slow
def test_two_expert_parallel_ranks(model_path, prompts, hf_reference):
    """Each rank holds half the experts, half the query heads and their sinks."""
    llm = make_llm(model_path, tensor_parallel_size=2, **ENGINE)
    try:
        outputs = generate(llm, prompts[:3], logprobs=5)
        for out, (tokens, _) in zip(outputs, hf_reference[:3]):
            assert_same_or_near_tie(out.token_ids, tokens, out.logprobs)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


def test_experts_with_biases_are_not_stacked_for_triton():
    """triton_moe.py's grouped GEMMs compute SiLU experts without biases: gpt-oss's run one by
    one on every device."""
    from tokenbus.loader import load_arch, resolve_model
    from tokenbus.model.moe import SparseMoeBlock

    arch = load_arch(resolve_model(str(cached_tiny_model("gpt_oss"))))
    assert not SparseMoeBlock(arch, bias=True).stackable
    assert SparseMoeBlock(dataclasses.replace(arch, swiglu_limit=None)).stackable


def _openai_mxfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks [..., G, 16], scales [..., G], the values they hold) of fp32 rows [..., cols] in
    OpenAI's MXFP4 layout: quantized by gguf (ggml's layout), then its bits moved back."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType.MXFP4
    ggml = torch.from_numpy(gguf.quants.quantize(rows.numpy(), qtype))
    values = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(ggml.numpy(), qtype)))
    ggml = ggml.view(*rows.shape[:-1], -1, 17)
    scales, packed = ggml[..., 0], ggml[..., 1:]
    codes = torch.cat((packed & 0x0F, packed >> 4), dim=-1)  # value j, j < 32, of each block
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), scales.contiguous(), values


@pytest.fixture(scope="module")
def mxfp4_dirs(hf_dir, tmp_path_factory):
    """(OpenAI's MXFP4 checkpoint of the tiny model, the same model with its experts' weights
    replaced by the values those blocks hold, dense: HF's reference for it)."""
    root = tmp_path_factory.mktemp("mxfp4")
    blocked, rounded = root / "mxfp4", root / "rounded"
    shutil.copytree(hf_dir, blocked)
    weights = load_file(str(hf_dir / "model.safetensors"))
    dense = dict(weights)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # HF's runtime layout [E, in, out]; the blocks run along `in` for each output row
        blocks, scales, values = _openai_mxfp4(weights[name].transpose(1, 2).contiguous())
        del weights[name]
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
        dense[name] = values.transpose(1, 2).contiguous()
    save_file(weights, str(blocked / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((blocked / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (blocked / "config.json").write_text(json.dumps(config))
    _with_weights(hf_dir, rounded, lambda name, tensor: dense[name])
    return blocked, rounded


def test_mxfp4_blocks_move_to_ggml_bits_exactly():
    """loader/mxfp4.py against gguf: OpenAI's blocks turned into ggml's are gguf's own
    quantization of the same values, and dequantize to gguf's values, at every exponent."""
    import gguf

    from tokenbus.loader.mxfp4 import dequantize, ggml_blocks

    rows = torch.randn(6, 256, generator=torch.Generator().manual_seed(0))
    rows *= torch.logspace(-30, 30, 6, base=2).unsqueeze(-1)  # exponents far apart
    blocks, scales, values = _openai_mxfp4(rows)
    want = gguf.quants.quantize(rows.numpy(), gguf.GGMLQuantizationType.MXFP4)
    assert torch.equal(ggml_blocks(blocks, scales), torch.from_numpy(want))
    assert torch.equal(dequantize(blocks, scales), values)


@pytest.mark.parametrize("quantization", ["auto", "q8_0"])
def test_mxfp4_safetensors_run_on_their_blocks(mxfp4_dirs, prompts, quantization):
    """OpenAI's MXFP4 checkpoint on CPU: its experts stay MXFP4 blocks and give the tokens HF
    gives the dense model of the same values. With --quantization q8_0 the other linears are
    rounded to Q8_0 too (another model, so its own op-by-op run is the reference), and every
    decode step runs in C."""
    import gguf

    blocked, rounded = mxfp4_dirs
    outputs = {}
    for eager in (False, True):
        llm = make_llm(blocked, quantization=quantization, enforce_eager=eager, **ENGINE)
        model = llm.engine.client.engine_core.executor.worker.model
        expert = model.layers[1].mlp.experts[3]
        for linear in (expert.gate_up_proj, expert.down_proj):
            qtypes = {w.qtype for w in linear.quantized_weights()}
            assert qtypes == {gguf.GGMLQuantizationType.MXFP4}
        assert model.decodes_in_c == (quantization == "q8_0" and not eager)
        outputs[eager] = generate(llm, prompts, logprobs=5)
        assert_engine_clean(llm)
    reference = _reference(rounded, prompts) if quantization == "auto" else None
    for i, out in enumerate(outputs[False]):
        tokens = reference[i][0] if reference else outputs[True][i].token_ids
        assert_same_or_near_tie(out.token_ids, tokens, out.logprobs)


def test_mxfp4_safetensors_dequantized_give_hfs_tokens(mxfp4_dirs, prompts):
    """--quantization none: the blocks dequantized at load, HF's tokens and logprobs."""
    blocked, rounded = mxfp4_dirs
    llm = make_llm(blocked, quantization="none", **ENGINE)
    assert llm.engine.client.engine_core.executor.worker.model.quant_kernels is None
    assert_matches_hf(generate(llm, prompts), _reference(rounded, prompts))
    assert_engine_clean(llm)


def test_other_quantized_safetensors_are_refused_by_name(tmp_path):
    """A quantization_config is refused (HQQ, say), and MXFP4 outside gpt-oss."""
    from tokenbus.loader import load_arch, resolve_model

    for family, method in (("gpt_oss", "hqq"), ("llama", "mxfp4")):
        model = tmp_path / f"{family}-{method}"
        shutil.copytree(cached_tiny_model(family), model)
        config = json.loads((model / "config.json").read_text())
        config["quantization_config"] = {"quant_method": method}
        (model / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=f"quantization_config.*{method}.*GGUF"):
            load_arch(resolve_model(str(model)))


def test_a_gguf_without_its_window_is_refused(tmp_path):
    """llama.cpp requires gpt-oss.attention.sliding_window: a file without it is refused by
    name, not read as all-global layers."""
    from tokenbus.loader.gpt_oss_config import gpt_oss_gguf_fields

    with pytest.raises(ValueError, match="gpt-oss.attention.sliding_window"):
        gpt_oss_gguf_fields({}, 2)
    fields = gpt_oss_gguf_fields({"gpt-oss.attention.sliding_window": 128}, 4)
    assert fields["sliding_windows"] == (128, None, 128, None)
