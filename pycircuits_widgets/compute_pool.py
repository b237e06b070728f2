"""Single-thread compute workers shared by the whole process: independent tasks instead of short
parallel regions.

Why: a loop of short torch ops at 2 intra-op threads (the screen's one int8 GEMM and one row max
per ``[4096, 1024]`` tile, a few ms each) opens a parallel region per op, and every region ends at
an OpenMP barrier. On a loaded host, whenever one of the two threads is descheduled the other waits
at that barrier, hundreds of times per screen: measured 5-20x slower than one thread. Here the same
ops run as independent tasks on workers that each run torch at ONE intra-op thread: a descheduled
worker delays only its own task while the others take the next ones, so a job keeps its share of
the CPU.

``map_tasks(task, n)`` runs ``task(0) ... task(n - 1)`` on the process's pool (``shared()``) and
returns their results in order, each computed by the same kernels on the same inputs as a serial
loop would (bit-identical where the kernel's result does not depend on its thread count, as the
int8 screen's does not). A call uses at most ``min(pool size, torch.get_num_threads())`` workers
at once; the pool has one worker per core this process may run on (``os.sched_getaffinity``), and
every concurrent call (a click's exact table and the background fill's, say) shares it, so the
tasks never run on more threads than cores. The calling thread only waits.

**One thread per worker.** ``torch.set_num_threads`` cannot do it: called on a worker it also sets
the process-wide count that threads created later inherit. Each worker instead initialises torch's
per-thread state (``torch.get_num_threads()``), then lowers only its own OpenMP and MKL counts
(``omp_set_num_threads(1)``, ``MKL_Set_Num_Threads_Local(1)``, resolved through ``libtorch_cpu`` so
they are the runtimes torch itself uses), and checks that torch now reports 1. Where that is not
possible (no such symbols, e.g. Windows), ``shared()`` is None and ``map_tasks`` runs the loop
serially in the caller, as before.

**Priorities.** Concurrent calls are served by ``priority`` (a thread's level, lower first; the
widgets' runner gives clicks 0, work the user asked for 1, the background fill 2), decided each
time a worker takes a task: a fill's screen already running gives way to a click's at its next
tile.

Lifetime: the shared pool's workers start on first use (daemon threads, idle between calls); a
call interrupted in its caller (Ctrl-C) starts none of its remaining tasks; a forked child (a Ray
worker, multiprocessing) gets a fresh pool of its own on first use.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import itertools
import os
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
THREAD_PREFIX = "pcw-compute"
"""Name prefix of the pool's worker threads."""


def cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@functools.cache
def _thread_controls():
    """``(omp_set_num_threads, MKL_Set_Num_Threads_Local or None)`` as torch resolves them, or None."""
    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.*"))
    for path in libs:
        try:
            lib = ctypes.CDLL(path)  # already loaded by torch: the same handle, nothing re-initialised
            omp = lib.omp_set_num_threads  # dlsym through libtorch_cpu: the OpenMP runtime torch uses
        except (OSError, AttributeError):
            continue
        omp.argtypes, omp.restype = [ctypes.c_int], None
        mkl = getattr(lib, "MKL_Set_Num_Threads_Local", None)  # the C entry (lower case is Fortran's, by pointer)
        if mkl is not None:
            mkl.argtypes, mkl.restype = [ctypes.c_int], ctypes.c_int
        elif torch.backends.mkl.is_available():
            return None  # MKL would keep running its GEMMs at the process's thread count
        return omp, mkl
    return None


def pin_to_one_thread() -> bool:
    """Make the calling thread run torch at one intra-op thread, leaving every other thread and the
    count new threads inherit as they are (module docstring). True when torch then reports 1."""
    controls = _thread_controls()
    if controls is None:
        return False
    omp, mkl = controls
    torch.get_num_threads()  # torch's lazy per-thread init first: it would reset the count later
    omp(1)
    if mkl is not None:
        mkl(1)
    return torch.get_num_threads() == 1


