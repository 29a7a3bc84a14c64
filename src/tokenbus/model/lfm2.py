"""LFM2 (Lfm2ForCausalLM: LFM2 / LFM2.5 350M-2.6B): a hybrid of gated short convolutions and
attention layers, each followed by a SwiGLU MLP in a pre-norm block.

- `layer_types` says which layers are "conv" (model/short_conv.py: a recurrent state per
  request, no K/V) and which attend: Qwen3's attention, per-head q/k RMSNorms, no biases.
- The final norm is HF's `embedding_norm`; the LM head is tied.
- HF's names differ from the shared parts' (operator_norm, ffn_norm, feed_forward.w1/w3/w2,
  out_proj, q/k_layernorm): loader/lfm2_config.py renames them at load.

LFM2-MoE (Lfm2MoeForCausalLM: LFM2-8B-A1B, LFM2-24B-A2B) keeps these layers and makes every
MLP after the first `num_dense_layers` a sparse MoE block (model/moe.py) whose router scores
each expert by its sigmoid and chooses by score + a per-expert bias.

LFM3 (Lfm3ForCausalLM: LFM3-1.7B) keeps the convolutions and makes three changes:
- Attention layers are "full_attention" or "sliding_attention" (a window, 256 by default); the
  full ones turn half of each head's angles on a base of 1M ("proportional" rope), the sliding
  ones all of them on 10k (CausalLM's local table).
- Each attention head's output is scaled by sigmoid(g_proj(x)), one gate a head
  (ModelArch.attn_head_gate).
- Every block is a sandwich (decoder.SandwichDecoderLayer, recurrent's for the convolutions):
  the mixer's and the MLP's outputs are RMSNormed again before they join the residual.
"""

from __future__ import annotations

from torch import nn

from tokenbus.model.causal_lm import CausalLM
from tokenbus.model.decoder import Attention, DecoderLayer, GatedMLP, QKNorm, SandwichDecoderLayer
from tokenbus.model.moe_causal_lm import MoECausalLM
from tokenbus.model.parallel import TensorParallel
from tokenbus.model.recurrent import RecurrentDecoderLayer, RecurrentSandwichDecoderLayer
from tokenbus.model.short_conv import ShortConv
from tokenbus.model_arch import ModelArch


class Lfm2ForCausalLM(CausalLM):
    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> nn.Module:
        if self.making_layer in arch.recurrent_layers:
            return RecurrentDecoderLayer(arch, ShortConv(arch, tp), self.make_mlp(arch, tp))
        attention = Attention(arch, tp, qk_norm=QKNorm.HEADS)
        return DecoderLayer(arch, attention, self.make_mlp(arch, tp))

    def make_mlp(self, arch: ModelArch, tp: TensorParallel) -> nn.Module:
        return GatedMLP(arch, tp)


class Lfm2MoeForCausalLM(Lfm2ForCausalLM, MoECausalLM):
    """LFM2's layers (make_layer) with MoECausalLM's MLPs and expert loading; experts per
    expert (the released checkpoints) or stacked as transformers 5 saves them."""

    family = "lfm2_moe"
    make_mlp = MoECausalLM.make_mlp


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    """LFM2's convolutions and Qwen3's attention (with a gate per head), in sandwich blocks."""

    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> nn.Module:
        mlp = self.make_mlp(arch, tp)
        if self.making_layer in arch.recurrent_layers:
            return RecurrentSandwichDecoderLayer(arch, ShortConv(arch, tp), mlp)
        bias = arch.attention_bias  # q/k/v and o_proj, as HF's Lfm3Attention
        attention = Attention(arch, tp, qkv_bias=bias, o_bias=bias, qk_norm=QKNorm.HEADS)
        return SandwichDecoderLayer(arch, attention, mlp)
