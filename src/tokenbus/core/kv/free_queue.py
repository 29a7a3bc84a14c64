"""The free block queue: an intrusive doubly linked list over KVBlock objects.

Why not ``collections.deque``: a prefix-cache hit must take a free block out of the middle
of the queue in O(1), and the links live in the blocks themselves (no wrapper objects).
The head is evicted first: with prefix caching the order is least-recently-freed first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tokenbus.core.kv.block import KVBlock


class FreeBlockQueue:
    """Fake head and tail sentinels make every real block an inner node: no edge cases.

    Invariant: a block is in the queue ⇔ both its links are set; ``num_free_blocks`` is the
    number of real blocks between the sentinels.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVBlock:
        """Remove and return the head block (the next one to reuse)."""
        if self.num_free_blocks == 0:
            raise ValueError("no free blocks left")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Remove and return the first ``n`` blocks, in queue order."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue, in O(1)."""
        prev, next_ = block.prev_free, block.next_free
        if prev is None or next_ is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = next_
        next_.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        """Put ``block`` at the tail: reused last (LRU for cached blocks)."""
        self._insert_after(self._tail.prev_free, block)

    def append_n(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            self.append(block)

    def prepend(self, block: KVBlock) -> None:
        """Put ``block`` at the head: reused first (blocks that hold no cached prefix)."""
        self._insert_after(self._head, block)

    def iter_free_blocks(self) -> Iterator[KVBlock]:
        """Free blocks from head (reused first) to tail, lazily: a reader may stop early."""
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None, "free queue is broken: a link is missing"
            yield node
            node = node.next_free

    def get_all_free_blocks(self) -> list[KVBlock]:
        """All free blocks from head to tail (for tests and integrity checks; O(n))."""
        blocks: list[KVBlock] = []
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None, "free queue is broken: a link is missing"
            blocks.append(node)
            node = node.next_free
        return blocks

    def _insert_after(self, prev: KVBlock | None, block: KVBlock) -> None:
        assert prev is not None and prev.next_free is not None
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        next_ = prev.next_free
        block.prev_free, block.next_free = prev, next_
        prev.next_free = block
        next_.prev_free = block
        self.num_free_blocks += 1
