"""Loading HF-named checkpoint tensors into a decoder's (possibly fused, possibly sharded)
parameters, strictly (L2): every name must be known, none may be missing, every shape must be
the one built; each error names the tensor.

A model maps each HF name to a loader (name, tensor) -> None that copies this rank's slice of
the tensor into its parameter (`Slicer`s cut the slice: model/parallel.py says which).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from functools import partial

import torch

from tokenbus.model.decoder import Attention, DecoderLayer, GatedMLP, QKNorm, ReluSquaredMLP
from tokenbus.model.layers import Linear
from tokenbus.model.layers.quantized import is_quantized
from tokenbus.model.parallel import TensorParallel
from tokenbus.model_arch import ModelArch

WeightLoader = Callable[[str, torch.Tensor], None]
Slicer = Callable[[torch.Tensor], torch.Tensor]
# Checkpoint tensors that carry no information for us (old HF checkpoints store inv_freq).
IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


def load_strictly(
    loaders: dict[str, WeightLoader],
    weights: Iterable[tuple[str, torch.Tensor]],
    arch: ModelArch,
    optional: set[str] = frozenset(),
) -> None:
    """Feed each (name, tensor) to its loader; unknown, repeated and missing names are errors
    (names in `optional` may be missing: another rank's experts)."""
    loaded: set[str] = set()
    for name, tensor in weights:
        if name in loaded:
            raise ValueError(f"weight {name} appears twice")
        loader = loaders.get(name)
        if loader is None:
            tied_head = name == "lm_head.weight" and arch.tie_word_embeddings
            if name.endswith(IGNORED_WEIGHT_SUFFIXES) or tied_head:
                continue
            raise ValueError(
                f"unexpected weight {name} for {arch.architecture} "
                f"with {arch.num_hidden_layers} layers"
            )
        loader(name, tensor)
        loaded.add(name)
    missing = sorted(set(loaders) - loaded - optional)
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        )
        raise ValueError(f"missing weights: {shown}")


# A decoder layer's norms, by HF's names: a layer has those its kind uses (decoder.py: a pre-norm
# layer the first two, Gemma's sandwich all four).
LAYER_NORM_NAMES = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def layer_loaders(
    prefix: str, layer: DecoderLayer, tp: TensorParallel, arch: ModelArch
) -> dict[str, WeightLoader]:
    """HF names of one decoder layer (`prefix` = "model.layers.N.") -> loaders: separate
    q/k/v and gate/up tensors into the fused linears, this rank's slice of each. A layer whose
    mlp is not a GatedMLP (a sparse MoE block), or whose mixer is not decoder.Attention (a
    short convolution: model/short_conv.py; latent attention: model/mla.py), gets those names
    from its family."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [
        (name, getattr(layer, name))
        for name in LAYER_NORM_NAMES
        if getattr(layer, name, None) is not None
    ]
    loaders: dict[str, WeightLoader] = {
        f"{prefix}{name}.weight": partial(copy_param, norm.weight) for name, norm in norms
    }
    for name, norm in norms:  # a LayerNorm's bias (PhiMoE's)
        if getattr(norm, "bias", None) is not None:
            loaders[f"{prefix}{name}.bias"] = partial(copy_param, norm.bias)
    cut = TensorSlicer(tp, arch)
    fused = _mlp_shards(mlp, cut, tp)
    if isinstance(attn, Attention):  # another attention (model/mla.py) names its own
        fused += _attention_shards(prefix, attn, cut, tp, arch, loaders)
    for linear, scope, shards in fused:
        for shard, (name, weight_slice, bias_slice) in enumerate(shards):
            loaders[f"{prefix}{scope}{name}.weight"] = sliced(
                partial(linear.load_shard, shard=shard), weight_slice
            )
            if linear.bias is not None:
                loaders[f"{prefix}{scope}{name}.bias"] = sliced(
                    partial(linear.load_shard, shard=shard, is_bias=True), bias_slice
                )
    return loaders


# (linear, scope, [(HF name, weight slicer, bias slicer)]) per fused linear.
_Shards = list[tuple[Linear, str, list[tuple[str, Slicer | None, Slicer | None]]]]


def _mlp_shards(mlp, cut: TensorSlicer, tp: TensorParallel) -> _Shards:
    """A GatedMLP's gate/up (fused) and down projections, a ReluSquaredMLP's up and down; []
    for another MLP (or none)."""
    if isinstance(mlp, ReluSquaredMLP):
        rows = cut.rows(tp.rank * mlp.down_proj.in_features, mlp.down_proj.in_features)
        return [
            (mlp.up_proj, "mlp.", [("up_proj", rows, None)]),
            (mlp.down_proj, "mlp.", [("down_proj", cut.columns(rows), None)]),
        ]
    if not isinstance(mlp, GatedMLP):
        return []
    rows = cut.rows(tp.rank * mlp.down_proj.in_features, mlp.down_proj.in_features)
    return [
        (mlp.gate_up_proj, "mlp.", [("gate_proj", rows, None), ("up_proj", rows, None)]),
        (mlp.down_proj, "mlp.", [("down_proj", cut.columns(rows), None)]),
    ]


def _attention_shards(
    prefix: str,
    attn: Attention,
    cut: TensorSlicer,
    tp: TensorParallel,
    arch: ModelArch,
    loaders: dict[str, WeightLoader],
) -> _Shards:
    """Attention's q/k/v (fused) and o projections; its q/k norms' loaders go to `loaders`."""
    if attn.qk_norm is QKNorm.HEADS:  # per head, the same on every rank
        for name, norm in (("q_norm", attn.q_norm), ("k_norm", attn.k_norm)):
            if norm is not None:  # a layer reading another's K/V has no k_norm (Gemma 3n's)
                loaders[f"{prefix}self_attn.{name}.weight"] = partial(copy_param, norm.weight)
    q_rows = cut.head_rows(attn.num_heads * tp.rank, attn.num_heads)
    kv_rows = cut.head_rows(tp.kv_head_start(arch.num_key_value_heads), attn.num_kv_heads)
    if attn.qk_norm is QKNorm.WHOLE:  # over the whole projection: this rank's heads' part
        for name, norm, rows in (("q_norm", attn.q_norm, q_rows), ("k_norm", attn.k_norm, kv_rows)):
            loaders[f"{prefix}self_attn.{name}.weight"] = sliced(
                partial(copy_param, norm.weight), rows
            )
    qkv = [("q_proj", q_rows, q_rows), ("k_proj", kv_rows, kv_rows), ("v_proj", kv_rows, kv_rows)]
    if attn.output_gate:  # its gate's rows follow the queries' (the family names them)
        qkv.append(("gate_proj", q_rows, q_rows))
    shards: _Shards = [
        (attn.qkv_proj, "self_attn.", qkv),
        (attn.o_proj, "self_attn.", [("o_proj", cut.columns(q_rows), cut.rank0_only())]),
    ]
    if attn.gate_proj is not None:  # a row per query head: this rank's heads'
        gate_rows = cut.rows(attn.num_heads * tp.rank, attn.num_heads)
        shards.append((attn.gate_proj, "self_attn.", [("gate_proj", gate_rows, None)]))
    return shards


class TensorSlicer:
    """This rank's slice of a full HF tensor; None (no slicing) without tensor parallelism."""

    def __init__(self, tp: TensorParallel, arch: ModelArch) -> None:
        self.tp = tp
        self.head_dim = arch.head_dim

    def rows(self, start: int, count: int) -> Slicer | None:
        return None if not self.tp.enabled else (lambda t: t[start : start + count])

    def head_rows(self, first_head: int, num_heads: int) -> Slicer | None:
        return self.rows(first_head * self.head_dim, num_heads * self.head_dim)

    def columns(self, rows: Slicer | None) -> Slicer | None:
        """The same range along the input dim (row-parallel weights are [out, in])."""
        return None if rows is None else (lambda t: rows(t.T).T)

    def rank0_only(self) -> Slicer | None:
        """A row-parallel bias is added once: rank 0 keeps it, the others add zeros."""
        if not self.tp.enabled:
            return None
        return (lambda t: t) if self.tp.rank == 0 else torch.zeros_like

    def vocab_rows(self, start: int, per_rank: int) -> Slicer | None:
        """Rows [start, start + per_rank), zero-padded past the real vocabulary."""
        if not self.tp.enabled:
            return None

        def cut(t: torch.Tensor) -> torch.Tensor:
            part = t[start : start + per_rank]
            pad = per_rank - part.shape[0]
            return torch.cat([part, part.new_zeros(pad, *part.shape[1:])]) if pad else part

        return cut


