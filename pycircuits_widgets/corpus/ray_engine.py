"""The Ray engine: shards recorded by Ray Core actors that keep the model loaded.

The driver (the process that called ``sweep``) cuts the corpus into shards and keeps the store; each
actor builds the model once from weights put in Ray's object store once, records the shards it is
handed (``record.Recorder``, ``cpus_per_worker`` torch threads, on the GPU with ``num_gpus``) and returns
their accumulators, which the driver writes and merges in shard order exactly as the serial engine's
(``store.py``): the same store, whatever the number of workers or machines. Each actor holds at most
two shards (one running, one waiting), so the driver's memory stays a few shards.

The cluster: the one this process is connected to (``ray.init(address=...)`` before the sweep, or
``address=`` here), else a local one started for the sweep (with this package's code shipped to its
workers, Ray's ``runtime_env`` ``py_modules``) and shut down after it. On a cluster of your own the
workers import ``pycircuits_widgets`` as installed on each node, or as shipped by your
``ray.init(runtime_env={"py_modules": [pycircuits_widgets]})``; before any shard is handed out, every
actor's code is checked to be the driver's (``code_identity``), since another version could record
differently. A worker that dies is restarted and its shard retried (``max_restarts``); a driver that
dies loses the shards in flight, and the next call resumes.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..models.circuit_model import weight_shapes
from .accumulators import Accumulator
from .arguments import check_positive

IN_FLIGHT_PER_WORKER = 2
SERIAL = "engine='serial' makes the same store in this process, without Ray"
RESULT_SOURCES = ("models/circuit_model.py", "models/forward.py", "models/activation_cache.py", "analysis/head_scores.py",
                  "linalg.py", "corpus/record.py", "corpus/accumulators.py")


class ShardWorker:
    """A Ray actor's state: the model (built on its first shard, again after a restart) and its ``Recorder``.

    The weights come as an object reference inside a list, which Ray does not resolve by itself: the
    actor fetches them once, not with every shard."""

    def __init__(self, settings: dict, device, threads: int):
        torch.set_num_threads(threads)
        self.settings, self.device = settings, device
        self.recorder = None

    def code_identity(self) -> str:
        return code_identity()

    def record(self, shard: int, windows: np.ndarray, parts: list) -> dict[str, torch.Tensor]:
        if self.recorder is None:
            import ray

            from ..models.circuit_model import CircuitModel
            from .record import Recorder

            model_parts = ray.get(parts[0])
            model = CircuitModel(model_parts["cfg"], **model_parts["weights"])
            self.recorder = Recorder(model, self.settings["k"], self.settings["scores_only"], self.device)
        return self.recorder.record(torch.tensor(windows), shard * self.settings["shard_windows"],
                                    self.settings["batch_size"]).tensors()


def code_identity() -> str:
    """sha256 of the sources that decide what a shard records (this package's model forward, head scores,
    recorder and accumulators): equal on the driver and every worker, or the sweep is refused."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for part in RESULT_SOURCES:
        h.update((root / part).read_bytes())
    return h.hexdigest()


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("engine='ray' needs Ray: pip install 'pycircuits_widgets[ray]'") from None
    return ray


def start_local_cluster(num_cpus: int | None = None, attempts: int = 3) -> None:
    """``ray.init`` of a local cluster (``num_cpus``: default all) whose workers get this package's code
    (``py_modules``). Tried ``attempts`` times: the raylet gives its dashboard agent a fixed 15 s to report
    its ports and dies when it is late (ray-project/ray#65983), which a busy machine can cause.
    ``address="local"``: a new cluster even where ``ray start`` left one's address on this machine
    (``/tmp/ray/ray_current_cluster``), which a bare ``ray.init`` would join, refusing ``num_cpus``."""
    ray = _ray()
    for attempt in range(attempts):
        try:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level="warning",
                     runtime_env={"py_modules": [str(Path(__file__).resolve().parents[1])]})
            return
        except Exception as err:  # Ray raises a bare Exception for a node that did not start
            ray.shutdown()
            if attempt == attempts - 1:
                raise RuntimeError(f"a local Ray cluster did not start in {attempts} attempts ({err}); {SERIAL}, or "
                                   "on a busy machine try again, or start one yourself (ray start --head)") from err


