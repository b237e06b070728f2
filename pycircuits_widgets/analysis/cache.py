"""Results that depend only on a model's weights, computed once per model and kept.

The analysis functions route their model-level and per-head work through ``cached``: the
token Grams (``eigen.token_gram``), every head's spectra (``eigen.eigenvalues``), the
composition score tables, each head's centred skip-trigram factors and OV diagonal, each
pair's composition detail. Every view reads the analysis functions, so a view revisiting a
head, or a second view of the same head, gets the stored result.

* **Keyed on the model object** through a weak reference: a model's entries go when the model
  is garbage-collected, and two models never share an entry.
* **Invalidated by a weight edit**: every lookup compares a stamp of the model's weights (for
  each weight tensor: the tensor itself, by identity, and its in-place version counter
  ``Tensor._version``) and the config object with those the entries were computed from, and
  drops them all when it differs. So ``model.W_Q[0, 3] *= 2`` (under ``torch.no_grad()``) or
  ``model.W_E = new`` invalidates. Writes that bypass the version counter (through ``.data``,
  a numpy view, a ``torch.from_numpy`` buffer) are not seen: after those, call ``clear(model)``.
* **Bounded memory**: at most ``budget()`` bytes of tensors per model (default
  ``BUDGET_BYTES``, 512 MiB, ``set_budget`` changes it), evicted by tier (``FACTORS``, then
  ``RESULT``, then ``MODEL``) and least recently used first within one; a result larger than the
  budget is returned and not kept. At GPT-2-small shapes
  (d_vocab 50257, d_head 64) a head's centred factors take 51 MB, so about nine heads' factors
  stay next to the model-level results (token Grams 2.4 MB each in float32, spectra and score
  tables under 1 MB) and every head's OV diagonal (0.2 MB each).
* **Computed once under threads**: views compute on worker threads; a second request for a
  key being computed waits for the first instead of repeating it. A result computed in pieces
  that a caller may stop between (the exact skip-trigram table: ``keeper``) never makes another
  thread wait for it: each computes, and takes between its pieces a result the other kept
  (``holds``), so a click never waits behind the background fill's search of the same head.
* **Counted**: ``stats(model)`` says how many lookups were answered from the store (``hits``)
  and how many computed (``misses``), so a benchmark or a test sees what a revisit recomputed.

Cached values are shared: callers must not modify them in place.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import fields, is_dataclass

import numpy as np
import torch

BUDGET_BYTES = 512 << 20
"""Default bytes of cached tensors kept per model."""
FACTORS, RESULT, MODEL = 0, 1, 2
"""Eviction tiers, first evicted first: per-head inputs that are large and quick to recompute
(centred factors, 51 MB a head at GPT-2 shapes), per-head and per-pair results (a diagonal, a
detail: kilobytes), and results every head shares (token Grams, all spectra, score tables)."""
ENTRY_OVERHEAD = 1024
"""Bytes each entry is charged beyond its tensors (its key and Python objects), so that many
small results are bounded too."""

_budget = BUDGET_BYTES
_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_models_lock = threading.Lock()


def set_budget(n_bytes: int) -> None:
    """Bytes of cached tensors kept per model from now on (entries over it are evicted at once)."""
    global _budget
    if isinstance(n_bytes, bool) or not isinstance(n_bytes, int) or n_bytes < 0:
        raise ValueError(f"the cache budget must be a non-negative int of bytes, got {n_bytes!r}")
    _budget = n_bytes
    with _models_lock:
        stores = list(_models.values())
    for store in stores:
        with store.lock:
            store.evict()


def budget() -> int:
    """Bytes of cached tensors kept per model."""
    return _budget


def nbytes(value) -> int:
    """Bytes held by the tensors in ``value`` (tensors, numpy arrays, bytes and memoryviews,
    in tuples, lists, dicts, dataclasses)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (bytes, bytearray, memoryview, np.ndarray)):
        return value.nbytes if hasattr(value, "nbytes") else len(value)
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if is_dataclass(value) and not isinstance(value, type):
        return sum(nbytes(getattr(value, f.name)) for f in fields(value))
    return 0


def _tensors(model) -> list:
    """``(name, tensor)`` of every tensor attribute of ``model`` (its weights), by name."""
    return sorted(((name, t) for name, t in vars(model).items() if isinstance(t, torch.Tensor)), key=lambda x: x[0])


def _stamp(model) -> tuple:
    """What the entries of ``model`` were computed from: weak references to the config and to every
    weight tensor, and each tensor's in-place version counter. Holds nothing alive."""
    return (weakref.ref(model.cfg), *((name, weakref.ref(t), t._version) for name, t in _tensors(model)))


def _matches(stamp: tuple, model) -> bool:
    """Whether ``model`` still has the config, the tensors and the versions ``stamp`` recorded.
    Compares by identity (a dead reference matches nothing), never tensor values: cheap."""
    tensors = _tensors(model)
    return (stamp[0]() is model.cfg and len(stamp) == 1 + len(tensors)
            and all(n == name and ref() is t and v == t._version for (n, ref, v), (name, t) in zip(stamp[1:], tensors)))


