"""How often bf16 changes greedy output vs fp32 on SmolLM2 (the CPU default-dtype question).

16 chat questions, greedy, 64 tokens each, run once per dtype with everything else equal;
prints how many completions are identical and where the others first differ.
Usage: python benchmarks/dtype_agreement.py [--max-tokens 64]
"""

import argparse

from tokenbus import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis briefly.",
    "List three prime numbers.",
    "How do I sort a list in Python?",
    "What causes rain?",
    "Give me a recipe for pancakes.",
    "Who wrote Hamlet?",
    "Describe a cat in two sentences.",
    "What is 17 times 23?",
    "Translate 'good morning' to Spanish.",
    "Why is the sky blue?",
    "Name a famous painter.",
    "What is machine learning?",
    "Tell me a short joke.",
    "What is gravity?",
]


def first_difference(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    outputs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, multiprocess=False)
        outputs[dtype] = [
            r.outputs[0].token_ids for r in llm.chat(conversations, params, use_tqdm=False)
        ]
        llm.shutdown()
    pairs = list(zip(outputs["float32"], outputs["bfloat16"]))
    identical = sum(a == b for a, b in pairs)
    print(f"identical completions: {identical} of {len(pairs)}")
    print(
        "first differing token of the others:", [first_difference(a, b) for a, b in pairs if a != b]
    )


if __name__ == "__main__":
    main()
