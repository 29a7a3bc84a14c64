"""ProxyConfig: what `tokenbus proxy` routes to and how patiently (L5)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import urlsplit


def normalize_url(url: str) -> str:
    """`url` without a trailing slash; a ValueError unless it is an absolute http(s) URL with
    a host and no query (paths like /v1/completions are appended to it)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r} must not carry a query or fragment")
    try:
        parts.port  # noqa: B018 - urlsplit checks the port only when asked
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}") from None
    return url.rstrip("/")


@dataclass(frozen=True)
class ProxyConfig:
    # Base URLs of the upstream `tokenbus serve` instances, e.g. http://10.0.0.5:8100.
    prefill_urls: tuple[str, ...]  # --prefill: compute prompts, hand their KV on
    decode_urls: tuple[str, ...]  # --decode: generate, reading the prefilled KV
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the "Proxying on" log line names it)
    # Seconds from a request's arrival to its last byte, both legs together; past it the
    # upstream request is closed (the instance aborts it) and the client gets 408 (or an error
    # event, once a stream has started). None: no limit.
    request_timeout: float | None = None
    connect_timeout: float = 3.0  # seconds to open a connection before the instance counts as dead
    # Seconds a prefill leg may take, from sending it to its whole answer (the prefiller's
    # queue included). Past it the leg is closed (the prefiller aborts it), the prefiller is
    # marked down until its engine answers a probe (see health.py), and the leg moves to another
    # prefiller or, with none left, the decoder computes the prompt itself: the client still
    # gets the same answer, later. So a prefill cut short is never wrong, only work wasted
    # (and the prefiller out until the probe finds its engine answering), while a hung
    # prefiller holds each request sent to it before its first timeout this long. 10 s: the
    # default model (SmolLM2-135M) on one busy CPU core prefills 2k tokens in ~2 s, 4k in ~7 s,
    # its whole 8k context in ~18 s. Raise it for prompts that long on few cores, for larger
    # models on CPUs, or for prefillers that queue many prompts at once.
    prefill_timeout: float = 10.0
    # Seconds a decode leg may go without a byte. Generous on purpose: a decode stream sends
    # nothing while its request waits in the decoder's queue, and a non-stream answer sends
    # nothing until its last token, so silence there is no sign of a hang. New requests keep
    # away from a stopped decoder anyway: the health probe takes a stopped process out at
    # once, and one whose engine stopped once its own /health says so (the server's
    # --engine-stall-timeout). 600 s: the server's own default --request-timeout, past which
    # it ends the request itself. None: no limit.
    decode_timeout: float | None = 600.0
    health_interval: float = 2.0  # seconds between GET /health probes of every instance
    # Seconds GET /health may take before the instance counts as dead: short, so that a server
    # that accepts connections but answers nothing (its process stopped) leaves soon.
    health_timeout: float = 2.0
    shutdown_timeout: float = 30.0  # seconds open streams may finish after SIGTERM
    max_request_body_bytes: int = 10 * 1024 * 1024  # larger bodies get 413, as from the server

    def __post_init__(self) -> None:
        if not self.decode_urls:
            raise ValueError("decode_urls (--decode): at least one decode instance is needed")
        for field, flag in (("prefill_urls", "--prefill"), ("decode_urls", "--decode")):
            try:
                urls = tuple(normalize_url(url) for url in getattr(self, field))
            except ValueError as exc:
                raise ValueError(f"{field} ({flag}): {exc}") from None
            if len(set(urls)) != len(urls):
                raise ValueError(f"{field} ({flag}): a URL is listed twice: {list(urls)}")
            object.__setattr__(self, field, urls)  # normalized once, here
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is not in [0, 65535]")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout: must be > 0 seconds, got {self.request_timeout}")
        if self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes: must be >= 1, got {self.max_request_body_bytes}"
            )
        for name in (
            "connect_timeout",
            "prefill_timeout",
            "decode_timeout",
            "health_interval",
            "health_timeout",
            "shutdown_timeout",
        ):
            value = getattr(self, name)
            # inf is refused too: socket timeouts and sleeps take finite seconds (None: no limit).
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{name}: must be a finite number > 0 seconds, got {value}")
