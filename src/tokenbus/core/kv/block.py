"""One KV cache block's bookkeeping: id, reference count, cached hash, free-queue links."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class KVBlock:
    """Metadata of one physical KV block; the K/V tensors live in the worker.

    Blocks are created once at start-up and reused for the engine's lifetime; a block is
    identified by its object (``eq=False``: equality is identity), and by ``block_id`` across
    processes. Invariants (see ``BlockPool``):

    - ``ref_cnt == 0`` ⇔ the block sits in the free queue (except the null block, never free);
    - ``block_hash`` is set only while the block is full and registered in the hash map. A free
      block keeps its hash (it stays a cache hit) until it is popped for reuse.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # Intrusive links of FreeBlockQueue; both None while the block is not in the queue.
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)
    # Block 0: a placeholder for padded slots; never allocated, freed or counted.
    is_null: bool = False
