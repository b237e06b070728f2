"""Freed memory handed back to the system after each shard, so a sweep's memory stays flat in the corpus.

A batch's forward allocates and frees tensors of up to tens of MB (the attention patterns). glibc's
malloc serves blocks that size from its heaps once its adaptive mmap threshold has risen past them
(after the first one is freed), and a heap keeps the freed memory it cannot trim from its top: small
allocations that outlive a batch (the shard's per-batch accumulators, the window stream's arrays, made
in its own thread's arena) pin it. Resident memory then creeps up with the number of batches run, not
with what is alive: on attn-only-2l, 4,096 windows of 128 tokens on one thread, the memory left after
each shard wandered 285 -> 377 MiB; with ``malloc_trim(0)`` after each shard it stayed at 245-253 MiB.
Once per shard (about 32k tokens) it costs a few milliseconds. Where malloc has no ``malloc_trim``
(macOS, Windows, musl) this is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def release_free_memory() -> None:
    """Return the C heap's free pages to the system (glibc ``malloc_trim(0)``; elsewhere nothing)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
