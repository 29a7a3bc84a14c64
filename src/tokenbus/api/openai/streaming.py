"""Server-sent events, merging several engine streams, and cancelling work on disconnect (L5)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any], exclude_unset: bool = False) -> bytes:
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude_unset=exclude_unset)
    else:
        data = json.dumps(payload)
    return f"data: {data}\n\n".encode()


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always finishes its body and runs `on_close`.

    Starlette stops iterating the body when the client disconnects, which can leave our
    generator suspended at a `yield` and its engine request running until garbage collection.
    Closing the generator here runs its `finally` (which aborts the engine request) at once,
    and `on_close` releases the admission slot even if the body never started.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self._on_close()


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Yield (iterator index, item) in arrival order; cancel all that remain when closed early."""
    pending: dict[asyncio.Future, int] = {}
    try:
        if len(iterators) == 1:
            async for item in iterators[0]:
                yield 0, item
            return
        pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                yield i, item
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
    finally:
        # Cancelling a pending anext cancels the engine stream, which aborts its request.
        for future in pending:
            future.cancel()
        if pending:
            await asyncio.wait(pending)
        for iterator in iterators:  # each one's own cleanup (engine abort) runs now, not at GC
            await iterator.aclose()


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it and return None.

    A non-streaming response sends nothing until generation ends, so without this a client
    that gave up would keep its request (and KV blocks) busy in the engine until the end.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        return None
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
