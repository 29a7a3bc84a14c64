"""MiniCPM3 (MiniCPM3ForCausalLM: MiniCPM3-4B): DeepSeek-V2's multi-head latent attention
(model/mla.py, its rotary turning halves) and a dense SiLU MLP in pre-norm layers, under muP's
scales, which are Granite's multipliers (model/granite.py): the embeddings scaled, each
sublayer's output scaled before it joins the residual, the logits divided
(loader/minicpm3_config.py)."""

from __future__ import annotations

from tokenbus.model.causal_lm import CausalLM
from tokenbus.model.decoder import DecoderLayer, GatedMLP
from tokenbus.model.granite import GraniteMultipliers
from tokenbus.model.mla import LatentAttention, latent_attention_loaders
from tokenbus.model.parallel import TensorParallel
from tokenbus.model.weights import WeightLoader
from tokenbus.model_arch import ModelArch


class _MiniCPM3Layers(CausalLM):
    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> DecoderLayer:
        return DecoderLayer(arch, LatentAttention(arch, tp), GatedMLP(arch, tp))

    def _weight_loaders(self) -> dict[str, WeightLoader]:
        return {**super()._weight_loaders(), **latent_attention_loaders(self.layers)}


class MiniCPM3ForCausalLM(GraniteMultipliers, _MiniCPM3Layers):
    pass
