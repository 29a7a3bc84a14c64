"""A model's shape and weights from its files (config.json + safetensors, or GGUF)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

from tokenbus.loader.apertus_config import APERTUS_NORM_NAMES
from tokenbus.loader.bnb import bnb_dequantized, bnb_scheme
from tokenbus.loader.deepseek_config import DEEPSEEK_ARCHITECTURES
from tokenbus.loader.ernie_config import ERNIE_ARCHITECTURES, without_mtp
from tokenbus.loader.fp8 import dequantized_fp8, fp8_scheme
from tokenbus.loader.gguf_file import read_gguf
from tokenbus.loader.gguf_loader import (
    QuantizedWeight,
    arch_from_gguf,
    iter_gguf_weights,
)
from tokenbus.loader.glm4_moe_config import without_mtp_layers
from tokenbus.loader.hf_loader import (
    GLM4_NORM_NAMES,
    INTERLEAVED_ROTARY_ARCHITECTURES,
    arch_from_hf_config,
    iter_safetensors,
    read_json,
    safetensors_files,
)
from tokenbus.loader.hunyuan_config import HUNYUAN_NORM_NAMES
from tokenbus.loader.int_weights import packed_scheme, unpacked
from tokenbus.loader.lfm2_config import lfm2_names
from tokenbus.loader.multimodal_config import is_multimodal, text_model_weights
from tokenbus.loader.mxfp4 import gpt_oss_experts
from tokenbus.loader.qk_rows import PER_HEAD_NORMS, unpermute_head_rows, unpermute_qk
from tokenbus.loader.qwen3_5_config import QWEN3_5_ARCHITECTURES
from tokenbus.loader.qwen3_5_config import without_mtp as qwen3_5_without_mtp
from tokenbus.loader.source import ModelSource
from tokenbus.loader.weight_names import renamed_modules
from tokenbus.model_arch import ModelArch

if TYPE_CHECKING:  # torch is imported where tensors are made: the API server reads model
    import torch  # metadata through this module, and its start-up is shorter without torch


def load_arch(src: ModelSource) -> ModelArch:
    """The model's shape from metadata only (config.json or the GGUF header)."""
    if src.kind == "hf":
        config_path = src.path / "config.json"
        return arch_from_hf_config(read_json(config_path), config_path)
    return arch_from_gguf(read_gguf(src.path))


def iter_weights(
    src: ModelSource, arch: ModelArch, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF tensor name, tensor) pairs; GGUF tensors come with q/k un-permuted, dequantized to
    fp32 or (keep_quantized) as QuantizedWeight blocks where the native kernels run them, and so
    do gpt-oss's MXFP4 experts from safetensors (loader/mxfp4.py), the integers of GPTQ, AWQ
    and compressed-tensors files (loader/int_weights.py) and bitsandbytes' int8 rows
    (loader/bnb.py); FP8 matrices and bitsandbytes' 4-bit codes multiplied out to fp32;
    ERNIE's q/k rows from interleaved pairs to halves (ERNIE's, GLM-4's); an image-and-text
    checkpoint's text model's."""
    if src.kind == "hf":
        config_path = src.path / "config.json"
        config = read_json(config_path)
        weights = iter_safetensors(safetensors_files(src.path))
        # tensors never loaded go first (a vision tower, MTP layers: no work on their blocks)
        if is_multimodal(config):
            weights = text_model_weights(weights)
        if arch.architecture in ERNIE_ARCHITECTURES:
            weights = without_mtp(weights)
        if arch.architecture in QWEN3_5_ARCHITECTURES:
            weights = qwen3_5_without_mtp(weights)
        if arch.architecture in ("glm4_moe", *DEEPSEEK_ARCHITECTURES):
            weights = without_mtp_layers(weights, arch.num_hidden_layers)
        # then, before any module is renamed, quantized matrices meet their scales by name
        if (fp8 := fp8_scheme(config, config_path)) is not None:
            weights = dequantized_fp8(weights, fp8)
        if (packed := packed_scheme(config, config_path)) is not None:
            weights = unpacked(weights, packed, keep_quantized)
        if (bnb := bnb_scheme(config, config_path)) is not None:
            weights = bnb_dequantized(weights, bnb, keep_quantized)
        if arch.architecture == "gpt_oss":
            return gpt_oss_experts(weights, keep_quantized)
        if arch.architecture == "glm4":
            weights = renamed_modules(weights, GLM4_NORM_NAMES)
        if arch.architecture in ("lfm2", "lfm2_moe", "lfm3"):
            weights = lfm2_names(weights, sandwich=arch.architecture == "lfm3")
        if arch.architecture == "hunyuan_v1_dense":
            weights = renamed_modules(weights, HUNYUAN_NORM_NAMES)
        if arch.architecture == "apertus":
            weights = renamed_modules(weights, APERTUS_NORM_NAMES)
        if arch.architecture in INTERLEAVED_ROTARY_ARCHITECTURES:
            return _rotary_pairs_as_halves(weights, arch)
        return weights
    return iter_gguf_weights(read_gguf(src.path), arch, keep_quantized)


def _rotary_pairs_as_halves(
    weights: Iterator[tuple[str, torch.Tensor | QuantizedWeight]], arch: ModelArch
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """q/k projections whose rotary turns adjacent pairs (GPT-J's layout), their rows reordered
    so each pair's two dims stand half the rotary width apart, as NeoX's rotary turns them: the
    inverse of llama.cpp's permute (within the rotary dims of a partial one). q·k is unchanged;
    the rest passes as it is."""
    heads = {"q_proj": arch.num_attention_heads, "k_proj": arch.num_key_value_heads}
    for name, tensor in weights:
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in heads and parts[-3:-2] == ["self_attn"]:
            if isinstance(tensor, QuantizedWeight):  # whole rows move: rows of blocks too
                rows = unpermute_qk(tensor.data, heads[parts[-2]], arch.rotary_dim)
                tensor = dataclasses.replace(tensor, data=rows.contiguous())
            else:
                tensor = unpermute_qk(tensor, heads[parts[-2]], arch.rotary_dim)
        elif name.endswith(PER_HEAD_NORMS):
            if tensor.dim() == 2:  # a weight per head [heads, D] (Command R+'s)
                tensor = unpermute_head_rows(tensor, arch.rotary_dim)
        yield name, tensor
