"""The GPU figures, each part in one process, on real-size models with random weights.

    bandwidth   device-to-device copy: bytes read + written per second (the memory bound)
    decode      one greedy stream of a --load-format dummy model: tokens/s against the bound
                weight bytes / bandwidth, steps one at a time and with --async-scheduling
    throughput  offline: N prompts (IN tokens in, OUT out, EOS ignored) through tokenbus,
                then HF transformers `generate` on the same device in static batches (its best
                batch size wins)
    graphs      decode tokens/s at batch 1 and 64, --enforce-eager against CUDA graphs

Every part prints one JSON object (and writes it with --json). Runs on CPU too, slowly (smoke
test of the script: --device cpu with benchmarks/configs/smollm2-135m and small sizes).

    python benchmarks/gpu_bench.py decode --model benchmarks/configs/llama-3.1-8b \
        --tokenizer .whl/smollm2-tokenizer --json out.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import random
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["bandwidth", "decode", "throughput", "graphs"])
    parser.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--tokenizer", default=None, help="default: the model's own")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--bandwidth", type=float, default=None, help="bytes/s (else measured)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = {"part": args.part, "device": device_name(args.device), "model": args.model}
    result |= {"versions": versions()}
    result |= PARTS[args.part](args)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def versions() -> dict[str, str]:
    import transformers

    found = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        pass
    return found


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure_bandwidth(device: str, num_bytes: int = 2 << 30, repeats: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    return 2 * num_bytes * repeats / (time.perf_counter() - start)


def part_bandwidth(args) -> dict:
    return {"bandwidth_bytes_per_s": measure_bandwidth(args.device)}


def make_llm(args, **overrides):
    from tokenbus import LLM

    engine = dict(
        load_format="dummy",
        tokenizer=args.tokenizer,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        max_model_len=args.input_len + args.output_len + 8,
        multiprocess=False,
    )
    return LLM(args.model, **(engine | overrides))


def with_llm(args, measure, **overrides):
    """measure(llm) on an engine built for this part, which is gone when this returns: no
    reference to it outlives the call, so its weights and KV pool are freed before the next
    engine (or HF's model) needs the memory."""
    llm = make_llm(args, **overrides)
    try:
        return measure(llm)
    finally:
        llm.shutdown()
        del llm
        free_memory()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def worker_of(llm):
    return llm.engine.client.engine_core.executor.worker


def token_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(length)]} for _ in range(num)
    ]


def timed_generate(llm, prompts, max_tokens: int) -> float:
    from tokenbus import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return elapsed


def decode_rate(llm, prompts, num_tokens: int) -> float:
    """Decode tokens/s of `prompts` together: the time of num_tokens + 1 tokens less the time
    of one (prefill and the first token), per decoded token of the batch."""
    timed_generate(llm, prompts, 2)  # warm-up: kernels compiled, graphs replayed once
    first = timed_generate(llm, prompts, 1)
    whole = timed_generate(llm, prompts, num_tokens + 1)
    return len(prompts) * num_tokens / (whole - first)