class PoolError(RuntimeError):
    """The compute pool could not start a worker at one thread."""


class _Thread(threading.local):
    pool = None  # the ComputePool whose worker this thread is (None: not a worker)
    priority = 0  # of this thread's calls (``priority``)


_thread = _Thread()


@contextlib.contextmanager
def priority(level: int):
    """Within the block, this thread's ``map_tasks`` calls have priority ``level`` (default 0):
    whenever a worker takes a task, it takes one of the waiting calls of the lowest level, first
    come first served within a level. So a call of a later level (the background fill's screen)
    gives way, at its next task, to one of an earlier level (a click's)."""
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(f"a priority is an int (lower runs first), got {level!r}")
    before, _thread.priority = _thread.priority, level
    try:
        yield
    finally:
        _thread.priority = before


def current_priority() -> int:
    """The priority of this thread's calls now (``priority``)."""
    return _thread.priority


class _Call:
    """One ``map`` call: its tasks, how many started and run now, and its results."""

    __slots__ = ("done", "failed", "limit", "n", "next", "order", "results", "running", "stop", "task")

    def __init__(self, task, n: int, limit: int, order: tuple[int, int]):
        self.task, self.n, self.limit, self.order = task, n, limit, order
        self.next = self.running = 0
        self.results: list = [None] * n
        self.failed = None  # (index, exception) of the first task that failed
        self.stop = False
        self.done = threading.Event()


