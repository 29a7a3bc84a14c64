"""The Triton attention backend through the whole engine, and --load-format dummy.

Without a GPU the Triton kernels run in Triton's interpreter (tests/conftest.py): slow, so
the workloads are small; on CUDA (benchmarks/gpu_check.sh) the same tests run compiled.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm, random_prompts
from tests.fixtures.triton_device import DEVICE, needs_triton
from tokenbus import SamplingParams
from tokenbus.model.attention_backend import triton_problem


@needs_triton
def test_triton_backend_gives_the_torch_paths_greedy_tokens(tiny_llama_dir):
    # Chunked prefill (budget 16), a shared prefix (cache hits) and decodes in mixed batches.
    prompts = random_prompts(5, 5, 40, seed=3)
    prompts.append(prompts[0][:20] + [7, 8, 9])
    args = dict(max_num_batched_tokens=16, device=DEVICE, dtype="float32")
    expected = generate_greedy(
        make_llm(tiny_llama_dir, attention_backend="torch", **args), prompts, 8
    )
    llm = make_llm(tiny_llama_dir, attention_backend="triton", **args)
    assert llm.engine.config.model.attention_backend == "triton"
    assert generate_greedy(llm, prompts, 8) == expected
    assert_engine_clean(llm)


@needs_triton
def test_triton_backend_reads_an_fp8_cache_in_place(tiny_llama_dir):
    """--kv-cache-dtype fp8 on the Triton kernels: the pool holds e4m3 bytes, and the same
    prompts again (their blocks now prefix-cache hits, read back in place) give the same
    tokens, as a quantized cache must (the same inputs give the same bytes)."""
    prompts = random_prompts(4, 20, 40, seed=4)
    # fp32: a prefix hit changes the prefill's shapes (a GPU's bf16 GEMMs may then round apart)
    engine = dict(attention_backend="triton", kv_cache_dtype="fp8", device=DEVICE, dtype="float32")
    llm = make_llm(tiny_llama_dir, **engine)
    worker = llm.engine.client.engine_core.executor.worker
    assert worker.kv_dtype == worker.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    first = generate_greedy(llm, prompts, 8)
    hits = llm.engine.stats_totals["prefix_cache_hits"]
    assert generate_greedy(llm, prompts, 8) == first
    assert llm.engine.stats_totals["prefix_cache_hits"] > hits
    assert_engine_clean(llm)


def test_triton_backend_on_cpu_without_the_interpreter_is_refused(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: triton runs")
    with pytest.raises(ValueError, match="attention_backend 'triton'.*CUDA device"):
        make_llm(tiny_llama_dir, attention_backend="triton", device="cpu")


@pytest.fixture(scope="module")
def config_only_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model's config.json alone: no weights, no tokenizer."""
    path = tmp_path_factory.mktemp("config-only")
    shutil.copy(tiny_llama_dir / "config.json", path / "config.json")
    return path


def test_dummy_weights_need_only_a_config_and_are_seeded(config_only_dir, tiny_llama_dir):
    prompts = random_prompts(3, 4, 12, seed=5)
    args = dict(load_format="dummy", tokenizer=str(tiny_llama_dir))
    first = make_llm(config_only_dir, **args)
    tokens = generate_greedy(first, prompts, 6)
    assert all(len(t) == 6 for t in tokens)
    assert generate_greedy(make_llm(config_only_dir, **args), prompts, 6) == tokens
    assert generate_greedy(make_llm(config_only_dir, seed=1, **args), prompts, 6) != tokens
    params = SamplingParams(max_tokens=1, logprobs=1, temperature=0.0)
    logprob = first.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    value = next(iter(logprob[0].outputs[0].logprobs[0].values())).logprob
    assert value == value and value > -50  # finite: weights scaled like an initialisation
    assert_engine_clean(first)


def test_dummy_weights_refuse_to_keep_gguf_blocks(config_only_dir, tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization 'gguf' needs real weights"):
        make_llm(
            config_only_dir, load_format="dummy", tokenizer=str(tiny_llama_dir), quantization="gguf"
        )


@pytest.mark.parametrize(
    "name, layers, hidden, kv_heads, experts",
    [
        ("llama-3.1-8b", 32, 4096, 8, 0),
        ("qwen2.5-7b", 28, 3584, 4, 0),
        ("qwen3-30b-a3b", 48, 2048, 4, 128),
    ],
)
def test_real_size_config_resolves_without_weights(name, layers, hidden, kv_heads, experts):
    """Each shipped config builds an engine setup (metadata only: no 16 GB here)."""
    from pathlib import Path

    from tokenbus.engine.setup import create_engine_setup
    from tokenbus.engine_args import EngineArgs

    path = Path(__file__).resolve().parents[2] / "benchmarks/configs" / name
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == layers
    setup = create_engine_setup(
        EngineArgs(model=str(path), load_format="dummy", max_model_len=4096)
    )
    assert setup.arch.hidden_size == hidden and setup.arch.num_key_value_heads == kv_heads
    assert setup.arch.num_experts == experts
    assert setup.config.model.load_format == "dummy"


def test_load_format_resolves_to_the_files_format_and_refuses_another(tiny_llama_dir):
    from tokenbus.engine.setup import resolve_load_format
    from tokenbus.loader import resolve_model

    source = resolve_model(str(tiny_llama_dir))
    assert resolve_load_format("auto", source) == "safetensors"
    assert resolve_load_format("dummy", source) == "dummy"
    with pytest.raises(ValueError, match="load_format 'gguf'.*holds safetensors weights"):
        make_llm(tiny_llama_dir, load_format="gguf")


def test_triton_needs_blocks_of_16_tokens_and_dummy_weights_key_their_own_kv():
    from tokenbus.engine_args import EngineArgs
    from tokenbus.kv_transfer.layout import kv_layout
    from tokenbus.model_arch import ModelArch

    assert "--block-size 16 or more" in (triton_problem(DEVICE, block_size=8) or "")
    arch = ModelArch("llama", 100, 8, 16, 1, 1, 1, 8, 1024)
    resolved = dict(
        device="cpu",
        dtype="float32",
        quantization="none",
        attention_backend="torch",
        kv_cache_dtype="float32",
    )
    dummy = kv_layout(EngineArgs(load_format="dummy", seed=3, **resolved).to_config(256), arch)
    real = kv_layout(EngineArgs(load_format="safetensors", **resolved).to_config(256), arch)
    assert dummy.weights == "dummy seed 3" and real.weights == "files"
    assert dummy.fingerprint() != real.fingerprint()
