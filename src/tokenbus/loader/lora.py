"""LoRA adapters in PEFT's format: a directory with adapter_config.json and
adapter_model.safetensors (L2).

`read_adapter_config` checks what an adapter asks for without reading its tensors (the front
end refuses a bad adapter before a request reaches the engine); `load_adapter` reads the
low-rank pairs for the worker, keyed by the HF module each one adapts:
"model.layers.3.self_attn.q_proj" → (A [r, in], B [out, r], scaling).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from tokenbus.loader.hf_loader import read_json
from tokenbus.model_arch import ModelArch

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The modules of a Llama-family decoder layer an adapter may target, each under the scope that
# holds it (model/lora.py maps each onto its fused linear: q/k/v → qkv_proj, gate/up →
# gate_up_proj). The scope is checked: LFM3's attention has a gate_proj of its own (a per-head
# gate), which is not the MLP's.
TARGET_SCOPES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
TARGET_MODULES = tuple(TARGET_SCOPES)
# PEFT's names: base_model.model.<HF module>.lora_A.weight (the adapter's own name is dropped).
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.(?P<module>model\.layers\.\d+\.(?P<scope>\w+)\.(?P<target>\w+))"
    r"\.lora_(?P<part>[AB])\.weight$"
)
# Options that change what the adapter computes and that we do not implement: refused, never
# ignored. The value is the one that means "off".
_OFF_OPTIONS: dict[str, Any] = {
    "use_dora": False,
    "lora_bias": False,
    "fan_in_fan_out": False,
    "use_qalora": False,
    "use_bdlora": None,
    "modules_to_save": None,
    "layer_replication": None,
    "target_parameters": None,
    "trainable_token_indices": None,
    "alora_invocation_tokens": None,
    "alpha_pattern": {},
}


@dataclass(frozen=True)
class AdapterConfig:
    path: Path
    rank: int  # the largest rank of any module (rank_pattern may lower some)
    lora_alpha: float
    use_rslora: bool
    max_rank: int  # the engine's --max-lora-rank, which every module must keep under

    def scaling(self, rank: int) -> float:
        """PEFT's factor on B·A for a module of this rank: alpha / r (rsLoRA: / sqrt(r))."""
        return self.lora_alpha / (rank**0.5 if self.use_rslora else rank)


