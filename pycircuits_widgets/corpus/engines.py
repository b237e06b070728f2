"""The serial engine: shards recorded one after another in this process.

An engine is a function ``(model, settings, todo, *, device, **options)`` yielding ``(shard, windows,
accumulator)`` for each ``(shard, windows [n, seq_len])`` of ``todo``, in any order; ``sweep`` keeps and
merges them (``store.py``). The Ray engine is ``ray_engine.run``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from .accumulators import Accumulator
from .record import Recorder


def serial(model, settings: dict, todo: Iterator[tuple[int, np.ndarray]], *, device=None,
           on_batch: Callable[[int], None] | None = None) -> Iterator[tuple[int, np.ndarray, Accumulator]]:
    """Each shard of ``todo`` recorded here, on ``device`` (default: where the model is); ``on_batch(b)``
    after each batch of ``b`` windows (the sweep's bar ticks per batch, not only per shard)."""
    recorder = Recorder(model, settings["k"], settings["scores_only"], device)
    for shard, windows in todo:
        acc = recorder.record(torch.from_numpy(windows), shard * settings["shard_windows"], settings["batch_size"],
                              on_batch)
        yield shard, windows, acc
