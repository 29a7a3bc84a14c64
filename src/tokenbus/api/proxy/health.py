"""The background health probe: GET URL/health of every instance, every few seconds (L5).

Healthy instances are probed too, not only the ones marked down: a server whose engine died
or stalled still accepts connections but answers 503 on /health, and it must leave the
rotation before requests are sent into it. A server that accepts connections but answers
nothing (its whole process stopped) fails the probe by the probe's short timeout.

An instance marked down because a leg timed out there (Instance.engine_check) needs more than
/health to come back: its API process answers /health 200 while its engine is stopped or hung
(the server calls that a stall only after its --engine-stall-timeout, 60 s by default, and
only while it holds work). So once /health answers 200, such an instance is sent a one-token
completion, which only its engine can answer, and it is back when that is answered. Healthy
instances are never sent one: on a busy instance it would wait in the queue and time out,
taking a slow instance for a dead one; a real leg's timeout is what finds a stopped engine.

Each instance has its own loop, so a probe that waits out its timeout delays no other's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import httpx

from tokenbus.api.proxy.pool import EngineCheck, Instance, InstancePool

logger = logging.getLogger("tokenbus.proxy")

ENGINE_PROBE_PROMPT = "Hello"


async def probe_once(
    client: httpx.AsyncClient,
    pool: InstancePool,
    instance: Instance,
    timeout_s: float,
    engine_timeout_s: float,
) -> None:
    try:
        response = await client.get(f"{instance.url}/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        pool.mark_down(instance, f"GET /health: {type(exc).__name__}: {exc}")
        return
    if response.status_code != 200:
        pool.mark_down(instance, f"GET /health answered {response.status_code}")
        return
    check = instance.engine_check  # read after the await: a leg may have timed out meanwhile
    if check is None:
        pool.mark_up(instance)
        return
    why = await check_engine(client, instance, check, engine_timeout_s)
    # A leg that timed out during the check left a newer one: this answer may predate it.
    if why is not None and instance.engine_check is check:
        pool.mark_up(instance, why)


async def check_engine(
    client: httpx.AsyncClient, instance: Instance, check: EngineCheck, timeout_s: float
) -> str | None:
    """Why the instance may come back (its engine answered); None while it stays down."""
    headers = {"accept-encoding": "identity"}
    if check.authorization is not None:
        headers["authorization"] = check.authorization
    body = {"model": check.model, "prompt": ENGINE_PROBE_PROMPT, "max_tokens": 1, "stream": False}
    try:
        response = await client.post(
            f"{instance.url}/v1/completions", json=body, headers=headers, timeout=timeout_s
        )
    except httpx.HTTPError as exc:
        instance.down_reason = f"a one-token completion got no answer: {type(exc).__name__}"
        return None
    if response.status_code == 200:
        return "its engine answered a one-token completion"
    if response.status_code < 500 and response.status_code not in (408, 429):
        # Refused before its engine saw it (a model renamed, a key revoked): the engine cannot
        # be checked this way, and an instance must not stay out for good on that. /health is
        # all there is to go on; a leg that times out again takes it out again. (408 and 429
        # are a server too busy to answer: it stays down.)
        return (
            f"GET /health answered 200; a one-token completion to check its engine was "
            f"refused with {response.status_code}"
        )
    instance.down_reason = f"a one-token completion answered {response.status_code}"
    return None


async def probe_forever(
    client: httpx.AsyncClient,
    pools: Sequence[InstancePool],
    interval_s: float,
    timeout_s: float,
    engine_timeout_s: float,
) -> None:
    """Probe each instance, then sleep `interval_s`, each on its own; until cancelled."""
    await asyncio.gather(
        *(
            _probe_instance_forever(client, pool, instance, interval_s, timeout_s, engine_timeout_s)
            for pool in pools
            for instance in pool.instances
        )
    )


async def _probe_instance_forever(
    client: httpx.AsyncClient,
    pool: InstancePool,
    instance: Instance,
    interval_s: float,
    timeout_s: float,
    engine_timeout_s: float,
) -> None:
    while True:
        try:
            await probe_once(client, pool, instance, timeout_s, engine_timeout_s)
        except Exception:  # a bug in a probe must not end this instance's probes
            logger.exception("health probe of %s failed", instance.url)
        await asyncio.sleep(interval_s)
