"""The body MoE families share (L2): a decoder whose MLPs are model/moe.py's SparseMoeBlocks."""

from __future__ import annotations

from tokenbus.model.causal_lm import CausalLM
from tokenbus.model.decoder import Attention, DecoderLayer, GatedMLP, QKNorm
from tokenbus.model.moe import SparseMoeBlock, skip_weight, stacked_experts_split
from tokenbus.model.parallel import TensorParallel
from tokenbus.model.weights import WeightLoader, load_strictly
from tokenbus.model_arch import ModelArch


class MoECausalLM(CausalLM):
    """A decoder whose MLPs are SparseMoeBlocks, except arch.dense_layers (a GatedMLP). A
    subclass names its family (EXPERT_NAMES), the HF scope of its MoE block and its attention's
    q/k norms; q/k/v and o_proj carry biases where the config says `attention_bias`."""

    family = ""
    moe_scope = "mlp."
    qk_norm = QKNorm.NONE

    def make_attention(self, arch: ModelArch, tp: TensorParallel) -> Attention:
        bias = arch.attention_bias
        return Attention(arch, tp, qkv_bias=bias, o_bias=bias, qk_norm=self.qk_norm)

    def make_layer(self, arch: ModelArch, tp: TensorParallel) -> DecoderLayer:
        return DecoderLayer(arch, self.make_attention(arch, tp), self.make_mlp(arch, tp))

    def make_mlp(self, arch: ModelArch, tp: TensorParallel) -> GatedMLP | SparseMoeBlock:
        """The MLP of the layer being made: dense in arch.dense_layers, sparse elsewhere."""
        if self.making_layer in arch.dense_layers:
            return GatedMLP(arch, tp)
        return SparseMoeBlock(arch, tp)

    def _weight_loaders(self) -> dict[str, WeightLoader]:
        loaders = super()._weight_loaders()
        for idx, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                prefix = f"model.layers.{idx}.{self.moe_scope}"
                loaders.update(layer.mlp.skipped_names(prefix, self.family))
                loaders.update(layer.mlp.weight_loaders(prefix, self.family))
        return loaders

    def load_weights(self, weights) -> None:
        # Other ranks' experts are known names: fed to a no-op, and not required. Experts
        # stacked as transformers 5 saves them are read per expert.
        loaders = self._weight_loaders()
        skipped = {name for name, loader in loaders.items() if loader is skip_weight}
        load_strictly(loaders, stacked_experts_split(weights), self.arch, optional=skipped)
