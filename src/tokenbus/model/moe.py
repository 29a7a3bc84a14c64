"""A sparse mixture-of-experts MLP (L2): Mixtral's and Qwen3-MoE's, and Qwen2-MoE's and
ERNIE 4.5's with a shared expert.

Routing: a router linear (`gate`, [E, hidden]) gives each token E logits; softmax over all E
in fp32, the top k kept, and (norm_topk_prob) renormalised to sum to 1. Mixtral's "softmax of
the top-k logits" is the same numbers (the renormalised top-k of a softmax), so both families
share this one rule, with norm_topk_prob always on for Mixtral. ERNIE 4.5 chooses its top k
by the probabilities plus a per-expert bias (`selection_bias`, its e_score_correction_bias),
the weights still the chosen experts' probabilities. LFM2-MoE's router scores each expert by
its own sigmoid instead of a softmax (arch.moe_scoring), chooses by score + bias as ERNIE does,
renormalises with HF's 1e-6 in the sum (arch.moe_norm_eps), and scales the weights by
routed_scaling_factor. GLM-4.5's (DeepSeek-V3's) router is LFM2-MoE's with 1e-20 for the 1e-6,
and may limit the choice to the best groups of experts (arch.moe_groups, moe_topk_groups):
each group scored by its two best biased scores, the other groups' experts masked off.
PhiMoE's sparsemixer picks its two experts one by one (`sparsemixer`).

The expert step is fused over the batch: the T*k (token, expert) pairs are sorted by expert
(a stable argsort), so each expert's tokens are one contiguous run; each active expert runs
once on its gathered rows (gate_up -> silu*up -> down, through the linear kernels the kernel
plan chose: packed oneDNN for dense weights, the GGUF blocks kept quantized otherwise), its
rows are scaled by their routing weights and added back with one index_add_. The Python loop is
over active experts (at most E), never over tokens, and experts run in ascending order, as HF's
does, so the sums per token are taken in HF's order. A decode-sized step on CPU runs the
same pipeline in C inside its layer (native/decode_layer.c, moe_mlp), where the plan allows.

Reading the counts waits on the device, once per layer, and a CUDA graph cannot record it. So
on CUDA with the Triton backend, where the experts are dense, the kernel plan stacks them
(`stack_experts`: HF's [E, 2I, hidden] and [E, hidden, I] layout, each expert's linears then
views of it) and the step runs model/triton_moe.py's grouped GEMMs instead, nothing read
back: equal to this path in fp32 up to summation order, to rounding in bf16 and fp16.

Tensor parallelism is expert parallel: a rank holds whole experts [r*E/size, (r+1)*E/size)
and the router whole; every rank routes every token, runs only its own experts, and one
all-reduce sums the ranks' partial outputs (the same single all-reduce a dense MLP has).
Whole experts keep each kernel call at the expert's full width (a slice of I/size columns would
halve every call's work while keeping its fixed cost) and need no slicing of quantized blocks.

A shared expert runs on every token beside the routed ones and is added after them, as HF adds
it: scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE's) or as it is (ERNIE 4.5's). It is one
whole expert too: rank 0 holds and runs it, so the same one all-reduce sums it in.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial

import torch
from torch import nn

from tokenbus.model.layers import Linear, OpsModule
from tokenbus.model.parallel import SINGLE, TensorParallel
from tokenbus.model.weights import WeightLoader
from tokenbus.model_arch import ModelArch

# An expert's HF tensor names per family: (gate, up, down).
EXPERT_NAMES = {
    "mixtral": ("w1", "w3", "w2"),
    "phimoe": ("w1", "w3", "w2"),
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
    "ernie4_5_moe": ("gate_proj", "up_proj", "down_proj"),
    "olmoe": ("gate_proj", "up_proj", "down_proj"),
    "granitemoe": ("gate_proj", "up_proj", "down_proj"),  # split from HF's stacked tensors
    "gpt_oss": ("gate_proj", "up_proj", "down_proj"),  # split from HF's stacked tensors
    "granitemoehybrid": ("gate_proj", "up_proj", "down_proj"),  # likewise
    "lfm2_moe": ("gate_proj", "up_proj", "down_proj"),  # renamed from w1, w3, w2 at load
    "qwen3_5_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen3_next": ("gate_proj", "up_proj", "down_proj"),
    "glm4_moe": ("gate_proj", "up_proj", "down_proj"),
    "minimax_m2": ("w1", "w3", "w2"),
    "deepseek": ("gate_proj", "up_proj", "down_proj"),
    "gemma4": ("gate_proj", "up_proj", "down_proj"),  # a GGUF's, split at load
}


# A family's shared expert's HF names under the MoE block: (expert, its gate or None).
SHARED_EXPERT_NAMES = {
    "qwen2_moe": ("shared_expert", "shared_expert_gate"),
    "qwen3_5_moe": ("shared_expert", "shared_expert_gate"),
    "qwen3_next": ("shared_expert", "shared_expert_gate"),
    "ernie4_5_moe": ("shared_experts", None),
    "granitemoehybrid": ("shared_experts", None),  # Granite 4.0-H's shared_mlp
    "glm4_moe": ("shared_experts", None),
    "deepseek": ("shared_experts", None),
}
# The experts' gate activations (ModelArch.hidden_act): SiLU, Gemma 4's tanh GELU
EXPERT_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# How a router's logits become probabilities (ModelArch.moe_scoring)
MOE_SCORINGS = ("softmax", "sigmoid", "sparsemixer")
# ERNIE 4.5's selection bias, under the MoE block ([1, E] in HF's checkpoints); the families
# that name it otherwise (GLM-4.5's router holds it, MiniMax-M2's MoE block)
SELECTION_BIAS_NAME = "moe_statics.e_score_correction_bias"
SELECTION_BIAS_NAMES = {
    "glm4_moe": "gate.e_score_correction_bias",
    "minimax_m2": "e_score_correction_bias",
    "deepseek": "gate.e_score_correction_bias",  # DeepSeek-V3's
}


def sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's routing at inference (HF's sparsemixer, not training): (weights [T, 2], expert
    ids [T, 2]). The best expert first; its weight is its softmax share among the experts whose
    logit lies within a relative 2 eps of the best ((best - s) / max(|s|, best) <= 2 eps), the
    others masked off. Then the same over the experts left, the first masked off, the relative
    gap still measured against every logit's own |s|. Neither pair is renormalised. On the fp32
    logits, as every router here: HF takes them in the router's dtype, so a bf16 model's mask
    edge and weights may differ from HF's by that rounding."""
    ids, weights = [], []
    left = logits
    for _ in range(2):
        best, chosen = left.max(dim=-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * eps
        weights.append(torch.softmax(left.masked_fill(far, float("-inf")), -1).gather(-1, chosen))
        ids.append(chosen)
        left = left.scatter(-1, chosen, float("-inf"))
    return torch.cat(weights, -1), torch.cat(ids, -1)


class Expert(nn.Module):
    """One expert's gated MLP: gate and up as one linear [2I, hidden], down [hidden, I]; each
    with a bias where the family has them (gpt-oss)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, (intermediate_size, intermediate_size), bias=bias)
        self.down_proj = Linear(intermediate_size, (hidden_size,), bias=bias)


class SparseMoeBlock(OpsModule):
    """x [T, hidden] -> the routed experts' weighted sum [T, hidden]. `bias`: the router and
    every expert's linears carry biases (gpt-oss's); with arch.swiglu_limit set the experts'
    activation is gpt-oss's clamped SwiGLU instead of SiLU. Only SiLU experts without biases
    run stacked (stack_experts: triton_moe.py's grouped GEMMs compute those)."""

    def __init__(self, arch: ModelArch, tp: TensorParallel = SINGLE, bias: bool = False) -> None:
        super().__init__()
        if arch.hidden_act not in EXPERT_ACTIVATIONS:
            raise ValueError(
                f"hidden_act: experts take {' or '.join(EXPERT_ACTIVATIONS)}, "
                f"got {arch.hidden_act!r}"
            )
        if not 0 < arch.num_experts_per_tok <= arch.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={arch.num_experts}], "
                f"got {arch.num_experts_per_tok}"
            )
        if arch.num_experts % tp.size:
            raise ValueError(
                f"tensor_parallel_size={tp.size} does not divide the {arch.num_experts} experts "
                "of this model (experts are split whole across ranks)"
            )
        self.tp = tp
        self.num_experts = arch.num_experts
        self.top_k = arch.num_experts_per_tok
        if arch.moe_scoring not in MOE_SCORINGS:
            raise ValueError(
                f"moe_scoring: {arch.moe_scoring!r} is not supported "
                f"(supported: {', '.join(MOE_SCORINGS)})"
            )
        # PhiMoE's sparsemixer threshold (its two experts chosen one by one); None: another
        # scoring
        self.sparsemixer_eps: float | None = None
        if arch.moe_scoring == "sparsemixer":
            if self.top_k != 2:
                raise ValueError(f"sparsemixer routing takes 2 experts a token, not {self.top_k}")
            self.sparsemixer_eps = arch.moe_jitter_eps
        self.norm_topk_prob = arch.norm_topk_prob
        self.norm_eps = arch.moe_norm_eps
        self.groups, self.topk_groups = _check_groups(arch)
        self.sigmoid_scores = arch.moe_scoring == "sigmoid"
        self.routed_scaling_factor = arch.routed_scaling_factor
        # (limit, alpha) of gpt-oss's clamped SwiGLU; None: SiLU
        self.swiglu = None if arch.swiglu_limit is None else (arch.swiglu_limit, arch.swiglu_alpha)
        # the activation act_mul computes (decode_layer.c's MLP_ACTIVATIONS): SiLU, gpt-oss's
        # clamped SwiGLU, or Gemma 4's tanh GELU
        self.activation = arch.hidden_act if self.swiglu is None else "clamped_swiglu"
        per_rank = arch.num_experts // tp.size
        self.first_expert = tp.rank * per_rank  # this rank's experts: [first, first + per_rank)
        # The router, whole on every rank. Row-invariant: a token's experts never depend on
        # which other tokens share its step (and decode_layer.c reads the same panels).
        self.gate = Linear(arch.hidden_size, (arch.num_experts,), bias=bias, row_invariant=True)
        # fp32 [E], added to the probabilities to choose the top k only; None: none
        self.selection_bias: nn.Parameter | None = None
        if arch.moe_selection_bias:
            zeros = torch.zeros(arch.num_experts, dtype=torch.float32)
            self.selection_bias = nn.Parameter(zeros, requires_grad=False)
        self.experts = nn.ModuleList(
            Expert(arch.hidden_size, arch.moe_intermediate_size, bias) for _ in range(per_rank)
        )
        # The shared expert and its gate [1, hidden] (arch.shared_expert_intermediate_size),
        # on rank 0 only; None without one, and on the other ranks.
        self.has_shared_expert = arch.shared_expert_intermediate_size > 0
        self.shared_expert: Expert | None = None
        self.shared_expert_gate: Linear | None = None
        if self.has_shared_expert and tp.rank == 0:
            self.shared_expert = Expert(arch.hidden_size, arch.shared_expert_intermediate_size)
        if self.shared_expert is not None and arch.shared_expert_gated:
            # row-invariant as the router: decode_layer.c reads the same panels
            self.shared_expert_gate = Linear(arch.hidden_size, (1,), row_invariant=True)
        # stack_experts: (gate_up [E, 2I, hidden], down [E, hidden, I]), which
        # triton_moe.fused_experts runs; None: experts run one by one.
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) of each token."""
        logits = self.gate(x).float()  # [T, E]
        if self.sparsemixer_eps is not None:
            weights, expert_ids = sparsemixer(logits, self.sparsemixer_eps)
            return weights.to(x.dtype), expert_ids
        probs = torch.sigmoid(logits) if self.sigmoid_scores else torch.softmax(logits, dim=-1)
        if self.selection_bias is None and self.groups == 1:
            weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        else:  # chosen by the biased probabilities, weighed by the probabilities
            choice = probs if self.selection_bias is None else probs + self.selection_bias.float()
            if self.groups > 1:
                choice = self._best_groups_only(choice)
            _, expert_ids = torch.topk(choice, self.top_k, dim=-1)
            weights = probs.gather(-1, expert_ids)
        if self.norm_topk_prob:
            # sigmoid scores need not sum to anything: HF's LFM2-MoE keeps the sum off 0
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.norm_eps)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return weights.to(x.dtype), expert_ids

    def _best_groups_only(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] with the experts outside each token's moe_topk_groups best groups
        at -inf; a group's score is the sum of its two best choice scores (DeepSeek-V3's)."""
        grouped = choice.view(choice.shape[0], self.groups, -1)  # [T, G, E / G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        best = group_scores.topk(self.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)

    def forward(self, x: torch.Tensor, routed_by: torch.Tensor | None = None) -> torch.Tensor:
        """`routed_by`: what the router reads where it is not x (Gemma 4's: the residual
        stream, its experts the normed one)."""
        weights, expert_ids = self.route(x if routed_by is None else routed_by)
        if self.stacked is not None:
            from tokenbus.model.triton_moe import fused_experts  # imports triton: CUDA only

            out = fused_experts(
                x, *self.stacked, weights, expert_ids, self.ops.silu_mul,
                first_expert=self.first_expert, some_experts_elsewhere=self.tp.size > 1,
            )  # fmt: skip
        else:
            out = self._experts_one_by_one(x, weights, expert_ids)
        if self.shared_expert is not None:  # after the routed sum, as HF adds it
            shared = self.shared_expert
            y = shared.down_proj(self.act_mul(shared.gate_up_proj(x)))
            if self.shared_expert_gate is not None:
                y = torch.sigmoid(self.shared_expert_gate(x)) * y  # gate [T, 1]
            out = out + y
        return self.tp.all_reduce(out)

    def _experts_one_by_one(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        flat_ids = expert_ids.flatten()  # [T*k]: pair p is token p // k
        order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, tokens ascending
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        pair_weights = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = sum(counts[: self.first_expert])  # the pairs before this rank's experts
        for local, expert in enumerate(self.experts):
            count = counts[self.first_expert + local]
            if count == 0:
                continue
            run = slice(start, start + count)
            rows = token_of[run]
            h = expert.down_proj(self.act_mul(expert.gate_up_proj(x[rows])))  # [n, hidden]
            out.index_add_(0, rows, h * pair_weights[run].unsqueeze(-1))
            start += count
        return out

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """An expert's activation: [n, 2I] (gate, then up) -> [n, I]."""
        if self.swiglu is not None:
            return self.ops.clamped_swiglu_mul(gate_up, *self.swiglu)
        if self.activation == "gelu_pytorch_tanh":
            return self.ops.gelu_tanh_mul(gate_up)
        return self.ops.silu_mul(gate_up)

    @property
    def stackable(self) -> bool:
        """Whether triton_moe.py's grouped GEMMs compute these experts: SiLU, no biases."""
        return self.activation == "silu" and self.gate.bias is None

    def stack_experts(self) -> None:
        """Run the experts through triton_moe.py's grouped GEMMs from now on: their dense
        weights are stacked into two tensors, and each expert's linears view its slice of
        them (one copy in memory). The plan calls this at load (kernel_plan.py)."""
        if self.stacked is not None:
            return
        linears = [(e.gate_up_proj, e.down_proj) for e in self.experts]
        stacked = tuple(torch.stack([pair[i].weight for pair in linears]) for i in range(2))
        for e, pair in enumerate(linears):
            for linear, weights in zip(pair, stacked):
                linear.use_weight(weights[e])
        self.stacked = stacked

    def _apply(self, fn, *args, **kwargs):
        # .to(), .half() & co convert each expert's weight on its own, which ends its view of
        # the stacked tensors: stack the converted weights again.
        result = super()._apply(fn, *args, **kwargs)
        if self.stacked is not None:
            self.stacked = None
            self.stack_experts()
        # The selection bias stays fp32 in a bf16 / fp16 model, as HF keeps it: probabilities
        # near each other are told apart by it.
        if self.selection_bias is not None and self.selection_bias.dtype != torch.float32:
            self.selection_bias.data = self.selection_bias.data.float()
        return result

    @property
    def _tensor_kinds(self) -> tuple[str, ...]:
        """The checkpoint tensors of each linear: its weight, and its bias where it has one."""
        return ("weight", "bias") if self.gate.bias is not None else ("weight",)

    def weight_loaders(self, prefix: str, family: str) -> dict[str, WeightLoader]:
        """HF names under `prefix` ("model.layers.N.mlp." or "...block_sparse_moe.") of the
        router and this rank's experts (other ranks' experts are skipped: see skipped_names)."""
        gate_name, up_name, down_name = EXPERT_NAMES[family]
        loaders: dict[str, WeightLoader] = {}
        for kind in self._tensor_kinds:
            bias = kind == "bias"
            loaders[f"{prefix}gate.{kind}"] = partial(self.gate.load_shard, is_bias=bias)
            for local, expert in enumerate(self.experts):
                scope = f"{prefix}experts.{self.first_expert + local}."
                gate_up, down = expert.gate_up_proj.load_shard, expert.down_proj.load_shard
                loaders[f"{scope}{gate_name}.{kind}"] = partial(gate_up, shard=0, is_bias=bias)
                loaders[f"{scope}{up_name}.{kind}"] = partial(gate_up, shard=1, is_bias=bias)
                loaders[f"{scope}{down_name}.{kind}"] = partial(down, is_bias=bias)
        if self.selection_bias is not None:
            bias_name = SELECTION_BIAS_NAMES.get(family, SELECTION_BIAS_NAME)
            loaders[prefix + bias_name] = self._load_selection_bias
        if self.shared_expert is not None:  # the other ranks skip its names (skipped_names)
            loaders.update(self._shared_loaders(prefix, family))
        return loaders

    def _load_selection_bias(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.numel() != self.num_experts:
            raise ValueError(f"{name}: expected {self.num_experts} values, got {tensor.shape}")
        with torch.no_grad():
            self.selection_bias.copy_(tensor.reshape(-1))

    def _shared_loaders(self, prefix: str, family: str) -> dict[str, WeightLoader]:
        """The shared expert's HF names (a gated MLP's, under the family's name) and its gate's;
        skipped on the ranks that do not hold it."""
        expert_name, gate_name = SHARED_EXPERT_NAMES[family]
        names = [
            f"{prefix}{expert_name}.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")
        ]
        if gate_name is not None:
            names.append(f"{prefix}{gate_name}.weight")
        shared = self.shared_expert
        if shared is None:  # rank 0's
            return dict.fromkeys(names, skip_weight)
        loads = [
            partial(shared.gate_up_proj.load_shard, shard=0),
            partial(shared.gate_up_proj.load_shard, shard=1),
            shared.down_proj.load_shard,
        ]
        if gate_name is not None:
            loads.append(self.shared_expert_gate.load_shard)
        return dict(zip(names, loads))

    def skipped_names(self, prefix: str, family: str) -> dict[str, WeightLoader]:
        """Other ranks' experts (and rank 0's shared expert): known names this rank drops."""
        mine = range(self.first_expert, self.first_expert + len(self.experts))
        skipped = {
            f"{prefix}experts.{e}.{name}.{kind}": skip_weight
            for e in range(self.num_experts)
            if e not in mine
            for name in EXPERT_NAMES[family]
            for kind in self._tensor_kinds
        }
        if self.has_shared_expert and self.shared_expert is None:  # rank 0's
            skipped.update(self._shared_loaders(prefix, family))
        return skipped


def _check_groups(arch: ModelArch) -> tuple[int, int]:
    """(moe_groups, moe_topk_groups) where the experts split into groups of two or more and
    the kept groups hold at least the top k; a ValueError naming the field otherwise."""
    groups, kept = arch.moe_groups, arch.moe_topk_groups
    if groups < 1 or arch.num_experts % groups or (groups > 1 and arch.num_experts // groups < 2):
        raise ValueError(
            f"n_group: {groups} must split the {arch.num_experts} experts into equal groups "
            "of two or more"
        )
    if groups > 1 and not (
        0 < kept <= groups and kept * (arch.num_experts // groups) >= arch.num_experts_per_tok
    ):
        raise ValueError(
            f"topk_group: {kept} must be in [1, n_group={groups}] and its groups must hold "
            f"the {arch.num_experts_per_tok} experts a token takes"
        )
    return groups, kept


def skip_weight(name: str, tensor: object) -> None:
    del name, tensor


def stacked_experts_split(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Experts stacked as transformers 5 holds them (mlp.experts.gate_up_proj [E, 2I, hidden]:
    each expert's gate rows, then its up rows; mlp.experts.down_proj [E, hidden, I]) under the
    per-expert names SparseMoeBlock loads, as views; other tensors as they are."""
    for name, tensor in weights:
        scope, _, leaf = name.rpartition(".mlp.experts.")
        if leaf == "gate_up_proj":
            for e, (gate, up) in enumerate(t.chunk(2) for t in tensor):
                yield f"{scope}.mlp.experts.{e}.gate_proj.weight", gate
                yield f"{scope}.mlp.experts.{e}.up_proj.weight", up
        elif leaf == "down_proj":
            for e in range(tensor.shape[0]):
                yield f"{scope}.mlp.experts.{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor
