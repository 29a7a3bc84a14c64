"""KV block bookkeeping (L1, pure Python): block pool, free queue, prefix-cache hashes, manager."""

from tokenbus.core.kv.block import KVBlock
from tokenbus.core.kv.block_hash import (
    NONE_HASH,
    block_extra_keys,
    hash_block_tokens,
    hash_new_full_blocks,
    make_block_hasher,
)
from tokenbus.core.kv.block_pool import BlockPool
from tokenbus.core.kv.free_queue import FreeBlockQueue
from tokenbus.core.kv.manager import KVCacheManager
from tokenbus.core.kv.stats import PrefixCacheStats

__all__ = [
    "NONE_HASH",
    "BlockPool",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "PrefixCacheStats",
    "block_extra_keys",
    "hash_block_tokens",
    "hash_new_full_blocks",
    "make_block_hasher",
]
