"""HF checkpoint directories: config.json -> ModelArch; *.safetensors (sharded or not) ->
weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from tokenbus.config import ModelArch

if TYPE_CHECKING:  # torch is imported where tensors are made: the API server reads model
    import torch  # metadata through this module, and its start-up is shorter without torch

# HF `architectures` entry -> ModelArch.architecture (model_type); model/registry.py builds each.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# Rope types we pass on to the model (model/layers/rotary.py ROPE_TYPES; a test keeps them in sync).
HF_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_REQUIRED_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def arch_from_hf_config(config: dict[str, Any], path: Path) -> ModelArch:
    """Resolve a config.json (transformers 4.x or 5.x layout) into a ModelArch."""
    architecture = _architecture(config, path)

    def need(key: str) -> Any:
        if config.get(key) is None:
            raise ValueError(f"{path}: missing {key!r}")
        return config[key]

    if config.get("mlp_bias"):
        raise ValueError(f"{path}: mlp_bias=true is not supported")
    hidden_size, num_heads = need("hidden_size"), need("num_attention_heads")
    rope_theta, rope_scaling = _rope(config, path)
    eos = config.get("eos_token_id")
    return ModelArch(
        architecture=architecture,
        vocab_size=need("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=need("intermediate_size"),
        num_hidden_layers=need("num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or hidden_size // num_heads,
        max_position_embeddings=_max_positions(config, architecture),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=architecture == "qwen2" or bool(config.get("attention_bias", False)),
        hidden_act=config.get("hidden_act", "silu"),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        **_moe_fields(config, architecture, path),
    )


def _moe_fields(config: dict[str, Any], architecture: str, path: Path) -> dict[str, Any]:
    """ModelArch's MoE fields (model/moe.py) of a Mixtral or Qwen3-MoE config; {} otherwise.
    Fields we do not implement (shared experts) are refused, naming them."""
    if architecture not in ("mixtral", "qwen3_moe"):
        return {}
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if config.get(key):
            raise ValueError(f"{path}: {key} (shared experts) is not supported for {architecture}")
    num_experts = config.get("num_local_experts") or config.get("num_experts")
    top_k = config.get("num_experts_per_tok")
    if not num_experts or not top_k:
        raise ValueError(
            f"{path}: an MoE config needs 'num_local_experts' and 'num_experts_per_tok'"
        )
    num_layers = int(config["num_hidden_layers"])
    if architecture == "mixtral":
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=config["intermediate_size"],
            norm_topk_prob=True,
        )
    step = int(config.get("decoder_sparse_step") or 1)
    only = set(config.get("mlp_only_layers") or ())
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=config.get("moe_intermediate_size") or config["intermediate_size"],
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        dense_layers=tuple(i for i in range(num_layers) if i in only or (i + 1) % step),
    )


def _architecture(config: dict[str, Any], path: Path) -> str:
    model_type = config.get("model_type")
    if model_type in HF_ARCHITECTURES.values():
        return model_type
    for name in config.get("architectures") or ():
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    found = model_type or config.get("architectures")
    raise ValueError(
        f"{path}: unsupported model architecture {found!r} "
        f"(supported: {', '.join(HF_ARCHITECTURES)})"
    )


def _rope(config: dict[str, Any], path: Path) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from 5.x `rope_parameters` or 4.x
    `rope_theta`/`rope_scaling`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in HF_ROPE_TYPES:
        raise ValueError(
            f"{path}: unsupported rope type {rope_type!r} (supported: {', '.join(HF_ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{path}: partial_rotary_factor != 1 is not supported")
    missing = [key for key in _ROPE_REQUIRED_KEYS.get(rope_type, ()) if key not in params]
    if missing:
        raise ValueError(f"{path}: rope type {rope_type!r} needs {missing}")
    return theta, None if rope_type == "default" else {**params, "rope_type": rope_type}


def _max_positions(config: dict[str, Any], architecture: str) -> int:
    """Context length; capped at a sliding window, since our attention always sees the full
    context."""
    max_positions = int(config.get("max_position_embeddings", 2048))
    window = config.get("sliding_window")
    uses_window = architecture in ("mistral", "mixtral") or config.get("use_sliding_window", False)
    return min(max_positions, window) if uses_window and window else max_positions


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: missing 'weight_map'")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ValueError(f"{index}: shard {file.name} not found in {directory}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors weights found")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from each file; a damaged file raises ValueError naming it."""
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(
                f"{file}: cannot read safetensors weights (truncated or corrupted?): {e}"
            ) from e