def read_adapter_config(path: str | Path, max_rank: int) -> AdapterConfig:
    """The adapter's settings, checked: a ValueError names what we cannot run."""
    root = Path(path)
    if not (root / CONFIG_FILE).is_file():
        raise ValueError(f"LoRA adapter {root}: no {CONFIG_FILE} (a PEFT adapter directory)")
    if not (root / WEIGHTS_FILE).is_file():
        raise ValueError(
            f"LoRA adapter {root}: no {WEIGHTS_FILE} (adapters are read from safetensors only)"
        )
    config = read_json(root / CONFIG_FILE)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {root}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {root}: bias {config['bias']!r} is not supported")
    for option, off in _OFF_OPTIONS.items():
        value = config.get(option, off)
        if value != off and not (off is None and value in ({}, [])):
            raise ValueError(f"LoRA adapter {root}: {option}={value!r} is not supported")
    rank = config.get("r")
    ranks = [rank, *dict(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and r > 0 for r in ranks):
        raise ValueError(f"LoRA adapter {root}: r must be a positive integer, got {rank!r}")
    if max(ranks) > max_rank:
        raise ValueError(
            f"LoRA adapter {root}: rank {max(ranks)} is above --max-lora-rank {max_rank}"
        )
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise ValueError(
                f"LoRA adapter {root}: target modules {unknown} are not supported "
                f"(supported: {', '.join(TARGET_MODULES)})"
            )
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {root}: lora_alpha must be a number, got {alpha!r}")
    return AdapterConfig(
        root, max(ranks), float(alpha), bool(config.get("use_rslora", False)), max_rank
    )


LoRAPair = tuple["torch.Tensor", "torch.Tensor", float]  # A [r, in], B [out, r], scaling


def module_shape(arch: ModelArch, module: str) -> tuple[int, int]:
    """(in, out) features of the HF module "model.layers.<i>.<scope>.<target>" in `arch`."""
    layer, target = int(module.split(".")[2]), module.rsplit(".", 1)[1]
    if layer >= arch.num_hidden_layers:
        raise ValueError(f"{module}: the model has {arch.num_hidden_layers} layers")
    # the layer's own shape where layers differ (Gemma 4's global heads, double-wide MLPs)
    kv_heads, head_dim = arch.kv_shape(layer)
    q_size, kv_size = arch.num_attention_heads * head_dim, kv_heads * head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    if arch.layer_intermediate_sizes:
        inter = arch.layer_intermediate_sizes[layer]
    missing = _missing_projections(arch, layer)
    if target in missing:
        raise ValueError(f"{module}: layer {layer} has no {target} ({missing[target]})")
    return {
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[target]


def _missing_projections(arch: ModelArch, layer: int) -> dict[str, str]:
    """The projections a layer lacks, and why: a layer reading another's K/V has no k or v
    (Gemma 3n's, Gemma 4's); a Gemma 4 global layer whose values are its keys has no v."""
    if arch.kv_owner(layer) != layer:
        reason = f"it attends layer {arch.kv_owner(layer)}'s K/V"
        return {"k_proj": reason, "v_proj": reason}
    global_layer = not arch.sliding_windows or arch.sliding_windows[layer] is None
    if arch.attn_k_eq_v and global_layer:
        return {"v_proj": "its values are its keys' projection"}
    return {}


def check_adapter(path: str | Path, max_rank: int, arch: ModelArch) -> None:
    """Everything `load_adapter` would refuse, from the file headers only (no tensor read):
    the engine checks an adapter before any worker loads it."""
    config = read_adapter_config(path, max_rank)
    _pairs(config, _read(config, lambda weights, name: weights.get_slice(name).get_shape()), arch)


def load_adapter(path: str | Path, max_rank: int, arch: ModelArch) -> dict[str, LoRAPair]:
    """HF module name → its (A, B, scaling), every tensor checked for name, rank and shape."""
    config = read_adapter_config(path, max_rank)
    tensors = _read(config, lambda weights, name: weights.get_tensor(name))
    shapes = {
        module: {part: list(t.shape) for part, t in parts.items()}
        for module, parts in tensors.items()
    }
    ranks = _pairs(config, shapes, arch)
    return {
        module: (parts["A"], parts["B"], config.scaling(ranks[module]))
        for module, parts in tensors.items()
    }


def _read(config: AdapterConfig, get: Any) -> dict[str, dict[str, Any]]:
    """HF module → {"A": get(A's name), "B": get(B's name)}; any other tensor is refused."""
    halves: dict[str, dict[str, Any]] = {}
    try:
        with safe_open(str(config.path / WEIGHTS_FILE), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                match = _TENSOR_NAME.match(name)
                if match is None or TARGET_SCOPES.get(match["target"]) != match["scope"]:
                    supported = ", ".join(f"{s}.{t}" for t, s in TARGET_SCOPES.items())
                    raise ValueError(
                        f"LoRA adapter {config.path}: tensor {name} adapts a module we do not "
                        f"support (supported: {supported} of decoder layers)"
                    )
                halves.setdefault(match["module"], {})[match["part"]] = get(weights, name)
    except SafetensorError as exc:
        raise ValueError(f"LoRA adapter {config.path}: cannot read {WEIGHTS_FILE}: {exc}") from exc
    if not halves:
        raise ValueError(f"LoRA adapter {config.path}: {WEIGHTS_FILE} holds no LoRA tensors")
    return halves


def _pairs(
    config: AdapterConfig, shapes: dict[str, dict[str, list[int]]], arch: ModelArch
) -> dict[str, int]:
    """Each module's rank, once its A [r, in] and B [out, r] fit the model and the limit."""
    ranks: dict[str, int] = {}
    for module, parts in shapes.items():
        if set(parts) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {config.path}: {module} lacks lora_A or lora_B")
        try:
            in_features, out_features = module_shape(arch, module)
        except ValueError as exc:
            raise ValueError(f"LoRA adapter {config.path}: {exc}") from exc
        a, b = list(parts["A"]), list(parts["B"])
        rank = a[0] if a else 0
        if a != [rank, in_features] or b != [out_features, rank] or rank < 1:
            raise ValueError(
                f"LoRA adapter {config.path}: {module} has lora_A {a} and lora_B {b}; this "
                f"model needs [r, {in_features}] and [{out_features}, r]"
            )
        if rank > config.max_rank:
            raise ValueError(
                f"LoRA adapter {config.path}: {module} has rank {rank}, above --max-lora-rank "
                f"{config.max_rank}"
            )
        ranks[module] = rank
    return ranks
