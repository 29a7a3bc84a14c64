"""Background asyncio tasks of a server's lifespan (L0)."""

from __future__ import annotations

import asyncio


async def cancel_all(tasks: list[asyncio.Task]) -> None:
    """Cancel every task, wait until each has ended (their errors swallowed), empty the list."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    tasks.clear()
