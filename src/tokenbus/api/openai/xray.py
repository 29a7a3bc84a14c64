"""/xray: a live page of the scheduler and KV cache, its event stream and a JSON snapshot (L5).

    GET /xray           the page (static HTML + JS shipped in the package; nothing from a CDN)
    GET /xray/stream    server-sent events, one `data:` line of JSON per new snapshot
    GET /xray/snapshot  the newest snapshot of each engine, once (tokenbus top, tests)

Snapshots are built in each EngineCore while a viewer watches (core/xray.py) and ride on its
step outputs; the server keeps only the newest per engine (engine/xray_hub.py). A viewer keeps
the engines watching by renewing its interest every few seconds; when it leaves they stop.
"""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Any, Protocol

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from tokenbus.engine.xray_hub import XrayHub
from tokenbus.protocol import XraySnapshot

WATCH_SECONDS = 5.0  # how long one renewal keeps the engines snapshotting
KEEPALIVE_SECONDS = 10.0
FRESH_SNAPSHOT_WAIT_S = 0.5  # a new viewer's wait for a snapshot newer than the hub's


class XraySource(Protocol):
    xray_hub: XrayHub

    async def xray_watch(self, seconds: float) -> None: ...


def snapshot_dict(snapshot: XraySnapshot) -> dict[str, Any]:
    """Field names for every struct (requests and steps are arrays on the wire)."""
    data = msgspec.structs.asdict(snapshot)
    data["requests"] = [msgspec.structs.asdict(r) for r in snapshot.requests]
    data["steps"] = [msgspec.structs.asdict(s) for s in snapshot.steps]
    return data  # bytes fields become base64 strings in JSON


def encode_snapshots(snapshots: list[XraySnapshot], model: str) -> bytes:
    return msgspec.json.encode({"model": model, "engines": [snapshot_dict(s) for s in snapshots]})


def add_xray_routes(app: FastAPI, engine: XraySource, model: str) -> None:
    page = resources.files("tokenbus.api.openai").joinpath("static/xray.html").read_text()

    @app.get("/xray", include_in_schema=False)
    async def xray_page() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/xray/snapshot", include_in_schema=False)
    async def xray_snapshot() -> Response:
        await engine.xray_watch(WATCH_SECONDS)
        return Response(
            encode_snapshots(engine.xray_hub.latest(), model), media_type="application/json"
        )

    @app.get("/xray/stream", include_in_schema=False)
    async def xray_stream(request: Request) -> StreamingResponse:
        return StreamingResponse(
            _events(request, engine, model),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )


async def _events(request: Request, engine: XraySource, model: str):
    """One event per new hub version. The generator runs only as fast as the client reads
    (ASGI back-pressure), and always sends the newest snapshots: a slow reader skips some."""
    loop = asyncio.get_running_loop()
    hub = engine.xray_hub
    # The hub holds what the engines sent while last watched, maybe long ago: a new viewer
    # waits briefly for a snapshot taken under this watch, and is sent the old one only when
    # none comes (an idle engine takes no step to snapshot).
    await engine.xray_watch(WATCH_SECONDS)
    await hub.wait_newer(hub.version, timeout=FRESH_SNAPSHOT_WAIT_S)
    version, renew_at, quiet_since = -1, loop.time() + WATCH_SECONDS / 2, loop.time()
    while not await request.is_disconnected():
        now = loop.time()
        if now >= renew_at:
            await engine.xray_watch(WATCH_SECONDS)
            renew_at = now + WATCH_SECONDS / 2
        newer = await hub.wait_newer(version, timeout=1.0)
        if newer != version:
            version, quiet_since = newer, loop.time()
            yield b"data: " + encode_snapshots(hub.latest(), model) + b"\n\n"
        elif loop.time() - quiet_since > KEEPALIVE_SECONDS:
            quiet_since = loop.time()
            yield b": keepalive\n\n"
