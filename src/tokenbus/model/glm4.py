"""GLM-4 (Glm4ForCausalLM: GLM-4-9B-0414, GLM-Z1-9B): Llama's attention and MLP in Gemma 2's
sandwich block, x + post_self_attn_norm(attn(input_norm(x))), then
+ post_mlp_norm(mlp(post_attention_norm(.))) (decoder.SandwichDecoderLayer; its HF norms go by
their own names, which the loader maps onto the block's).

- q/k/v carry biases (`attention_bias`), o_proj none.
- The rotary turns the first half of each head (`partial_rotary_factor` 0.5) in adjacent pairs
  (GPT-J's layout); the loader reorders those rows, pairs to halves, so our rotary turns them
  (loader/model_loader.py; llama.cpp's converter writes them as they are, read the same way).
- Gate and up come as one `gate_up_proj` [2 * I, hidden] (gate first), as Phi-3's.
"""

from __future__ import annotations

from tokenbus.model.causal_lm import CausalLM
from tokenbus.model.decoder import Attention, GatedMLP, SandwichDecoderLayer
from tokenbus.model.parallel import TensorParallel
from tokenbus.model.weights import WeightLoader, fused_rows_loader
from tokenbus.model_arch import ModelArch


class Glm4ForCausalLM(CausalLM):
    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> SandwichDecoderLayer:
        attention = Attention(arch, tp, qkv_bias=arch.attention_bias, o_bias=False)
        return SandwichDecoderLayer(arch, attention, GatedMLP(arch, tp))

    def _weight_loaders(self) -> dict[str, WeightLoader]:
        loaders = super()._weight_loaders()
        sizes = (self.arch.intermediate_size,) * 2
        for idx in range(self.num_layers):
            prefix = f"model.layers.{idx}.mlp."
            parts = [loaders.pop(f"{prefix}{part}.weight") for part in ("gate_proj", "up_proj")]
            loaders[f"{prefix}gate_up_proj.weight"] = fused_rows_loader(parts, sizes)
        return loaders