def sliced(loader: WeightLoader, slicer: Slicer | None) -> WeightLoader:
    if slicer is None:
        return loader

    def load(name: str, tensor: torch.Tensor) -> None:
        if is_quantized(tensor):
            raise ValueError(
                f"weight {name}: GGUF blocks cannot be split for tensor parallelism; "
                f"use --quantization none"
            )
        loader(name, slicer(tensor))

    return load


def copy_param(param: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    if tensor.shape != param.shape:
        raise ValueError(
            f"weight {name}: expected shape {list(param.shape)}, got {list(tensor.shape)}"
        )
    with torch.no_grad():
        param.copy_(tensor)


def plus_one(loader: WeightLoader) -> WeightLoader:
    """A norm loader taking HF's w and storing 1 + w, added in fp32 as HF's forward does (the
    (1 + w) RMSNorms of Gemma's and Qwen3.5's, held as a plain weight)."""

    def load(name: str, tensor: torch.Tensor) -> None:
        loader(name, 1.0 + tensor.float())

    return load


def fused_rows_loader(parts: list[WeightLoader], sizes: tuple[int, ...]) -> WeightLoader:
    """A loader for one checkpoint tensor stacking `parts` along its rows (`sizes` each)."""

    def load(name: str, tensor) -> None:
        rows = tensor.rows if is_quantized(tensor) else tensor.shape[0]
        if rows != sum(sizes):
            shape = [tensor.rows, tensor.cols] if is_quantized(tensor) else list(tensor.shape)
            raise ValueError(
                f"weight {name}: expected {sum(sizes)} rows {list(sizes)}, got {shape}"
            )
        start = 0
        for loader, size in zip(parts, sizes):
            loader(name, _rows(tensor, start, size))
            start += size

    return load


def _rows(tensor, start: int, count: int):
    """Rows [start, start + count) of a dense tensor or of a GGUF matrix's blocks (a view)."""
    if is_quantized(tensor):
        return dataclasses.replace(tensor, data=tensor.data[start : start + count])
    return torch.narrow(tensor, 0, start, count)
