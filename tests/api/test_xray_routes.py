"""/xray's routes on a bare app with a fake engine: the key, the JSON, the bounded stream."""

import asyncio
import json

from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.core.sched_utils import make_request, make_scheduler, run_step
from tokenbus.api.openai.middleware import APIKeyMiddleware
from tokenbus.api.openai.xray import _events, add_xray_routes
from tokenbus.core.xray import XrayRecorder
from tokenbus.engine.xray_hub import XrayHub


class FakeEngine:
    """Two data-parallel engines' recorders behind one hub, as AsyncLLM wires them."""

    def __init__(self):
        self.xray_hub = XrayHub()
        self.schedulers = [make_scheduler(num_blocks=20), make_scheduler(num_blocks=20)]
        self.recorders = [XrayRecorder(s) for s in self.schedulers]
        self.watches = 0

    async def xray_watch(self, seconds):
        self.watches += 1
        for index, recorder in enumerate(self.recorders):
            self.xray_hub.publish(index, recorder.watch(seconds))


def make_app(engine, api_key="sesame"):
    app = FastAPI()
    add_xray_routes(app, engine, "tiny")
    app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


def test_routes_need_the_key_as_header_or_page_query():
    client = TestClient(make_app(FakeEngine()))
    assert client.get("/xray").status_code == 401
    assert client.get("/xray/snapshot").status_code == 401
    assert client.get("/xray/snapshot?api_key=wrong").status_code == 401
    page = client.get("/xray?api_key=sesame")
    assert page.status_code == 200 and "tokenbus X-ray" in page.text
    auth = {"Authorization": "Bearer sesame"}
    assert client.get("/xray/snapshot", headers=auth).status_code == 200
    # The query key opens /xray's paths only.
    assert client.get("/v1/models?api_key=sesame").status_code == 401


def test_snapshot_json_has_one_panel_per_engine_with_named_fields():
    engine = FakeEngine()
    engine.schedulers[1].add_request(make_request("r1", 40, max_tokens=4))
    run_step(engine.schedulers[1])
    client = TestClient(make_app(engine))
    data = client.get("/xray/snapshot", headers={"Authorization": "Bearer sesame"}).json()
    assert data["model"] == "tiny"
    assert [e["engine_index"] for e in data["engines"]] == [0, 1]
    row = data["engines"][1]["requests"][0]
    assert (row["request_id"], row["status"], row["block_ids"]) == ("r1", "running", [1, 2, 3])
    assert data["engines"][0]["requests"] == [] and data["engines"][0]["num_blocks"] == 20


class FakeRequest:
    def __init__(self, reads):
        self.reads = reads

    async def is_disconnected(self):
        self.reads -= 1
        return self.reads < 0


def test_stream_sends_the_newest_snapshot_and_a_slow_reader_skips_the_rest():
    engine = FakeEngine()

    async def scenario():
        events = _events(FakeRequest(reads=3), engine, "tiny")
        first = json.loads((await anext(events))[6:])
        assert first["engines"][0]["step_index"] == 0
        # While the reader is busy, the engines publish many snapshots; the hub keeps one each.
        for step in range(1, 501):
            engine.recorders[0].num_steps = step
            engine.xray_hub.publish(0, engine.recorders[0].snapshot())
        assert len(engine.xray_hub.latest()) == 2
        second = json.loads((await anext(events))[6:])
        assert second["engines"][0]["step_index"] == 500
        await events.aclose()

    asyncio.run(scenario())
    assert engine.watches == 1  # renewed once per WATCH_SECONDS / 2, not per event


def test_top_renders_the_pool_steps_and_requests():
    from tokenbus.cli.top_cmd import render

    engine = FakeEngine()
    engine.schedulers[0].add_request(make_request("r1", 40, max_tokens=4))
    run_step(engine.schedulers[0])
    client = TestClient(make_app(engine))
    data = client.get("/xray/snapshot?api_key=sesame").json()
    text = render(data, width=40)
    lines = text.splitlines()
    assert lines[0].startswith("tokenbus top · tiny")
    assert " ###................" in lines  # null block, r1's three blocks, 16 free
    row = next(line for line in lines if line.startswith("r1"))
    assert row.split()[:6] == ["r1", "running", "40", "1", "40", "0"] and row.endswith("1 2 3")


def test_a_query_key_beyond_latin1_is_a_401_not_a_crash():
    client = TestClient(make_app(FakeEngine()), raise_server_exceptions=False)
    assert client.get("/xray?api_key=%E2%82%AC").status_code == 401
