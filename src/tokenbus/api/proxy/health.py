"""The background health probe: GET URL/health of every instance, every few seconds (L5).

Healthy instances are probed too, not only the ones marked down: a server whose engine died
or stalled still accepts connections but answers 503 on /health, and it must leave the
rotation before requests are sent into it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import httpx

from tokenbus.api.proxy.pool import Instance, InstancePool

logger = logging.getLogger("tokenbus.proxy")


async def probe_once(
    client: httpx.AsyncClient, pool: InstancePool, instance: Instance, timeout_s: float
) -> None:
    try:
        response = await client.get(f"{instance.url}/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        pool.mark_down(instance, f"GET /health: {type(exc).__name__}: {exc}")
        return
    if response.status_code == 200:
        pool.mark_up(instance)
    else:
        pool.mark_down(instance, f"GET /health answered {response.status_code}")


async def probe_forever(
    client: httpx.AsyncClient, pools: Sequence[InstancePool], interval_s: float, timeout_s: float
) -> None:
    """Probe all instances at once, then sleep `interval_s`; until cancelled."""
    while True:
        probes = [probe_once(client, pool, i, timeout_s) for pool in pools for i in pool.instances]
        results = await asyncio.gather(*probes, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):  # a bug in a probe must not stop the others
                logger.error("health probe failed", exc_info=result)
        await asyncio.sleep(interval_s)
