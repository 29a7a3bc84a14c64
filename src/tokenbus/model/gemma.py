"""Gemma, Gemma 2 and Gemma 3 (text): model/decoder.py's parts (attention, GeGLU MLP, pre-norm
or sandwich-norm layer) configured as Gemma's.

- RMSNorm scales by (1 + w), computed in fp32 whatever the activations' dtype, then cast back
  (HF's Gemma2RMSNorm / Gemma3RMSNorm: layers.Fp32RMSNorm). The parameter holds (1 + w), made
  in fp32 at load from HF's w (a GGUF's norms come back as w too: loader/gguf_loader.py), so in
  an fp32 model the norm is a plain RMSNorm and the fused C op runs it.
- Gemma 2's and Gemma 3's layers norm before and after attention and before and after the MLP
  (decoder.SandwichDecoderLayer); Gemma's before each only, as Llama's (decoder.DecoderLayer).
  Every MLP is GeGLU (decoder.GeGLUMLP).
- The embedding is scaled by sqrt(hidden_size), that factor cast to the activations' dtype first.
- Attention scale query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps the attention scores
  (attn_logit_softcapping) and both may soft-cap the final logits (final_logit_softcapping).
- Gemma 3 norms each query and key head (q_norm / k_norm, the same (1 + w) norm) before the
  rotary, and its local (sliding-window) layers take their own RoPE base, unscaled: the model
  hands its layers both tables stacked ([2, T, 1, D/2]: global, local), each layer reads its own.
- Tied embeddings (Gemma's default).

Sliding windows: each layer keeps its window as `self_attn.sliding_window` (None: global); the
attention plans narrow to it, and the hybrid KV cache (core/kv/hybrid.py) frees the local
layers' blocks that fall out of it.

Kernels (model/kernel_plan.py): every backend soft-caps Gemma 2's scores (the native kernel,
Triton, torch), and both families' layers are decode_layer.c's parts (sandwich norms, GeGLU, a
soft-cap, rotary table and KV group per layer), so their decode steps on GGUF tiles run there.
"""

from __future__ import annotations

import torch

from tokenbus.model.causal_lm import GLOBAL_ROPE, CausalLM
from tokenbus.model.decoder import (
    Attention,
    DecoderLayer,
    GeGLUMLP,
    QKNorm,
    SandwichDecoderLayer,
)
from tokenbus.model.layers import Fp32RMSNorm
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.weights import WeightLoader, plus_one
from tokenbus.model_arch import ModelArch


class GemmaAttention(Attention):
    """The shared attention with Gemma's scale, score soft-cap and (Gemma 3) (1 + w) q/k
    norms; CausalLM gives each layer its window and RoPE table."""

    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        bias = arch.attention_bias
        qk_norm = QKNorm.HEADS if arch.architecture == "gemma3" else QKNorm.NONE
        super().__init__(arch, tp, qkv_bias=bias, o_bias=bias, qk_norm=qk_norm, norm=Fp32RMSNorm)
        self.scale = (arch.query_pre_attn_scalar or arch.head_dim) ** -0.5
        self.logit_softcap = arch.attn_logit_softcapping
        self.rope_table = GLOBAL_ROPE  # Gemma 2's layers too read row 0 of stacked tables


class GemmaForCausalLM(CausalLM):
    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__(arch, tp)
        self.norm = Fp32RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def make_layer(
        self, arch: ModelArch, tp: TensorParallel
    ) -> DecoderLayer | SandwichDecoderLayer:
        attn, mlp = GemmaAttention(arch, tp), GeGLUMLP(arch, tp)
        if arch.architecture == "gemma":
            return DecoderLayer(arch, attn, mlp, Fp32RMSNorm)
        return SandwichDecoderLayer(arch, attn, mlp, Fp32RMSNorm)

    def rotary_lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [R, T, 1, D/2]: row GLOBAL_ROPE, and LOCAL_ROPE where the model has one."""
        cos, sin = super().rotary_lookup(positions, dtype)
        if self.local_rotary is None:
            return cos.unsqueeze(0), sin.unsqueeze(0)
        return cos, sin

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super()._embed(input_ids)
        # HF: a fp32 tensor of sqrt(hidden) cast to the weights' dtype (55.43 is 55.5 in bf16)
        return x * torch.tensor(self.arch.hidden_size**0.5, dtype=torch.float32).to(x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else self.kernels.ops.softcap(logits, cap)

    def _weight_loaders(self) -> dict[str, WeightLoader]:
        loaders = super()._weight_loaders()
        # Every norm of Gemma's is a Fp32RMSNorm: HF's w in, (1 + w) held.
        return {
            name: plus_one(loader) if name.endswith("norm.weight") else loader
            for name, loader in loaders.items()
        }
