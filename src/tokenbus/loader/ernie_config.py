"""ERNIE 4.5 shapes: what its config.json says beyond a Llama's or an MoE decoder's (L2; no
torch). hf_loader / gguf_loader join these ModelArch fields to the rest.

- Rotary: ERNIE turns adjacent pairs of each head's dims (GPT-J's interleaved layout, llama.cpp's
  rope type "norm"), where our kernels turn each dim with the one half a head away (NeoX's).
  Its q/k rows are reordered at load, interleaved pairs to halves (model_loader.py, as llama.cpp's
  Llama GGUFs are read): q·k is unchanged, and every rotary path serves it. llama.cpp's converter
  writes ERNIE's rows as they are, so its GGUF is read the same way.
- MoE (Ernie4_5_MoeForCausalLM): `moe_num_experts` experts, `moe_k` a token, chosen by their
  softmax probabilities plus a per-expert bias (`moe_statics.e_score_correction_bias`), weighed
  by the probabilities renormalised over the k (`moe_norm_min` clamps that sum, never reached
  by k probabilities in fp32: not modelled). The layers from `moe_layer_start_index` to
  `moe_layer_end_index` on the `moe_layer_interval` are MoE, the others dense. A shared MLP of
  `moe_num_shared_experts` experts' width is added ungated.
- `use_bias` (biases on every linear) is refused: the released models have none.
- Its multi-token-prediction head (`model.mtp_*`, for training) is not read, as transformers and
  llama.cpp's converter leave it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

ERNIE_ARCHITECTURES = ("ernie4_5", "ernie4_5_moe")
ERNIE_GGUF_ARCHITECTURES = {"ernie4_5": "ernie4_5", "ernie4_5-moe": "ernie4_5_moe"}


def check_ernie(config: dict[str, Any], path: Path) -> None:
    if config.get("use_bias"):
        raise ValueError(f"{path}: use_bias=true is not supported for ERNIE 4.5")


def ernie_hf_moe_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """ModelArch's MoE fields of an Ernie4_5_MoeForCausalLM config."""
    num_layers = int(config["num_hidden_layers"])
    for key in ("moe_num_experts", "moe_k", "moe_intermediate_size"):
        if not config.get(key):
            raise ValueError(f"{path}: an ERNIE 4.5 MoE config needs {key!r}")
    start = int(config.get("moe_layer_start_index", 0))
    end = config.get("moe_layer_end_index")
    end = num_layers - 1 if end is None or end < 0 else int(end)
    interval = int(config.get("moe_layer_interval") or 1)
    width = int(config["moe_intermediate_size"])
    return dict(
        num_experts=int(config["moe_num_experts"]),
        num_experts_per_tok=int(config["moe_k"]),
        moe_intermediate_size=width,
        norm_topk_prob=True,
        moe_selection_bias=True,
        shared_expert_intermediate_size=width * int(config.get("moe_num_shared_experts") or 0),
        shared_expert_gated=False,
        # Ernie4_5_MoeDecoderLayer's test, as it is
        dense_layers=tuple(
            i for i in range(num_layers) if not ((i + 1) % interval == 0 and start <= i <= end)
        ),
    )


def without_mtp(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors but its multi-token-prediction head's (model.mtp_*)."""
    return ((name, tensor) for name, tensor in weights if not name.startswith("model.mtp_"))
