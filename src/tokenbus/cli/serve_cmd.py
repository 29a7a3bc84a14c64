"""`tokenbus serve` (L7)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from tokenbus.api.openai.reasoning_parsers import PARSERS as REASONING_PARSERS
from tokenbus.api.openai.server_config import DEFAULT_REQUEST_TIMEOUT_S
from tokenbus.api.openai.tool_parsers import PARSERS
from tokenbus.cli.args import add_engine_args, engine_args_from


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0: any free port (logged at start)")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("TOKENBUS_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health, "
        "/metrics, /version, /ping, /load (default: $TOKENBUS_API_KEY)",
    )
    serve.add_argument("--served-model-name", default=None, help="default: the model argument")
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        default=(),
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served as model names, with --enable-lora: "
        'name=path, or JSON {"name": ..., "path": ...}',
    )
    serve.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the adapters while "
        "serving (default: $VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )
    serve.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="sequences that may wait beyond --max-num-seqs; more get 503 + "
        "Retry-After (default: as many as --max-num-seqs; -1: unbounded)",
    )
    serve.add_argument(
        "--max-request-body-bytes", type=int, default=10 * 1024 * 1024, help="larger bodies get 413"
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="seconds a request may take from arrival to its last byte; past it, "
        "it is aborted (408, or an error event in a stream). Default: %(default)g "
        "(the longest request a CPU serves, and the OpenAI client's own timeout); 0: no limit",
    )
    serve.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=60.0,
        help="seconds the engine may have work without completing a step before "
        "/health answers 503 (its stacks are logged); 0: never",
    )
    serve.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens in responses (as vLLM)",
    )
    _add_cors_args(serve)
    serve.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprob tokens as "token_id:N" unless a request sets return_tokens_as_token_ids',
    )
    serve.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="accepted for vLLM's command lines: GET /load always reports the requests in flight",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": the model decides, its text parsed by --tool-call-parser',
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(PARSERS),
        help="how tool calls look in the model's text (hermes: also what models "
        "whose chat template has no tools are shown)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="a reasoning model's thinking returned as reasoning_content, apart from content "
        "(qwen3: Qwen3; deepseek_r1: DeepSeek R1, its distills, QwQ)",
    )
    _add_limit_args(serve)
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may finish after SIGTERM before they are aborted",
    )
    serve.add_argument(
        "--log-interval",
        type=float,
        default=10.0,
        help="seconds between stats log lines; 0 turns them off",
    )
    serve.add_argument(
        "--disable-xray",
        action="store_true",
        help="no /xray page (a live view of the scheduler and KV cache, behind --api-key)",
    )
    serve.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the EngineCore in the server process (debugging)",
    )
    serve.set_defaults(func=_serve)


def _add_cors_args(serve: argparse.ArgumentParser) -> None:
    """CORS, with vLLM's flags and defaults: every origin, method and header, no credentials."""
    serve.add_argument(
        "--allowed-origins",
        default=None,
        help="CORS: origins browsers may call from, as JSON ('[\"*\"]') or comma-separated; "
        "default: all (as vLLM); '[]' or '': none (no CORS headers)",
    )
    serve.add_argument(
        "--allow-credentials", action="store_true", help="CORS: allow cookies and credentials"
    )
    serve.add_argument(
        "--allowed-methods", default=None, help="CORS: methods, like --allowed-origins (all)"
    )
    serve.add_argument(
        "--allowed-headers", default=None, help="CORS: headers, like --allowed-origins (all)"
    )


def _add_limit_args(serve: argparse.ArgumentParser) -> None:
    """A flag per RequestLimits field (api/openai/limits.py): the caps on one request's work."""
    from tokenbus.api.openai.limits import RequestLimits

    group = serve.add_argument_group("request limits (over one: a 400 naming the flag)")
    for f in dataclasses.fields(RequestLimits):
        default = "" if f.default is None else f" (default: {f.default})"
        group.add_argument(
            RequestLimits.flag(f.name),
            type=int,
            default=f.default,
            help=f"the most {f.metadata['help']}{default}",
        )


def _cors_list(value: str | None, name: str) -> tuple[str, ...]:
    """A CORS list flag: JSON or comma-separated; left out: all ("*"); empty: none."""
    if value is None:
        return ("*",)
    if value.lstrip().startswith("["):
        items = json.loads(value)
        if not isinstance(items, list) or not all(isinstance(o, str) for o in items):
            raise ValueError(f"{name}: expected a JSON list of strings")
        return tuple(items)
    return tuple(o.strip() for o in value.split(",") if o.strip())


def _serve(ns: argparse.Namespace) -> int:
    from tokenbus.api.openai import launch
    from tokenbus.api.openai.limits import RequestLimits
    from tokenbus.api.openai.server_config import ServerConfig
    from tokenbus.api.openai.serving_lora import parse_lora_module

    limits = RequestLimits(
        **{f.name: getattr(ns, f.name) for f in dataclasses.fields(RequestLimits)}
    )
    config = ServerConfig(
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key,
        served_model_name=ns.served_model_name,
        lora_modules=tuple(parse_lora_module(text) for text in ns.lora_modules),
        enable_lora_runtime_updates=ns.enable_lora_runtime_updates,
        limits=limits,
        max_request_body_bytes=ns.max_request_body_bytes,
        request_timeout=ns.request_timeout,
        engine_stall_timeout=ns.engine_stall_timeout,
        enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
        allowed_origins=_cors_list(ns.allowed_origins, "allowed_origins"),
        allow_credentials=ns.allow_credentials,
        allowed_methods=_cors_list(ns.allowed_methods, "allowed_methods"),
        allowed_headers=_cors_list(ns.allowed_headers, "allowed_headers"),
        return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_call_parser=ns.tool_call_parser,
        reasoning_parser=ns.reasoning_parser,
        shutdown_timeout=ns.shutdown_timeout,
        log_interval=ns.log_interval,
        engine_in_process=ns.engine_in_process,
        enable_xray=not ns.disable_xray,
    )
    args = engine_args_from(ns)
    return launch.serve(args, config)
