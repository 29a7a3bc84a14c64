"""P2PConnector end to end: a prefiller (its own EngineCore process, so its loop keeps serving
after generate() returns) and in-process decoders that pull its prompt KV over TCP."""

from __future__ import annotations

import json
import logging
import random
import socket
import time

import pytest
import torch
import zmq

from tests.e2e.oracle import hf_greedy, load_hf
from tests.e2e.utils import assert_engine_clean, make_llm
from tokenbus import SamplingParams
from tokenbus.config import KVTransferConfig
from tokenbus.core.request import RequestStatus
from tokenbus.kv_transfer.base import ConnectorContext, KVLayout, TransferCounters
from tokenbus.kv_transfer.p2p import RemotePrefill
from tokenbus.kv_transfer.p2p_config import P2PSettings, SendSpec, prompt_digest
from tokenbus.kv_transfer.p2p_peers import _Sender, handshake_reply
from tokenbus.kv_transfer.p2p_transport import ERROR, NOT_READY, OK, Done, Hello, Pull
from tokenbus.utils import cdiv

ABORT_TIMEOUT_S = 4.0  # the producer's: short, so unpulled sends are freed within a test
PULL_TIMEOUT_S = 1.5  # the decoders': a dead peer costs this much


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kv_config(role: str, policy: str = "recompute", **extra) -> str:
    return json.dumps(
        {
            "kv_connector": "P2PConnector",
            "kv_role": role,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": extra,
        }
    )


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in lengths]


def _prefill(producer, prompts) -> list[dict]:
    """Run the prompts on the prefiller (one token each); the params a decoder pulls with."""
    params = SamplingParams(
        temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    outs = producer.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, prompt in zip(outs, prompts):
        assert out.kv_transfer_params["remote_num_tokens"] == len(prompt)
        assert len(out.kv_transfer_params["remote_block_ids"]) == cdiv(len(prompt), 16)
    return [o.kv_transfer_params for o in outs]


def _decode(decoder, prompts, kv_params, max_tokens=8):
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, kv_transfer_params=p
        )
        for p in kv_params
    ]
    return decoder.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _wait_clean(llm, timeout_s: float) -> float:
    """Poll check_integrity until it passes (a prefiller frees its sends a step after DONE);
    returns when (time.monotonic())."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            llm.engine.client.call_utility("check_integrity")
            return time.monotonic()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _bytes_per_block(llm) -> int:
    arch = llm.engine.setup.arch  # fp32 K and V of 16 tokens in every layer
    return arch.num_hidden_layers * 2 * 16 * arch.num_key_value_heads * arch.head_dim * 4


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    model = load_hf(str(tiny_llama_dir))
    return lambda prompt, n=8: hf_greedy(model, prompt, n)


@pytest.fixture(scope="module")
def producer(tiny_llama_dir):
    llm = make_llm(
        tiny_llama_dir,
        multiprocess=True,
        kv_transfer_config=_kv_config(
            "kv_producer", kv_port=_free_port(), abort_timeout_s=ABORT_TIMEOUT_S
        ),
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def decoder(tiny_llama_dir):
    llm = make_llm(
        tiny_llama_dir, kv_transfer_config=_kv_config("kv_consumer", pull_timeout_s=PULL_TIMEOUT_S)
    )
    yield llm
    llm.shutdown()


def test_decoder_computes_only_the_last_prompt_token_and_matches_colocated(producer, decoder, hf):
    prompts = _prompts([20, 32, 47, 64, 83, 96, 100], seed=1)  # 32, 64, 96: whole blocks
    expected = [hf(p) for p in prompts]
    colocated = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    outs = producer.generate([{"prompt_token_ids": p} for p in prompts], colocated, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected

    kv_params = _prefill(producer, prompts)
    outs = _decode(decoder, prompts, kv_params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.num_cached_tokens for o in outs] == [len(p) - 1 for p in prompts]
    totals = decoder.engine.stats_totals
    assert totals["num_prompt_tokens"] == len(prompts)  # the last token of each, nothing more
    assert totals["external_prefix_cache_hits"] == sum(len(p) for p in prompts)
    assert totals["prefix_cache_hits"] == 0
    assert totals["kv_bytes_loaded"] == sum(cdiv(len(p), 16) for p in prompts) * _bytes_per_block(
        decoder
    )
    assert_engine_clean(decoder)
    _wait_clean(producer, ABORT_TIMEOUT_S / 2)  # freed by DONE, not by the timeout
    # The prefiller served the pulls in steps that ran nothing: their byte counts still came out
    # (read by the front end with its next outputs).
    producer.generate(
        [{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1), use_tqdm=False
    )
    assert producer.engine.stats_totals["kv_bytes_saved"] == totals["kv_bytes_loaded"]


def test_local_prefix_hit_pulls_only_the_rest(producer, decoder, hf):
    first = _prompts([60], seed=7)[0]
    prompt = first[:48] + _prompts([30], seed=8)[0]  # its first 3 blocks are the decoder's already
    decoder.generate([{"prompt_token_ids": first}], SamplingParams(max_tokens=4), use_tqdm=False)
    before = dict(decoder.engine.stats_totals)
    [out] = _decode(decoder, [prompt], _prefill(producer, [prompt]))
    assert out.outputs[0].token_ids == hf(prompt)
    assert out.num_cached_tokens == len(prompt) - 1
    totals = {key: value - before[key] for key, value in decoder.engine.stats_totals.items()}
    assert totals["prefix_cache_hits"] == 48
    assert totals["external_prefix_cache_hits"] == len(prompt) - 48
    assert totals["kv_bytes_loaded"] == 2 * _bytes_per_block(decoder)  # blocks 3 and 4 only
    assert_engine_clean(decoder)
    _wait_clean(producer, ABORT_TIMEOUT_S / 2)


def _dead_params(prompt: list[int], port: int) -> dict:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "gone",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_request_id": "0",
        "remote_block_ids": list(range(1, cdiv(len(prompt), 16) + 1)),
        "remote_num_tokens": len(prompt),
    }


def test_dead_prefiller_recomputes_or_fails(decoder, tiny_llama_dir, hf, caplog):
    prompts = _prompts([40, 64], seed=2)
    dead_port = _free_port()  # nobody listens there
    with caplog.at_level(logging.ERROR, logger="tokenbus.kv_transfer.p2p"):
        outs = _decode(decoder, prompts, [_dead_params(p, dead_port) for p in prompts])
    assert [o.outputs[0].token_ids for o in outs] == [hf(p) for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    # The second job waited behind the first: it fails at once instead of timing out again.
    assert "no reply" in caplog.text and "did not answer an earlier request" in caplog.text
    assert_engine_clean(decoder)

    failing = make_llm(
        tiny_llama_dir,
        kv_transfer_config=_kv_config("kv_consumer", "fail", pull_timeout_s=PULL_TIMEOUT_S),
    )
    try:
        outs = _decode(failing, prompts[:1], [_dead_params(prompts[0], dead_port)])
        assert outs[0].outputs[0].finish_reason == "error"
        assert_engine_clean(failing)
    finally:
        failing.shutdown()


def test_abort_while_waiting_for_remote_kv_frees_both_sides(producer, tiny_llama_dir):
    slow = make_llm(
        tiny_llama_dir, kv_transfer_config=_kv_config("kv_consumer", debug_delay_pull_s=60)
    )
    try:
        prompt = _prompts([50], seed=3)[0]
        [kv_params] = _prefill(producer, [prompt])
        registered = time.monotonic()
        engine, core = slow.engine, slow.engine.client.engine_core
        engine.add_request(
            "slow", prompt, SamplingParams(max_tokens=4, kv_transfer_params=kv_params)
        )
        while (
            "slow" not in core.scheduler.requests
            or core.scheduler.requests["slow"].status != RequestStatus.WAITING_FOR_REMOTE_KVS
        ):
            engine.step()
        engine.step()  # the worker has the job now; its puller sleeps in debug_delay_pull_s
        engine.abort_request(["slow"])
        assert core.has_unfinished_requests()  # its blocks wait for the worker's report
        deadline = time.monotonic() + 5
        while core.has_unfinished_requests():
            assert time.monotonic() < deadline
            engine.step()
        assert_engine_clean(slow)
        assert slow.engine.stats_totals["kv_bytes_loaded"] == 0
        # The puller told the prefiller DONE on the abort: freed before its timeout.
        assert _wait_clean(producer, ABORT_TIMEOUT_S) - registered < ABORT_TIMEOUT_S
    finally:
        slow.shutdown()


def test_handshake_names_the_mismatched_fields():
    ours = KVLayout(
        model="m",
        dtype="float32",
        quantization="none",
        block_size=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
    )
    same = handshake_reply(
        ours, "prefill-1", Hello(seq=3, engine_id="decode-1", layout=ours.describe())
    )
    assert (same.status, same.seq) == (OK, 3)
    theirs = dict(ours.describe(), block_size=32, dtype="bfloat16")
    reply = handshake_reply(ours, "prefill-1", Hello(seq=4, engine_id="decode-1", layout=theirs))
    assert (reply.status, reply.seq) == (ERROR, 4)
    assert "block_size: ours 16, theirs 32" in reply.message
    assert "dtype: ours 'float32', theirs 'bfloat16'" in reply.message
    assert "decode-1" in reply.message and "num_layers" not in reply.message


def _sender(abort_timeout_s: float):
    layout = KVLayout(
        model="m",
        dtype="float32",
        quantization="none",
        block_size=16,
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
    )
    ctx = ConnectorContext(
        KVTransferConfig("P2PConnector", "kv_producer", engine_id="prefill-1"), layout, "prefill-1"
    )
    settings = P2PSettings.from_extra({"kv_port": _free_port(), "abort_timeout_s": abort_timeout_s})

    def read_blocks(block_ids):  # block i holds the value i: [L, 2, n, block_size, Hkv, D]
        return (
            torch.tensor(block_ids, dtype=torch.float32)
            .view(1, 1, -1, 1, 1, 1)
            .expand(2, 2, -1, 16, 1, 4)
        )

    zmq_ctx = zmq.Context()
    return _Sender(ctx, settings, zmq_ctx, read_blocks), zmq_ctx


PROMPT = list(range(100, 120))


def test_sender_serves_only_registered_blocks_until_done():
    sender, zmq_ctx = _sender(abort_timeout_s=60)
    try:

        def pull(block_ids, engine_id="prefill-1"):
            return sender.handle(
                Pull(
                    seq=1,
                    engine_id=engine_id,
                    request_id="r1",
                    block_ids=block_ids,
                    prompt_digest=prompt_digest(PROMPT),
                )
            )

        assert pull([3])[0].status == NOT_READY  # its metadata has not arrived yet
        sender.register({"r1": SendSpec([3, 5], prompt_digest(PROMPT))})
        reply, data = pull([5])
        assert (reply.status, reply.dtype, reply.shape) == (OK, "float32", [2, 2, 1, 16, 1, 4])
        assert reply.nbytes == data.numel() == 2 * 2 * 16 * 4 * 4
        assert torch.equal(data.view(torch.float32), torch.full((256,), 5.0))
        assert "r1's prompt blocks" in pull([4])[0].message  # never another block
        assert "this is engine prefill-1, not other" in pull([3], engine_id="other")[0].message
        assert sender.handle(Done(seq=2, engine_id="prefill-1", request_id="r1"))[0].status == OK
        counters = TransferCounters()
        assert sender.take_finished(counters) == {"r1"}
        assert counters.bytes_saved == reply.nbytes
        assert "no longer held" in pull([3])[0].message
    finally:
        sender.close()
        zmq_ctx.term()


def test_sender_serves_a_pull_only_for_the_same_prompt_and_block_positions():
    """Pulls follow kv_transfer_params a client sent the decoder: blocks out of order, twice,
    or another prompt's would be wrong K/V in the decoder's pool (and its prefix cache)."""
    sender, zmq_ctx = _sender(abort_timeout_s=60)
    try:

        def pull(block_ids, prompt=PROMPT):
            return sender.handle(
                Pull(
                    seq=1,
                    engine_id="prefill-1",
                    request_id="r1",
                    block_ids=block_ids,
                    prompt_digest=prompt_digest(prompt),
                )
            )[0]

        sender.register({"r1": SendSpec([3, 5, 7], prompt_digest(PROMPT))})
        # after a local prefix hit
        assert pull([3, 5, 7]).status == OK and pull([5, 7]).status == OK
        for block_ids in ([7, 5, 3], [5, 5], [3, 5], [3, 3, 3, 3]):
            reply = pull(block_ids)
            assert reply.status == ERROR and "prompt blocks" in reply.message, block_ids
        reply = pull([3, 5, 7], prompt=PROMPT[:-1] + [7])
        assert reply.status == ERROR and "another prompt" in reply.message
    finally:
        sender.close()
        zmq_ctx.term()


def test_sender_frees_an_unpulled_send_after_abort_timeout(caplog):
    sender, zmq_ctx = _sender(abort_timeout_s=0.2)
    try:
        sender.register({"r1": SendSpec([1], prompt_digest(PROMPT))})
        assert sender.take_finished(TransferCounters()) == set()
        time.sleep(0.3)
        with caplog.at_level(logging.WARNING, logger="tokenbus.kv_transfer.p2p"):
            assert sender.take_finished(TransferCounters()) == {"r1"}
            assert sender.take_finished(TransferCounters()) == set()  # reported once
        assert caplog.text.count("nobody pulled request r1") == 1
    finally:
        sender.close()
        zmq_ctx.term()


def test_remote_prefill_params_are_checked():
    good = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_host": "h",
        "remote_port": 1234,
        "remote_request_id": "r",
        "remote_block_ids": [1, 2],
        "remote_num_tokens": 20,
    }
    assert RemotePrefill.parse(good).block_ids == [1, 2]
    assert RemotePrefill.parse({"do_remote_decode": True}) is None
    for key, bad in [
        ("remote_port", "1234"),
        ("remote_port", 70000),
        ("remote_block_ids", [1, -2]),
        ("remote_block_ids", [True]),
        ("remote_num_tokens", None),
        ("remote_host", 3),
    ]:
        with pytest.raises(ValueError, match=key):
            RemotePrefill.parse(dict(good, **{key: bad}))


def test_mismatched_decoder_is_refused_and_recomputes(producer, tiny_llama_dir, hf, caplog):
    other = make_llm(tiny_llama_dir, block_size=32, kv_transfer_config=_kv_config("kv_consumer"))
    try:
        prompt = _prompts([70], seed=4)[0]
        kv_params = _prefill(producer, [prompt])
        with caplog.at_level(logging.ERROR, logger="tokenbus.kv_transfer.p2p"):
            [out] = _decode(other, [prompt], kv_params)
        assert out.outputs[0].token_ids == hf(prompt)
        assert out.num_cached_tokens == 0
        assert (
            "handshake refused" in caplog.text and "block_size: ours 16, theirs 32" in caplog.text
        )
        assert_engine_clean(other)
        _wait_clean(producer, ABORT_TIMEOUT_S / 2)  # the refused decoder still said DONE
    finally:
        other.shutdown()


def test_unpulled_send_is_freed_after_abort_timeout(producer):
    _prefill(producer, _prompts([33], seed=5))
    finished = time.monotonic()
    with pytest.raises(Exception, match="blocks still held for KV transfer"):
        producer.engine.client.call_utility("check_integrity")
    assert _wait_clean(producer, ABORT_TIMEOUT_S + 5) - finished >= ABORT_TIMEOUT_S - 0.5


def test_killed_prefiller_recomputes(producer, decoder, hf):
    """Last: it kills the module's producer."""
    prompt = _prompts([55], seed=6)[0]
    kv_params = _prefill(producer, [prompt])
    producer.engine.client.proc.kill()
    producer.engine.client.proc.join(timeout=10)
    [out] = _decode(decoder, [prompt], kv_params)
    assert out.outputs[0].token_ids == hf(prompt)
    assert out.num_cached_tokens == 0
    assert_engine_clean(decoder)


