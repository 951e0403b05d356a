"""The pool of KV-cache blocks: reference counts, an O(1) LRU free queue, and the prefix-cache map.

Block 0 is a null block that is never handed out (it pads block tables). A free block keeps its hash,
so it can still be hit by the prefix cache until it is evicted (popped from the head of the queue).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tandem_engine.core.kv_events import BlockRemoved, BlockStored, KVEvent

NONE_HASH = 0
# Names the hash below; GET /tokenizer sends it so a router that hashes otherwise refuses the spec
# (docs/contracts.md, "Block hashing"). Change it whenever `hash_block` or NONE_HASH changes.
HASH_SPEC = "blake2b-64:parent-u64le+tokens-u32le:root-0:v1"


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained 64-bit hash of one full block: stable across processes (unlike `hash()` of bytes)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids))
    return int.from_bytes(h.digest(), "little")


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # LRU order: the head is evicted first. Values are unused; OrderedDict gives O(1) removal
        # from the middle (a cache hit on a free block) and O(1) pops from the head.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.null_block = 0
        self.ref_cnt[0] = 1
        # What the prefix cache gained and lost since the last `take_events()` (docs/contracts.md,
        # "KV events"); None when nobody publishes them.
        self._events: list[KVEvent] | None = [] if record_events else None

    def take_events(self) -> list[KVEvent]:
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    def record_stored(self, event: BlockStored) -> None:
        if self._events is not None:
            self._events.append(event)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by live requests (cached free blocks count as free)."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def free_block_ids(self) -> list[int]:
        """The free queue in eviction order (head first); for tests and the debug view."""
        return list(self._free)

    def get_cached_block(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[int]:
        """Pop `n` blocks from the head of the free queue, evicting their cached hashes."""
        if n > len(self._free):
            raise RuntimeError(f"allocate({n}) with only {len(self._free)} free blocks")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (prefix hits), removing free ones from the queue."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the tail of the queue in
        the order given (callers pass a request's blocks last-first so its tail is evicted first)."""
        for block_id in block_ids:
            if block_id == self.null_block:
                continue
            if self.ref_cnt[block_id] <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a full block under its hash; a duplicate of an already cached hash stays private.
        True when the cache gained the hash."""
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return False
        if block_hash in self._cached:
            return False
        self.block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def cached_hashes(self) -> set[int]:
        """Every hash a prefix hit can find now (what a router's exact index must hold)."""
        return set(self._cached) if self.enable_caching else set()

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            self.block_hash[block_id] = None
            if self._cached.get(h) == block_id:
                del self._cached[h]
                if self._events is not None:
                    last = self._events[-1] if self._events else None
                    if isinstance(last, BlockRemoved):
                        last.block_hashes.append(h)
                    else:
                        self._events.append(BlockRemoved([h]))
