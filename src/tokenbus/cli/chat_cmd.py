"""`tokenbus chat`: an interactive conversation, streamed token by token (L7)."""

from __future__ import annotations

import sys

from tokenbus.engine.llm_engine import LLMEngine
from tokenbus.engine.output_processor import OutputKind
from tokenbus.engine_args import EngineArgs
from tokenbus.sampling_params import SamplingParams


def run_chat(args: EngineArgs, params: SamplingParams, system: str | None) -> int:
    engine = LLMEngine.from_engine_args(args)
    messages = [{"role": "system", "content": system}] if system else []
    turn = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        _, token_ids = engine.input_processor.render_chat(messages)
        engine.add_request(f"chat-{turn}", token_ids, params.clone(n=1), kind=OutputKind.DELTA)
        reply = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                text = output.outputs[0].text
                reply.append(text)
                sys.stdout.write(text)
                sys.stdout.flush()
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
        turn += 1
