"""Gemma 2 and Gemma 3 (text) through the paged KV cache vs HF transformers on the same weights
(fp32), from safetensors and from a GGUF in llama.cpp's naming; their loaders (config layouts,
GGUF metadata and names, the (1 + w) norms) and the refusals that name a field."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file
from tests.e2e.oracle import load_hf
from tests.fixtures.paged import PagedKV
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model, make_tiny_model
from tests.fixtures.triton_device import needs_triton_on_cpu

from tokenbus.loader import load_arch, resolve_model
from tokenbus.model import get_model_class
from tokenbus.model.gemma import GemmaForCausalLM
from tokenbus.model.kernel_plan import KernelRequest, apply_kernels
from tokenbus.model.layers import Fp32RMSNorm
from tokenbus.worker.model_builder import load_model

ATOL = 1e-4
IDS = [101, 202, 303, 404, 505, 606, 707, 808, 909, 1010, 1111, 1212, 1313, 1414]
HAS_CC = shutil.which(os.environ.get("CC", "cc")) is not None


def hf_logits(path, ids: list[int]) -> torch.Tensor:
    hf = load_hf(str(path))
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def our_logits(model, ids: list[int], prefill: int = 10, block_size: int = 4) -> torch.Tensor:
    """Prefill ids[:prefill], then decode the rest one by one; logits of every position."""
    kv = PagedKV.for_model(model, block_size=block_size)
    rows = []
    with torch.inference_mode():
        for batch in [[("r", ids[:prefill])]] + [[("r", [t])] for t in ids[prefill:]]:
            input_ids, ctx = kv.step(batch)
            rows.append(model.compute_logits(model(input_ids, ctx)))
    return torch.cat(rows)


def load(path, backend: str = "auto", dtype: torch.dtype = torch.float32):
    src = resolve_model(str(path))
    return load_model(src, load_arch(src), dtype, "cpu", backend)


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def hf_dir(family):
    return cached_tiny_model(family)


@pytest.fixture(scope="module")
def gguf_path(hf_dir, family, tmp_path_factory):
    return write_gguf(hf_dir, tmp_path_factory.mktemp(family) / f"tiny-{family}.gguf")


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_prefill_then_decode_matches_hf(hf_dir, gguf_path, family, fmt, backend):
    if backend == "native" and not HAS_CC:
        pytest.skip("no C compiler: the native kernel cannot be built here")
    path = hf_dir if fmt == "safetensors" else gguf_path
    ours = load(path, backend)
    assert isinstance(ours, GemmaForCausalLM)
    torch.testing.assert_close(our_logits(ours, IDS), hf_logits(hf_dir, IDS), atol=ATOL, rtol=0)


@needs_triton_on_cpu
def test_triton_kernels_match_hf(family):
    """The Triton kernels (here in their interpreter) with Gemma's soft-capped scores and a
    window of 8 keys on the local layers: a 24-token prefill over two KV blocks, then decodes
    whose windows leave the first block behind."""
    path = cached_tiny_model(family, sliding_window=8)
    ours = load(path, "triton")
    assert ours.kernels.attention.name == "triton"
    ids = [(7 * i + 3) % 1000 + 10 for i in range(40)]
    logits = our_logits(ours, ids, prefill=24, block_size=16)
    torch.testing.assert_close(logits, hf_logits(path, ids), atol=ATOL, rtol=0)


def test_mixed_batch_of_decodes_and_prefill_chunks_matches_hf(hf_dir):
    """Decodes beside prefill chunks with context (the torch path's tiles and spans)."""
    ours = load(hf_dir, "torch")
    a, c = IDS[:9], IDS
    kv = PagedKV.for_model(ours, block_size=4)
    with torch.inference_mode():
        first = ours.compute_logits(ours(*kv.step([("c", c[:5]), ("a", a[:8])])))
        second = ours.compute_logits(ours(*kv.step([("a", a[8:9]), ("c", c[5:])])))
    ref_a, ref_c = hf_logits(hf_dir, a), hf_logits(hf_dir, c)
    torch.testing.assert_close(first, torch.cat([ref_c[:5], ref_a[:8]]), atol=ATOL, rtol=0)
    torch.testing.assert_close(second, torch.cat([ref_a[8:], ref_c[5:]]), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "family_name,overrides",
    [
        ("gemma2", dict(attn_logit_softcapping=None, final_logit_softcapping=None)),
        ("gemma2", dict(query_pre_attn_scalar=64, num_key_value_heads=1)),
        ("gemma3", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
        ("gemma3", dict(final_logit_softcapping=4.0, tie_word_embeddings=False)),
    ],
    ids=[
        "gemma2-no-softcap",
        "gemma2-scalar-mqa",
        "gemma3-global-linear-rope",
        "gemma3-cap-untied",
    ],
)
def test_variants_match_hf(family_name, overrides):
    path = cached_tiny_model(family_name, **overrides)
    torch.testing.assert_close(
        our_logits(load(path, "torch"), IDS), hf_logits(path, IDS), atol=ATOL, rtol=0
    )


def test_gemma3_global_rope_scaling_reaches_the_gguf(tmp_path):
    """llama.cpp writes Gemma 3's linear rope scaling as the (global) rope.scaling keys; the
    local layers stay unscaled at base 10k."""
    path = cached_tiny_model("gemma3", rope_scaling={"rope_type": "linear", "factor": 4.0})
    src = resolve_model(str(write_gguf(path, tmp_path / "m.gguf")))
    arch = load_arch(src)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert (arch.rope_theta, arch.rope_local_theta) == (1_000_000.0, 10_000.0)
    ours = load_model(src, arch, torch.float32, "cpu", "torch")
    torch.testing.assert_close(our_logits(ours, IDS), hf_logits(path, IDS), atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 0.3)])
def test_bf16_runs_close_to_fp32_hf(hf_dir, dtype, atol):
    """Norms in fp32 with fp32 (1 + w) weights, cast back, as HF does in half precision."""
    ours = load(hf_dir, "torch", dtype)
    assert ours.layers[0].input_layernorm.weight.dtype == torch.float32
    assert ours.embed_tokens.dtype == dtype
    kv = PagedKV.for_model(ours, dtype=dtype)
    with torch.inference_mode():
        logits = ours.compute_logits(ours(*kv.step([("r", IDS)])))
    torch.testing.assert_close(logits, hf_logits(hf_dir, IDS), atol=atol, rtol=0)


def test_layers_keep_their_windows_and_rope_tables(family, hf_dir):
    """Gemma 2 alternates local and global layers; Gemma 3 has five local ones, then a global
    one, the local ones on their own RoPE base. The context stops at the window."""
    ours = load(hf_dir, "torch")
    windows = [layer.self_attn.sliding_window for layer in ours.layers]
    tables = [layer.self_attn.rope_table for layer in ours.layers]
    if family == "gemma2":
        assert windows == [32, None] and tables == [0, 0] and ours.local_rotary is None
        assert ours.layers[0].self_attn.q_norm is None
    else:
        assert windows == [32] * 5 + [None] and tables == [1] * 5 + [0]
        assert isinstance(ours.layers[0].self_attn.q_norm, Fp32RMSNorm)
    assert ours.arch.max_position_embeddings == 512  # the windows narrow layers, not the context
    assert ours.layers[0].self_attn.scale == 16**-0.5
    assert not ours.decodes_in_c  # the torch attention path: no C layers


# ----------------------------------------------------------------------------- loaders


def test_arch_from_config_and_gguf_agree(family, hf_dir, gguf_path):
    arch = load_arch(resolve_model(str(hf_dir)))
    assert arch.architecture == family and arch.hidden_act == "gelu_pytorch_tanh"
    assert arch.tie_word_embeddings and arch.head_dim == 16
    gguf_arch = load_arch(resolve_model(str(gguf_path)))
    same = dict(rms_norm_eps=arch.rms_norm_eps)  # a GGUF stores eps as float32
    assert dataclasses.replace(gguf_arch, **same) == arch


def test_gguf_uses_llama_cpps_names_and_norm_offset(family, hf_dir, gguf_path):
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    assert reader.fields["general.architecture"].contents() == family
    assert {
        "blk.0.attn_norm.weight",
        "blk.0.post_attention_norm.weight",
        "blk.0.ffn_norm.weight",
        "blk.0.post_ffw_norm.weight",
    } <= set(tensors)
    assert ("blk.0.attn_q_norm.weight" in tensors) == (family == "gemma3")
    assert "output.weight" not in tensors  # tied
    assert reader.fields[f"{family}.attention.sliding_window"].contents() == 32
    hf = load_file(str(hf_dir / "model.safetensors"))
    stored = torch.from_numpy(tensors["blk.0.ffn_norm.weight"].data.copy())
    torch.testing.assert_close(stored, hf["model.layers.0.pre_feedforward_layernorm.weight"] + 1)
    ours = load(gguf_path, "torch")  # HF's w comes back, 1 + w is held
    torch.testing.assert_close(ours.layers[0].pre_feedforward_layernorm.weight, stored)


