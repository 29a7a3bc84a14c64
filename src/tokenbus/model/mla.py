"""Multi-head latent attention (L2): DeepSeek-V2's MLA (DeepSeek-V2/V3, Kimi K2, Moonlight,
GLM-4.7-Flash), its K/V cached compressed.

HF computes, for each token and query head h:
- the query [q_nope_h, q_pe_h] from q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))) through a
  rank-q_lora_rank bottleneck: qk_nope_head_dim unturned dims, then qk_rope_head_dim turned ones;
- one latent per token, kv_a_proj_with_mqa(x) = [c, k_pe]: c (kv_lora_rank values) normed by
  kv_a_layernorm, k_pe (qk_rope_head_dim) turned once and shared by every head;
- each head's key [W_UK_h c, k_pe] and value W_UV_h c, kv_b_proj's rows for that head being
  W_UK_h (qk_nope_head_dim of them) then W_UV_h (v_head_dim).

Since q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c, and the weighted sum of the values
sum_j p_j W_UV_h c_j = W_UV_h sum_j p_j c_j, the heads need not expand the latent: each query
is absorbed into it, [W_UK_h^T q_nope_h, q_pe_h], the attention runs over the latents alone
(MQA: every query head reads one KV head [c, k_pe] of kv_lora_rank + qk_rope_head_dim values,
arch.head_dim), and W_UV_h turns each head's output back. The values are the keys themselves:
the first kv_lora_rank dims of a head's output are sum_j p_j c_j, the rest are dropped. So the
cache holds kv_lora_rank + qk_rope_head_dim values per token and layer (K and V alike: the
pools keep the two halves), where expanded K/V would take heads * (qk_nope_head_dim +
qk_rope_head_dim + v_head_dim).

The rotary turns adjacent pairs of the rotary dims (HF's DeepSeek-V2 and V3 with
`rope_interleave`, llama.cpp's deepseek2: GPT-J's layout) or halves (NeoX's), as
arch.mla_rope_interleaved says.

Under tensor parallelism a rank holds its query heads' rows of q_b_proj (q_proj) and of
kv_b_proj, and their columns of o_proj; the latent (q_a, kv_a and their norms) is computed
whole on every rank, the one KV head replicated.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from tokenbus.model.attention import Plan, paged_attention
from tokenbus.model.layers import Linear, OpsModule, RMSNorm
from tokenbus.model.layers.quantized import dense
from tokenbus.model.layers.rotary import apply_rotary, yarn_mscale
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.weights import TensorSlicer, WeightLoader, copy_param, sliced
from tokenbus.model_arch import ModelArch

# The latents' RMSNorms (q_a_layernorm, kv_a_layernorm) take their class's default epsilon in
# transformers, whatever the config's rms_norm_eps (GLM-4.7-Flash's 1e-5)
LATENT_NORM_EPS = 1e-6


class LatentAttention(OpsModule):
    """MLA with the queries absorbed into the cached latent (the module docstring)."""

    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.cut = TensorSlicer(tp, arch)  # this rank's slices of the checkpoint's tensors
        self.num_heads = tp.shard_arch(arch).num_attention_heads
        self.nope_dim = arch.qk_nope_head_dim
        self.rope_dim = arch.rotary_dim  # arch.head_dim is kv_lora_rank + rotary_dim
        self.kv_lora_rank = arch.kv_lora_rank
        self.v_head_dim = arch.v_head_dim
        self.interleaved = arch.mla_rope_interleaved
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.scale = softmax_scale(arch)
        q_size = self.num_heads * self.qk_head_dim
        self.q_lora_rank = arch.q_lora_rank
        if self.q_lora_rank:
            self.q_a_proj = Linear(arch.hidden_size, (self.q_lora_rank,), bias=arch.attention_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, (q_size,))
        else:
            self.q_proj = Linear(arch.hidden_size, (q_size,))
        latent = self.kv_lora_rank + self.rope_dim
        self.kv_a_proj_with_mqa = Linear(arch.hidden_size, (latent,), bias=arch.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        # kv_b_proj's rows, per head: W_UK [H, nope, c] and W_UV [H, v, c], dense (small: the
        # absorbed products are batched matmuls over the heads)
        self.w_uk = nn.Parameter(
            torch.empty(self.num_heads, self.nope_dim, self.kv_lora_rank), requires_grad=False
        )
        self.w_uv = nn.Parameter(
            torch.empty(self.num_heads, self.v_head_dim, self.kv_lora_rank), requires_grad=False
        )
        self.o_proj = Linear(
            self.num_heads * self.v_head_dim, (arch.hidden_size,), bias=arch.attention_bias
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: Plan,
        q_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(num_tokens, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split((self.nope_dim, self.rope_dim), dim=-1)
        latent = self.kv_a_proj_with_mqa(x)
        c, k_pe = latent.split((self.kv_lora_rank, self.rope_dim), dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        q_pe, k_pe = self._rotate(q_pe, cos, sin), self._rotate(k_pe.unsqueeze(1), cos, sin)
        # [H, T, nope] @ [H, nope, c] -> each head's query in the latent's coordinates
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        query = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, c + rope]
        if q_scale is not None:
            query.mul_(q_scale)
        key = torch.cat((c.unsqueeze(1), k_pe), dim=-1)  # [T, 1, c + rope]: the one KV head
        out = paged_attention(query, key, key, kv_cache, slot_mapping, plan, self.scale)
        # [H, T, c] @ [H, c, v]: the values' latent sums turned into each head's value
        out = torch.bmm(out[..., : self.kv_lora_rank].transpose(0, 1), self.w_uv.transpose(1, 2))
        out = out.transpose(0, 1).reshape(num_tokens, self.num_heads * self.v_head_dim)
        return self.tp.all_reduce(self.o_proj(out))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, rope] turned by cos/sin [T, 1, rope / 2]: pair i is dims (2i, 2i + 1) when
        interleaved, else (i, i + rope / 2)."""
        if not self.interleaved:
            return apply_rotary(x, cos, sin)
        pairs = x.unflatten(-1, (-1, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        turned = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
        return turned.flatten(-2)

    # ------------------------------------------------------------------ weights
    def weight_loaders(self, prefix: str) -> dict[str, WeightLoader]:
        """HF names under `prefix` ("model.layers.N.self_attn.") -> loaders of this rank's
        share (a GGUF's split kv_b_proj is joined back at load: loader/deepseek_config.py)."""
        q_rows = self._head_slicer(self.qk_head_dim)
        loaders: dict[str, WeightLoader] = {
            f"{prefix}kv_a_layernorm.weight": partial(copy_param, self.kv_a_layernorm.weight),
            f"{prefix}kv_b_proj.weight": self._load_kv_b,
        }
        # (linear, HF name, weight slicer, bias slicer): the latent's projections whole on
        # every rank, o_proj row-parallel (its bias added once, on rank 0)
        o_columns = self.cut.columns(self._head_slicer(self.v_head_dim))
        o_bias = self.cut.rank0_only()
        linears = [
            (self.kv_a_proj_with_mqa, "kv_a_proj_with_mqa", None, None),
            (self.o_proj, "o_proj", o_columns, o_bias),
        ]
        if self.q_lora_rank:
            loaders[f"{prefix}q_a_layernorm.weight"] = partial(
                copy_param, self.q_a_layernorm.weight
            )
            linears += [
                (self.q_a_proj, "q_a_proj", None, None),
                (self.q_b_proj, "q_b_proj", q_rows, None),
            ]
        else:
            linears.append((self.q_proj, "q_proj", q_rows, None))
        for linear, name, weight_slice, bias_slice in linears:
            loaders[f"{prefix}{name}.weight"] = sliced(linear.load_shard, weight_slice)
            if linear.bias is not None:
                load_bias = partial(linear.load_shard, is_bias=True)
                loaders[f"{prefix}{name}.bias"] = sliced(load_bias, bias_slice)
        return loaders

    def _head_slicer(self, rows_per_head: int):
        """This rank's heads' rows of a tensor of `rows_per_head` rows a head (None: all)."""
        count = self.num_heads * rows_per_head
        return self.cut.rows(self.tp.rank * count, count)

    def _load_kv_b(self, name: str, tensor) -> None:
        """kv_b_proj [H * (nope + v), c]: each head's W_UK rows, then its W_UV rows."""
        weight = dense(tensor)
        per_head = self.nope_dim + self.v_head_dim
        full_heads = self.num_heads * self.tp.size
        if tuple(weight.shape) != (full_heads * per_head, self.kv_lora_rank):
            raise ValueError(
                f"weight {name}: expected shape {[full_heads * per_head, self.kv_lora_rank]}, "
                f"got {list(weight.shape)}"
            )
        heads = weight.view(full_heads, per_head, self.kv_lora_rank)
        mine = heads[self.tp.rank * self.num_heads : (self.tp.rank + 1) * self.num_heads]
        copy_param(self.w_uk, name, mine[:, : self.nope_dim])
        copy_param(self.w_uv, name, mine[:, self.nope_dim :])


def latent_attention_loaders(layers) -> dict[str, WeightLoader]:
    """The HF-named loaders of every layer's LatentAttention (a family whose layers hold one
    adds them to the rest: decoder layers name only decoder.Attention's)."""
    loaders: dict[str, WeightLoader] = {}
    for idx, layer in enumerate(layers):
        if isinstance(layer.self_attn, LatentAttention):
            loaders.update(layer.self_attn.weight_loaders(f"model.layers.{idx}.self_attn."))
    return loaders


def softmax_scale(arch: ModelArch) -> float:
    """(qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times YaRN's mscale(factor,
    mscale_all_dim) squared under a YaRN rotary that names mscale_all_dim (transformers'
    yarn_apply_mscale; llama.cpp's deepseek2 kq_scale)."""
    scale = (arch.qk_nope_head_dim + arch.rotary_dim) ** -0.5
    scaling = arch.rope_scaling or {}
    if scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return scale