def weight_bytes(model: str, dtype: str) -> int:
    """The weight bytes one decoded token reads: every layer's, and the LM head."""
    from tokenbus.loader import load_arch, resolve_model

    a = load_arch(resolve_model(model))
    attn = a.hidden_size * (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim
    attn += a.num_attention_heads * a.head_dim * a.hidden_size
    dense_mlp = 3 * a.hidden_size * a.intermediate_size
    # An MoE layer's token reads the router and its top k experts, not all of them.
    moe_mlp = a.num_experts * a.hidden_size
    moe_mlp += a.num_experts_per_tok * 3 * a.hidden_size * a.moe_intermediate_size
    count = a.vocab_size * a.hidden_size  # the LM head (the embedding row read is negligible)
    for layer in range(a.num_hidden_layers):
        sparse = a.num_experts > 0 and layer not in a.dense_layers
        count += attn + (moe_mlp if sparse else dense_mlp)
    return count * torch.finfo(getattr(torch, dtype)).bits // 8


def part_decode(args) -> dict:
    bandwidth = args.bandwidth or measure_bandwidth(args.device)

    def one_stream(llm) -> float:
        vocab = llm.get_tokenizer().vocab_size
        return decode_rate(llm, token_prompts(1, 128, vocab), args.output_len)

    rate = with_llm(args, one_stream, max_num_seqs=8)
    # The next step scheduled and launched while the device runs this one.
    rate_async = with_llm(args, one_stream, max_num_seqs=8, async_scheduling=True)
    num_bytes = weight_bytes(args.model, args.dtype)
    bound = bandwidth / num_bytes
    return {
        "decode_tokens_per_s": rate,
        "decode_tokens_per_s_async": rate_async,
        "weight_bytes": num_bytes,
        "bandwidth_bytes_per_s": bandwidth,
        "bound_tokens_per_s": bound,
        "fraction_of_bound": rate / bound,
        "fraction_of_bound_async": rate_async / bound,
    }


def part_throughput(args) -> dict:
    def offline(llm) -> tuple[float, list[dict]]:
        vocab = llm.get_tokenizer().vocab_size
        prompts = token_prompts(args.num_prompts, args.input_len, vocab, seed=1)
        timed_generate(llm, prompts[:4], 4)
        return timed_generate(llm, prompts, args.output_len), prompts

    elapsed, prompts = with_llm(args, offline, max_num_seqs=min(args.num_prompts, 256))
    ours = args.num_prompts * (args.input_len + args.output_len) / elapsed
    result: dict = {"tokenbus_total_tokens_per_s": ours}
    write_partial(args, result)  # kept should HF fail (out of memory, say)
    hf, errors = {}, {}
    for batch_size in args.hf_batch_sizes:
        try:
            hf[batch_size] = hf_throughput(args, prompts, batch_size)
        except Exception as exc:  # a batch HF cannot run: named, the others still count
            errors[batch_size] = f"{type(exc).__name__}: {str(exc)[:300]}"
            free_memory()
    result["hf_total_tokens_per_s_by_batch"] = hf
    if errors:
        result["hf_errors_by_batch"] = errors
    if hf:
        best = max(hf, key=hf.get)
        result |= {"hf_best_batch_size": best, "ratio_vs_hf_best": ours / hf[best]}
    return result


def write_partial(args, result: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"part": args.part, "partial": True} | result, f, indent=1)


def hf_throughput(args, prompts: list[dict], batch_size: int) -> float:
    """HF transformers generate on static batches (equal prompt lengths: no padding)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).eval()
    ids = torch.tensor([p["prompt_token_ids"] for p in prompts], device=args.device)
    generate = dict(
        do_sample=False,
        max_new_tokens=args.output_len,
        min_new_tokens=args.output_len,
        pad_token_id=0,
    )
    with torch.inference_mode():
        model.generate(input_ids=ids[:2, :32], max_new_tokens=4, min_new_tokens=4, pad_token_id=0)
        sync(args.device)
        start = time.perf_counter()
        for i in range(0, len(ids), batch_size):
            batch = ids[i : i + batch_size]
            model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), **generate)
        sync(args.device)
        elapsed = time.perf_counter() - start
    del model
    free_memory()
    return len(ids) * (args.input_len + args.output_len) / elapsed


def part_graphs(args) -> dict:
    """Graphs are captured at exactly the measured batch sizes: named sizes that fail to
    capture stop the engine, and an engine that captures nothing (capture disabled for the
    model, its log says why) stops the part, rather than leave it eager and the ratio near 1."""
    sizes = sorted(set(args.batches))
    modes = {"eager": dict(enforce_eager=True), "graphs": dict(cudagraph_capture_sizes=sizes)}
    rates: dict[str, dict[int, float]] = {}
    captured: list[int] = []

    def decode_rates(llm, graphs: bool) -> dict[int, float]:
        captured_step = worker_of(llm).runner.captured
        if graphs and args.device.startswith("cuda"):  # CPUs capture nothing (a rehearsal)
            if captured_step is None:
                raise RuntimeError("graphs asked for, but the engine captured none (see its log)")
            captured.extend(shape.num_reqs for shape in sorted(captured_step.runner.graphs))
        vocab = llm.get_tokenizer().vocab_size
        return {
            b: decode_rate(llm, token_prompts(b, 32, vocab, seed=b), args.output_len)
            for b in args.batches
        }

    for mode, overrides in modes.items():
        measure = functools.partial(decode_rates, graphs=mode == "graphs")
        rates[mode] = with_llm(args, measure, max_num_seqs=max(sizes), **overrides)
    return {
        "decode_tokens_per_s": rates,
        "captured_sizes": captured,
        "graphs_over_eager": {b: rates["graphs"][b] / rates["eager"][b] for b in args.batches},
    }


PARTS = {
    "bandwidth": part_bandwidth,
    "decode": part_decode,
    "throughput": part_throughput,
    "graphs": part_graphs,
}

if __name__ == "__main__":
    main()
