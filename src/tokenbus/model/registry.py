"""Architecture name -> model class. Names are our short names and HF's `architectures` entries."""

from __future__ import annotations

from torch import nn

from tokenbus.model.apertus import ApertusForCausalLM
from tokenbus.model.arcee import ArceeForCausalLM
from tokenbus.model.cohere2 import Cohere2ForCausalLM
from tokenbus.model.deepseek import DeepseekForCausalLM
from tokenbus.model.ernie import Ernie45MoeForCausalLM
from tokenbus.model.exaone4 import Exaone4ForCausalLM
from tokenbus.model.gemma import GemmaForCausalLM
from tokenbus.model.gemma3n import Gemma3nForCausalLM
from tokenbus.model.gemma4 import Gemma4ForCausalLM
from tokenbus.model.glm4 import Glm4ForCausalLM
from tokenbus.model.glm4_moe import Glm4MoeForCausalLM
from tokenbus.model.gpt_oss import GptOssForCausalLM
from tokenbus.model.granite import (
    GraniteForCausalLM,
    GraniteHybridForCausalLM,
    GraniteMoeForCausalLM,
)
from tokenbus.model.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM, Lfm3ForCausalLM
from tokenbus.model.llama import LlamaForCausalLM
from tokenbus.model.minicpm3 import MiniCPM3ForCausalLM
from tokenbus.model.minimax_m2 import MiniMaxM2ForCausalLM
from tokenbus.model.mixtral import MixtralForCausalLM
from tokenbus.model.nemotron_h import NemotronHForCausalLM
from tokenbus.model.olmo2 import Olmo2ForCausalLM
from tokenbus.model.olmoe import OlmoeForCausalLM
from tokenbus.model.phi3 import Phi3ForCausalLM
from tokenbus.model.phimoe import PhimoeForCausalLM
from tokenbus.model.qwen2_moe import Qwen2MoeForCausalLM
from tokenbus.model.qwen3 import Qwen3ForCausalLM
from tokenbus.model.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3NextForCausalLM,
)
from tokenbus.model.qwen3_moe import Qwen3MoeForCausalLM
from tokenbus.model.smollm3 import SmolLM3ForCausalLM

_MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "ministral": LlamaForCausalLM,
    "ministral3": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "hunyuan_v1_dense": Qwen3ForCausalLM,  # Qwen3's layers, q/k normed after the rotary
    "HunYuanDenseV1ForCausalLM": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "smollm3": SmolLM3ForCausalLM,
    "granite": GraniteForCausalLM,
    "olmo2": Olmo2ForCausalLM,
    "olmo3": Olmo2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MinistralForCausalLM": LlamaForCausalLM,
    "Ministral3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo2ForCausalLM,
    "gemma": GemmaForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "gemma3n": Gemma3nForCausalLM,
    "gemma4": Gemma4ForCausalLM,
    "Gemma3nForCausalLM": Gemma3nForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "granitemoe": GraniteMoeForCausalLM,
    "granitemoehybrid": GraniteHybridForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "ernie4_5": LlamaForCausalLM,
    "glm4": Glm4ForCausalLM,
    "seed_oss": LlamaForCausalLM,
    "arcee": ArceeForCausalLM,
    "apertus": ApertusForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "solar_open": Glm4MoeForCausalLM,  # its layers are GLM-4.5's without the extras
    "dots1": Glm4MoeForCausalLM,  # GLM-4.5's MoE under Qwen3's attention
    "minimax_m2": MiniMaxM2ForCausalLM,
    "deepseek_v2": DeepseekForCausalLM,
    "deepseek_v3": DeepseekForCausalLM,  # V2's attention, GLM-4.5's router
    "glm4_moe_lite": DeepseekForCausalLM,  # GLM-4.7-Flash: DeepSeek-V3's layers
    "mistral4": DeepseekForCausalLM,  # Mistral Small 4: V3's layers, a query temperature
    "minicpm3": MiniCPM3ForCausalLM,
    "cohere": Cohere2ForCausalLM,  # Cohere2's block, every layer global with a rotary
    "cohere2": Cohere2ForCausalLM,
    "exaone4": Exaone4ForCausalLM,
    "ernie4_5_moe": Ernie45MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteHybridForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Ernie4_5ForCausalLM": LlamaForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "SeedOssForCausalLM": LlamaForCausalLM,
    "ArceeForCausalLM": ArceeForCausalLM,
    "ApertusForCausalLM": ApertusForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "SolarOpenForCausalLM": Glm4MoeForCausalLM,
    "Dots1ForCausalLM": Glm4MoeForCausalLM,
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "Glm4MoeLiteForCausalLM": DeepseekForCausalLM,
    "Mistral4ForCausalLM": DeepseekForCausalLM,
    "MiniCPM3ForCausalLM": MiniCPM3ForCausalLM,
    "CohereForCausalLM": Cohere2ForCausalLM,
    "Cohere2ForCausalLM": Cohere2ForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "Ernie4_5_MoeForCausalLM": Ernie45MoeForCausalLM,
    "lfm2": Lfm2ForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "lfm2_moe": Lfm2MoeForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2MoeForCausalLM,
    "lfm3": Lfm3ForCausalLM,
    "Lfm3ForCausalLM": Lfm3ForCausalLM,
    "phimoe": PhimoeForCausalLM,
    "PhimoeForCausalLM": PhimoeForCausalLM,
    "PhiMoEForCausalLM": PhimoeForCausalLM,
    "nemotron_h": NemotronHForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "qwen3_5_moe": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(_MODEL_CLASSES)


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; "
            f"supported: {', '.join(_MODEL_CLASSES)}"
        ) from None