def test_transformers_4_config_layout(tmp_path):
    """A Gemma 3 config.json as Google ships it (transformers 4.5x): rope_theta, rope_scaling and
    rope_local_base_freq flat, sliding_window_pattern instead of layer_types."""
    hf_dir = shutil.copytree(cached_tiny_model("gemma3"), tmp_path / "m")
    config = json.loads((hf_dir / "config.json").read_text())
    new_arch = load_arch(resolve_model(str(hf_dir)))
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        del config[key]
    config.update(
        rope_theta=1_000_000.0,
        rope_scaling=None,
        rope_local_base_freq=10000.0,
        sliding_window_pattern=6,
        eos_token_id=[1, 106],
    )
    (hf_dir / "config.json").write_text(json.dumps(config))
    old_arch = load_arch(resolve_model(str(hf_dir)))
    assert dataclasses.replace(old_arch, eos_token_ids=(2,)) == new_arch
    assert old_arch.eos_token_ids == (1, 106)


def test_registry_and_architecture_names():
    assert get_model_class("gemma2") is get_model_class("Gemma3ForCausalLM") is GemmaForCausalLM


@pytest.mark.parametrize(
    "edit,message",
    [
        (dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        (
            dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]),
            "model_type 'gemma3': Gemma3ForConditionalGeneration needs its text_config",
        ),
        (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
        (
            dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0}}),
            "unsupported rope type 'dynamic'",
        ),
    ],
    ids=["activation", "bidirectional", "multimodal", "layer-types", "rope-type"],
)
def test_config_fields_not_implemented_are_named(tmp_path, edit, message):
    hf_dir = shutil.copytree(cached_tiny_model("gemma2"), tmp_path / "m")
    if "rope_parameters" in edit:
        hf_dir = shutil.copytree(cached_tiny_model("gemma3"), tmp_path / "m3")
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(edit)
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_arch(resolve_model(str(hf_dir)))


