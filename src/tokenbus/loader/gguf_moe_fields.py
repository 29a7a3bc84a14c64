"""A GGUF's sparse-MoE fields of ModelArch from its `{arch}.expert_*` metadata and tensor names
(L2; no torch): the experts' count and width, which layers are dense, a shared expert, the
router's renormalising, selection bias and groups."""

from __future__ import annotations

from tokenbus.loader.deepseek_config import DEEPSEEK_GGUF_ARCHITECTURES
from tokenbus.loader.gemma4_config import GEMMA4_GGUF
from tokenbus.loader.gguf_file import GGUFFile
from tokenbus.loader.glm4_moe_config import DOTS1_GGUF, GLM4_MOE_GGUF
from tokenbus.loader.gpt_oss_config import GPT_OSS_GGUF_ARCHITECTURE
from tokenbus.loader.mamba_config import GRANITE_HYBRID_GGUF
from tokenbus.loader.minimax_m2_config import MINIMAX_M2_GGUF

# Architectures whose router renormalises only where expert_weights_norm says (and whose
# shared MLP is ungated)
_NORM_WHERE_TOLD = (GLM4_MOE_GGUF, DOTS1_GGUF, *DEEPSEEK_GGUF_ARCHITECTURES)


def gguf_moe_fields(gf: GGUFFile, arch: str, num_layers: int) -> dict:
    """ModelArch's MoE fields from `{arch}.expert_*` metadata ({} for a dense model). Layers
    without a router tensor (ffn_gate_inp) are dense (Qwen3-MoE's mlp_only_layers); shared
    experts (ffn_*_shexp) are Qwen2-MoE's, ERNIE 4.5's, GLM-4.5's and the hybrids', refused
    elsewhere, naming the tensor; a selection bias (ERNIE's, LFM2-MoE's, GLM-4.5's,
    MiniMax-M2's) is its exp_probs_b."""
    meta = gf.metadata
    num_experts = int(meta.get(f"{arch}.expert_count", 0))
    own_width = (
        *("qwen3moe", "qwen3vlmoe", "qwen2moe", "ernie4_5-moe", GPT_OSS_GGUF_ARCHITECTURE),
        "lfm2moe",
        *("qwen35moe", "qwen3next", GLM4_MOE_GGUF, MINIMAX_M2_GGUF, DOTS1_GGUF),
        *DEEPSEEK_GGUF_ARCHITECTURES,
    )
    if not num_experts:
        if arch in (*own_width, "olmoe", "granitemoe"):
            raise ValueError(f"{gf.path}: missing GGUF metadata {arch}.expert_count")
        return {}
    shared = 0
    if arch == "qwen2moe":  # llama.cpp: the dense width when the shared one is not given
        shared = int(meta.get(f"{arch}.expert_shared_feed_forward_length", 0))
        shared = shared or int(meta.get(f"{arch}.feed_forward_length", 0))
    if arch in (GRANITE_HYBRID_GGUF, "qwen35moe", "qwen3next"):  # Granite 4.0-H's ungated
        shared = int(meta.get(f"{arch}.expert_shared_feed_forward_length", 0))
    if arch in _NORM_WHERE_TOLD:  # expert_shared_count experts' width (n_ff_shexp)
        width = int(meta.get(f"{arch}.expert_feed_forward_length", 0))
        shared = width * int(meta.get(f"{arch}.expert_shared_count", 0))
    shexp = (
        *("qwen2moe", "ernie4_5-moe", GRANITE_HYBRID_GGUF, "qwen35moe", "qwen3next"),
        GLM4_MOE_GGUF,
        DOTS1_GGUF,
        *DEEPSEEK_GGUF_ARCHITECTURES,
    )
    for name, info in gf.tensors.items():
        if "_shexp" in name and arch not in shexp:
            raise ValueError(f"{gf.path}: tensor {name}: shared experts are not supported")
        if name.endswith(".ffn_gate_shexp.weight") and arch == "ernie4_5-moe":
            shared = info.shape[0]  # its width, from the tensor (the converter's key is not it)
    if f"{arch}.expert_used_count" not in meta:
        raise ValueError(f"{gf.path}: missing GGUF metadata {arch}.expert_used_count")
    # Gemma 4's: its experts beside the dense MLP (the 26B-A4B; the others have none)
    own = arch in (*own_width, GEMMA4_GGUF)
    width_key = "expert_feed_forward_length" if own else "feed_forward_length"
    if f"{arch}.{width_key}" not in meta:
        raise ValueError(f"{gf.path}: missing GGUF metadata {arch}.{width_key}")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(meta[f"{arch}.expert_used_count"]),
        moe_intermediate_size=int(meta[f"{arch}.{width_key}"]),
        # llama.cpp renormalises Mixtral's and Qwen3-MoE's top k unless told otherwise, and
        # never OLMoE's or Qwen2-MoE's (their graphs pass no weight norm, as their configs');
        # GLM-4.5's and DeepSeek's only where told
        norm_topk_prob=arch not in ("olmoe", "qwen2moe")
        and bool(meta.get(f"{arch}.expert_weights_norm", arch not in _NORM_WHERE_TOLD)),
        dense_layers=tuple(
            i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in gf.tensors
        ),
        shared_expert_intermediate_size=shared,
        shared_expert_gated=arch not in ("ernie4_5-moe", GRANITE_HYBRID_GGUF, *_NORM_WHERE_TOLD),
        moe_selection_bias=any(name.endswith(".exp_probs_b.bias") for name in gf.tensors),
        # DeepSeek-V3's group limit, where the converter wrote the config's n_group / topk_group
        # (llama.cpp's graph applies it to any architecture)
        moe_groups=int(meta.get(f"{arch}.expert_group_count") or 1),
        moe_topk_groups=int(meta.get(f"{arch}.expert_group_used_count") or 1),
    )
