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
    heads_by_induction.parquet    every head's top k by its attention to a role's targets, one table
                                  per head score (``heads_by_previous_token``, ``..._duplicate_token``,
                                  ``..._induction``), the columns of ``heads.parquet``
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

Self-checking (``StoreCorrupt`` names what is wrong): the manifest records every file it names, by path
relative to the store (only the layout's own names are taken: no other folder is ever read or written
through it), with its size and sha256, and a sha256 of its own content (``digest``). On open the manifest
is checked against its digest and its schema (types, ranges, and counts that agree: shards, windows and
``shard_windows``; a finished store names exactly its shards' windows). A file is checked against its record
before it is read: every file before a resume, a finished store's lazily, each file on first use. A
finished store's statistics file carries the manifest's final content but for ``files`` and ``digest``
(``SEAL``, in its safetensors metadata; ``read_stats``): an edit that also redid the digest (a count the
schema allows, the model's fingerprint) differs from it, and is refused naming the field.

This module owns the layout: ``Store`` writes a store (and, once every shard is merged, turns the
accumulators into its tables and statistics: ``Store.finish``), ``FinishedStore`` reads a finished one
back for ``sweeps.Sweep``, which only queries it; no other module names a store's file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file, save_file

from ..analysis.head_scores import SCORE_NAMES
from .accumulators import EMPTY, Accumulator

FORMAT = "pycircuits_widgets.sweep/4"
SEAL = "pycircuits_widgets.manifest"
"""The statistics file's metadata key holding the sealed manifest (module docstring)."""
PARTS = ("windows", "shards", "merged")
_SHARD_FILE = re.compile(r"\d{6}\.safetensors")
_FILE = re.compile(r"(windows|shards|merged)/\d{6}\.safetensors|stats\.safetensors|"
                   rf"(heads|neurons|heads_by_({'|'.join(SCORE_NAMES)}))\.parquet")
"""The files a manifest may name (module docstring, "Layout"), relative to the store."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


class StoreMismatch(ValueError):
    """The store was made by another sweep (the message names what differs)."""


class StoreCorrupt(ValueError):
    """A store's manifest or file is not what the sweep wrote (the message names the file or field)."""


def _name(shard: int) -> str:
    return f"{shard:06d}.safetensors"


STATS = "stats.safetensors"
"""The statistics file (module docstring, "Layout")."""


def windows_file(shard: int) -> str:
    """Shard ``shard``'s windows file, relative to the store."""
    return f"windows/{_name(shard)}"


def table_file(table: str) -> str:
    """A finished store's examples table ``table`` ("heads", "neurons", "heads_by_induction", ...),
    relative to the store."""
    return f"{table}.parquet"


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


def _content_digest(manifest: dict) -> str:
    """sha256 (hex) of the manifest's content less its ``digest``, in one canonical JSON form."""
    content = {key: value for key, value in manifest.items() if key != "digest"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def _write_json(path: Path, value: dict) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=1, sort_keys=True)
            f.write("\n")

    _atomic(path, write)


def file_record(path: Path) -> dict:
    """``{"size", "sha256"}`` of the file at ``path``, as a manifest records it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def check_file(store: Path, manifest: dict, name: str) -> Path:
    """``store / name``, refused (``StoreCorrupt``) unless the manifest records it and the file's size and
    sha256 are the recorded ones (module docstring)."""
    path = Path(store) / name
    record = manifest["files"].get(name)
    if record is None:
        raise StoreCorrupt(f"store {store}: the manifest names no file {name!r}; the store is incomplete or its "
                           "manifest was edited: sweep again into a new folder")
    if not path.is_file():
        raise StoreCorrupt(f"store {store}: {name} is missing (the manifest records it, {record['size']} bytes); "
                           "sweep again into a new folder")
    found = file_record(path)
    if found != record:
        what = "size" if found["size"] != record["size"] else "sha256"
        raise StoreCorrupt(f"store {store}: {name} is not the file the sweep wrote (its {what} differs from the "
                           f"manifest's: {found[what]!r}, recorded {record[what]!r}); it was changed or damaged: "
                           "sweep again into a new folder")
    return path


def read_manifest(path: Path) -> dict:
    """The manifest of the store at ``path``, checked (module docstring): ``FileNotFoundError`` if there is
    none, ``ValueError`` for a file that is no sweep manifest, ``StoreCorrupt`` for one edited or damaged."""
    file = Path(path) / "manifest.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a sweep store (no manifest.json); make one with pcw.sweep")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as err:
        raise ValueError(f"{file} is not a sweep manifest (not JSON: {type(err).__name__}: {err})"[:2000]) from None
    if not isinstance(manifest, dict) or not str(manifest.get("format", "")).startswith("pycircuits_widgets.sweep/"):
        raise ValueError(f"{file} is not a sweep manifest of format {FORMAT!r}")
    if manifest["format"] != FORMAT:
        raise ValueError(f"{file} is a sweep store of format {manifest['format']!r}, made by an earlier version "
                         f"(this one reads {FORMAT!r}, whose stores check themselves: module docstring): sweep "
                         "again into a new folder")
    if manifest.get("digest") != _content_digest(manifest):
        raise StoreCorrupt(f"{file} was edited or damaged after the sweep wrote it (its digest does not match its "
                           "content); sweep again into a new folder")
    _check_schema(manifest, file)
    return manifest


def _check_schema(m: dict, file: Path) -> None:
    """Refuse (``StoreCorrupt``, naming the field, what was expected and what was found) a manifest whose
    fields have the wrong types or ranges, or whose counts disagree (module docstring)."""
    def fail(field: str, expected: str, got):
        raise StoreCorrupt(f"{file}: {field} must be {expected}, got {repr(got)[:200]}")

    def integer(value, low: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low

    for key in ("model", "corpus", "tokenization", "settings", "info", "files"):
        if not isinstance(m.get(key), dict):
            fail(key, "an object", m.get(key))
    if not isinstance(m["info"].get("model"), dict):
        fail("info.model", "an object", m["info"].get("model"))
    for part, field in (("model", "fingerprint"), ("corpus", "fingerprint")):
        if not isinstance(m[part].get(field), str):
            fail(f"{part}.{field}", "a string", m[part].get(field))
    if not isinstance(m["info"]["model"].get("name"), str):
        fail("info.model.name", "a string", m["info"]["model"].get("name"))
    settings = m["settings"]
    for field in ("seq_len", "k", "batch_size", "shard_windows"):
        if not integer(settings.get(field), 1):
            fail(f"settings.{field}", "an int >= 1", settings.get(field))
    if settings.get("max_windows") is not None and not integer(settings["max_windows"], 1):
        fail("settings.max_windows", "null or an int >= 1", settings["max_windows"])
    for where, value in (("settings.scores_only", settings.get("scores_only")), ("complete", m.get("complete"))):
        if not isinstance(value, bool):
            fail(where, "true or false", value)
    if m.get("merged") is not None and not (isinstance(m["merged"], str) and _SHARD_FILE.fullmatch(m["merged"])):
        fail("merged", "null or a shard file name (six digits, .safetensors)", m["merged"])
    if not integer(m.get("merged_through"), -1):
        fail("merged_through", "an int >= -1", m.get("merged_through"))
    pending = m.get("pending")
    if not (isinstance(pending, list) and all(integer(s, m["merged_through"] + 2) for s in pending)
            and pending == sorted(set(pending))):
        fail("pending", "a sorted list of distinct shard numbers after merged_through + 1", pending)
    for field in ("shards", "windows"):
        if m.get(field) is not None and not integer(m[field], 1):
            fail(field, "null or an int >= 1", m.get(field))
    for name, record in m["files"].items():
        if not _FILE.fullmatch(name):
            fail("files", "names of the store's layout (windows/, shards/ or merged/ then six digits and "
                          ".safetensors; stats.safetensors; heads.parquet, heads_by_<score>.parquet, neurons.parquet)", name)
        if not (isinstance(record, dict) and set(record) == {"size", "sha256"} and integer(record["size"], 0)
                and isinstance(record["sha256"], str) and _SHA256.fullmatch(record["sha256"])):
            fail(f"files[{name!r}]", '{"size": bytes, "sha256": 64 hex digits}', record)
    shards, windows, shard_windows = m["shards"], m["windows"], settings["shard_windows"]
    if (shards is None) != (windows is None):
        fail("shards and windows", "both null (the corpus not yet at its end) or both set", (shards, windows))
    if shards is not None and not (shards - 1) * shard_windows < windows <= shards * shard_windows:
        fail("windows", f"in {(shards - 1) * shard_windows + 1}..{shards * shard_windows} for {shards} shards of "
                        f"{shard_windows} windows", windows)
    if windows is not None and settings.get("max_windows") is not None and windows > settings["max_windows"]:
        fail("windows", f"at most settings.max_windows = {settings['max_windows']}", windows)
    recorded = set(range(m["merged_through"] + 1)) | set(pending)
    wanted = {windows_file(s) for s in recorded}
    optional = set()
    if m["complete"]:
        if shards is None or m["merged"] is not None or pending or m["merged_through"] + 1 != shards:
            fail("complete", "true only once every shard is merged and written out (shards set, merged null, "
                             "pending empty, merged_through = shards - 1)",
                 {k: m[k] for k in ("shards", "merged", "pending", "merged_through")})
        wanted.add(STATS)
        if not settings["scores_only"]:
            wanted |= {table_file(name) for name in ("heads", *(f"heads_by_{r}" for r in SCORE_NAMES))}
            optional.add(table_file("neurons"))  # attention-only models have no neurons
    else:
        wanted |= {f"shards/{_name(s)}" for s in pending} | ({f"merged/{m['merged']}"} if m["merged"] else set())
    named = set(m["files"])
    if not wanted <= named or named - wanted - optional:
        fail("files", "the files its progress implies", {"missing": sorted(wanted - named),
                                                         "unexpected": sorted(named - wanted - optional)})


def _sealed_content(manifest: dict) -> dict:
    """What a finished store seals in its statistics file: the manifest less ``files`` and ``digest``."""
    return {key: value for key, value in manifest.items() if key not in ("files", "digest")}


def read_stats(path: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """The statistics of the finished store at ``path``: its file checked against the manifest's record,
    and the manifest against the content sealed in the file (module docstring)."""
    file = check_file(path, manifest, STATS)
    with safe_open(file, "pt") as f:
        sealed = (f.metadata() or {}).get(SEAL)
        stats = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    if sealed is None:
        raise StoreCorrupt(f"store {path}: stats.safetensors carries no sealed manifest ({SEAL!r} metadata); the "
                           "store was not finished by this version: sweep again into a new folder")
    diff = differences(json.loads(sealed), _sealed_content(manifest), labels=("sealed", "now"))
    if diff:
        raise StoreCorrupt(f"{Path(path) / 'manifest.json'}: " + "; ".join(diff) + " (the manifest was edited after "
                           "the sweep finished: stats.safetensors seals what it wrote); sweep again into a new folder")
    return stats


def check_identity(path: Path, manifest: dict, identity: dict) -> None:
    """Refuse (``StoreMismatch``, naming each difference) the store at ``path`` unless its manifest records
    ``identity`` (its keys only: ``Store``'s)."""
    diff = differences({key: manifest.get(key) for key in identity}, identity)
    if diff:
        raise StoreMismatch(f"store {path} was made by another sweep (of model {manifest['info']['model']['name']!r}): "
                            + "; ".join(diff) + ". Use another folder, or delete this one to start over")


def differences(recorded: dict, wanted: dict, where: str = "", labels: tuple[str, str] = ("in the store", "now")
                ) -> list[str]:
    """``"where.key: recorded labels[0], wanted labels[1]"`` for every leaf that differs between two dicts."""
    out = []
    for key in sorted(set(recorded) | set(wanted)):
        a, b = recorded.get(key), wanted.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{where}{key}.", labels)
        elif a != b:
            out.append(f"{where}{key}: {a!r} {labels[0]}, {b!r} {labels[1]}")
    return out


class Store:
    """A store opened for writing by one sweep (module docstring). ``identity``: ``{"model", "corpus",
    "tokenization", "settings"}``, each a JSON-able dict; an existing store must have the same. ``info``:
    recorded, not compared: ``{"corpus": {...}, "model": {"name", ...}}`` (what the corpus skipped, how the
    model is called: a name is no part of what it computes)."""

    def __init__(self, path, identity: dict, info: dict):
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(f"store {self.path} is a file; pass a folder (it is created if missing)")
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = _lock(self.path)
        self._merged: Accumulator | None = None
        self._unchecked: dict[int, tuple[int, dict]] = {}  # shard -> (its windows, its files' records)
        try:
            self._open(identity, info)
        except BaseException:
            self.close()
            raise
        self._tidy()

    def _open(self, identity: dict, info: dict) -> None:
        if (self.path / "manifest.json").exists():
            self.manifest = read_manifest(self.path)
            check_identity(self.path, self.manifest, identity)
            if not self.complete:  # before a resume builds on them: every file as the sweep wrote it
                for name in self.manifest["files"]:
                    check_file(self.path, self.manifest, name)
            return
        # what a sweep killed before its first manifest leaves: its lock, its empty folders, temporaries
        leftovers = [p for p in self.path.iterdir() if not (
            p.name == ".lock" or (p.name in PARTS and p.is_dir() and not any(p.iterdir()))
            or (p.name.startswith(".") and p.name.endswith(".tmp")))]
        if leftovers:
            raise StoreMismatch(f"store {self.path} is a folder with files and no sweep manifest "
                                f"({', '.join(sorted(p.name for p in leftovers)[:5])}); pass an empty or new folder")
        self.manifest = {"format": FORMAT, **identity, "info": info, "merged": None, "merged_through": -1,
                         "pending": [], "shards": None, "windows": None, "complete": False, "files": {}}
        for part in PARTS:
            (self.path / part).mkdir(exist_ok=True)
        self._save()

    # --- progress ---------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        return bool(self.manifest["complete"])

    def recorded(self) -> set[int]:
        """Shards recorded so far (merged or pending)."""
        return set(range(self.manifest["merged_through"] + 1)) | set(self.manifest["pending"])

    def _write(self, name: str, write) -> dict:
        """Write the store's file ``name`` (``write(tmp)``, atomically); its record for the manifest."""
        path = self.path / name
        _atomic(path, write)
        return {name: file_record(path)}

    def record(self, shard: int, windows: np.ndarray, acc: Accumulator, vocab: int, checked: bool = True) -> None:
        """Keep shard ``shard``: its windows, then its accumulator, merged at once when it follows the merged
        shards (with any pending ones it unblocks), else kept as a pending shard file; then the manifest.

        ``checked=False``: its windows hold text of a document not yet checked against the corpus's scan
        (``windows.window_blocks``): its files are written but the manifest does not name them (a crash
        leaves files the next open removes) until ``confirm`` reaches it."""
        dtype = np.uint16 if vocab <= 1 << 16 else np.int32
        files = self._write(windows_file(shard),
                            lambda tmp: save_numpy({"windows": np.ascontiguousarray(windows, dtype=dtype)}, tmp))
        if checked and shard == self.manifest["merged_through"] + 1:
            self.manifest["files"].update(files)
            self._fold(acc)
            return
        files.update(self._write(f"shards/{_name(shard)}", lambda tmp: save_file(acc.tensors(), tmp)))
        if not checked:
            self._unchecked[shard] = (len(windows), files)
            return
        self.manifest["files"].update(files)
        self.manifest["pending"] = sorted(set(self.manifest["pending"]) | {shard})
        self._save()

    def confirm(self, checked_windows: float) -> None:
        """Every shard recorded unchecked whose windows all lie below ``checked_windows`` (windows of checked
        documents, counted from 0; ``math.inf`` once the corpus was read to its end) is named by the
        manifest as a pending shard, and merged where it can be."""
        size = self.manifest["settings"]["shard_windows"]
        ready = [s for s, (n, _) in self._unchecked.items() if s * size + n <= checked_windows]
        if not ready:
            return
        for shard in ready:
            self.manifest["files"].update(self._unchecked.pop(shard)[1])
        self.manifest["pending"] = sorted(set(self.manifest["pending"]) | set(ready))
        self._save()
        self.fold()

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
        self.manifest["files"].update(self._write(f"merged/{name}", lambda tmp: save_file(self._merged.tensors(), tmp)))
        for gone in [f"shards/{_name(s)}" for s in folded] + ([] if old is None else [f"merged/{old}"]):
            self.manifest["files"].pop(gone, None)
        self.manifest.update(merged=name, merged_through=through, pending=sorted(pending))
        self._save()
        # removed once the manifest no longer names them (a crash before leaves files _tidy removes)
        for shard in folded:
            (self.path / "shards" / _name(shard)).unlink(missing_ok=True)
        if old is not None:
            (self.path / "merged" / old).unlink(missing_ok=True)
        return self._merged

    def finish(self, model) -> None:
        """Every shard merged into the finished store: the examples tables (Parquet: each head's and neuron's
        top k, with their tokens) and the statistics (head scores, head_out means, neuron means and
        fractions > 0, counts), written and sealed (``_write_final``)."""
        merged = self.fold()
        m = self.manifest
        if merged is None or m["merged_through"] + 1 != m["shards"]:
            raise RuntimeError(f"store {self.path}: {m['merged_through'] + 1} of {m['shards']} shards merged")
        sums = merged.sums
        positions = int(sums["positions"])
        stats = {"positions": sums["positions"], "windows": sums["windows"]}
        for name in SCORE_NAMES:
            stats[name] = sums[f"mass.{name}"] / sums[f"targets.{name}"]
            stats[f"targets.{name}"] = sums[f"targets.{name}"]
        tables = {}
        if merged.heads is not None:  # examples: Parquet (pyarrow, the `sweep` extra); a scores-only sweep needs none
            import pyarrow as pa

            strings = np.array(model.token_strings, dtype=object)
            W_O = model.W_O.detach().to("cpu", torch.float64)
            stats["head_out_mean"] = torch.einsum("lhe,lhed->lhd", sums["z"] / positions, W_O)
            for name, table in {"heads": merged.heads, **{f"heads_by_{r}": t for r, t in merged.roles.items()}}.items():
                cols = example_rows(table, ("layer", "head"), model.cfg.n_heads)
                cols["token"] = strings[self._tokens_at(cols["window"], cols["position"])]
                cols["source_token"] = strings[self._tokens_at(cols["window"], cols["source"])]
                tables[name] = pa.table(cols)
            if merged.neurons is not None:
                stats["neuron_mean"] = sums["neuron_sum"] / positions
                stats["neuron_fraction_positive"] = sums["neuron_positive"].to(torch.float64) / positions
                cols = example_rows(merged.neurons, ("layer", "neuron"), model.cfg.d_mlp)
                cols["token"] = strings[self._tokens_at(cols["window"], cols["position"])]
                tables["neurons"] = pa.table(cols)
        self._write_final(tables, stats)

    def _tokens_at(self, windows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Token ids at ``(windows[i], positions[i])``, reading one shard's windows at a time."""
        shard_windows = self.manifest["settings"]["shard_windows"]
        out = np.zeros(len(windows), dtype=np.int64)
        shards = windows // shard_windows
        for shard in np.unique(shards):
            at = shards == shard
            block = self.windows_of(int(shard))
            out[at] = block[windows[at] - shard * shard_windows, positions[at]]
        return out

    def windows_of(self, shard: int) -> np.ndarray:
        """Shard ``shard``'s windows ``[n, seq_len]`` as written."""
        return load_numpy(self.path / windows_file(shard))["windows"]

    def _write_final(self, tables: dict, stats: dict[str, torch.Tensor]) -> None:
        """Write the final tables (Parquet) and statistics (safetensors, sealing the finished manifest:
        module docstring), mark the store complete and drop the accumulators."""
        files = self.manifest["files"]
        for name, table in tables.items():
            import pyarrow.parquet as pq

            files.update(self._write(table_file(name), lambda tmp, t=table: pq.write_table(t, tmp)))
        self.manifest.update(complete=True, merged=None, pending=[])  # saved below, once stats is written
        seal = {SEAL: json.dumps(_sealed_content(self.manifest), sort_keys=True)}
        files.update(self._write(STATS,
                                 lambda tmp: save_file({k: v.contiguous() for k, v in stats.items()}, tmp, seal)))
        for name in [n for n in files if n.startswith(("shards/", "merged/"))]:
            del files[name]
        self._save()
        for part in ("shards", "merged"):
            shutil.rmtree(self.path / part, ignore_errors=True)

    # --- housekeeping -------------------------------------------------------------------------------
    def _save(self) -> None:
        self.manifest["digest"] = _content_digest(self.manifest)
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


class FinishedStore:
    """A finished store read back (what ``Sweep`` queries): its ``manifest``, ``stats`` (``read_stats``),
    windows and examples tables, each file checked against its manifest record on first use
    (``check_file``). A store not finished yet is refused, saying how to resume it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.manifest = m = read_manifest(self.path)
        if not m["complete"]:
            raise ValueError(f"the sweep in {self.path} is not finished ({m['merged_through'] + 1 + len(m['pending'])} "
                             "shards recorded); run pcw.sweep with the same arguments again to resume it")
        self.stats = read_stats(self.path, m)
        self._verified: set[str] = set()

    def _checked(self, name: str) -> Path:
        if name not in self._verified:
            check_file(self.path, self.manifest, name)
            self._verified.add(name)
        return self.path / name

    def windows(self) -> np.ndarray:
        """``[n_windows, seq_len]`` int64: every shard's windows in order, checked against the manifest's
        counts (files as written, counts edited with the digest redone: ``StoreCorrupt``)."""
        m = self.manifest
        windows = np.concatenate([load_numpy(self._checked(windows_file(s)))["windows"] for s in range(m["shards"])])
        expected = (m["windows"], m["settings"]["seq_len"])
        if windows.shape != expected:
            raise StoreCorrupt(f"store {self.path}: its window files hold {list(windows.shape)} windows x tokens, the "
                               f"manifest says {list(expected)}; sweep again into a new folder")
        return windows.astype(np.int64)

    def table(self, name: str):
        """The examples table ``name`` (``table_file``) as a pandas DataFrame."""
        import pandas as pd

        return pd.read_parquet(self._checked(table_file(name)))


def _lock(path: Path):
    """An exclusive lock on ``path/.lock`` for this process (released when closed or when the process
    dies), or None where the platform has no ``fcntl``; another holder: ``StoreMismatch``."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks here
        return None
    try:
        handle = open(path / ".lock", "a")  # noqa: SIM115 - held open: the lock lasts as long as the handle
    except OSError as err:  # read-only media (a finished store reads back without it: sweeps._finished)
        raise OSError(f"store {path} cannot be written ({err.strerror or err}): an unfinished sweep resumes only "
                      "in a folder it can write; copy it to one") from None
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