def test_gguf_tensors_strictly_mapped(tmp_path):
    """A Gemma 3 GGUF without its post-MLP norms is refused naming them."""
    hf_dir = shutil.copytree(cached_tiny_model("gemma3"), tmp_path / "m")
    path = write_gguf(hf_dir, tmp_path / "full.gguf", with_tokenizer=False)
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "cut.gguf"), "gemma3")
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for tensor in reader.tensors:
        if tensor.name != "blk.3.post_ffw_norm.weight":
            writer.add_tensor(tensor.name, tensor.data.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    src = resolve_model(str(tmp_path / "cut.gguf"))
    with pytest.raises(ValueError, match="missing weights: model.layers.3.post_feedforward"):
        load_model(src, load_arch(src), torch.float32, "cpu")


def test_softcapped_attention_runs_on_the_native_kernel_and_batch_invariant():
    """Gemma 2's soft-capped scores on the native kernel (it caps them too), and so under
    --batch-invariant as well: the logits equal HF's."""
    if not HAS_CC:
        pytest.skip("no C compiler: the native kernel cannot be built here")
    path = cached_tiny_model("gemma2")
    ours = load(path, "torch")
    apply_kernels(ours, KernelRequest(batch_invariant=True))
    assert ours.kernels.attention.kernel is not None
    torch.testing.assert_close(our_logits(ours, IDS), hf_logits(path, IDS), atol=ATOL, rtol=0)


def test_make_tiny_gemma_overrides(tmp_path):
    path = make_tiny_model(tmp_path, "gemma2", num_hidden_layers=4, sliding_window=64)
    arch = load_arch(resolve_model(str(path)))
    assert arch.sliding_windows == (64, None, 64, None) and arch.max_position_embeddings == 512


def test_engine_resolves_gemma_attention_to_the_native_kernel():
    """The engine's resolved config says what runs: the native kernel on CPU where it builds,
    for Gemma 2's soft-capped scores as for Gemma 3."""
    from tokenbus.engine.setup import resolve_config
    from tokenbus.engine_args import EngineArgs

    for family_name in ("gemma2", "gemma3"):
        src = resolve_model(str(cached_tiny_model(family_name)))
        config = EngineArgs(model=str(src.path), device="cpu").to_config(128)
        resolved = resolve_config(config, src)
        assert resolved.model.attention_backend == ("native" if HAS_CC else "torch")


def test_generation_configs_eos_list_stops_at_each(tmp_path):
    """Gemma's generation_config.json lists eos_token_id [1, 106]: the first is the request's
    EOS, the others stop it too (as stop_token_ids, unless ignore_eos)."""
    from tokenbus import LLM, SamplingParams
    from tokenbus.sampling_params import StructuredOutputsParams

    hf_dir = shutil.copytree(cached_tiny_model("gemma3"), tmp_path / "m")
    llm = LLM(str(hf_dir), multiprocess=False, seed=0, attention_backend="torch")
    prompt = {"prompt_token_ids": IDS}
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    stop_at = tokens[3]  # the 4th greedy token as the model's second EOS id
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop_at]}))
    llm = LLM(str(hf_dir), multiprocess=False, seed=0, attention_backend="torch")
    assert llm.engine.setup.extra_eos_token_ids == (stop_at,)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    first = tokens.index(stop_at)
    assert out[0].outputs[0].token_ids == tokens[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    ignored = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == tokens  # ignore_eos ignores every EOS id
    # A grammar ends on any of them too: xgrammar is told every EOS id as a stop token.
    grammars = llm.engine.client.engine_core.grammar_manager
    compiled = grammars._get_backend().compile(StructuredOutputsParams(choice=["yes", "no"]))
    assert compiled.tokenizer_info.stop_token_ids == [2, stop_at]
    llm.shutdown()


def test_gguf_window_pattern_and_27b_scale():
    """llama.cpp's choices where the GGUF is silent (Gemma 3: five local layers, then a global
    one; the 27B models scaled by hidden / heads); its sliding_window_pattern key where present,
    as a period or as per-layer flags."""
    from tokenbus.loader.gemma_config import gemma_gguf_fields

    meta = {
        "gemma3.embedding_length": 64,
        "gemma3.attention.head_count": 2,
        "gemma3.attention.key_length": 16,
        "gemma3.attention.sliding_window": 512,
    }
    fields = gemma_gguf_fields(meta, "gemma3", 7)
    assert fields["sliding_windows"] == (512,) * 5 + (None, 512)
    assert fields["query_pre_attn_scalar"] == 16 and fields["rope_local_theta"] == 10000.0
    assert gemma_gguf_fields(meta, "gemma3", 62)["query_pre_attn_scalar"] == 32  # 64 / 2
    period = {**meta, "gemma3.attention.sliding_window_pattern": 2}
    assert gemma_gguf_fields(period, "gemma3", 3)["sliding_windows"] == (512, None, 512)
    flags = {**meta, "gemma3.attention.sliding_window_pattern": [False, True]}
    assert gemma_gguf_fields(flags, "gemma3", 2)["sliding_windows"] == (None, 512)
    with pytest.raises(ValueError, match="sliding_window_pattern: 2 flags for 3 layers"):
        gemma_gguf_fields(flags, "gemma3", 3)


def test_softcapped_sdpa_is_hfs_eager_attention():
    """attention.sdpa with a soft-cap against HF Gemma 2's eager attention: GQA, a causal
    mask aligned to the end (a chunk after context), and an additive mask."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from tokenbus.model.sdpa import sdpa

    g = torch.Generator().manual_seed(3)
    q = 3 * torch.randn(1, 4, 5, 16, generator=g)  # [B, Hq, Lq, D], scores past the cap
    k, v = (3 * torch.randn(1, 2, 9, 16, generator=g) for _ in range(2))  # [B, Hkv, Lk, D]
    visible = torch.ones(5, 9, dtype=torch.bool).tril(9 - 5)
    mask = torch.zeros(5, 9).masked_fill(~visible, float("-inf"))
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    ref, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.25, softcap=2.0)
    ref = ref.transpose(1, 2)  # HF returns [B, Lq, H, D]
    ours = sdpa(q, k, v, is_causal=True, scale=0.25, enable_gqa=True, softcap=2.0)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(sdpa(q, k, v, mask, scale=0.25, enable_gqa=True, softcap=2.0), ref)
    uncapped = sdpa(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    assert (uncapped - ours).abs().max() > 0.1  # the cap bends these scores


def test_captured_decode_plan_soft_caps_like_the_eager_one():
    """A captured step's static plan (TorchDecodePlan) with the cap gives the eager plan's rows."""
    from tests.model.test_attention_backend import pad_uniform
    from tests.model.test_native_attention import make_batch

    from tokenbus.model.attention import paged_attention
    from tokenbus.model.attention_backend import TorchAttentionBackend

    backend = TorchAttentionBackend(torch.float32)
    q, k, v, kv, ctx = make_batch([(1, c) for c in (0, 5, 16, 40)], 4, 2, 16)
    q = 4 * q
    eager = backend.build_metadata(ctx)
    ref = paged_attention(q, k, v, kv.clone(), ctx.slot_mapping, eager, 0.25, softcap=2.0)
    padded, pq, pk, pv = pad_uniform(
        ctx, q, k, v, padded_reqs=6, q_len=1, width=ctx.block_tables.shape[1] + 2
    )
    backend.prepare_for_capture(padded)
    plan = backend.prepare_for_replay(padded, padded.num_tokens)
    out = paged_attention(pq, pk, pv, kv, padded.slot_mapping, plan, 0.25, softcap=2.0)
    torch.testing.assert_close(out[: ctx.num_tokens], ref, atol=2e-5, rtol=1e-4)
    plain = paged_attention(q, k, v, kv.clone(), ctx.slot_mapping, eager, 0.25)
    assert (plain - ref).abs().max() > 0.01
