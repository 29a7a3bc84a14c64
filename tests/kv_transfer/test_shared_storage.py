"""SharedStorageConnector end to end: a producer's saved blocks are a fresh consumer's prompt."""

from __future__ import annotations

import json

from tests.e2e.oracle import hf_greedy, load_hf
from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm, random_prompts


def _kv_config(path, role="kv_both") -> str:
    return json.dumps(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)},
        }
    )


def test_consumer_loads_what_producer_saved_and_matches_hf(tiny_llama_dir, tmp_path):
    prompts = random_prompts(3, 40, 70, seed=21)
    hf = load_hf(str(tiny_llama_dir))
    expected = [hf_greedy(hf, p, 8) for p in prompts]

    producer = make_llm(tiny_llama_dir, kv_transfer_config=_kv_config(tmp_path, "kv_producer"))
    assert generate_greedy(producer, prompts, 8) == expected
    assert_engine_clean(producer)
    files = list(tmp_path.rglob("*.safetensors"))
    assert len(files) >= sum(len(p) for p in prompts) // 16

    consumer = make_llm(tiny_llama_dir, kv_transfer_config=_kv_config(tmp_path, "kv_consumer"))
    from tokenbus import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    outs = consumer.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    for prompt, out in zip(prompts, outs):
        # Every full block before the last token came from the files.
        assert out.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    totals = consumer.engine.stats_totals
    assert totals["prefix_cache_hits"] == 0  # a fresh pool: the hits were external
    assert totals["external_prefix_cache_hits"] == sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert totals["kv_bytes_loaded"] > 0 and totals["kv_bytes_saved"] == 0  # a consumer only
    assert_engine_clean(consumer)
