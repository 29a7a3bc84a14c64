"""GGUF models: metadata -> ModelArch; tensors -> weights with HF names: dequantized fp32, or
(keep_quantized) the GGUF blocks themselves for the types the native kernels run.

llama.cpp's converter permutes the rows of q/k weights of llama-arch models (interleaved
rotary pairs instead of HF's rotate-half halves); `unpermute_qk` undoes it. Qwen2 and Qwen3
GGUFs are written unpermuted (llama.cpp's NeoX rotary is rotate-half), and so are Gemma 2 and
Gemma 3's, whose norm weights llama.cpp stores as (1 + w): they are given back as HF's w.
Mistral is written as architecture "llama". A tensor name this table does not know is refused,
naming it.

SmolLM3 ("smollm3"): llama's tensors, permuted as llama's; llama.cpp writes no metadata for its
NoPE layers and takes every fourth (`n_no_rope_layer_step` 4, SmolLM3's own default), as we do.
Granite ("granite"): llama's tensors, permuted as llama's, and its multipliers as
`embedding_scale`, `residual_scale`, `attention.scale` and `logit_scale` (absent: 1, and for
the attention scale llama.cpp's 1 / sqrt(head_dim)). GraniteMoE ("granitemoe") adds experts
stacked as Mixtral's (ffn_*_exps, the router ffn_gate_inp; feed_forward_length their width).

OLMo 2 ("olmo2"): unpermuted (llama.cpp turns it NeoX-style); its norms after attention and after
the MLP as `post_attention_norm` and `post_ffw_norm`, none before; q/k norms over the whole
projection as `attn_q_norm` / `attn_k_norm` [H * D]. OLMo 3 is written as olmo2 with
`attention.sliding_window` and its local layers' flags (`sliding_window_pattern`; absent: all but
every fourth); llama.cpp's local layers turn by `rope.freq_base` unscaled, its global ones with
the file's YaRN, as transformers' Olmo3 does.

Phi-3 ("phi3"): q/k/v fused in `attn_qkv` (or separate attn_q/k/v), gate and up fused in
`ffn_up` [2*I, hidden] (HF's gate_up_proj), unpermuted; LongRoPE as two tensors,
`rope_factors_long` / `rope_factors_short`, with `rope.scaling.original_context_length` and
`rope.scaling.attn_factor`; partial rotary as `rope.dimension_count` < head_dim; its window as
`attention.sliding_window` (0: none), on every layer as config.json's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tokenbus.loader.apertus_config import APERTUS_GGUF, apertus_gguf_xielu
from tokenbus.loader.cohere2_config import (
    COHERE2_GGUF_EPS_KEY,
    COHERE_GGUF,
    COHERE_GGUF_ARCHITECTURES,
    cohere2_gguf_fields,
)
from tokenbus.loader.deepseek_config import (
    DEEPSEEK_ARCHITECTURES,
    DEEPSEEK_GGUF_ARCHITECTURES,
    MISTRAL4_GGUF,
    deepseek_gguf_fields,
    deepseek_gguf_yarn,
    joined_kv_b,
)
from tokenbus.loader.ernie_config import ERNIE_ARCHITECTURES, ERNIE_GGUF_ARCHITECTURES
from tokenbus.loader.gemma3n_config import (
    GEMMA3N_GGUF,
    GEMMA3N_GGUF_STACKED,
    gemma3n_gguf_fields,
)
from tokenbus.loader.gemma4_config import GEMMA4_GGUF, gemma4_gguf_fields
from tokenbus.loader.gemma_config import (
    GEMMA_GGUF_ARCHITECTURES,
    gemma_gguf_fields,
)
from tokenbus.loader.gguf_file import GGUFFile, GGUFTensorInfo, string_ids
from tokenbus.loader.gguf_moe_fields import gguf_moe_fields
from tokenbus.loader.gguf_names import hf_weight_name
from tokenbus.loader.gguf_rope import ROPE_TENSORS, attn_temperature, gguf_rope_scaling
from tokenbus.loader.glm4_moe_config import (
    DOTS1_GGUF,
    GLM4_MOE_GGUF,
    dots1_gguf_fields,
    glm4_moe_gguf_fields,
)
from tokenbus.loader.gpt_oss_config import (
    GPT_OSS_GGUF_ARCHITECTURE,
    GPT_OSS_STOP_TOKENS,
    gpt_oss_gguf_fields,
)
from tokenbus.loader.hunyuan_config import HUNYUAN_GGUF
from tokenbus.loader.layer_kinds import (
    EXAONE4_PATTERN,
    OLMO3_PATTERN,
    gguf_local_layers,
    global_nope_layers,
    windows,
)
from tokenbus.loader.lfm2_config import LFM2_GGUF_ARCHITECTURES, lfm2_gguf_fields
from tokenbus.loader.mamba_config import (
    GRANITE_HYBRID_GGUF,
    NEMOTRON_H_GGUF,
    mamba_gguf_tensor,
    mamba_hybrid_gguf_fields,
)
from tokenbus.loader.minicpm3_config import MINICPM3_GGUF, minicpm3_gguf_fields
from tokenbus.loader.minimax_m2_config import MINIMAX_M2_GGUF, minimax_m2_gguf_fields
from tokenbus.loader.qk_rows import PER_HEAD_NORMS, unpermute_head_rows, unpermute_qk
from tokenbus.loader.qwen3_5_config import (
    QWEN3_5_ARCHITECTURES,
    QWEN3_5_GGUF_ARCHITECTURES,
    qwen3_5_gguf_fields,
    qwen3_5_gguf_tensor,
)
from tokenbus.model_arch import ModelArch

if TYPE_CHECKING:  # torch is imported where tensors are made: the API server reads model
    import torch  # metadata through this module, and its start-up is shorter without torch

# The Qwen-VL text models llama.cpp writes (their vision part in an mmproj file): Qwen2's,
# Qwen3's and Qwen3-MoE's layers with a multimodal rotary, which turns a text token by its
# position alone (every section the same position) and so is theirs for text.
_QWEN_VL_TEXT_GGUF = {"qwen2vl": "qwen2", "qwen3vl": "qwen3", "qwen3vlmoe": "qwen3_moe"}
# general.architecture values we load
GGUF_ARCHITECTURES = (
    *("llama", "qwen2", "qwen3", "smollm3", "granite", "granitemoe", "olmo2", "phi3"),
    *("qwen3moe", "qwen2moe", "olmoe", GPT_OSS_GGUF_ARCHITECTURE),
    *_QWEN_VL_TEXT_GGUF,
    *ERNIE_GGUF_ARCHITECTURES,
    "glm4",
    "seed_oss",
    "arcee",
    GLM4_MOE_GGUF,
    DOTS1_GGUF,
    MINIMAX_M2_GGUF,
    *DEEPSEEK_GGUF_ARCHITECTURES,
    MINICPM3_GGUF,
    "mistral3",
    *COHERE_GGUF_ARCHITECTURES,
    "exaone4",
    *LFM2_GGUF_ARCHITECTURES,
    GRANITE_HYBRID_GGUF,
    NEMOTRON_H_GGUF,
    *QWEN3_5_GGUF_ARCHITECTURES,
    *GEMMA_GGUF_ARCHITECTURES,
    GEMMA3N_GGUF,
    GEMMA4_GGUF,
    HUNYUAN_GGUF,
    APERTUS_GGUF,
)
# Architectures whose q/k rows llama.cpp's converter permutes (LlamaModel's `permute`).
# ERNIE's, GLM-4's, Cohere's and Cohere2's too: their HF rows are interleaved already (GLM-4's in
# each head's rotary half) and their converters write them as they are.
_PERMUTED_QK_ARCHITECTURES = (
    *("llama", "mixtral", "smollm3", "granite", "granitemoe", "granitemoehybrid", "nemotron_h"),
    "arcee",
    *ERNIE_ARCHITECTURES,
    "glm4",
    "ministral3",  # llama.cpp's "mistral3"
    "cohere",  # llama.cpp's "command-r"
    "cohere2",
)
# llama.cpp's fixed NoPE pattern for SmolLM3: no rotary on layers il with (il + 1) % 4 == 0.
_SMOLLM3_NO_ROPE_LAYER_STEP = 4
# Architectures whose llama.cpp graph turns only rope.dimension_count dims of each head.
_PARTIAL_ROTARY_ARCHITECTURES = (
    *("phi3", "glm4", GLM4_MOE_GGUF, MINIMAX_M2_GGUF, MINICPM3_GGUF),
    *DEEPSEEK_GGUF_ARCHITECTURES,
    *QWEN3_5_GGUF_ARCHITECTURES,
)
# Architectures whose block_count counts multi-token-prediction blocks after the model's: those
# blocks are not served (ModelArch.num_hidden_layers excludes them)
_MTP_BLOCK_ARCHITECTURES = (*QWEN3_5_ARCHITECTURES, "glm4_moe", *DEEPSEEK_ARCHITECTURES)
# llama.cpp's MoE names: experts stacked per layer ([E, rows, cols]), split here into HF's
# per-expert names (quantized experts stay blocks: each expert's rows are contiguous).
# (convert_hf_to_gguf's --fuse-gate-up-exps writes gate and up as one ffn_gate_up_exps [E, 2I,
# cols]: each expert's gate rows, then its up rows)
_EXPERT_NAMES = {
    "ffn_gate_exps": (0,),
    "ffn_up_exps": (1,),
    "ffn_down_exps": (2,),
    "ffn_gate_up_exps": (0, 1),
}
# The 16-bit float types: F16 and BF16 files, and the F16 matrices a quantized file keeps (Gemma
# 4's per-layer projection). The kernels take their values 32 at a time, as the file holds them.
HALF_QTYPES = (GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
# The block types model/native/quant_matmul.c runs (the llama.cpp _S/_M/_L recipes mix them per
# tensor: Q5_0/Q8_0 where a row is not a multiple of 256, Q6_K for output and some attn_v/ffn_down,
# IQ4_NL/IQ4_XS in imatrix quants; MXFP4 for gpt-oss's experts).
BLOCK_QTYPES = tuple(
    GGMLQuantizationType[name]
    for name in (
        *("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4"),  # 32-value blocks
        *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"),  # 256-value super-blocks
    )
)
# Types the kernels run as the file holds them; F32 is copied on load.
KERNEL_QTYPES = (*BLOCK_QTYPES, *HALF_QTYPES)
SUPPORTED_QTYPES = (GGMLQuantizationType.F32, *HALF_QTYPES, *BLOCK_QTYPES)


@dataclass(frozen=True)
class QuantizedWeight:
    """A GGUF matrix kept in its blocks: uint8 [rows, row_bytes] (the file's pages, mapped
    copy-on-write: read when a kernel repacks or runs on them), `cols` values per row."""

    qtype: int
    data: torch.Tensor
    cols: int

    @property
    def rows(self) -> int:
        return self.data.shape[0]


def q8_0_weight(scales: torch.Tensor, values: torch.Tensor) -> QuantizedWeight:
    """Q8_0 rows holding int8 `values` [rows, cols] as they are, each 32-value block scaled by
    its entry of `scales` [rows, cols / 32] (rounded to the block's fp16 d): the exact blocks of
    a checkpoint's own int8 values (GPTQ's, compressed-tensors', bitsandbytes')."""
    import torch

    rows, cols = values.shape
    head = scales.to(torch.float16).unsqueeze(-1).view(torch.uint8)  # [rows, blocks, 2]
    body = values.to(torch.int8).view(torch.uint8).view(rows, cols // 32, 32)
    data = torch.cat((head, body), dim=-1).reshape(rows, -1).contiguous()
    return QuantizedWeight(int(GGMLQuantizationType.Q8_0), data, cols)


def arch_from_gguf(gf: GGUFFile) -> ModelArch:
    meta = gf.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{gf.path}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )

    def need(key: str):
        if f"{arch}.{key}" not in meta:
            raise ValueError(f"{gf.path}: missing GGUF metadata {arch}.{key}")
        return meta[f"{arch}.{key}"]

    hidden_size, num_heads = need("embedding_length"), need("attention.head_count")
    head_dim = meta.get(f"{arch}.attention.key_length", hidden_size // num_heads)
    rotary_dim = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary_dim != head_dim and arch not in _PARTIAL_ROTARY_ARCHITECTURES:
        raise ValueError(
            f"{gf.path}: partial rotary ({arch}.rope.dimension_count {rotary_dim} != head_dim "
            f"{head_dim}) is not supported for {arch}"
        )
    if "token_embd.weight" not in gf.tensors:
        raise ValueError(f"{gf.path}: missing tensor token_embd.weight")
    for info in gf.tensors.values():  # refused here, before any weight is read
        check_qtype(gf, info)
    rope_theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    # llama.cpp's arcee graph squares a ReLU (LLM_FFN_RELU_SQR), apertus's takes xIELU; every
    # other family here gates by SiLU but Gemma's (gemma_gguf_fields)
    family: dict = {"hidden_act": {"arcee": "relu2", APERTUS_GGUF: "xielu"}.get(arch, "silu")}
    if arch in GEMMA_GGUF_ARCHITECTURES:
        family = gemma_gguf_fields(meta, arch, need("block_count"))
    if arch == GEMMA3N_GGUF:
        family = gemma3n_gguf_fields(meta, gf.tensors, gf.path)
    if arch == GEMMA4_GGUF:  # key_length is the global layers' (512); head_dim the local ones'
        family = gemma4_gguf_fields(meta, gf.tensors, gf.path)
        head_dim = rotary_dim = family.pop("head_dim")
    if arch == GPT_OSS_GGUF_ARCHITECTURE:
        family = gpt_oss_gguf_fields(meta, need("block_count"))
    if arch in COHERE_GGUF_ARCHITECTURES:
        family = cohere2_gguf_fields(meta, arch, need("block_count"), gf.tensors)
    if arch == "exaone4" and meta.get(f"{arch}.attention.sliding_window"):
        local = gguf_local_layers(meta, arch, need("block_count"), EXAONE4_PATTERN)
        family["sliding_windows"] = windows(local, meta[f"{arch}.attention.sliding_window"])
        family["nope_layers"] = global_nope_layers(local)  # as Cohere2's
    window = meta.get(f"{arch}.attention.sliding_window", 0)
    if arch == "phi3" and window:  # every layer's (0: none), as config.json's
        family["sliding_windows"] = (window,) * need("block_count")
    rope_scaling = gguf_rope_scaling(gf, arch)
    if arch == "mistral3" and meta.get(f"{arch}.attention.temperature_scale"):
        family["attn_temperature"] = attn_temperature(gf, arch)
    if arch == GPT_OSS_GGUF_ARCHITECTURE and rope_scaling is not None:
        rope_scaling["truncate"] = False  # gpt_oss_config.py: YaRN as the model was trained
    if arch == "olmo2" and window:  # llama.cpp writes OLMo 3 as olmo2 with its window
        local = gguf_local_layers(meta, arch, need("block_count"), OLMO3_PATTERN)
        family["sliding_windows"] = windows(local, window)
        if rope_scaling is not None and any(local):  # YaRN is the global layers' (olmo2.cpp)
            family["rope_local_theta"] = rope_theta
    if arch == "smollm3":
        step = _SMOLLM3_NO_ROPE_LAYER_STEP
        family["nope_layers"] = tuple(i for i in range(need("block_count")) if (i + 1) % step == 0)
    if arch in (GRANITE_HYBRID_GGUF, NEMOTRON_H_GGUF):
        num_layers = need("block_count")
        family.update(mamba_hybrid_gguf_fields(meta, arch, num_layers, gf.tensors, gf.path))
    if arch in ("granite", "granitemoe", GRANITE_HYBRID_GGUF):
        # llama.cpp writes a multiplier where a config has one
        family.update(
            embedding_multiplier=float(meta.get(f"{arch}.embedding_scale", 1.0)),
            residual_multiplier=float(meta.get(f"{arch}.residual_scale", 1.0)),
            # absent: llama.cpp's 1 / sqrt(head_dim)
            attention_multiplier=meta.get(f"{arch}.attention.scale"),
            logits_scaling=float(meta.get(f"{arch}.logit_scale", 1.0)),
        )
    if arch in LFM2_GGUF_ARCHITECTURES:
        family.update(lfm2_gguf_fields(meta, arch, need("block_count"), gf.path))
    if arch in QWEN3_5_GGUF_ARCHITECTURES:
        family.update(qwen3_5_gguf_fields(meta, arch, gf.path))
    if arch == GLM4_MOE_GGUF:
        family.update(glm4_moe_gguf_fields(meta, gf.tensors, gf.path))
    if arch == DOTS1_GGUF:
        family.update(dots1_gguf_fields(meta, gf.path))
    if arch == MINIMAX_M2_GGUF:
        family.update(minimax_m2_gguf_fields(meta, gf.path))
    if arch in DEEPSEEK_GGUF_ARCHITECTURES:
        family.update(deepseek_gguf_fields(meta, gf.tensors, gf.path, arch))
        rope_scaling = deepseek_gguf_yarn(rope_scaling, meta, arch)
    if arch == MISTRAL4_GGUF and meta.get(f"{arch}.attention.temperature_scale"):
        family["attn_temperature"] = attn_temperature(gf, arch)
    if arch == MINICPM3_GGUF:  # the latent cache's shape in place of the heads'
        family.update(minicpm3_gguf_fields(meta, gf.path))
        head_dim, rotary_dim = family.pop("head_dim"), family.pop("rotary_dim")
    kv_heads = family.pop("num_key_value_heads", meta.get(f"{arch}.attention.head_count_kv"))
    width = family.pop("intermediate_size", None) or need("feed_forward_length")
    # qwen35's, glm4moe's and deepseek2's block_count count their multi-token-prediction blocks
    num_layers = family.pop("num_hidden_layers", None) or need("block_count")
    moe = gguf_moe_fields(gf, arch, num_layers)
    return ModelArch(
        architecture=family.pop("architecture", None) or _our_architecture(arch, moe, bool(window)),
        vocab_size=gf.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden_size,
        intermediate_size=width,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads or num_heads,
        head_dim=head_dim,
        max_position_embeddings=need("context_length"),
        rms_norm_eps=float(
            need(
                COHERE2_GGUF_EPS_KEY
                if arch in COHERE_GGUF_ARCHITECTURES
                else "attention.layer_norm_rms_epsilon"
            )
        ),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in gf.tensors,
        attention_bias=family.pop("attention_bias", "blk.0.attn_q.bias" in gf.tensors),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_token_ids(gf),
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        **family,
        **moe,
    )


def _our_architecture(gguf_arch: str, moe: dict, window: bool) -> str:
    """llama.cpp writes Mixtral as "llama" with experts, OLMo 3 as "olmo2" with a window;
    "qwen3moe" is our "qwen3_moe", "qwen2moe" our "qwen2_moe", "gpt-oss" our "gpt_oss"."""
    renamed = {
        "qwen3moe": "qwen3_moe",
        "qwen2moe": "qwen2_moe",
        "mistral3": "ministral3",
        GPT_OSS_GGUF_ARCHITECTURE: "gpt_oss",
        GRANITE_HYBRID_GGUF: "granitemoehybrid",
        "lfm2moe": "lfm2_moe",
        GLM4_MOE_GGUF: "glm4_moe",
        HUNYUAN_GGUF: "hunyuan_v1_dense",
        MINIMAX_M2_GGUF: "minimax_m2",
        COHERE_GGUF: "cohere",
        **_QWEN_VL_TEXT_GGUF,
        **dict(zip(QWEN3_5_GGUF_ARCHITECTURES, QWEN3_5_ARCHITECTURES, strict=True)),
        **ERNIE_GGUF_ARCHITECTURES,
    }
    if gguf_arch in renamed:
        return renamed[gguf_arch]
    if gguf_arch == "olmo2" and window:
        return "olmo3"
    return "mixtral" if gguf_arch == "llama" and moe else gguf_arch


def _eos_token_ids(gf: GGUFFile) -> tuple[int, ...]:
    meta = gf.metadata
    keys = (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    )
    ids = [meta[key] for key in keys if key in meta]
    if meta.get("general.architecture") == GPT_OSS_GGUF_ARCHITECTURE:  # <|call|> too
        stops = string_ids(gf, "tokenizer.ggml.tokens", GPT_OSS_STOP_TOKENS)
        ids += [stops[token] for token in GPT_OSS_STOP_TOKENS if token in stops]
    return tuple(dict.fromkeys(ids))  # unique, in order


def iter_gguf_weights(
    gf: GGUFFile, arch: ModelArch, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield (HF name, weight) for every tensor with q/k un-permuted: an fp32 tensor, or with
    keep_quantized a QuantizedWeight for each matrix the kernels take (`in_blocks`); Apertus's xIELU
    parameters, from metadata, as its tensors."""
    import torch

    if arch.architecture == "apertus":
        yield from apertus_gguf_xielu(gf.metadata, arch.num_hidden_layers)
    for info in gf.tensors.values():
        if info.name in ROPE_TENSORS:
            continue
        parts = info.name.split(".")
        if arch.architecture in _MTP_BLOCK_ARCHITECTURES and parts[0] == "blk":
            if int(parts[1]) >= arch.num_hidden_layers:
                continue  # a multi-token-prediction block after the model's: not served
        if parts[2:3] == ["attn_v_b"]:
            continue  # joined with its attn_k_b
        if parts[2:3] == ["attn_k_b"]:  # llama.cpp's split of kv_b_proj, joined back
            v_b = gf.tensors[info.name.replace("attn_k_b", "attn_v_b")]
            kv_b = joined_kv_b(_dequantize(gf, info), _dequantize(gf, v_b))
            yield hf_weight_name(gf, info.name), torch.from_numpy(kv_b)
            continue
        if info.name in GEMMA3N_GGUF_STACKED:  # Gemma 3n's [3, H, H]: one HF linear each
            stacked = torch.from_numpy(_dequantize(gf, info))
            for i, matrix in enumerate(stacked):
                yield f"{GEMMA3N_GGUF_STACKED[info.name]}.{i}.weight", matrix.contiguous()
            continue
        if parts[2:3] and parts[2] in _EXPERT_NAMES and parts[-1] in ("weight", "bias"):
            yield from _expert_weights(gf, info, arch, keep_quantized)
            continue
        name = _moe_scope(hf_weight_name(gf, info.name), arch)
        if keep_quantized and len(info.shape) == 2 and in_blocks(info, name):
            # [rows, row bytes], a view of the file: its pages are read when a kernel repacks
            # them (then unmapped with the view) or runs on them, never copied at load, so peak
            # memory is the tiles plus one linear's blocks, not the file twice.
            tensor = torch.from_numpy(gf.tensor_bytes(info, writable=True))
        else:
            tensor = torch.from_numpy(_dequantize(gf, info))
        permuted = arch.architecture in _PERMUTED_QK_ARCHITECTURES
        if permuted and ".self_attn.q_proj." in name:
            tensor = unpermute_qk(tensor, arch.num_attention_heads, arch.rotary_dim)
        elif permuted and ".self_attn.k_proj." in name:
            tensor = unpermute_qk(tensor, arch.num_key_value_heads, arch.rotary_dim)
        elif permuted and name.endswith(PER_HEAD_NORMS) and tensor.dim() == 2:
            tensor = unpermute_head_rows(tensor, arch.rotary_dim)  # Command R+'s [heads, D]
        elif arch.architecture in GEMMA_GGUF_ARCHITECTURES and name.endswith("norm.weight"):
            tensor = tensor - 1.0  # llama.cpp stores Gemma's norm weights as 1 + w; HF's w
        elif name.endswith(".shared_expert_gate.weight") and tensor.dim() == 1:
            tensor = tensor.unsqueeze(0)  # llama.cpp's [hidden] vector is HF's [1, hidden]
        elif ".mamba." in name:
            tensor = mamba_gguf_tensor(name, tensor)
        elif arch.architecture in QWEN3_5_ARCHITECTURES:
            tensor = qwen3_5_gguf_tensor(name, tensor)
        # The permutation moves whole rows, so it applies to rows of blocks unchanged.
        yield (
            name,
            (
                QuantizedWeight(int(info.qtype), tensor.contiguous(), info.shape[1])
                if tensor.dtype == torch.uint8
                else tensor
            ),
        )