def run(model, settings: dict, todo: Iterator[tuple[int, np.ndarray]], *, device=None, address: str | None = None,
        workers: int | None = None, cpus_per_worker: int = 1,
        num_gpus: float = 0) -> Iterator[tuple[int, np.ndarray, Accumulator]]:
    """Each shard of ``todo`` recorded by an actor (module docstring), yielded as it finishes.

    ``address``: a cluster to connect to when this process is not connected yet. ``workers``: how many
    actors (default: the cluster's CPUs // ``cpus_per_worker``, or its GPUs // ``num_gpus``).
    ``cpus_per_worker``: CPUs each actor reserves and torch threads it runs. ``num_gpus``: GPUs each
    actor reserves; the model goes to its GPU. ``device`` is for the serial engine."""
    if device is not None:
        raise TypeError("device= is for engine='serial'; Ray workers take num_gpus= (the model goes to their GPU)")
    if workers is not None:
        check_positive("workers", workers, "a positive int or None (as many as the cluster has room for)")
    check_positive("cpus_per_worker", cpus_per_worker)
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, (int, float)) or not num_gpus >= 0:
        raise ValueError(f"num_gpus must be a number >= 0 (GPUs per worker), got {num_gpus!r}")
    ray = _ray()
    started = False
    if not ray.is_initialized():
        if address:
            try:
                ray.init(address=address, logging_level="warning")
            except Exception as err:  # ConnectionError, TimeoutError, or Ray's bare Exception for a late node
                raise RuntimeError(f"could not connect to the Ray cluster at {address!r} ({err}); {SERIAL}") from err
        else:
            start_local_cluster()
            started = True
    actors = []
    try:
        resources = ray.cluster_resources()
        if workers is None:
            workers = int(resources.get("GPU", 0) // num_gpus if num_gpus else resources.get("CPU", 1) // cpus_per_worker)
        if workers < 1:
            raise ValueError(f"the Ray cluster has no room for a worker of {cpus_per_worker} CPUs and {num_gpus} GPUs "
                             f"(cluster resources: {resources})")
        weights = {n: getattr(model, n) for n in weight_shapes(model.cfg)}
        parts = ray.put({"cfg": model.cfg, "weights": {n: w.detach().cpu() for n, w in weights.items() if w is not None}})
        Actor = ray.remote(ShardWorker).options(num_cpus=cpus_per_worker, num_gpus=num_gpus, max_restarts=2,
                                                max_task_retries=2)
        actors = [Actor.remote(settings, "cuda" if num_gpus else None, cpus_per_worker) for _ in range(workers)]
        advice = ("install the same pycircuits_widgets on every node, or connect with ray.init(address=..., "
                  "runtime_env={'py_modules': [pycircuits_widgets]})")
        try:
            theirs = ray.get([actor.code_identity.remote() for actor in actors])
        except ray.exceptions.RayError as err:
            raise RuntimeError(f"the Ray workers could not start the sweep's actor ({type(err).__name__}: {err}); "
                               f"{advice}") from err
        if any(code != code_identity() for code in theirs):
            raise RuntimeError(f"the Ray workers run another pycircuits_widgets than this process (its recorder or "
                               f"model code differs): {advice}")
        yield from _dispatch(ray, actors, todo, parts)
    finally:
        for actor in actors:
            ray.kill(actor)
        if started:
            ray.shutdown()


def _dispatch(ray, actors: list, todo, parts) -> Iterator[tuple[int, np.ndarray, Accumulator]]:
    """Hand shards to free actors, up to ``IN_FLIGHT_PER_WORKER`` each; yield each result as it comes."""
    free = deque(actors * IN_FLIGHT_PER_WORKER)
    in_flight: dict = {}
    todo = iter(todo)
    more = True
    while True:
        while free and more:
            item = next(todo, None)
            if item is None:
                more = False
                break
            actor = free.popleft()
            shard, windows = item
            in_flight[actor.record.remote(shard, windows, [parts])] = (shard, windows, actor)
        if not in_flight:
            return
        done, _ = ray.wait(list(in_flight), num_returns=1)
        for ref in done:
            shard, windows, actor = in_flight.pop(ref)
            try:
                tensors = ray.get(ref)
            except ray.exceptions.RayError as err:
                raise RuntimeError(f"Ray worker failed on shard {shard} ({type(err).__name__}: {err}); the shards "
                                   "recorded so far are kept: run the same sweep again to resume") from err
            free.append(actor)
            yield shard, windows, Accumulator.from_tensors(tensors)
