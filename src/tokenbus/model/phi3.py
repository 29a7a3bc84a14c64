"""Phi-3 / Phi-4 (`Phi3ForCausalLM`: Phi-3-mini/medium, Phi-3.5-mini, Phi-4, Phi-4-mini): the
Llama decoder without biases, whose checkpoints store q/k/v as one `qkv_proj` [Hq*D + 2*Hkv*D,
hidden] and gate/up as one `gate_up_proj` [2*I, hidden] (gate first), as our linears hold them.

Each fused tensor is cut, along its rows, into the q/k/v (gate/up) parts the shared loaders
take, so tensor parallelism slices each part as for a Llama: rank r gets its query heads, its
KV heads and its share of gate and of up. GGUF blocks are cut the same way (whole rows of
blocks), and the linear stacks them back into one kernel weight.

LongRoPE and partial rotary (Phi-4-mini) live in model/layers/rotary.py; Phi-3's
`sliding_window` narrows every layer, as Mistral's.
"""

from __future__ import annotations

from tokenbus.model.causal_lm import CausalLM
from tokenbus.model.decoder import Attention, DecoderLayer, GatedMLP
from tokenbus.model.parallel import TensorParallel
from tokenbus.model.weights import WeightLoader, fused_rows_loader
from tokenbus.model_arch import ModelArch


class Phi3ForCausalLM(CausalLM):
    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> DecoderLayer:
        return DecoderLayer(arch, Attention(arch, tp), GatedMLP(arch, tp))

    def _weight_loaders(self) -> dict[str, WeightLoader]:
        loaders = super()._weight_loaders()
        arch = self.arch
        q_rows = arch.num_attention_heads * arch.head_dim
        kv_rows = arch.num_key_value_heads * arch.head_dim
        fused = {  # fused name -> (its parts' names, their full row counts)
            "self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"), (q_rows, kv_rows, kv_rows)),
            "mlp.gate_up_proj": (("gate_proj", "up_proj"), (arch.intermediate_size,) * 2),
        }
        for idx in range(self.num_layers):
            prefix = f"model.layers.{idx}."
            for name, (parts, sizes) in fused.items():
                scope = name.split(".")[0]
                part_loaders = [loaders.pop(f"{prefix}{scope}.{part}.weight") for part in parts]
                loaders[f"{prefix}{name}.weight"] = fused_rows_loader(part_loaders, sizes)
        return loaders
