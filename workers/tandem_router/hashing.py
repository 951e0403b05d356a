"""Prompt block hashes and a consistent-hash ring, both deterministic across processes.

`token_block_hashes` is the router's copy of the engine's block hash (docs/contracts.md, "Block
hashing"): the exact keys of the engine's prefix cache and of its KV events, from token ids.
tests/router/test_tokenizer.py checks it against the engine's own `hash_block` and a live engine.

The router has no tokenizer: a prompt is cut into blocks of characters (about 4 characters a token),
and each block's hash covers its text and the previous block's hash, as the engine's prefix cache
chains token blocks. Python's `hash()` is salted per process, so blake2b is used: several router
replicas must compute the same hashes and the same ring to agree on where a prefix lives.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Iterator, Sequence

CHARS_PER_TOKEN = 4
# The engine sends its hash's name in GET /tokenizer; the router hashes only when the names agree.
BLOCK_HASH_SPEC = "blake2b-64:parent-u64le+tokens-u32le:root-0:v1"


def hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hashes(text: str, block_chars: int, max_blocks: int, seed: str = "") -> list[int]:
    """Chained hashes of the full `block_chars`-sized blocks of `text` (a partial tail is not cached)."""
    data = text.encode("utf-8", "surrogatepass")
    n = min(len(data) // block_chars, max_blocks)
    out: list[int] = []
    prev = hash64(seed.encode())
    for i in range(n):
        block = data[i * block_chars : (i + 1) * block_chars]
        prev = hash64(prev.to_bytes(8, "little") + block)
        out.append(prev)
    return out


def token_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The engine's chained hashes of the full `block_size`-token blocks of `token_ids`: blake2b with an
    8-byte digest over the parent's hash (8 bytes little-endian, 0 for the first block) followed by each
    token id (4 bytes little-endian), the digest read little-endian. A partial tail is not hashed."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    pack = struct.Struct(f"<Q{block_size}I").pack
    out: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        data = pack(parent, *token_ids[start : start + block_size])
        parent = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
        out.append(parent)
    return out


def estimate_tokens(text: str) -> int:
    return len(text) // CHARS_PER_TOKEN + 1


class HashRing:
    """Consistent hashing with virtual nodes; `walk(key)` yields every member once, clockwise."""

    def __init__(self, vnodes: int = 64) -> None:
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._members: frozenset[str] = frozenset()

    def set_members(self, members: set[str] | frozenset[str]) -> None:
        members = frozenset(members)
        if members == self._members:
            return
        pairs = sorted((hash64(f"{m}#{i}".encode()), m) for m in members for i in range(self.vnodes))
        self._points = [p for p, _ in pairs]
        self._owners = [m for _, m in pairs]
        self._members = members

    def walk(self, key: int) -> Iterator[str]:
        n = len(self._points)
        if n == 0:
            return
        start = bisect.bisect_left(self._points, key % (1 << 64))
        seen: set[str] = set()
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._members):
                    return
