"""The C heap during a sweep: kept between a shard's batches, handed back after each shard.

A batch's forward allocates and frees tensors of up to tens of MB (the attention patterns). With
glibc's defaults each of them is served by fresh pages: malloc either maps the block and unmaps it on
free, or grows its heap and trims the top again, so every batch pays the page faults of touching that
memory anew. On attn-only-2l (16 windows of 128 tokens, one thread) that was 40% of the forward's CPU
time: 35-48 ms a batch against 22-23 ms with the freed memory kept (``heap_kept``: blocks up to 32 MiB
from the heap, 64 MiB of free top kept; measured with ``mallopt`` in-process, 2026-12-07).

Kept memory must not outlive the shard: a heap keeps the freed memory it cannot trim from its top
(small allocations that outlive a batch, the shard's accumulators, the window stream's arrays, pin
it), so resident memory would creep up with the batches run, not with what is alive. On attn-only-2l,
4,096 windows of 128 tokens on one thread, the memory left after each shard wandered 285 -> 377 MiB;
with ``malloc_trim(0)`` after each shard (``release_free_memory``) it stayed at 245-253 MiB.

Where malloc has no ``mallopt`` / ``malloc_trim`` (macOS, Windows, musl) both are no-ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import threading
from collections.abc import Iterator

# mallopt(3) parameters and glibc's values: blocks up to the adaptive mmap threshold's own ceiling
# (32 MiB on 64-bit) come from the heap; 64 MiB of free top is kept between batches
M_TOP_PAD, M_MMAP_THRESHOLD = -2, -3
KEPT_TOP_PAD, KEPT_MMAP_THRESHOLD, DEFAULT_TOP_PAD = 64 << 20, 32 << 20, 128 << 10

_kept = [0]  # heap_kept blocks running (threads, or a Ray actor's calls): the last one out restores
_kept_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def release_free_memory() -> None:
    """Return the C heap's free pages to the system (glibc ``malloc_trim(0)``; elsewhere nothing)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def heap_kept() -> Iterator[None]:
    """Inside: freed blocks of up to 32 MiB stay in the heap for the next batch (module docstring).
    After the last block running ends: glibc's default top pad again and every free page handed back.

    glibc cannot return to its adaptive mmap threshold once one is set: after the first block the
    threshold stays at 32 MiB, the ceiling the adaptive one rises to by itself on a workload like this."""
    libc = _libc()
    if libc is None:
        yield
        return
    with _kept_lock:
        if _kept[0] == 0:
            libc.mallopt(M_MMAP_THRESHOLD, KEPT_MMAP_THRESHOLD)
            libc.mallopt(M_TOP_PAD, KEPT_TOP_PAD)
        _kept[0] += 1
    try:
        yield
    finally:
        with _kept_lock:
            _kept[0] -= 1
            if _kept[0] == 0:
                libc.mallopt(M_TOP_PAD, DEFAULT_TOP_PAD)
                libc.malloc_trim(0)
