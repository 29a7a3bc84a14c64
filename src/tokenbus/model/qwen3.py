"""Qwen3 (dense): the Llama decoder with an RMSNorm over each query and key head (q_norm,
k_norm: one weight [head_dim] each, applied before the rotary), no q/k/v bias unless
`attention_bias` asks for one (then o_proj has one too), and head_dim from the config, which may
differ from hidden_size / num_attention_heads.

Its sliding-window layers (`use_sliding_window`, on the layers of `layer_types`) attend within
their window (ModelArch.sliding_windows), as Qwen2's.

HunYuan dense (`hunyuan_v1_dense`) is these layers with the q/k norms after the rotary
(Attention.qk_norm_after_rope; decode_layer.c too), its rope base stretched by NTK alpha at load
(loader/hunyuan_config.py).
"""

from __future__ import annotations

from tokenbus.model.causal_lm import CausalLM
from tokenbus.model.decoder import Attention, DecoderLayer, GatedMLP, QKNorm
from tokenbus.model.parallel import TensorParallel
from tokenbus.model_arch import ModelArch


class Qwen3ForCausalLM(CausalLM):
    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> DecoderLayer:
        bias = arch.attention_bias
        attention = Attention(arch, tp, qkv_bias=bias, o_bias=bias, qk_norm=QKNorm.HEADS)
        attention.qk_norm_after_rope = arch.architecture == "hunyuan_v1_dense"
        return DecoderLayer(arch, attention, GatedMLP(arch, tp))
