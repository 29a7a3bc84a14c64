"""Multi-LoRA serving end to end: adapters mixed in one batch give HF + PEFT's greedy tokens,
on dense and GGUF base weights; an adapter's blocks are never shared with the base model's;
max_loras holds; bad adapters are refused with the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.e2e.oracle import assert_same_or_near_tie
from tests.e2e.utils import assert_engine_clean, make_llm, model_runner, random_prompts
from tests.fixtures.lora import hf_lora_greedy, hf_lora_model, make_adapter
from tokenbus import LoRARequest, SamplingParams

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    first = make_adapter(tiny_llama_dir, root / "first", seed=1, r=4)
    # Another rank, attention only, rsLoRA scaling.
    second = make_adapter(
        tiny_llama_dir,
        root / "second",
        seed=2,
        r=8,
        targets=("q_proj", "v_proj", "o_proj"),
        use_rslora=True,
    )
    return {
        "first": LoRARequest("first", str(first)),
        "second": LoRARequest("second", str(second)),
    }


def _greedy(llm, prompts, loras):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    return outputs


def test_two_adapters_and_the_base_model_in_one_batch_match_hf_peft(tiny_llama_dir, adapters):
    prompts = random_prompts(6, 20, 40, seed=3)
    loras = [adapters["first"], adapters["second"], None] * 2
    expected = []
    models = {
        name: hf_lora_model(str(tiny_llama_dir), lora.lora_path if lora else None)
        for name, lora in (
            ("first", adapters["first"]),
            ("second", adapters["second"]),
            ("base", None),
        )
    }
    for prompt, lora in zip(prompts, loras):
        expected.append(
            hf_lora_greedy(models[lora.lora_name if lora else "base"], prompt, MAX_TOKENS)
        )
    # The adapters change the model: greedy tokens differ from the base model's.
    assert hf_lora_greedy(models["base"], prompts[0], MAX_TOKENS) != expected[0]
    assert hf_lora_greedy(models["base"], prompts[1], MAX_TOKENS) != expected[1]

    llm = make_llm(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    outputs = _greedy(llm, prompts, loras)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    assert_engine_clean(llm)


def test_adapter_prefix_blocks_are_never_the_base_models(tiny_llama_dir, adapters):
    prompt = random_prompts(1, 64, 64, seed=5)[0]
    llm = make_llm(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    base = _greedy(llm, [prompt], None)[0]
    first = _greedy(llm, [prompt], adapters["first"])[0]
    again = _greedy(llm, [prompt], adapters["first"])[0]
    second = _greedy(llm, [prompt], adapters["second"])[0]
    assert base.num_cached_tokens == 0
    assert first.num_cached_tokens == 0  # the base model's blocks hold other K/V
    assert again.num_cached_tokens == 48  # its own, three full blocks (the last is recomputed)
    assert second.num_cached_tokens == 0
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert list(first.outputs[0].token_ids) != list(base.outputs[0].token_ids)
    assert_engine_clean(llm)


def test_more_adapters_than_max_loras_take_turns(tiny_llama_dir, adapters):
    prompts = random_prompts(4, 20, 30, seed=7)
    loras = [adapters["first"], adapters["second"]] * 2
    reference = make_llm(tiny_llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    want = [list(o.outputs[0].token_ids) for o in _greedy(reference, prompts, loras)]
    # One slot, one cached adapter: the second waits for the first, and is read again after.
    llm = make_llm(tiny_llama_dir, enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    got = [list(o.outputs[0].token_ids) for o in _greedy(llm, prompts, loras)]
    assert got == want
    assert_engine_clean(llm)


@pytest.mark.slow
def test_adapters_on_gguf_blocks_match_hf_peft(tiny_llama_dir, adapters, tmp_path):
    from tests.fixtures.tiny_gguf import write_gguf

    gguf = write_gguf(tiny_llama_dir, tmp_path / "tiny-q8_0.gguf", qtype="Q8_0")
    prompts = random_prompts(3, 20, 40, seed=11)
    loras = [adapters["first"], None, adapters["second"]]
    llm = make_llm(gguf, enable_lora=True, max_loras=2, max_lora_rank=8)
    outputs = _greedy(llm, prompts, loras)
    for prompt, lora, output in zip(prompts, loras, outputs):
        hf = hf_lora_model(str(gguf), lora.lora_path if lora else None)
        want = hf_lora_greedy(hf, prompt, MAX_TOKENS)
        completion = output.outputs[0]
        assert_same_or_near_tie(list(completion.token_ids), want, completion.logprobs)
    assert_engine_clean(llm)


def test_bad_adapters_are_refused_with_the_reason(tiny_llama_dir, adapters, tmp_path):
    plain = make_llm(tiny_llama_dir)
    with pytest.raises(ValueError, match="lora_request: adapter 'first' needs an engine started"):
        plain.generate(
            [{"prompt_token_ids": [5, 6]}], lora_request=adapters["first"], use_tqdm=False
        )
    llm = make_llm(tiny_llama_dir, enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8 is above --max-lora-rank 4"):
        llm.generate(
            [{"prompt_token_ids": [5, 6]}], lora_request=adapters["second"], use_tqdm=False
        )
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate(
            [{"prompt_token_ids": [5, 6]}],
            lora_request=LoRARequest("missing", str(tmp_path / "nowhere")),
            use_tqdm=False,
        )
    dora = tmp_path / "dora"
    dora.mkdir()
    first = Path(adapters["first"].lora_path)
    config = json.loads((first / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    shutil.copy(first / "adapter_model.safetensors", dora / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        llm.generate(
            [{"prompt_token_ids": [5, 6]}], lora_request=LoRARequest("d", str(dora)), use_tqdm=False
        )
    # An adapter made for another model's shapes: refused with the module that does not fit.
    from tests.fixtures.tiny_models import cached_tiny_model

    wider = cached_tiny_model("llama", hidden_size=96)
    other = make_adapter(wider, tmp_path / "other", seed=3, r=4)
    needs = r"lora_request: .*down_proj .*this model needs \[r, 128\] and \[64, r\]"
    with pytest.raises(ValueError, match=needs):
        llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}] * 2,
            SamplingParams(max_tokens=3),
            lora_request=[adapters["first"], LoRARequest("other", str(other))],
            use_tqdm=False,
        )
    (good,) = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}],
        SamplingParams(max_tokens=3, ignore_eos=True),
        lora_request=adapters["first"],
        use_tqdm=False,
    )
    assert good.outputs[0].finish_reason == "length"
    assert_engine_clean(llm)


def test_the_engine_fails_a_request_whose_adapter_does_not_fit(tiny_llama_dir, tmp_path):
    """The engine checks too (a front end of another version, a file changed since): the
    request fails alone."""
    from tests.fixtures.tiny_models import cached_tiny_model
    from tokenbus.protocol import EngineRequest

    wider = cached_tiny_model("llama", hidden_size=96)
    other = make_adapter(wider, tmp_path / "other", seed=3, r=4)
    llm = make_llm(tiny_llama_dir, enable_lora=True, max_lora_rank=4)
    core = llm.engine.client.engine_core  # in this process
    request = EngineRequest(
        request_id="x",
        prompt_token_ids=[5, 6],
        sampling_params=SamplingParams(max_tokens=2),
        lora_request=LoRARequest("other", str(other)),
    )
    with pytest.raises(ValueError, match="this model needs"):
        core.add_request(request)
    assert_engine_clean(llm)


def test_decode_layers_in_c_add_the_same_side_path(tiny_llama_dir, adapters, tmp_path):
    """Decode steps of a GGUF model run each layer in one C call (decode_layer.c's lora_add);
    --enforce-eager runs them op by op through LinearLoRA: the same tokens and logprobs."""
    from tests.fixtures.tiny_gguf import write_gguf

    gguf = write_gguf(tiny_llama_dir, tmp_path / "tiny-q8_0.gguf", qtype="Q8_0")
    prompts = random_prompts(5, 10, 30, seed=13)
    loras = [adapters["first"], None, adapters["second"], adapters["first"], None]
    results = []
    for eager in (False, True):
        llm = make_llm(gguf, enable_lora=True, max_loras=2, max_lora_rank=8, enforce_eager=eager)
        runner = model_runner(llm)
        assert runner.model.decodes_in_c is not eager
        results.append(_greedy(llm, prompts, loras))
        assert_engine_clean(llm)
    for c_path, eager_path, lora in zip(*results, loras):
        ours, theirs = c_path.outputs[0], eager_path.outputs[0]
        assert list(ours.token_ids) == list(theirs.token_ids)
        # The base model's rows: bit for bit. An adapter's: its side path sums in another
        # order than torch's GEMMs (fp32 rounding, carried through the layers).
        tolerance = 1e-3 if lora else 0.0
        for mine, other, token in zip(ours.logprobs, theirs.logprobs, ours.token_ids):
            assert abs(mine[token].logprob - other[token].logprob) <= tolerance


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adapters_on_a_gpu_give_the_cpu_engines_tokens(tiny_llama_dir, adapters):
    """Adapters on CUDA: the slots and the side path's rows sit on the activations' device
    (fp32 on both sides, so the tokens agree up to a near tie)."""
    prompts = random_prompts(5, 20, 40, seed=8)
    loras = [adapters["first"], None, adapters["first"], adapters["second"], None]
    args = dict(enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32")
    cpu = make_llm(tiny_llama_dir, device="cpu", **args)
    expected = _greedy(cpu, prompts, loras)
    cpu.shutdown()
    gpu = make_llm(tiny_llama_dir, device="cuda", **args)
    try:
        for ours, theirs in zip(_greedy(gpu, prompts, loras), expected):
            ours, theirs = ours.outputs[0], theirs.outputs[0]
            assert_same_or_near_tie(list(ours.token_ids), list(theirs.token_ids), ours.logprobs)
        assert_engine_clean(gpu)
    finally:
        gpu.shutdown()


@pytest.mark.parametrize("module", ["self_attn.gate_proj", "mlp.q_proj", "block_sparse_moe.w1"])
def test_a_projection_under_another_scope_is_refused_by_name(
    module, tiny_llama_dir, adapters, tmp_path
):
    """LFM3's attention has a gate_proj of its own: an adapter of it must not land on the MLP's
    gate, nor an "mlp.q_proj" on the attention's q."""
    from safetensors.torch import save_file

    from tokenbus.loader import load_arch, resolve_model
    from tokenbus.loader.lora import check_adapter

    arch = load_arch(resolve_model(str(tiny_llama_dir)))
    bad = tmp_path / "bad"
    bad.mkdir()
    first = Path(adapters["first"].lora_path)
    shutil.copy(first / "adapter_config.json", bad / "adapter_config.json")
    prefix = f"base_model.model.model.layers.0.{module}"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.zeros(4, arch.hidden_size),
            f"{prefix}.lora_B.weight": torch.zeros(arch.hidden_size, 4),
        },
        str(bad / "adapter_model.safetensors"),
    )
    with pytest.raises(ValueError, match=rf"tensor {prefix}\.lora_A.* adapts a module we do not"):
        check_adapter(bad, 4, arch)
    check_adapter(first, 4, arch)  # the fixture's own adapter passes the same check
