"""How far the reduced-precision paths move the default model from fp32 (weight-only tiles, fp32
K/V), on real chat text: int16, int8 and (on AMX) bf16 activations (--quant-activations), an fp16
KV cache (--kv-cache-dtype), and the defaults (auto: int16 below 16 rows, bf16 from 16 rows on
AMX, fp16 K/V). A few questions, each answered greedily (48 tokens) under each mode, and the fp32
run's prompt + answer scored under each mode (prompt logprobs, prefilled in 64-token chunks so
every matmul runs on the tiles with that mode's activations).

    .venv/bin/python benchmarks/activation_error.py

Prints, per mode: how many answers equal fp32's and where the first one differs, and the
absolute difference of the per-token logprobs from fp32's (mean and max).
"""

from __future__ import annotations

from tokenbus import LLM, SamplingParams
from tokenbus.model.native import load_quant_kernels
from tokenbus.utils.cpu import CpuFeatures

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain what a hash table is in two sentences.", "List three prime numbers and say why they are prime.",
             "How do I reverse a list in Python?", "Why is the sky blue?"]
# label -> engine arguments; fp32 (the reference) first.
MODES = {"fp32": dict(quant_activations="fp32", kv_cache_dtype="float32"),
         "int16": dict(quant_activations="int16", kv_cache_dtype="float32"),
         "int8": dict(quant_activations="int8", kv_cache_dtype="float32"),
         "bf16": dict(quant_activations="bf16", kv_cache_dtype="float32"),  # AMX only
         "fp16 KV": dict(quant_activations="fp32", kv_cache_dtype="float16"),
         "defaults": dict()}


def main() -> None:
    print(f"CPU: {CpuFeatures.detect().describe()}")
    answers, scores = {}, {}
    texts = None
    modes = [mode for mode in MODES if mode != "bf16" or load_quant_kernels().bf16_engine]
    for mode in modes:
        llm = LLM(multiprocess=False, enable_prefix_caching=False, max_num_batched_tokens=64, max_model_len=1024,
                  **MODES[mode])
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                                  add_generation_prompt=True), add_special_tokens=False)
                   for q in QUESTIONS]
        greedy = SamplingParams(temperature=0.0, max_tokens=48, min_tokens=48)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        answers[mode] = [o.outputs[0].token_ids for o in outputs]
        if texts is None:  # fp32 runs first: its prompt + answer is the text every mode scores
            texts = [p + a for p, a in zip(prompts, answers[mode])]
        scored = llm.generate([{"prompt_token_ids": t} for t in texts],
                              SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        scores[mode] = [[entry[t].logprob for entry, t in zip(o.prompt_logprobs[1:], text[1:])]
                        for o, text in zip(scored, texts)]
        llm.shutdown()
    for mode in modes[1:]:
        same = sum(a == b for a, b in zip(answers[mode], answers["fp32"]))
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                 for a, b in zip(answers[mode], answers["fp32"])]
        diffs = [abs(x - y) for got, ref in zip(scores[mode], scores["fp32"]) for x, y in zip(got, ref)]
        differing = [f for f in first if f is not None] or "-"
        print(f"{mode}: {same}/{len(QUESTIONS)} greedy answers equal fp32's (first difference at token "
              f"{differing}); per-token logprob |diff| mean {sum(diffs) / len(diffs):.2e}, "
              f"max {max(diffs):.2e} over {len(diffs)} tokens")


if __name__ == "__main__":
    main()
