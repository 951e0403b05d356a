"""An approximate index of which endpoint holds which prompt blocks, learned from routing history.

Two levels, as in llm-d's approximate indexer: block hash -> endpoints that were sent it, and per
endpoint an LRU bounded by the endpoint's (assumed) cache capacity, so the index cannot grow without
bound and forgets what an engine has most likely evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def leading_matches(hashes: list[int], holders: Mapping[int, set[K]]) -> dict[K, int]:
    """For every holder of the first block, how many leading blocks of `hashes` it holds without a gap
    (an engine's prefix-cache lookup stops at its first miss); holders of none are omitted."""
    out: dict[K, int] = {}
    alive: set[K] | None = None
    for i, h in enumerate(hashes):
        held = holders.get(h)
        if not held:
            break
        alive = set(held) if alive is None else alive & held
        if not alive:
            break
        for key in alive:
            out[key] = i + 1
    return out


class PrefixIndex:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def match(self, hashes: list[int]) -> dict[str, int]:
        """Number of leading blocks of `hashes` recorded per endpoint (endpoints with none omitted)."""
        return leading_matches(hashes, self._holders)

    def insert(self, url: str, hashes: list[int]) -> None:
        lru = self._lru.setdefault(url, OrderedDict())
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(url)
        while len(lru) > self.capacity_blocks:
            old, _ = lru.popitem(last=False)
            self._forget(old, url)

    def remove_endpoint(self, url: str) -> None:
        for h in self._lru.pop(url, {}):
            self._forget(h, url)

    def size(self, url: str) -> int:
        return len(self._lru.get(url, ()))

    def _forget(self, h: int, url: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(url)
            if not holders:
                del self._holders[h]