def test_decoder_pulls_only_from_allowed_peer_hosts(caplog):
    settings = P2PSettings.from_extra({})
    assert settings.allows_peer("127.0.0.1") and not settings.allows_peer("10.0.0.7")
    assert P2PSettings.from_extra({"kv_peer_hosts": ["10.0.0.7"]}).allows_peer("10.0.0.7")
    assert P2PSettings.from_extra({"kv_peer_hosts": ["*"]}).allows_peer("192.168.1.1")
    with pytest.raises(ValueError, match="kv_peer_hosts"):
        P2PSettings.from_extra({"kv_peer_hosts": "10.0.0.7"})


def test_params_naming_a_host_outside_kv_peer_hosts_compute_locally(decoder, hf, caplog):
    prompt = _prompts([40], seed=9)[0]
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_host": "169.254.169.254",
        "remote_port": 80,
        "remote_request_id": "r",
        "remote_block_ids": [1, 2, 3],
        "remote_num_tokens": len(prompt),
    }
    sampling = SamplingParams(
        temperature=0.0, max_tokens=8, min_tokens=8, kv_transfer_params=params
    )
    with caplog.at_level(logging.WARNING):
        out = decoder.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf(prompt)
    assert out.num_cached_tokens == 0
    assert "not in kv_peer_hosts" in caplog.text
    decoder.engine.client.call_utility("check_integrity")


