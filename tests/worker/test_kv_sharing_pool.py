"""The KV pool of a model whose last layers read an earlier layer's K/V (Gemma 3n's
kv_shared_layers): those layers get their owner's tensor, hold no bytes of their own, and the
block size counts the owners only; under a hybrid cache too."""

from __future__ import annotations

import dataclasses

import torch

from tokenbus.core.kv.hybrid import plan_kv_groups
from tokenbus.model_arch import ModelArch
from tokenbus.worker.kv_cache import allocate_kv_caches, bytes_per_block

CPU = torch.device("cpu")
# six layers, the last two reading layer 3's (global) and layer 2's (local) K/V
WINDOWS = (8, 8, 8, None, 8, None)
ARCH = ModelArch("gemma3n", 256, 32, 64, 6, 4, 2, 16, 512, kv_shared_layers=((4, 2), (5, 3)))


def test_layers_sharing_kv_get_their_owner_s_tensor():
    caches = allocate_kv_caches(ARCH, 5, 16, torch.float32, CPU)
    assert caches[4] is caches[2] and caches[5] is caches[3]
    assert len({id(cache) for cache in caches}) == 4 == ARCH.num_kv_layers
    per_layer = caches[0].numel() * caches[0].element_size()
    assert bytes_per_block(ARCH, 16, torch.float32) * 5 == 4 * per_layer
    unshared = dataclasses.replace(ARCH, kv_shared_layers=())
    assert (
        bytes_per_block(unshared, 16, torch.float32) * 4
        == bytes_per_block(ARCH, 16, torch.float32) * 6
    )


def test_hybrid_groups_place_readers_on_their_owner_s_buffer():
    arch = dataclasses.replace(ARCH, sliding_windows=WINDOWS)
    groups = plan_kv_groups(WINDOWS, shared=arch.kv_shared_layers)
    caches = allocate_kv_caches(arch, 5, 16, torch.float32, CPU, groups)
    assert caches[4] is caches[2] and caches[5] is caches[3]
    assert len({id(cache) for cache in caches}) == groups.num_buffers == 1  # one global owner
