"""`tokenbus serve` (L7)."""

from __future__ import annotations

import argparse
import os

from tokenbus.cli.args import add_engine_args, engine_args_from


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0: any free port (logged at start)")
    serve.add_argument("--api-key", default=os.environ.get("TOKENBUS_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on every route but /health, "
                            "/metrics, /version, /ping (default: $TOKENBUS_API_KEY)")
    serve.add_argument("--served-model-name", default=None, help="default: the model argument")
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="sequences that may wait beyond --max-num-seqs; more get 503 + "
                            "Retry-After (default: unbounded)")
    serve.add_argument("--max-n", type=int, default=16, help="cap on n per request")
    serve.add_argument("--max-request-body-bytes", type=int, default=10 * 1024 * 1024,
                       help="larger bodies get 413")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests may finish after SIGTERM before they are aborted")
    serve.add_argument("--log-interval", type=float, default=10.0,
                       help="seconds between stats log lines; 0 turns them off")
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
