"""Nemotron-H (NemotronHForCausalLM: Nemotron-H 4B / 8B, Nemotron Nano 9B v2): a stack of
single-mixer blocks, x + mixer(norm(x)), each layer one of

- a Mamba2 mixer (layers_block_type "linear_attention", its pattern's "M": model/mamba2.py);
- attention without a rotary ("full_attention", "*"), GQA, Llama's projections;
- an MLP alone ("mlp", "-"): down(relu(up(x)) ** 2), no gate (ModelArch.mlp_only_layers: no
  K/V, no state).

HF names each block's mixer `mixer`; the model renames them by the layer's kind at load, and
the embedding, the norms and the final norm (norm_f) to the shared parts' names. Its
mixture-of-experts blocks (Nemotron 3's "E") are refused by name (loader/nemotron_h_config.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenbus.model.attention import Plan
from tokenbus.model.causal_lm import CausalLM
from tokenbus.model.decoder import Attention, ReluSquaredMLP
from tokenbus.model.layers import RMSNorm
from tokenbus.model.mamba2 import Mamba2Mixer
from tokenbus.model.parallel import TensorParallel
from tokenbus.model.recurrent import RecurrentPlan
from tokenbus.model_arch import ModelArch


class SingleMixerLayer(nn.Module):
    """x + mixer(norm(x)), the mixer attention (self_attn), a recurrent one (mixer) or an MLP
    (mlp); like DecoderLayer it returns its output not yet added to the residual stream."""

    def __init__(
        self,
        arch: ModelArch,
        self_attn: Attention | None = None,
        mixer: nn.Module | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn, self.mixer, self.mlp = self_attn, mixer, mlp

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        slots: torch.Tensor,
        plan: Plan | RecurrentPlan,
        q_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        if self.mlp is not None:
            return self.mlp(h), residual
        mixer = self.self_attn if self.self_attn is not None else self.mixer
        return mixer(h, cos, sin, cache, slots, plan, q_scale), residual


class NemotronHForCausalLM(CausalLM):
    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> SingleMixerLayer:
        if self.making_layer in arch.recurrent_layers:
            return SingleMixerLayer(arch, mixer=Mamba2Mixer(arch, tp))
        if self.making_layer in arch.mlp_only_layers:
            return SingleMixerLayer(arch, mlp=ReluSquaredMLP(arch, tp))
        bias = arch.attention_bias
        return SingleMixerLayer(arch, self_attn=Attention(arch, tp, qkv_bias=bias, o_bias=bias))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._our_names(weights))

    def _our_names(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF's (or the released checkpoints' `backbone.`) names as the shared parts'."""
        globals_ = {"model.embeddings.weight": "model.embed_tokens.weight"}
        globals_["model.norm_f.weight"] = "model.norm.weight"
        for name, tensor in weights:
            name = name.replace("backbone.", "model.", 1) if name.startswith("backbone.") else name
            if name in globals_:
                yield globals_[name], tensor
                continue
            parts = name.split(".")  # model.layers.N.<norm | mixer>.<...>
            if parts[:2] == ["model", "layers"] and len(parts) > 4:
                layer, block, rest = int(parts[2]), parts[3], ".".join(parts[4:])
                prefix = f"model.layers.{layer}."
                if block == "norm":
                    name = f"{prefix}input_layernorm.{rest}"
                elif block == "mixer":
                    name = f"{prefix}{self._mixer_scope(layer)}{rest}"
            yield name, tensor

    def _mixer_scope(self, layer: int) -> str:
        """Our scope of layer `layer`'s mixer's weights."""
        if layer in self.arch.recurrent_layers:
            return Mamba2Mixer.hf_scope
        return "mlp." if layer in self.arch.mlp_only_layers else "self_attn."
