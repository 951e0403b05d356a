"""Per-request block tables on top of the block pool, with prefix caching.

The scheduler talks to this class in block ids only: how many tokens of a new request are already
cached, whether a step's tokens fit, and freeing a request's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem_engine.core.block_pool import NONE_HASH, BlockPool, hash_block
from tandem_engine.core.kv_events import BlockStored
from tandem_engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 record_events: bool = False) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, record_events)
        self.req_to_blocks: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Token counts since the last `take_prefix_stats()`.
        self._queries = 0
        self._hits = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def take_prefix_stats(self) -> tuple[int, int]:
        q, h = self._queries, self._hits
        self._queries = self._hits = 0
        return q, h

    def update_block_hashes(self, req: Request) -> None:
        """Extend the request's chained block hashes over every full block of its tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        tokens = req.all_token_ids
        parent = hashes[-1] if hashes else NONE_HASH
        for start in range(len(hashes) * bs, len(tokens) - bs + 1, bs):
            parent = hash_block(parent, tokens[start : start + bs])
            hashes.append(parent)

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks at the start of the request, and the tokens they cover.

        Never covers the last token: it must be computed to produce logits.
        """
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in req.block_hashes[:max_blocks]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        self._queries += req.num_tokens
        self._hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, req: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = (), *,
        cache_blocks: bool = True,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (plus the
        prefix hits in `new_computed_blocks`). Returns the newly allocated block ids, or None (and
        changes nothing) when the pool is short.

        `cache_blocks=False` keeps the blocks out of the prefix cache for now: their KV is still to
        arrive from another engine, so no request may hit them yet. A later call caches them.
        """
        bs = self.block_size
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * bs
        total = num_computed + num_new_tokens
        num_needed = -(-total // bs) - len(blocks) - len(new_computed_blocks)
        # Prefix hits sitting in the free queue stop being free once touched.
        num_hits_free = sum(1 for b in new_computed_blocks if self.pool.ref_cnt[b] == 0)
        if max(num_needed, 0) > self.pool.num_free_blocks - num_hits_free:
            if not blocks:
                del self.req_to_blocks[req.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.allocate(num_needed) if num_needed > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching and cache_blocks:
            self._cache_full_blocks(req, blocks, min(total, req.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, req: Request, blocks: list[int], num_tokens: int) -> None:
        """Register blocks that are full once this step's KV is written (their tokens are known)."""
        start = self._num_cached_blocks.get(req.request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        self.update_block_hashes(req)
        run: list[int] = []  # consecutive blocks the cache gained: one BlockStored each run
        for i in range(start, end + 1):
            if i < end and self.pool.cache_block(blocks[i], req.block_hashes[i]):
                run.append(i)
                continue
            if run:
                first, bs = run[0], self.block_size
                parent = req.block_hashes[first - 1] if first > 0 else None
                self.pool.record_stored(BlockStored(
                    [req.block_hashes[j] for j in run], parent,
                    list(req.all_token_ids[first * bs:(run[-1] + 1) * bs]), bs))
                run = []
        self._num_cached_blocks[req.request_id] = end

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def free(self, req: Request) -> None:
        """Return every block of the request; its last block is evicted first. Idempotent."""
        blocks = self.req_to_blocks.pop(req.request_id, [])
        self._num_cached_blocks.pop(req.request_id, None)
        self.pool.free(reversed(blocks))
