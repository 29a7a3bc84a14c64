"""L2 models: nn.Modules of decoder families (model/registry.py), their kernels and paged
attention."""

from tokenbus.model.forward_context import ForwardContext
from tokenbus.model.llama import LlamaForCausalLM
from tokenbus.model.registry import get_model_class, supported_architectures

__all__ = ["ForwardContext", "LlamaForCausalLM", "get_model_class", "supported_architectures"]
