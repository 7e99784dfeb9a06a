"""Prompt reuse for language models: the K/V of prompt prefixes seen recently, by block.

A prompt (its tokens but the last, the part that is prefilled) is cut into blocks of `block`
tokens. A block is known by a digest of its tokens chained to its predecessor's (and the
request's `cache_salt`), as vLLM's automatic prefix caching keys them, so a block's digest stands
for the whole prefix that ends with it. The pool keeps each block's keys and values, every
layer's, as one array (2L, Hkv, block, D), up to `max_bytes`, least recently used first out;
looking a prompt up refreshes its blocks from the last to the first, so that a prefix is
evicted from its end and never loses a block that later blocks need while they stay.

The scheduler looks each admitted prompt up, starts its cache from the longest run of blocks
found (copied into the request's cache: a request never shares arrays with the pool, so a
block evicted while a request that read it still runs changes nothing) and prefills only the
rest; once a prompt is prefilled, its full blocks the pool lacks are copied in. When a
single-sequence request (greedy, sampling) leaves, the full blocks of its prompt and answer
whose K/V its row holds are copied in too, under the same chain: the next turn of a
conversation sends the answer back inside its prompt, and finds it cached as far as its tokens
are the ones generated. Only whole blocks are kept.

Reuse is exact where the backend computes a token's K/V from the tokens before it alone,
whatever else shares its call: the GroupQueryAttention graph does (on every variant), and the
answers with and without the pool are the same bits. The plain graph's softmax spans the cached
and the new columns of a call, so a prompt resumed after a cached prefix sums in another order
than one prefilled at once: its numbers differ in their last bits (engine/onnx/lm_backend.py).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.generic]
# Tokens per block: a prefix is reused in whole blocks. 16 as vLLM's default: a small block
# reuses more of a prompt, and the copies are per block either way.
BLOCK = 16
_ROOT = b"attnserve-prefix"


@dataclass
class PrefixStats:
    """Counters and sizes the service exports (Prometheus)."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens whose K/V came from the pool
    evictions: int = 0  # blocks dropped for room
    blocks: int = 0
    bytes: int = 0


@dataclass
class Prefix:
    """The longest cached run of blocks at the start of a prompt."""

    tokens: int  # cached prompt tokens (a multiple of the block)
    # the pool's arrays of those blocks, (2L, Hkv, block, D) each, in order: read, never
    # written (a backend copies them into its cache: `from_prefixes`)
    blocks: list[Array]
    digests: list[bytes]  # the digest of every full block of the prompt (and answer), in order

    @property
    def columns(self) -> Array | None:
        """The blocks as one (2L, Hkv, tokens, D) array (a copy); None when none."""
        return np.concatenate(self.blocks, axis=2) if self.blocks else None


class PrefixCache:
    """A bounded pool of prompt blocks' K/V, shared by the requests of one model.

    Thread-safe (the engine thread writes, the metrics scrape reads)."""

    def __init__(self, max_bytes: int, block: int = BLOCK) -> None:
        if max_bytes < 0 or block < 1:
            raise ValueError("max_bytes must be >= 0 and block >= 1")
        self.max_bytes = max_bytes
        self.block = block
        self._blocks: OrderedDict[bytes, Array] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = PrefixStats()
        self.block_bytes = 0  # one block's K/V, known from the first block kept

    @property
    def capacity_blocks(self) -> int:
        """Blocks the pool holds when full (0 until a block's size is known)."""
        return self.max_bytes // self.block_bytes if self.block_bytes else 0

    def digests(self, tokens: Sequence[int], salt: str | None = None) -> list[bytes]:
        """The chained digest of each full block of `tokens`."""
        out: list[bytes] = []
        parent = hashlib.blake2b(_ROOT + (salt or "").encode("utf-8"), digest_size=16).digest()
        ids = np.asarray(tokens, dtype=np.int64)
        for start in range(0, len(tokens) - self.block + 1, self.block):
            block = ids[start : start + self.block].tobytes()
            parent = hashlib.blake2b(parent + block, digest_size=16).digest()
            out.append(parent)
        return out

    def lookup(self, tokens: Sequence[int], salt: str | None = None) -> Prefix:
        """The longest run of cached blocks at the start of `tokens`."""
        digests = self.digests(tokens, salt)
        with self._lock:
            found: list[Array] = []
            for digest in digests:
                block = self._blocks.get(digest)
                if block is None:
                    break
                found.append(block)
            for digest in reversed(digests[: len(found)]):  # the first block the most recent
                self._blocks.move_to_end(digest)
            self.stats.queries += len(tokens)
            self.stats.hits += len(found) * self.block
        return Prefix(len(found) * self.block, found, digests)

    def insert(self, prefix: Prefix, columns: Callable[[int, int], Array]) -> int:
        """Add the full blocks of `prefix.digests` that the pool lacks; `columns(start, end)`
        returns positions start .. end - 1 of the sequence's K/V (2L, Hkv, end - start, D), and
        is called once, for the span from the first missing block to the last one kept.
        Blocks past the pool's capacity are not read (they would be evicted at once). Returns
        the blocks added."""
        digests = prefix.digests
        with self._lock:
            if self.block_bytes:  # the first blocks are the most recent: they stay
                digests = digests[: self.capacity_blocks]
            missing = [i for i, d in enumerate(digests) if d not in self._blocks]
        if not missing or self.max_bytes == 0:
            return 0
        first = missing[0] * self.block
        kv = columns(first, (missing[-1] + 1) * self.block)
        added = 0
        with self._lock:
            for i in missing:
                digest = digests[i]
                if digest in self._blocks:
                    continue
                start = i * self.block - first
                block = np.ascontiguousarray(kv[:, :, start : start + self.block])
                self._blocks[digest] = block
                self.block_bytes = block.nbytes
                self.stats.bytes += block.nbytes
                added += 1
            for digest in reversed(digests):  # the first block the most recent
                if digest in self._blocks:
                    self._blocks.move_to_end(digest)
            self._evict()
            self.stats.blocks = len(self._blocks)
        return added

    def _evict(self) -> None:
        while self.stats.bytes > self.max_bytes and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self.stats.bytes -= block.nbytes
            self.stats.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.stats.bytes = self.stats.blocks = 0

    def snapshot(self) -> PrefixStats:
        with self._lock:
            return PrefixStats(**vars(self.stats))