class ComputePool:
    """``size`` worker threads, each running torch at one intra-op thread, serving ``map`` calls
    from any thread (module docstring). ``size`` is the most tasks that run at once, across all
    callers; a worker free for a task takes it from the waiting call of the lowest ``priority``.
    The workers start here, each pinned before it takes a task (``PoolError`` where one cannot be);
    they are daemon threads, idle between calls, and ``close`` ends them."""

    def __init__(self, size: int):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"a compute pool needs at least 1 worker, got {size!r}")
        self.size = size
        self._ready = threading.Condition()  # guards _calls and _closing; notified when either changes
        self._calls: list[_Call] = []  # calls with tasks not yet started or running
        self._closing = False
        self._seq = itertools.count()
        pinned: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, args=(pinned,), name=f"{THREAD_PREFIX}-{i}", daemon=True)
                         for i in range(size)]
        for thread in self._threads:
            thread.start()
        if not all(pinned.get() for _ in self._threads):
            self.close()
            raise PoolError("a compute worker could not set torch to one intra-op thread")

    def _next_task(self):
        """``(call, index)`` of the task to run next, or None (hold ``_ready``)."""
        waiting = [c for c in self._calls if c.next < c.n and not c.stop and c.running < c.limit]
        if not waiting:
            return None
        call = min(waiting, key=lambda c: c.order)
        call.next += 1
        call.running += 1
        return call, call.next - 1

    def _serve(self, pinned: queue.SimpleQueue) -> None:
        ok = pin_to_one_thread()
        _thread.pool = self
        pinned.put(ok)
        while ok:
            with self._ready:
                while not self._closing and (taken := self._next_task()) is None:
                    self._ready.wait()
                if self._closing:
                    return
            call, i = taken
            failed = None
            try:
                call.results[i] = call.task(i)
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller
                failed = exc
            with self._ready:
                call.running -= 1
                if failed is not None:
                    call.stop = True
                    if call.failed is None or i < call.failed[0]:
                        call.failed = (i, failed)
                if call.running == 0 and (call.stop or call.next == call.n):
                    self._calls.remove(call)
                    call.done.set()
                self._ready.notify_all()  # a call's limit freed a task

    def map(self, task: Callable[[int], T], n: int, workers: int | None = None) -> list[T]:
        """``[task(0), ..., task(n - 1)]``, computed on at most ``workers`` (default: the pool's size)
        of this pool's threads at once while the caller waits, at the caller's ``priority``. The
        first task to fail stops the rest (none is started after it) and its exception is raised
        here, noted with its index."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"the number of tasks must be an int >= 0, got {n!r}")
        if _thread.pool is not None:  # a task asking for tasks: run them here (its worker is pinned)
            return [task(i) for i in range(n)]
        limit = self.size if workers is None else workers
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"workers must be an int >= 1 or None (the pool's size), got {workers!r}")
        if n == 0:
            return []
        call = _Call(task, n, limit, (_thread.priority, next(self._seq)))
        with self._ready:
            if self._closing:
                raise PoolError("the compute pool is closed")
            self._calls.append(call)
            self._ready.notify_all()
        try:
            call.done.wait()
        finally:
            with self._ready:
                call.stop = True  # the caller is gone (an interrupt): start none of the rest
                if call.running == 0 and call in self._calls:
                    self._calls.remove(call)
        if call.failed is not None:
            i, exc = call.failed
            exc.add_note(f"(in task {i} of {n}, run on a compute pool worker)")
            raise exc
        if call.next < n:
            raise PoolError(f"the compute pool was closed after {call.next} of {n} tasks")
        return call.results

    def wait_queued(self, calls: int, timeout: float | None = None) -> bool:
        """Block until at least ``calls`` calls have tasks waiting for a worker (True), or ``timeout``
        s (False): for tests and benchmarks that need a known queue."""
        with self._ready:
            return self._ready.wait_for(lambda: sum(c.next < c.n and not c.stop for c in self._calls) >= calls,
                                        timeout)

    def close(self) -> None:
        """End the workers once the tasks running now are done (calls waiting for more get none)."""
        with self._ready:
            self._closing = True
            for call in self._calls:
                call.stop = True
                if call.running == 0:
                    call.done.set()
            self._ready.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()


_shared: list = []  # [pid, ComputePool | None], set on first use
_shared_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()  # (another thread may have held it at the fork)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def shared() -> ComputePool | None:
    """The process's pool, one worker per core (``cores()``), started on first use; None where a
    worker cannot be set to one thread (module docstring)."""
    with _shared_lock:
        if not _shared or _shared[0] != os.getpid():  # first use, or a forked child: its own pool
            try:
                pool = ComputePool(cores())
            except PoolError:
                pool = None
            _shared[:] = [os.getpid(), pool]
        return _shared[1]


_serial = [False]  # use_pool(False): every call runs its loop in the caller


def use_pool(enabled: bool) -> None:
    """Process-wide: ``False`` makes every ``map_tasks`` call a serial loop in its calling thread (the
    path before the pool), ``True`` (the default) undoes it. Only for a
    benchmark comparing the two (``benchmarks/bench_contention.py``)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"use_pool takes True or False, got {enabled!r}")
    _serial[0] = not enabled


def worker_count() -> int:
    """How many tasks a ``map_tasks`` call from this thread runs at once: ``min(pool size,
    torch.get_num_threads())``, 1 where there is no pool."""
    pool = shared()
    return 1 if pool is None else max(1, min(pool.size, torch.get_num_threads()))


def check_workers(workers) -> None:
    """Refuse (``ValueError``) a ``workers`` argument of ``map_tasks`` that is not an int >= 0 or None."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise ValueError(f"workers must be an int >= 0 or None (None: worker_count(); 0: a serial loop), "
                         f"got {workers!r}")


def map_tasks(task: Callable[[int], T], n: int, workers: int | None = None) -> list[T]:
    """``[task(0), ..., task(n - 1)]`` on the shared pool (``ComputePool.map``), at most ``workers``
    at once (default ``worker_count()``); ``workers=0``, no pool, or ``use_pool(False)``: a serial loop
    in the calling thread at its own torch thread count (the path before the pool)."""
    check_workers(workers)
    pool = shared() if workers != 0 and not _serial[0] else None
    if pool is None:
        return [task(i) for i in range(n)]
    return pool.map(task, n, worker_count() if workers is None else workers)
