"""`tokenbus proxy`: the disaggregated prefill/decode router (L7)."""

from __future__ import annotations

import argparse

from tokenbus.api.proxy.config import ProxyConfig, normalize_url


def add_proxy_parser(sub) -> None:
    proxy = sub.add_parser(
        "proxy",
        help="route OpenAI requests through prefill instances to decode instances",
        description="Each completion is prefilled on a --prefill instance (max_tokens=1, "
        "kv_transfer_params {do_remote_decode: true}), then generated on a --decode "
        "instance that receives the prefiller's kv_transfer_params. Instances are "
        "`tokenbus serve` servers; the least loaded healthy one of each kind is used.",
    )
    proxy.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        type=_url,
        help="base URLs of the prefill instances (http://host:port)",
    )
    proxy.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        type=_url,
        help="base URLs of the decode instances (http://host:port)",
    )
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument(
        "--port", type=int, required=True, metavar="P", help="0: any free port (logged at start)"
    )
    proxy.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a request may take, both legs, from arrival to its last byte; "
        "past it, it is aborted (408, or an error event in a stream). "
        "Default: no limit",
    )
    proxy.add_argument(
        "--prefill-timeout",
        type=float,
        default=ProxyConfig.prefill_timeout,
        metavar="S",
        help="seconds a prefill leg may take, queueing included; past it the prefiller "
        "leaves the rotation until its engine answers again, and the request is prefilled "
        "on another one or, with none left, by the decoder itself (same answer, later). "
        "Raise it for long prompts of large models on CPUs. Default: %(default)g",
    )
    proxy.add_argument(
        "--decode-timeout",
        type=float,
        default=ProxyConfig.decode_timeout,
        metavar="S",
        help="seconds a decode leg may go without a byte (its request queued, or a "
        "non-stream answer still generating); past it the decoder leaves the rotation until "
        "its engine answers again, and the request moves to another decoder (a stream "
        "already begun ends with an error event). Default: %(default)g; 0: no limit",
    )
    proxy.add_argument(
        "--health-interval",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds between GET /health probes of every instance; an instance "
        "that fails one leaves the rotation until it answers 200",
    )
    proxy.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=10 * 1024 * 1024,
        metavar="N",
        help="larger bodies get 413",
    )
    proxy.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds open streams may finish after SIGTERM",
    )
    proxy.set_defaults(func=_proxy)


def _url(value: str) -> str:
    try:
        return normalize_url(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None  # argparse names the flag


def config_from(ns: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        prefill_urls=tuple(ns.prefill),
        decode_urls=tuple(ns.decode),
        host=ns.host,
        port=ns.port,
        request_timeout=ns.request_timeout,
        prefill_timeout=ns.prefill_timeout,
        decode_timeout=ns.decode_timeout or None,  # 0: no limit, as for the server's timeouts
        health_interval=ns.health_interval,
        max_request_body_bytes=ns.max_request_body_bytes,
        shutdown_timeout=ns.shutdown_timeout,
    )


def _proxy(ns: argparse.Namespace) -> int:
    from tokenbus.api.proxy.app import run_proxy  # uvicorn and httpx only when serving

    return run_proxy(config_from(ns))  # a bad value: main prints the ValueError, status 2
