"""compute_pool: tasks on single-thread workers shared by the process, results in order, errors raised
to the caller, and the process's torch thread counts left as they were."""

import multiprocessing
import threading

import pytest
import torch

from pycircuits_widgets import compute_pool
from pycircuits_widgets.compute_pool import ComputePool

WAIT = 60.0  # seconds before a barrier that never fills fails the test instead of hanging it


def _new_thread_count() -> int:
    """``torch.get_num_threads()`` as a thread created now sees it."""
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


@pytest.fixture
def pool():
    if compute_pool.shared() is None:
        pytest.skip("no compute pool here: torch's thread count cannot be set per thread")
    p = ComputePool(2)
    yield p
    p.close()


class ActiveCounter:
    """Lock-protected count of tasks running now, and the most seen at once."""

    def __init__(self):
        self.lock, self.active, self.most, self.threads = threading.Lock(), 0, 0, set()

    def __enter__(self):
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
            self.threads.add(threading.current_thread().name)

    def __exit__(self, *exc):
        with self.lock:
            self.active -= 1


def test_results_come_back_in_task_order(pool):
    assert pool.map(lambda i: i * i, 50) == [i * i for i in range(50)]
    assert pool.map(lambda i: i, 0) == []


def test_workers_run_torch_at_one_thread_and_leave_the_process_counts_unchanged(pool):
    main, new = torch.get_num_threads(), _new_thread_count()
    seen = pool.map(lambda i: (torch.get_num_threads(), torch.ones(64, 64).sum().item()), 8)
    assert {count for count, _ in seen} == {1}
    assert torch.get_num_threads() == main
    assert _new_thread_count() == new


def test_concurrent_callers_share_the_workers_and_never_run_more_tasks_than_workers(pool):
    """Two threads each map 6 tasks on a 2-worker pool. Every task waits at a 2-party barrier, so
    the workers must run two at once (the most seen is exactly 2), and a third thread would be seen."""
    counter, barrier = ActiveCounter(), threading.Barrier(2, timeout=WAIT)

    def task(i):
        with counter:
            barrier.wait()
        return i

    results = {}
    callers = [threading.Thread(target=lambda name=name: results.setdefault(name, pool.map(task, 6)))
               for name in ("click", "fill")]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert results == {"click": list(range(6)), "fill": list(range(6))}
    assert counter.most == 2
    assert all(name.startswith(compute_pool.THREAD_PREFIX) for name in counter.threads)


def test_a_call_runs_at_most_its_workers_at_once(pool):
    counter = ActiveCounter()

    def task(i):
        with counter:
            return i

    assert pool.map(task, 20, workers=1) == list(range(20))
    assert counter.most == 1


def test_a_failing_task_raises_in_the_caller_naming_the_task(pool):
    def task(i):
        if i == 3:
            raise ValueError("tile 3 is bad")
        return i

    with pytest.raises(ValueError, match="tile 3 is bad") as info:
        pool.map(task, 10)
    assert any("task 3 of 10" in note for note in info.value.__notes__)
    assert pool.map(lambda i: i, 3) == [0, 1, 2]  # the pool still serves


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="at least 1 worker"):
        ComputePool(0)
    with pytest.raises(ValueError, match="workers must be an int >= 0"):
        compute_pool.map_tasks(lambda i: i, 3, workers=-1)


def test_workers_0_runs_serially_in_the_calling_thread():
    names = compute_pool.map_tasks(lambda i: threading.current_thread().name, 3, workers=0)
    assert names == [threading.current_thread().name] * 3


def test_with_torch_at_one_thread_a_call_uses_one_worker():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert compute_pool.worker_count() == 1
        counter = ActiveCounter()

        def task(i):
            with counter:
                return torch.get_num_threads()

        assert compute_pool.map_tasks(task, 12) == [1] * 12
        assert counter.most == 1
    finally:
        torch.set_num_threads(before)


def _child_sums(out):
    out.put(compute_pool.map_tasks(lambda i: int(torch.full((8,), i).sum()), 4))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")
def test_a_forked_child_gets_a_pool_of_its_own():
    compute_pool.map_tasks(lambda i: i, 4)  # the parent's pool is running
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_sums, args=(out,))
    child.start()
    try:
        assert out.get(timeout=WAIT) == [0, 8, 16, 24]
    finally:
        child.join(WAIT)
    assert child.exitcode == 0


def test_a_call_of_an_earlier_priority_goes_first_at_the_next_task():
    """One worker: the fill's call (priority 2) is running its first task when a click's call
    (priority 0) arrives; the worker takes the click's tasks next, then the fill's rest."""
    if compute_pool.shared() is None:
        pytest.skip("no compute pool here: torch's thread count cannot be set per thread")
    pool = ComputePool(1)
    order, started, release = [], threading.Event(), threading.Event()

    def fill_task(i):
        if i == 0:
            started.set()
            assert release.wait(WAIT)
        order.append(("fill", i))

    def fill():
        with compute_pool.priority(2):
            pool.map(fill_task, 4)

    def click():
        pool.map(lambda i: order.append(("click", i)), 3)

    try:
        threads = [threading.Thread(target=fill)]
        threads[0].start()
        assert started.wait(WAIT)
        threads.append(threading.Thread(target=click))
        threads[1].start()
        assert pool.wait_queued(2, WAIT)  # the fill's rest and the click's call
        release.set()
        for t in threads:
            t.join()
    finally:
        pool.close()
    assert order == [("fill", 0), ("click", 0), ("click", 1), ("click", 2), ("fill", 1), ("fill", 2), ("fill", 3)]


def test_a_closed_pool_says_so():
    if compute_pool.shared() is None:
        pytest.skip("no compute pool here: torch's thread count cannot be set per thread")
    pool = ComputePool(1)
    pool.close()
    with pytest.raises(compute_pool.PoolError, match="closed"):
        pool.map(lambda i: i, 2)


def test_use_pool_false_runs_every_call_serially_in_its_caller():
    compute_pool.use_pool(False)
    try:
        names = compute_pool.map_tasks(lambda i: threading.current_thread().name, 3)
    finally:
        compute_pool.use_pool(True)
    assert names == [threading.current_thread().name] * 3
    with pytest.raises(TypeError, match="True or False"):
        compute_pool.use_pool(1)
