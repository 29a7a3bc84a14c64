"""LoRA in the scheduler and the prefix cache, with fake runner outputs: at most max_loras
adapters run at once (the rest wait, keeping their place), and an adapter's blocks hash apart
from the base model's and from every other adapter's."""

from __future__ import annotations

from tests.core.sched_utils import make_request, make_scheduler, run_step, run_to_completion
from tokenbus.core.kv import make_block_hasher
from tokenbus.core.request import Request
from tokenbus.protocol import LoRARequest
from tokenbus.sampling_params import SamplingParams

BLOCK_SIZE = 16
FIRST = LoRARequest("first", "/adapters/first")
SECOND = LoRARequest("second", "/adapters/second")


def lora_request(request_id: str, lora: LoRARequest | None, lora_id: int) -> Request:
    req = make_request(request_id, 20, max_tokens=3, ignore_eos=True)
    req.lora_request, req.lora_id = lora, lora_id
    return req


def test_at_most_max_loras_adapters_run_at_once():
    sched = make_scheduler(max_loras=1)
    sched.add_request(lora_request("a1", FIRST, 1))
    sched.add_request(lora_request("b1", SECOND, 2))
    sched.add_request(lora_request("a2", FIRST, 1))
    sched.add_request(lora_request("base", None, 0))
    so, _ = run_step(sched)
    # b1 waits for the first adapter's turn; a2 and the base model's request overtake it.
    assert list(so.num_scheduled_tokens) == ["a1", "a2", "base"]
    assert [r.request_id for r in sched.waiting] == ["b1"]
    assert {new.req_id: (new.lora_id, new.lora_path) for new in so.scheduled_new_reqs} == {
        "a1": (1, "/adapters/first"),
        "a2": (1, "/adapters/first"),
        "base": (0, None),
    }
    for _ in range(2):  # a1 and a2 finish with their third token (one per step)
        so, _ = run_step(sched)
        assert "b1" not in so.num_scheduled_tokens
    so, _ = run_step(sched)
    assert list(so.num_scheduled_tokens) == ["b1"]
    assert so.scheduled_new_reqs[0].lora_id == 2
    run_to_completion(sched)
    sched.check_integrity()


def test_without_a_limit_every_adapter_runs():
    sched = make_scheduler()
    for req_id, lora, lora_id in (("a", FIRST, 1), ("b", SECOND, 2), ("c", None, 0)):
        sched.add_request(lora_request(req_id, lora, lora_id))
    so, _ = run_step(sched)
    assert list(so.num_scheduled_tokens) == ["a", "b", "c"]


def test_adapter_blocks_hash_apart_from_the_base_models():
    hasher = make_block_hasher(BLOCK_SIZE)
    prompt = list(range(100, 148))  # three full blocks

    def hashes(lora: LoRARequest | None) -> list[bytes]:
        return Request(
            "r", prompt, SamplingParams(), block_hasher=hasher, lora_request=lora
        ).block_hashes

    base, first, second = hashes(None), hashes(FIRST), hashes(SECOND)
    assert len(base) == len(first) == 3
    assert not set(base) & set(first) and not set(first) & set(second)
    assert hashes(FIRST) == first  # the same adapter: the same blocks, in any process
    # The same name from another directory is another adapter.
    assert not set(hashes(LoRARequest("first", "/elsewhere/first"))) & set(first)
