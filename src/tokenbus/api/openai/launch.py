"""`tokenbus serve`'s start-up up to the HTTP server: bind the port, spawn the EngineCore, and
while it starts import the server (fastapi, the routes) on the thread that loads the tokenizer,
so that import no longer precedes the engine's spawn (architecture.md, "Start-up";
benchmarks/startup_profile.py times what is imported before the spawn). Nothing here imports
fastapi or torch."""

from __future__ import annotations

import importlib
import importlib.util

from tokenbus.api.openai.server_config import ServerConfig
from tokenbus.engine.client_factory import start_engine
from tokenbus.engine.setup import create_engine_setup
from tokenbus.engine_args import EngineArgs
from tokenbus.utils.net import bind_socket

SERVER_MODULE = "tokenbus.api.openai.server"
# What the server module imports beyond the engine's own dependencies. Looked up (not imported)
# before the engine starts: imported while it starts, a missing one would only be reported once
# the engine had loaded and been shut down again.
SERVER_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")


def check_server_packages() -> None:
    """ModuleNotFoundError naming the HTTP server's packages this environment lacks."""
    missing = [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(
            f"tokenbus serve needs {' and '.join(missing)}, which this Python environment "
            f"lacks: pip install {' '.join(missing)}",
            name=missing[0],
        )


def serve(args: EngineArgs, config: ServerConfig) -> int:
    """Start the engine, serve until SIGTERM or engine death; return the exit status."""
    check_server_packages()
    sock = bind_socket(config.host, config.port)  # before the engine: fail fast on a busy port
    try:
        setup = create_engine_setup(args)
        tokenizer, client = start_engine(
            setup,
            multiprocess=not config.engine_in_process,
            asyncio_mode=True,
            ready_timeout_s=args.engine_ready_timeout_s,
            while_starting=lambda: importlib.import_module(SERVER_MODULE),
        )
    except BaseException:
        sock.close()
        raise
    try:
        # imported by now where the engine has its own process
        server = importlib.import_module(SERVER_MODULE)
    except BaseException:
        client.shutdown()
        sock.close()
        raise
    return server.run_server(args, config, sock, setup, tokenizer, client)
