"""Sockets the HTTP servers listen on (L0)."""

from __future__ import annotations

import socket


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn (the API server and the proxy)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only then, and
    # without it Nagle's algorithm holds each small SSE chunk back for the peer's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock
