"""A sweep's store: one folder, written the same way by every engine, readable by the ecosystem.

Layout (``FORMAT``)::

    manifest.json                 what the store holds: model, corpus, tokenisation, settings, progress
    windows/000000.safetensors    each shard's windows, ``"windows" [n, seq_len]`` (uint16, or int32
                                  for vocabularies over 65536)
    shards/000007.safetensors     a shard recorded before the one it follows (its ``Accumulator``): the
                                  Ray engine's shards can finish out of order
    merged/000006.safetensors     shards 0..6 merged (the file ``manifest["merged"]`` names)
    heads.parquet                 when complete: every head's top k (``layer, head, rank, window,
                                  position, score, source, attention, token, source_token``)
    neurons.parquet               every neuron's top k (``layer, neuron, rank, window, position,
                                  score, token``); absent for attention-only models
    stats.safetensors             head scores and their target counts, head_out means, neuron means
                                  and fractions > 0, position and window counts

Crash safety: every file is written under a temporary name and renamed into place (atomic on POSIX
file systems, local or shared), and the manifest, renamed last, is the only record of progress: a
process killed at any point leaves the store as its last manifest describes, losing at most the shards
in flight. Files it does not name (temporaries, a shard whose manifest update never happened, a
superseded merge) are removed when the store is opened again. Shards merge in shard order (the merge
of shard ``s + 1`` waits for shard ``s``), so every engine and every resume merges the same sums in the
same order and writes the same store. No pickle: JSON, safetensors and Parquet only.

A store is refused (``StoreMismatch``) when it was made with another model, corpus, tokenisation or
settings, naming what differs; and, where the platform has ``fcntl``, while another process writes it.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file, save_file

from .accumulators import EMPTY, Accumulator

FORMAT = "pycircuits_widgets.sweep/1"


class StoreMismatch(ValueError):
    """The store was made by another sweep (the message names what differs)."""


def _name(shard: int) -> str:
    return f"{shard:06d}.safetensors"


def _atomic(path: Path, write) -> None:
    """``write(tmp)`` then rename ``tmp`` to ``path``: readers see the old file or the whole new one."""
    # a fresh name per writer (not mkstemp: its files are private, 0600; a store is read by others)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_json(path: Path, value: dict) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=1, sort_keys=True)
            f.write("\n")

    _atomic(path, write)


def read_manifest(path: Path) -> dict:
    """The manifest of the store at ``path`` (``FileNotFoundError`` / ``ValueError`` if there is none)."""
    file = Path(path) / "manifest.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a sweep store (no manifest.json); make one with pcw.sweep")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not a sweep manifest (not JSON: {err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{file} is not a sweep manifest of format {FORMAT!r}")
    return manifest


def differences(recorded: dict, wanted: dict, where: str = "") -> list[str]:
    """``"where.key: recorded -> wanted"`` for every leaf that differs between two identity dicts."""
    out = []
    for key in sorted(set(recorded) | set(wanted)):
        a, b = recorded.get(key), wanted.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{where}{key}.")
        elif a != b:
            out.append(f"{where}{key}: {a!r} in the store, {b!r} now")
    return out


class Store:
    """A store opened for writing by one sweep (module docstring). ``identity``: ``{"model", "corpus",
    "tokenization", "settings"}``, each a JSON-able dict; an existing store must have the same. ``info``:
    recorded, not compared (e.g. what the corpus skipped)."""

    def __init__(self, path, identity: dict, info: dict | None = None):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(f"store {self.path} is a file; pass a folder (it is created if missing)")
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = _lock(self.path)
        self._merged: Accumulator | None = None
        file = self.path / "manifest.json"
        if file.exists():
            self.manifest = read_manifest(self.path)
            recorded = {key: self.manifest.get(key) for key in identity}
            diff = differences(recorded, identity)
            if diff:
                self.close()
                raise StoreMismatch(f"store {self.path} was made by another sweep: " + "; ".join(diff)
                                    + ". Use another folder, or delete this one to start over")
        else:
            if any(p.name != ".lock" for p in self.path.iterdir()):
                self.close()
                raise StoreMismatch(f"store {self.path} is a folder with files and no sweep manifest; "
                                    "pass an empty or new folder")
            self.manifest = {"format": FORMAT, **identity, "info": info or {}, "merged": None, "merged_through": -1,
                             "pending": [], "shards": None, "windows": None, "complete": False}
            for part in ("windows", "shards", "merged"):
                (self.path / part).mkdir(exist_ok=True)
            self._save()
        self._tidy()

    # --- progress ---------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return bool(self.manifest["complete"])

    def recorded(self) -> set[int]:
        """Shards recorded so far (merged or pending)."""
        return set(range(self.manifest["merged_through"] + 1)) | set(self.manifest["pending"])

    def record(self, shard: int, windows: np.ndarray, acc: Accumulator, vocab: int) -> None:
        """Keep shard ``shard``: its windows, then its accumulator, merged at once when it follows the merged
        shards (with any pending ones it unblocks), else kept as a pending shard file; then the manifest."""
        dtype = np.uint16 if vocab <= 1 << 16 else np.int32
        _atomic(self.path / "windows" / _name(shard),
                lambda tmp: save_numpy({"windows": np.ascontiguousarray(windows, dtype=dtype)}, tmp))
        if shard == self.manifest["merged_through"] + 1:
            self._fold(acc)
            return
        _atomic(self.path / "shards" / _name(shard), lambda tmp: save_file(acc.tensors(), tmp))
        self.manifest["pending"] = sorted(set(self.manifest["pending"]) | {shard})
        self._save()

    def end(self, shards: int, windows: int) -> None:
        """The corpus ended: ``shards`` shards holding ``windows`` windows in all."""
        self.manifest["shards"], self.manifest["windows"] = shards, windows
        self._save()

    def fold(self) -> Accumulator | None:
        """Merge the pending shards that follow the merged ones, in shard order; the merged accumulator
        (None before any shard)."""
        return self._fold(None)

    def _fold(self, following: Accumulator | None) -> Accumulator | None:
        """Merge ``following`` (the accumulator of shard ``merged_through + 1``, if given), then every
        pending shard that follows, in shard order; write the merge under a new name, then the manifest."""
        through, pending = self.manifest["merged_through"], set(self.manifest["pending"])
        if self._merged is None and self.manifest["merged"] is not None:
            self._merged = Accumulator.from_tensors(load_file(self.path / "merged" / self.manifest["merged"]))
        if following is None and through + 1 not in pending:
            return self._merged
        old, folded = self.manifest["merged"], []
        if following is not None:
            through += 1
            self._merged = following if self._merged is None else self._merged.merge(following)
        while through + 1 in pending:
            through += 1
            shard = Accumulator.from_tensors(load_file(self.path / "shards" / _name(through)))
            self._merged = shard if self._merged is None else self._merged.merge(shard)
            pending.discard(through)
            folded.append(through)
        name = _name(through)
        _atomic(self.path / "merged" / name, lambda tmp: save_file(self._merged.tensors(), tmp))
        self.manifest.update(merged=name, merged_through=through, pending=sorted(pending))
        self._save()
        # removed once the manifest no longer names them (a crash before leaves files _tidy removes)
        for shard in folded:
            (self.path / "shards" / _name(shard)).unlink(missing_ok=True)
        if old is not None:
            (self.path / "merged" / old).unlink(missing_ok=True)
        return self._merged

    def finish(self, tables: dict, stats: dict[str, torch.Tensor]) -> None:
        """Write the final tables (Parquet) and statistics (safetensors), mark the store complete and
        drop the accumulators."""
        for name, table in tables.items():
            import pyarrow.parquet as pq

            _atomic(self.path / f"{name}.parquet", lambda tmp, t=table: pq.write_table(t, tmp))
        _atomic(self.path / "stats.safetensors", lambda tmp: save_file({k: v.contiguous() for k, v in stats.items()}, tmp))
        self.manifest.update(complete=True, merged=None, pending=[])
        self._save()
        for part in ("shards", "merged"):
            shutil.rmtree(self.path / part, ignore_errors=True)

    def windows_of(self, shard: int) -> np.ndarray:
        return load_numpy(self.path / "windows" / _name(shard))["windows"]

    # --- housekeeping -------------------------------------------------------------------------------
    def _save(self) -> None:
        _write_json(self.path / "manifest.json", self.manifest)

    def _tidy(self) -> None:
        """Remove what the manifest does not name (module docstring)."""
        keep_shards = {_name(s) for s in self.manifest["pending"]}
        keep_merged = {self.manifest["merged"]}
        recorded = {_name(s) for s in self.recorded()}
        for part, keep in (("shards", keep_shards), ("merged", keep_merged), ("windows", recorded)):
            folder = self.path / part
            if not folder.is_dir():
                continue
            for file in folder.iterdir():
                if file.name not in keep:
                    file.unlink(missing_ok=True)
        for file in self.path.glob(".*.tmp"):
            file.unlink(missing_ok=True)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def _lock(path: Path):
    """An exclusive lock on ``path/.lock`` for this process (released when closed or when the process
    dies), or None where the platform has no ``fcntl``; another holder: ``StoreMismatch``."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks here
        return None
    handle = open(path / ".lock", "a")  # noqa: SIM115 - held open: the lock lasts as long as the handle
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise StoreMismatch(f"store {path} is being written by another process (its lock is held); wait for "
                            "it to finish or stop it") from None
    return handle


def example_rows(table, names: tuple[str, str], columns_per_row: int) -> dict[str, np.ndarray]:
    """A ``TopK`` flattened into columns for a Parquet table: ``layer``, ``names[1]`` (head or neuron),
    ``rank`` and the table's fields, empty slots dropped; rows in (layer, unit, rank) order."""
    R, k = table.score.shape
    rows = np.arange(R).repeat(k)
    keep = table.window.reshape(-1).numpy() != EMPTY
    out = {"layer": (rows // columns_per_row).astype(np.int32), names[1]: (rows % columns_per_row).astype(np.int32),
           "rank": np.tile(np.arange(k, dtype=np.int32), R)}
    fields = table.fields()
    for name in ("window", "position", "score", *table.extras):  # the columns users read first, first
        out[name] = fields[name].reshape(-1).numpy()
    return {name: col[keep] for name, col in out.items()}