def in_blocks(info: GGUFTensorInfo, name: str) -> bool:
    """Whether a matrix (or stack of experts' matrices) is kept as the file holds it for the
    kernels: every block type's; a half type's where its rows split into 32-value runs and it is
    no norm's weight (Command R+ keeps one per head as a matrix, read by no kernel)."""
    if info.qtype in HALF_QTYPES:
        return info.shape[-1] % 32 == 0 and "norm" not in name
    return info.qtype in KERNEL_QTYPES


def _moe_scope(name: str, arch: ModelArch) -> str:
    """Mixtral's, GraniteMoE's and MiniMax-M2's HF names say block_sparse_moe where the dense
    ones say mlp."""
    if arch.architecture in ("mixtral", "granitemoe", "minimax_m2"):
        return name.replace(".mlp.", ".block_sparse_moe.")
    return name


_HF_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "ernie4_5_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    # GraniteMoE's per-expert names (model/granite.py splits HF's stacked tensors into them)
    "granitemoe": ("block_sparse_moe", ("gate_proj", "up_proj", "down_proj")),
    # gpt-oss's per-expert names (model/gpt_oss.py splits HF's stacked tensors into them)
    "gpt_oss": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    # Granite 4.0-H's, likewise (model/granite.py)
    "granitemoehybrid": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "lfm2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_5_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_next": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    **{name: ("mlp", ("gate_proj", "up_proj", "down_proj")) for name in ("glm4_moe", "dots1")},
    "minimax_m2": ("block_sparse_moe", ("w1", "w3", "w2")),
    **{name: ("mlp", ("gate_proj", "up_proj", "down_proj")) for name in DEEPSEEK_ARCHITECTURES},
    "gemma4": ("mlp", ("gate_proj", "up_proj", "down_proj")),  # Gemma4Experts.split_*
}


