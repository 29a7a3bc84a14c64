"""ProxyConfig: what `tokenbus proxy` routes to and how patiently (L5)."""

from __future__ import annotations

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
    health_interval: float = 2.0  # seconds between GET /health probes of every instance
    health_timeout: float = 2.0  # seconds a probe may take before the instance counts as dead
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
        for name in ("connect_timeout", "health_interval", "health_timeout", "shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {getattr(self, name)}")
