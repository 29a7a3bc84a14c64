"""llama.cpp's GGUF tensor names as the HF names our models load (L2; no torch).

A GGUF names a layer's tensors blk.N.<tensor>.<weight|bias> (a tensor name may hold dots:
LFM2's shortconv.conv), the rest by global names. Most architectures share the table below;
some give a name another meaning (Gemma's ffn_norm is its pre-feedforward norm) or add their
own.
"""

from __future__ import annotations

from tokenbus.loader.deepseek_config import (
    DEEPSEEK_GGUF_ARCHITECTURES,
    DEEPSEEK_GGUF_BLOCK_NAMES,
    MLA_GGUF_BLOCK_NAMES,
)
from tokenbus.loader.gemma3n_config import (
    GEMMA3N_GGUF,
    GEMMA3N_GGUF_BLOCK_NAMES,
    GEMMA3N_GGUF_GLOBAL_NAMES,
    GEMMA3N_PARAMETER_NAMES,
)
from tokenbus.loader.gemma4_config import (
    GEMMA4_GGUF,
    GEMMA4_GGUF_BLOCK_NAMES,
    GEMMA4_PARAMETER_NAMES,
)
from tokenbus.loader.gemma_config import SANDWICH_GGUF_ARCHITECTURES
from tokenbus.loader.gguf_file import GGUFFile
from tokenbus.loader.glm4_moe_config import DOTS1_GGUF, DOTS1_GGUF_BLOCK_NAMES, GLM4_MOE_GGUF
from tokenbus.loader.gpt_oss_config import GPT_OSS_GGUF_ARCHITECTURE
from tokenbus.loader.lfm2_config import (
    LFM2_GGUF_ARCHITECTURES,
    LFM2_GGUF_BLOCK_NAMES,
    LFM2_GGUF_GLOBAL_NAMES,
)
from tokenbus.loader.mamba_config import (
    GRANITE_HYBRID_GGUF,
    GRANITE_HYBRID_GGUF_BLOCK_NAMES,
    MAMBA_PARAMETER_NAMES,
    NEMOTRON_H_GGUF,
)
from tokenbus.loader.minicpm3_config import MINICPM3_GGUF
from tokenbus.loader.minimax_m2_config import MINIMAX_M2_GGUF
from tokenbus.loader.qwen3_5_config import (
    QWEN3_5_GGUF_ARCHITECTURES,
    QWEN3_5_GGUF_BLOCK_NAMES,
    QWEN3_5_PARAMETER_NAMES,
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {  # blk.N.<gguf> -> model.layers.N.<hf>
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
    # Qwen2-MoE's shared expert and its gate (a [hidden] vector in the file: [1, hidden] here)
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",  # phi3
}
# Gemma's norms around attention and MLP: attn_norm is input_layernorm as above, but ffn_norm
# is the pre-MLP norm and the post-norms have their own names (gguf's ATTN_POST_NORM,
# FFN_PRE_NORM, FFN_POST_NORM).
_GEMMA_BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_BLOCK_NAMES = {  # where an architecture's blk.N.<gguf> means something else
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    # GLM-4: Gemma 2's sandwich norms, gate and up as one ffn_up (as Phi-3's)
    "glm4": {**_GEMMA_BLOCK_NAMES, "ffn_up": "mlp.gate_up_proj"},
    # gpt-oss: its pre-MLP norm by Gemma's post-attention name, a sink per query head
    GPT_OSS_GGUF_ARCHITECTURE: {
        "post_attention_norm": "post_attention_layernorm",
        "attn_sinks": "self_attn.sinks",
    },
    "olmo2": _GEMMA_BLOCK_NAMES,  # its post-norms by Gemma's names (and no attn_norm / ffn_norm)
    "exaone4": _GEMMA_BLOCK_NAMES,  # likewise
    **{arch: LFM2_GGUF_BLOCK_NAMES for arch in LFM2_GGUF_ARCHITECTURES},  # short convolutions
    GRANITE_HYBRID_GGUF: GRANITE_HYBRID_GGUF_BLOCK_NAMES,  # its Mamba2 mixers' tensors
    NEMOTRON_H_GGUF: GRANITE_HYBRID_GGUF_BLOCK_NAMES,  # likewise
    **{arch: QWEN3_5_GGUF_BLOCK_NAMES for arch in QWEN3_5_GGUF_ARCHITECTURES},  # Gated DeltaNet
    # ERNIE 4.5's shared MLP (several experts' width, ungated) and its selection bias
    "ernie4_5-moe": {
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
        "exp_probs_b": "mlp.moe_statics.e_score_correction_bias",
    },
    **{arch: _GEMMA_BLOCK_NAMES for arch in SANDWICH_GGUF_ARCHITECTURES},
    # Gemma 3n: Gemma's norms, its AltUp, LAuReL and per-layer-input tensors
    GEMMA3N_GGUF: {**_GEMMA_BLOCK_NAMES, **GEMMA3N_GGUF_BLOCK_NAMES},
    # Gemma 4: Gemma's norms, its per-layer-input tensors and each layer's output scale
    GEMMA4_GGUF: {**_GEMMA_BLOCK_NAMES, **GEMMA4_GGUF_BLOCK_NAMES},
    # Seed-OSS: its pre-MLP norm by Gemma's post-attention name
    "seed_oss": {"post_attention_norm": "post_attention_layernorm"},
    DOTS1_GGUF: DOTS1_GGUF_BLOCK_NAMES,  # GLM-4.5's shared MLP and router bias, Llama's norms
    # MiniMax-M2: its router's bias under the MoE block (mlp. here, block_sparse_moe. at load)
    MINIMAX_M2_GGUF: {"exp_probs_b": "mlp.e_score_correction_bias"},
    # latent attention, GLM-4.5's MoE (Mistral 4's too)
    **{arch: DEEPSEEK_GGUF_BLOCK_NAMES for arch in DEEPSEEK_GGUF_ARCHITECTURES},
    MINICPM3_GGUF: MLA_GGUF_BLOCK_NAMES,  # latent attention, a dense MLP
    # GLM-4.5: its pre-MLP norm by Gemma's post-attention name (as gpt-oss's), an ungated
    # shared MLP (as ERNIE's), the router's bias
    GLM4_MOE_GGUF: {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
        "exp_probs_b": "mlp.gate.e_score_correction_bias",
    },
}
# HF names that are a parameter themselves, not a module's `.weight` (gpt-oss's sinks, the
# selection biases of ERNIE, GLM-4.5 and MiniMax-M2).
_PARAMETER_NAMES = (
    "self_attn.sinks",
    "mlp.moe_statics.e_score_correction_bias",
    "mlp.gate.e_score_correction_bias",
    "mlp.e_score_correction_bias",
    *MAMBA_PARAMETER_NAMES,
    *QWEN3_5_PARAMETER_NAMES,
    *GEMMA3N_PARAMETER_NAMES,
    *GEMMA4_PARAMETER_NAMES,
)


def hf_weight_name(gf: GGUFFile, name: str) -> str:
    """The HF name of GGUF tensor `name` (blk.N.<tensor>.<weight|bias>, or a global one) in
    the file's architecture."""
    arch = gf.metadata.get("general.architecture")
    lfm2 = arch in LFM2_GGUF_ARCHITECTURES
    global_names = {**_GLOBAL_NAMES, **(LFM2_GGUF_GLOBAL_NAMES if lfm2 else {})}
    if arch in (GEMMA3N_GGUF, GEMMA4_GGUF):  # the per-layer inputs' tables
        global_names.update(GEMMA3N_GGUF_GLOBAL_NAMES)
    if name in global_names:
        return global_names[name]
    block_names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
    # blk.<layer>.<tensor>.<weight|bias>; a tensor may hold dots; a parameter (Mamba2's A and
    # D) may come without the suffix
    parts = name.split(".")
    suffixed = parts[-1] in ("weight", "bias")
    tensor = ".".join(parts[2:-1] if suffixed else parts[2:])
    if len(parts) >= 3 and parts[0] == "blk" and parts[1].isdigit() and tensor in block_names:
        hf_name = f"model.layers.{parts[1]}.{block_names[tensor]}"
        if block_names[tensor] in _PARAMETER_NAMES:
            return hf_name
        if suffixed:
            return f"{hf_name}.{parts[-1]}"
    raise ValueError(f"{gf.path}: unexpected GGUF tensor {name}")
