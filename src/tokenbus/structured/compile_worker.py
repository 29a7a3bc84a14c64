"""The grammar-check process: compiles one spec at a time for the front door (L2).

Runs in a child process (compile_pool.py starts it) so that a compile past its deadline can be
killed: xgrammar has no cancel, and a thread that runs one cannot be stopped. The protocol on
the pipe is bytes only, msgspec JSON both ways:

    parent → child   the tokenizer info (xgrammar's own JSON), once, first
    parent → child   a StructuredOutputsParams          ┐ repeated; the child answers each
    child → parent   a CheckReply                       ┘ before it reads the next

This module is the forkserver's preload: it imports xgrammar (and so torch) once, and every
worker forked from the server starts with it imported (milliseconds instead of seconds).
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import msgspec
import xgrammar as xgr

from tokenbus.sampling_params import StructuredOutputsParams
from tokenbus.structured.backend import XgrammarBackend
from tokenbus.structured.compile_pool import CheckReply


def serve(conn: Connection) -> None:
    """The child's main loop, until the parent closes the pipe (or kills the process)."""
    info = xgr.TokenizerInfo.deserialize_json(conn.recv_bytes().decode())
    # One thread: the pool runs one process per slot, so slots bound the cores checks take.
    # No cache: the parent remembers every outcome by spec.
    backend = XgrammarBackend(info, max_threads=1, cache=False)
    decoder = msgspec.json.Decoder(StructuredOutputsParams)
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            return
        try:
            backend.check(decoder.decode(message))
            reply = CheckReply()
        except ValueError as exc:
            reply = CheckReply(error=str(exc))
        conn.send_bytes(msgspec.json.encode(reply))
