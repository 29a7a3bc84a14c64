"""tokenbus: a small, readable LLM inference and serving engine built on vLLM V1's ideas."""

from tokenbus.protocol import LoRARequest
from tokenbus.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "LoRARequest",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineArgs",
    "__version__",
]


def __getattr__(name: str):
    # Lazy: `import tokenbus` stays light (no torch) for the CLI and the core tests.
    if name == "LLM":
        from tokenbus.api.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from tokenbus.engine import outputs

        return getattr(outputs, name)
    if name == "EngineArgs":
        from tokenbus.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'tokenbus' has no attribute {name!r}")
