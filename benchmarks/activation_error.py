"""How far the reduced-precision paths move the default model from fp32 (weight-only tiles, fp32
K/V), on real chat text: int16, int8, bf16 (AVX512-BF16) and q8_k (AVX-512 VNNI: int8 per 256
values) activations (--quant-activations), an fp16 KV cache (--kv-cache-dtype), and the defaults
(auto: int16 for decode steps, bf16 for prefill chunks where the CPU has a bf16 engine: the
default model has no K-quant weights, which auto would give q8_k from 16 rows; fp16 K/V). A few
questions, each answered greedily (48 tokens) under each mode, and the fp32 run's prompt +
answer scored under each mode (prompt logprobs, prefilled in 64-token chunks so every matmul
runs on the tiles with that mode's activations).

    .venv/bin/python benchmarks/activation_error.py
    .venv/bin/python benchmarks/activation_error.py --mixed 3.5 4 --modes fp32 int16 int8

--mixed T [T ...]: also simulated mixed activations, a mode per T. Every linear's input is
rounded per 32-value block as the kernels round it (da = max|x| / levels), to int16 where the
block's max|x| / rms exceeds T (an outlier in it) and to int8 elsewhere, then multiplied on the
fp32 weight-only path. "rows" rounds each row's block by its own test; "columns" rounds a block
column to int16 for every row if any row's block fails it (what one kernel call could take per
tile-block, all rows alike). These runs are eager (no C decode layers), so decode steps take
the rounding too. Prints the share of blocks rounded to int16: whether int8's error sits in a few
outlier blocks that int16 could take alone. --modes limits the real modes run.

Prints, per mode: how many answers equal fp32's and where the first one differs, and the
absolute difference of the per-token logprobs from fp32's (mean and max).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from tokenbus import LLM, SamplingParams
from tokenbus.bench.record import make_record, record_dir, this_command, write_record
from tokenbus.model.layers.quantized import QuantizedLinearKernel
from tokenbus.model.native import load_quant_kernels
from tokenbus.utils.cpu import CpuFeatures

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers and say why they are prime.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
]
# label -> engine arguments; fp32 (the reference) first.
MODES = {
    "fp32": dict(quant_activations="fp32", kv_cache_dtype="float32"),
    "int16": dict(quant_activations="int16", kv_cache_dtype="float32"),
    "int8": dict(quant_activations="int8", kv_cache_dtype="float32"),
    "bf16": dict(quant_activations="bf16", kv_cache_dtype="float32"),  # AVX512-BF16 only
    "q8_k": dict(quant_activations="q8_k", kv_cache_dtype="float32"),  # AVX-512 VNNI only
    "fp16 KV": dict(quant_activations="fp32", kv_cache_dtype="float16"),
    "defaults": dict(),
}


@dataclass
class MixedRounding:
    """Rounds x [M, K] per 32-value block: int16 where max|x| / rms > threshold, else int8
    (per_column: a block column goes int16 for all rows if any row's block fails). Counts the
    blocks each way."""

    threshold: float
    per_column: bool
    int16_blocks: int = 0
    blocks: int = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        b = x.reshape(m, k // 32, 32)
        amax = b.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        rms = b.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)
        wide = amax / rms > self.threshold
        if self.per_column:
            wide = wide.any(dim=0, keepdim=True).expand_as(wide)
        levels = torch.where(wide, 32767.0, 127.0)
        self.int16_blocks += int(wide.sum())
        self.blocks += wide.numel()
        return (torch.round(b / amax * levels) * (amax / levels)).reshape(m, k)


def run_mode(
    engine_args: dict, texts: list[list[int]] | None, rounding: MixedRounding | None = None
):
    """Greedy answers to QUESTIONS and per-token logprobs of `texts` (the mode's own prompt +
    answers when None: the reference run), with every linear's input rounded by `rounding`."""
    original = QuantizedLinearKernel.__call__
    if rounding is not None:  # the engine runs in this process (multiprocess=False)
        QuantizedLinearKernel.__call__ = lambda self, x: original(
            self, rounding(x.reshape(-1, self.in_features).float()).reshape(x.shape).to(x.dtype)
        )
    try:
        # Simulated rounding needs every linear to pass through QuantizedLinearKernel: eager steps,
        # so that decode steps do not run the C decode layers, which call the tiles themselves.
        llm = LLM(
            multiprocess=False,
            enable_prefix_caching=False,
            max_num_batched_tokens=64,
            max_model_len=1024,
            **engine_args,
            **(dict(enforce_eager=True) if rounding is not None else {}),
        )
        tokenizer = llm.get_tokenizer()
        prompts = [
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
                ),
                add_special_tokens=False,
            )
            for q in QUESTIONS
        ]
        greedy = SamplingParams(temperature=0.0, max_tokens=48, min_tokens=48)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        answers = [o.outputs[0].token_ids for o in outputs]
        texts = texts or [p + a for p, a in zip(prompts, answers)]
        scored = llm.generate(
            [{"prompt_token_ids": t} for t in texts],
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
        scores = [
            [entry[t].logprob for entry, t in zip(o.prompt_logprobs[1:], text[1:])]
            for o, text in zip(scored, texts)
        ]
        llm.shutdown()
    finally:
        QuantizedLinearKernel.__call__ = original
    return answers, scores, texts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(MODES),
        help="real modes (fp32 always)",
    )
    parser.add_argument(
        "--mixed", type=float, nargs="*", default=[], help="simulated mixed int8/int16 thresholds"
    )
    parser.add_argument(
        "--record",
        default=None,
        metavar="DIR",
        help="write a run record under DIR/activation_error/",
    )
    args = parser.parse_args()
    rows = {}
    print(f"CPU: {CpuFeatures.detect().describe()}")
    kernels = load_quant_kernels()
    here = {"bf16": bool(kernels.bf16_engine), "q8_k": kernels.q8_k}  # modes this CPU may lack
    modes = ["fp32"] + [mode for mode in args.modes if mode != "fp32" and here.get(mode, True)]
    reference = MODES["fp32"]
    answers, scores, texts = {}, {}, None
    for mode in modes:
        answers[mode], scores[mode], texts = run_mode(MODES[mode], texts)
    shares = {}
    for threshold in args.mixed:
        for per_column in (False, True):
            mode = f"mixed {'columns' if per_column else 'rows'} T={threshold:g}"
            rounding = MixedRounding(threshold, per_column)
            answers[mode], scores[mode], _ = run_mode(reference, texts, rounding)
            shares[mode] = rounding.int16_blocks / rounding.blocks
            modes.append(mode)
    for mode in modes[1:]:
        same = sum(a == b for a, b in zip(answers[mode], answers["fp32"]))
        first = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            for a, b in zip(answers[mode], answers["fp32"])
        ]
        diffs = [
            abs(x - y) for got, ref in zip(scores[mode], scores["fp32"]) for x, y in zip(got, ref)
        ]
        differing = [f for f in first if f is not None] or "-"
        share = f"; {shares[mode]:.1%} of blocks rounded to int16" if mode in shares else ""
        print(
            f"{mode}: {same}/{len(QUESTIONS)} greedy answers equal fp32's "
            f"(first difference at token {differing}); "
            f"per-token logprob |diff| mean {sum(diffs) / len(diffs):.2e}, "
            f"max {max(diffs):.2e} over {len(diffs)} tokens{share}"
        )
        rows[mode] = {
            "greedy answers equal fp32's": f"{same} / {len(QUESTIONS)}",
            "logprob diff, mean": f"{sum(diffs) / len(diffs):.2e}",
            "logprob diff, max": f"{max(diffs):.2e}",
        }
        if mode in shares:
            rows[mode]["blocks rounded to int16"] = round(shares[mode] * 100, 1)
    if record_dir(args.record):
        units = {"blocks rounded to int16": "%"}
        peers = ["fp32 activations (the reference)"]
        record = make_record("activation_error", this_command(), rows, units=units, peers=peers)
        write_record(record_dir(args.record), record)


if __name__ == "__main__":
    main()
