"""The proxy's Prometheus metrics, per upstream instance (L5).

Registered in a registry the app is given (no process-global state). Names follow the
server's `tokenbus:` prefix (api/openai/metrics.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from tokenbus.api.proxy.pool import Instance, InstancePool

PREFIX = "tokenbus:proxy_"
LABELS = ["kind", "url"]


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry, pools: Sequence[InstancePool]) -> None:
        self._requests = Counter(
            PREFIX + "upstream_requests",
            "Requests sent to an upstream instance (every try, retries included).",
            LABELS,
            registry=registry,
        )
        self._failures = Counter(
            PREFIX + "upstream_failures",
            "Requests to an upstream instance that "
            "failed: no connection, a dropped connection, no answer in time, a 5xx prefill.",
            LABELS,
            registry=registry,
        )
        self._fallbacks = Counter(
            PREFIX + "prefill_fallbacks",
            "Requests sent to a decode instance "
            "without a prefill leg (no prefill instance could serve them).",
            registry=registry,
        )
        healthy = Gauge(
            PREFIX + "upstream_healthy",
            "1 while an instance is in rotation.",
            LABELS,
            registry=registry,
        )
        in_flight = Gauge(
            PREFIX + "upstream_in_flight",
            "Requests through this proxy an instance is serving now.",
            LABELS,
            registry=registry,
        )
        for pool in pools:
            for instance in pool.instances:
                labels = (instance.kind.value, instance.url)
                # Read at scrape time: the pool stays the one place that holds these numbers.
                healthy.labels(*labels).set_function(lambda i=instance: float(i.is_healthy))
                in_flight.labels(*labels).set_function(lambda i=instance: float(i.num_in_flight))
                self._requests.labels(*labels)  # exported as 0 from the start
                self._failures.labels(*labels)

    def request(self, instance: Instance) -> None:
        self._requests.labels(instance.kind.value, instance.url).inc()

    def failure(self, instance: Instance) -> None:
        self._failures.labels(instance.kind.value, instance.url).inc()

    def fallback(self) -> None:
        self._fallbacks.inc()
