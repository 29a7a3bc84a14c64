"""The KV pool of a model whose layers hold K/V of different shapes (Gemma 4's global layers:
wider heads, fewer of them: ModelArch.layer_kv_shapes): each layer's tensor takes its own shape,
a block's bytes are the sum of its layers', and under a hybrid cache groups of one shape share
buffers while another shape's groups take buffers of their own."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenbus.core.kv.hybrid import KVGroup, engine_kv_groups, plan_kv_groups
from tokenbus.engine_args import EngineArgs
from tokenbus.kv_transfer.layout import kv_layout
from tokenbus.model.parallel import TensorParallel
from tokenbus.model_arch import ModelArch
from tokenbus.worker.kv_cache import allocate_kv_caches, bytes_per_block

CPU = torch.device("cpu")
LOCAL, GLOBAL = (2, 16), (1, 32)  # (KV heads, head size)
WINDOWS = (8, 8, None, 8, 8, None)
SHAPES = tuple(LOCAL if window else GLOBAL for window in WINDOWS)
ARCH = ModelArch(
    "gemma4", 256, 32, 64, 6, 4, 2, 16, 512, sliding_windows=WINDOWS, layer_kv_shapes=SHAPES
)


def _page(shape: tuple[int, int], block_size: int = 16, itemsize: int = 4) -> int:
    heads, dim = shape
    return 2 * heads * dim * block_size * itemsize


def test_each_layer_s_tensor_takes_its_own_shape():
    caches = allocate_kv_caches(ARCH, 5, 16, torch.float32, CPU)
    for layer, cache in enumerate(caches):
        heads, dim = SHAPES[layer]
        assert cache.shape == (2, 5, 16, heads, dim)
    assert len({id(cache) for cache in caches}) == 6
    assert bytes_per_block(ARCH, 16, torch.float32) == 4 * _page(LOCAL) + 2 * _page(GLOBAL)
    assert ARCH.kv_bytes_per_token == 4 * 2 * (2 * 16) + 2 * 2 * (1 * 32)
    assert ARCH.kv_shape(2) == GLOBAL and ARCH.kv_shape(0) == LOCAL


def test_hybrid_groups_share_buffers_within_a_shape_only():
    groups = plan_kv_groups(WINDOWS, shapes=SHAPES)
    assert groups.groups == (KVGroup(8, (0, 1)), KVGroup(8, (3, 4)), KVGroup(None, (2, 5)))
    assert groups.offsets == (0, 0, 2)
    assert groups.num_buffers == 4 and groups.buffer_layers == (0, 1, 2, 5)
    assert [groups.place(layer) for layer in range(6)] == [
        (0, 0),
        (0, 1),
        (2, 2),
        (1, 0),
        (1, 1),
        (2, 3),
    ]
    caches = allocate_kv_caches(ARCH, 5, 16, torch.float32, CPU, groups)
    assert caches[0] is caches[3] and caches[1] is caches[4]
    assert caches[2] is not caches[0] and caches[5] is not caches[1]
    assert caches[2].shape == (2, 5, 16, *GLOBAL) and caches[0].shape == (2, 5, 16, *LOCAL)
    assert bytes_per_block(ARCH, 16, torch.float32, groups) == 2 * _page(LOCAL) + 2 * _page(GLOBAL)


def test_one_shape_plans_as_before():
    uniform = plan_kv_groups(WINDOWS, shapes=[LOCAL] * 6)
    assert uniform == plan_kv_groups(WINDOWS)
    assert uniform.offsets == () and uniform.num_buffers == 2


def test_the_engine_plans_groups_by_shape():
    config = EngineArgs(num_kv_blocks=64).to_config(256)
    assert engine_kv_groups(config, ARCH) == plan_kv_groups(WINDOWS, shapes=SHAPES)


def test_a_rank_holds_its_share_of_each_shape_s_heads():
    arch = dataclasses.replace(ARCH, layer_kv_shapes=((4, 16), (2, 32)) * 3)
    shard = TensorParallel(rank=1, size=2).shard_arch(arch)
    assert shard.layer_kv_shapes == ((2, 16), (1, 32)) * 3


def test_kv_transfer_refuses_layers_of_different_shapes():
    config = EngineArgs(num_kv_blocks=64).to_config(256)
    with pytest.raises(ValueError, match="different shapes"):
        kv_layout(config, ARCH)


def test_tensor_parallel_must_split_every_shape_s_kv_heads():
    arch = dataclasses.replace(ARCH, num_key_value_heads=4, layer_kv_shapes=((4, 16), (3, 32)) * 3)
    with pytest.raises(ValueError, match="the 3 KV heads"):
        TensorParallel(0, 2).check_divides(arch)


def test_each_kv_group_plans_from_its_own_layers_pools():
    """A step's plan per KV group reads only its layers' pools: the local groups' prompt
    chunks go to the native flash path, the global group's (heads of 512, past the 256 it
    takes) to SDPA."""
    from tokenbus.model.attention import build_attention_plan
    from tokenbus.model.forward_context import ForwardContext, KVGroupInputs
    from tokenbus.model.native import NativeBuildError, load_paged_attention

    try:
        kernel = load_paged_attention()
    except NativeBuildError as exc:
        pytest.skip(f"no native attention kernel here: {exc}")
    shapes = tuple(LOCAL if window else (1, 512) for window in WINDOWS)
    arch = dataclasses.replace(ARCH, layer_kv_shapes=shapes)
    groups = plan_kv_groups(WINDOWS, shapes=shapes)
    caches = allocate_kv_caches(arch, 5, 16, torch.float32, CPU, groups)
    tables = torch.tensor([[1, 2]])
    ctx = ForwardContext(
        positions=torch.arange(20),
        slot_mapping=torch.arange(16, 36),
        kv_caches=caches,
        block_size=16,
        query_start_loc=[0, 20],
        seq_lens=[20],
        seq_lens_t=torch.tensor([20]),
        block_tables=tables,
        num_decodes=0,
        kv_groups=[KVGroupInputs(torch.arange(16, 36), tables) for _ in range(2)],
        layer_groups=tuple(groups.place(i)[0] for i in range(6)),
    )
    for group in range(3):
        own = {id(caches[i]) for i in range(6) if groups.place(i)[0] == group}
        view = ctx.group_context(group)
        assert {id(cache) for cache in view.attention_kv_caches} == own
        plan = build_attention_plan(view, torch.float32, kernel)
        is_global = groups.groups[group].window is None
        assert (plan.native_long is None) == is_global and bool(plan.prefills) == is_global
