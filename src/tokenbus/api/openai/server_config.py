"""The HTTP server's settings (`tokenbus serve`'s flags beyond the engine's), apart from the
server itself so that start-up can build them before importing it (launch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenbus.api.openai.limits import RequestLimits


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the "Serving on" log line names it)
    api_key: str | None = None
    served_model_name: str | None = None  # default: the model argument
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_request_body_bytes: int = 10 * 1024 * 1024
    request_timeout: float | None = (
        None  # seconds from arrival to a request's last byte; None: none
    )
    engine_stall_timeout: float = 60.0  # seconds of pending work without a step → 503; 0: off
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens, as vLLM
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers (browsers refuse)
    enable_auto_tool_choice: bool = False  # tool_choice "auto", parsed by tool_call_parser
    tool_call_parser: str | None = None
    shutdown_timeout: float = 30.0  # seconds in-flight requests may drain after SIGTERM
    log_interval: float = 10.0  # seconds between stats log lines; 0 disables them
    engine_in_process: bool = False
    enable_xray: bool = True  # the /xray page of the scheduler and KV cache (api/openai/xray.py)
    dead_exit_delay: float = 2.0  # seconds /health answers 503 before a dead-engine exit
