"""`tokenbus serve` (L7)."""

from __future__ import annotations

import argparse
import os

from tokenbus.cli.args import add_engine_args, engine_args_from


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("TOKENBUS_API_KEY"))
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--max-waiting-requests", type=int, default=None)
    serve.add_argument("--max-n", type=int, default=16, help="cap on n per request")
    serve.add_argument("--max-request-body-bytes", type=int, default=10 * 1024 * 1024)
    serve.add_argument("--shutdown-timeout", type=float, default=30.0)
    serve.add_argument("--log-interval", type=float, default=10.0)
    serve.add_argument("--engine-in-process", action="store_true",
                       help="run the EngineCore in the server process (debugging)")
    serve.set_defaults(func=_serve)


def _serve(ns: argparse.Namespace) -> int:
    from tokenbus.api.openai.server import ServerConfig, run_server

    config = ServerConfig(
        host=ns.host, port=ns.port, api_key=ns.api_key, served_model_name=ns.served_model_name,
        max_n=ns.max_n, max_request_body_bytes=ns.max_request_body_bytes,
        shutdown_timeout=ns.shutdown_timeout, log_interval=ns.log_interval,
        engine_in_process=ns.engine_in_process)
    args = engine_args_from(ns)
    return run_server(args, config)