class _Store:
    """One model's entries, in least-recently-used order."""

    def __init__(self, stamp: tuple):
        self.lock = threading.Lock()
        self.stamp = stamp
        self.entries: OrderedDict = OrderedDict()  # key -> (value, bytes, tier)
        self.bytes = 0
        self.computing: dict = {}  # key -> Event of the thread computing it
        self.hits = self.misses = 0  # lookups answered from the store / computed (never reset)

    def reset(self, stamp: tuple) -> None:
        self.stamp = stamp
        self.entries.clear()
        self.bytes = 0

    def evict(self) -> None:
        """Tier by tier (``FACTORS`` first), least recently used first within a tier."""
        if self.bytes <= _budget:
            return
        for tier in (FACTORS, RESULT, MODEL):
            for key in [key for key, entry in self.entries.items() if entry[2] == tier]:
                if self.bytes <= _budget:
                    return
                self.bytes -= self.entries.pop(key)[1]

    def put(self, key, value, tier: int) -> None:
        size = nbytes(value) + ENTRY_OVERHEAD
        if size > _budget:
            return
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self.entries[key] = (value, size, tier)
        self.bytes += size
        self.evict()


def _store(model) -> _Store:
    """``model``'s store, emptied first if its weights changed since its entries were computed."""
    with _models_lock:
        store = _models.get(model)
        if store is None:
            store = _models[model] = _Store(_stamp(model))
            return store
    with store.lock:
        if not _matches(store.stamp, model):
            store.reset(_stamp(model))
    return store


def cached(model, key: tuple, compute, tier: int = RESULT):
    """``compute()``'s result for ``model`` under ``key`` (a hashable tuple naming the function
    and its arguments): stored the first time, returned from the store after that while the
    model's weights are unchanged (module docstring). ``tier`` (``FACTORS``, ``RESULT``, ``MODEL``)
    orders eviction, so that visiting many heads never pushes out what every head shares, nor
    their small results to make room for large factors. An object that cannot be weakly referenced
    (a ``types.SimpleNamespace`` of weights, say) is computed for every call: keeping its entries
    would keep it alive."""
    try:
        weakref.ref(model)
    except TypeError:
        return compute()
    store = _store(model)
    while True:
        with store.lock:
            if key in store.entries:
                store.entries.move_to_end(key)
                store.hits += 1
                return store.entries[key][0]
            pending = store.computing.get(key)
            if pending is None:
                store.misses += 1
                stamp = store.stamp
                done = store.computing[key] = threading.Event()
                break
        pending.wait()  # another thread computes it; then look again (it may not have been kept)
    try:
        value = compute()
        with store.lock:
            if store.stamp is stamp and _matches(stamp, model):  # not a result of weights edited meanwhile
                store.put(key, value, tier)
        return value
    finally:
        with store.lock:
            del store.computing[key]
        done.set()


def stored(model, key: tuple):
    """The value stored for ``model`` under ``key`` (counted as a hit), or None when there is none
    now: for a caller that shows something else first while it computes (a partial table)."""
    try:
        store = _store(model)
    except TypeError:  # not weakly referenceable: nothing is ever stored
        return None
    with store.lock:
        entry = store.entries.get(key)
        if entry is None:
            return None
        store.entries.move_to_end(key)
        store.hits += 1
        return entry[0]


def holds(model, key: tuple) -> bool:
    """Whether ``model``'s store holds ``key`` now (not counted as a lookup: for a computation in
    pieces that checks between them whether another thread has kept its result meanwhile)."""
    try:
        store = _models.get(model)
    except TypeError:  # not weakly referenceable: nothing is ever stored
        return False
    if store is None:
        return False
    with store.lock:
        return key in store.entries


def keeper(model, key: tuple, tier: int = RESULT):
    """For a result computed in pieces (``analysis.pieces``), outside ``cached``: call it before the
    first piece; ``keep(value)``, the function it returns, called after the last, stores ``value``
    under ``key`` (a computed lookup, as ``cached`` counts it) unless the weights changed meanwhile,
    and returns the value the store holds (one another thread kept first, or ``value``)."""
    try:
        store = _store(model)
    except TypeError:  # not weakly referenceable: computed for every call
        return lambda value: value
    with store.lock:
        stamp = store.stamp

    def keep(value):
        with store.lock:
            entry = store.entries.get(key)
            if entry is not None and store.stamp is stamp:
                return entry[0]
            store.misses += 1
            if store.stamp is stamp and _matches(stamp, model):  # not a result of weights edited meanwhile
                store.put(key, value, tier)
        return value

    return keep


def stats(model) -> dict:
    """``{"hits", "misses"}``: lookups of ``model``'s entries answered from the store and computed,
    since its first one (a weight edit empties the store but keeps counting)."""
    with _models_lock:
        store = _models.get(model)
    return {"hits": 0, "misses": 0} if store is None else {"hits": store.hits, "misses": store.misses}


def clear(model) -> None:
    """Forget every entry of ``model`` (after a weight write the version counter does not see)."""
    with _models_lock:
        store = _models.get(model)
    if store is not None:
        with store.lock:
            store.reset(_stamp(model))


def discard(model, where) -> None:
    """Forget the entries of ``model`` whose key satisfies ``where(key)``."""
    with _models_lock:
        store = _models.get(model)
    if store is None:
        return
    with store.lock:
        for key in [key for key in store.entries if where(key)]:
            store.bytes -= store.entries.pop(key)[1]


def stored_bytes(model) -> int:
    """Bytes of tensors cached for ``model`` now."""
    with _models_lock:
        store = _models.get(model)
    return 0 if store is None else store.bytes


def keys(model) -> list[tuple]:
    """Keys cached for ``model``, least recently used first."""
    with _models_lock:
        store = _models.get(model)
    if store is None:
        return []
    with store.lock:
        return list(store.entries)