def test_data_parallel_engines_get_their_own_port_and_engine_id():
    from tokenbus.kv_transfer.factory import connector_context

    config = KVTransferConfig(
        kv_connector="P2PConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={"kv_port": 15000},
    )
    layout = KVLayout("m", "float32", "none", 16, 2, 2, 8)
    first, second = connector_context(config, layout, 0), connector_context(config, layout, 1)
    assert first.engine_id != second.engine_id
    assert P2PSettings.from_extra(first.extra, port_offset=first.data_parallel_rank).port == 15000
    assert P2PSettings.from_extra(second.extra, port_offset=second.data_parallel_rank).port == 15001
    with pytest.raises(ValueError, match="kv_port"):
        P2PSettings.from_extra({"kv_port": 65535}, port_offset=1)


def test_a_reply_larger_than_asked_for_is_never_buffered():
    import threading

    from tokenbus.kv_transfer.p2p_transport import BlockServer, PeerClient, Reply, TransportError

    port = _free_port()
    zmq_ctx = zmq.Context()
    data = torch.zeros(4096, dtype=torch.uint8)

    def handler(message):
        return Reply(seq=message.seq, status=OK, dtype="uint8", shape=[4096], nbytes=4096), data

    server = BlockServer(zmq_ctx, "127.0.0.1", port, handler)
    client = PeerClient(zmq_ctx, "127.0.0.1", port, threading.Event())
    try:
        pull = Pull(seq=0, engine_id="e", request_id="r", block_ids=[1], prompt_digest="d")
        reply, got = client.call(pull, time.monotonic() + 2, max_reply_bytes=4096)
        assert reply.status == OK and got.numel() == 4096
        with pytest.raises(TransportError, match="no reply"):
            client.call(pull, time.monotonic() + 0.5, max_reply_bytes=1024)
    finally:
        client.reset()
        server.close()
        zmq_ctx.term()
