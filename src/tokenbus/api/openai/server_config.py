"""The HTTP server's settings (`tokenbus serve`'s flags beyond the engine's), apart from the
server itself so that start-up can build them before importing it (launch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenbus.api.openai.limits import RequestLimits
from tokenbus.protocol import LoRARequest

# A request's deadline unless --request-timeout says otherwise. Long enough for the longest
# legitimate request on a CPU: a stream among 16 on the slowest 2-core machine of
# docs/benchmarks.md (a token each 74 ms, c16 ITL p50) generates ~8,000 tokens in it, nearly
# SmolLM2's whole 8,192-token context. And the OpenAI Python client's own default timeout: a
# client that waited longer has most likely left. Without a deadline, a request admitted before
# an engine stall waits as long as the stall lasts.
DEFAULT_REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the "Serving on" log line names it)
    api_key: str | None = None
    served_model_name: str | None = None  # default: the model argument
    # LoRA adapters served as model names (--lora-modules; the engine needs --enable-lora), and
    # whether /v1/load_lora_adapter and /v1/unload_lora_adapter may change them while running.
    lora_modules: tuple[LoRARequest, ...] = ()
    enable_lora_runtime_updates: bool = False
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_request_body_bytes: int = 10 * 1024 * 1024
    # Seconds from arrival to a request's last byte; 0 or None: no limit.
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S
    engine_stall_timeout: float = 60.0  # seconds of pending work without a step → 503; 0: off
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens, as vLLM
    # CORS, as vLLM's defaults: any origin may call (a key, when set, still guards every route);
    # no origins: no CORS headers (browsers refuse cross-origin calls).
    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N" by default
    enable_auto_tool_choice: bool = False  # tool_choice "auto", parsed by tool_call_parser
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # reasoning apart from content (reasoning_parsers.py)
    shutdown_timeout: float = 30.0  # seconds in-flight requests may drain after SIGTERM
    log_interval: float = 10.0  # seconds between stats log lines; 0 disables them
    engine_in_process: bool = False
    enable_xray: bool = True  # the /xray page of the scheduler and KV cache (api/openai/xray.py)
    dead_exit_delay: float = 2.0  # seconds /health answers 503 before a dead-engine exit
