"""The packaged SmolLM2-135M-Instruct Q4_1 GGUF: metadata, tokenizer, and greedy tokens vs
transformers.

transformers' own GGUF loader is slow (it parses the file twice); it is the oracle.
"""

from __future__ import annotations

import pytest
import torch
from tests.fixtures.paged import PagedKV

from tokenbus.bench.hf_peer import load_hf_model
from tokenbus.loader import load_arch, load_generation_config, load_tokenizer, resolve_model
from tokenbus.worker.model_builder import load_model


def test_smollm2_arch_and_tokenizer():
    src = resolve_model(None)
    arch = load_arch(src)
    shape = (
        arch.architecture,
        arch.num_hidden_layers,
        arch.hidden_size,
        arch.num_attention_heads,
        arch.num_key_value_heads,
        arch.vocab_size,
        arch.max_position_embeddings,
    )
    assert shape == ("llama", 30, 576, 9, 3, 49152, 8192)
    assert arch.tie_word_embeddings and arch.rope_theta == 100000.0 and arch.eos_token_ids == (2,)
    tokenizer = load_tokenizer(src)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert load_generation_config(src) == {}


@pytest.mark.slow
def test_smollm2_gguf_greedy_matches_transformers():
    """Greedy tokens of 3 prompts batched through the paged cache equal transformers' on the same
    GGUF (fp32)."""
    src = resolve_model(None)
    ours = load_model(src, load_arch(src), torch.float32, "cpu")
    prompts = {
        "a": [
            1,
            9690,
            198,
            2683,
            359,
            253,
            5356,
            5646,
            11173,
            2,
            198,
            1,
            4093,
            198,
            1780,
            314,
            260,
            3575,
            282,
            4649,
            47,
            2,
            198,
            1,
            520,
            9531,
            198,
        ],
        "b": [22503, 253, 14920, 563, 260, 7055, 30],
        "c": [504, 3575, 282, 4649, 314],
    }
    num_new = 6
    kv = PagedKV.for_model(ours, num_blocks=32, block_size=16)
    ours_out = {req: [] for req in prompts}
    batch = list(prompts.items())
    with torch.inference_mode():
        for _ in range(num_new):  # step 1: three prefills; then three decodes per step
            input_ids, ctx = kv.step(batch)
            last_rows = torch.tensor(ctx.query_start_loc[1:]) - 1
            next_ids = ours.compute_logits(ours(input_ids, ctx)[last_rows]).argmax(-1).tolist()
            for (req, _), token in zip(batch, next_ids):
                ours_out[req].append(token)
            batch = [(req, [token]) for (req, _), token in zip(batch, next_ids)]
        hf = load_hf_model(None, "float32")
        for req, prompt in prompts.items():
            ids = torch.tensor([prompt])
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                pad_token_id=0,
            )
            assert ours_out[req] == out[0, len(prompt) :].tolist(), req