def _expert_weights(
    gf: GGUFFile, info: GGUFTensorInfo, arch: ModelArch, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """blk.N.ffn_{gate,up,down}_exps [E, rows, cols] -> E per-expert HF tensors: views of the
    stacked blocks (each expert's rows are contiguous) or of the dequantized array; their
    biases [E, rows] (gpt-oss's) -> E fp32 bias vectors. A fused ffn_gate_up_exps gives each
    expert's gate (its first half of rows) and up (the second)."""
    import torch

    _, layer, kind, suffix = info.name.split(".")
    rank = {"weight": 3, "bias": 2}.get(suffix)
    if arch.architecture not in _HF_EXPERT_NAMES or len(info.shape) != rank:
        raise ValueError(f"{gf.path}: unexpected GGUF tensor {info.name}")
    if info.shape[0] != arch.num_experts:
        raise ValueError(
            f"{gf.path}: tensor {info.name} holds {info.shape[0]} experts, "
            f"expert_count says {arch.num_experts}"
        )
    scope, names = _HF_EXPERT_NAMES[arch.architecture]
    prefix = f"model.layers.{layer}.{scope}.experts."
    parts = _EXPERT_NAMES[kind]
    rows = info.shape[1] // len(parts)  # each part's rows of an expert
    quantized = keep_quantized and suffix == "weight" and in_blocks(info, info.name)
    if quantized:  # [E, rows, row bytes]
        stacked = torch.from_numpy(gf.tensor_bytes(info, writable=True))
    else:  # [E, rows(, cols)] fp32
        stacked = torch.from_numpy(_dequantize(gf, info))
    for e in range(arch.num_experts):
        for i, part in enumerate(parts):
            mine = stacked[e, i * rows : (i + 1) * rows]
            name = f"{prefix}{e}.{names[part]}.{suffix}"
            yield name, QuantizedWeight(int(info.qtype), mine, info.shape[2]) if quantized else mine


def check_qtype(gf: GGUFFile, info: GGUFTensorInfo) -> None:
    """A ValueError naming the tensor and its type unless tokenbus runs that type (the IQ1, IQ2
    and IQ3 families, TQ1_0/TQ2_0 and the like are refused)."""
    if info.qtype not in SUPPORTED_QTYPES:
        supported = ", ".join(t.name for t in SUPPORTED_QTYPES)
        raise ValueError(
            f"{gf.path}: tensor {info.name} has unsupported type {info.qtype.name} "
            f"(supported: {supported})"
        )


def _dequantize(gf: GGUFFile, info: GGUFTensorInfo) -> np.ndarray:
    """[numpy shape] fp32, writable (a fresh array, not a view of the file)."""
    check_qtype(gf, info)
    weights = dequantize(gf.tensor_bytes(info), info.qtype)
    return weights if weights.flags.writeable else weights.copy()
