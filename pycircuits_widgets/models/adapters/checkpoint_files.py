"""A Hugging Face checkpoint folder's ``*.safetensors`` shards, read one tensor at a time.

``CheckpointFiles`` knows every tensor's shard, shape and dtype from the shards' headers (nothing
else is read when it opens). ``read(key)`` memory-maps the tensor's shard, copies that one tensor
out (widened to float32 or float64 for the math) and unmaps the shard again, so the process never
keeps checkpoint pages resident: what it holds is the tensors the caller keeps.

``ModuleTree`` presents the keys as the module tree ``save_pretrained`` wrote them from
(``"model.layers.3.self_attn.q_proj.weight"`` is ``tree.model.layers[3].self_attn.q_proj.weight``),
so ``hf.py`` reads a checkpoint with the same ``Family`` descriptions and layout code it applies
to a loaded model: a ``weight`` or ``bias`` attribute is read when it is accessed.

Nothing outside the folder is read, and the folder is checked before anything opens a shard
(``from_safetensors``, and ``from_hf`` before it hands a folder to transformers): an index names
shards by file name only (no directory part, no ``..``, no absolute path), no file of the folder
may be a link leading out of it (except a hub cache snapshot's links into its ``blobs``), and
without an index only the standard names are read (``shard_paths``). Every header is checked
(``checkpoints.read_header``), every tensor must be stored once and where the index says.
Refusals are ``CheckpointError`` naming the file and the key.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path, PurePosixPath

import torch

from ..checkpoints import CheckpointError, load_json, read_header

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")  # a set save_pretrained writes: part, total


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def check_links(folder: Path) -> None:
    """Refuse any file of ``folder`` that is a link leading out of it: nothing outside the folder is
    read, by these loaders or by transformers. A Hugging Face hub cache snapshot
    (``models--org--name/snapshots/<revision>``) links its files into the repository's ``blobs``
    folder; those links are followed."""
    root = _real(folder)
    allowed = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_symlink():
                target = _real(Path(entry.path))
                if not any(target.is_relative_to(place) for place in allowed):
                    raise CheckpointError(f"{entry.path} is a link to {target}, outside the checkpoint folder "
                                          f"{folder}: nothing outside the folder is read")


def in_folder(folder: Path, name, source: str) -> Path:
    """``folder / name``, where ``name`` (read from ``source``) must be a file name in ``folder``: not a
    path, so neither an absolute path nor ``..`` reaches outside it (links: ``check_links``)."""
    if (not isinstance(name, str) or name in ("", ".", "..") or PurePosixPath(name).name != name
            or "\\" in name or "\0" in name):
        raise CheckpointError(f"{source} names {name!r} as a shard: expected a file name in {folder} (no directory "
                              "part, no '..', no absolute path); nothing outside the folder is read")
    return folder / name


def read_index(folder: Path) -> dict[str, str]:
    """``weight_map`` of ``folder``'s ``model.safetensors.index.json``: tensor name -> shard file name
    (each checked by ``in_folder``)."""
    index = folder / INDEX
    data = load_json(index)
    if not isinstance(data.get("metadata"), dict):  # transformers reads it (a KeyError there)
        raise CheckpointError(f"{index}: metadata is {type(data.get('metadata')).__name__}, expected a JSON object "
                              "(save_pretrained writes {\"total_size\": ...})")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map is {type(weight_map).__name__}, expected a JSON object mapping "
                              "each tensor name to the shard file that holds it")
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise CheckpointError(f"{index}: weight_map[{key!r}] is {name!r}, expected a shard file name (a string)")
        in_folder(folder, name, f"{index} (weight_map[{key!r}])")
    return weight_map


def shard_paths(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """(the shards to read, the index's ``weight_map`` or None). With ``model.safetensors.index.json``:
    the shards it names. Without: ``model.safetensors``, else one complete set of
    ``model-XXXXX-of-YYYYY.safetensors`` (what ``save_pretrained`` writes); any other ``*.safetensors``
    file (``consolidated.safetensors``, an adapter, a stray copy) is ignored with a warning naming it,
    as transformers ignores it, so that every loader reads the same weights."""
    if (folder / INDEX).is_file():
        weight_map = read_index(folder)
        return sorted({folder / name for name in weight_map.values()}), weight_map
    present = sorted(path.name for path in folder.glob("*.safetensors"))
    chosen = [SINGLE] if SINGLE in present else []
    sets: dict[int, set[int]] = {}
    for match in filter(None, map(SHARD.fullmatch, present)):
        part, total = int(match[1]), int(match[2])
        if 1 <= part <= total:
            sets.setdefault(total, set()).add(part)
    if not chosen and len(sets) > 1:
        raise CheckpointError(f"{folder} holds {len(sets)} sets of shards (model-XXXXX-of-YYYYY.safetensors for YYYYY "
                              f"in {sorted(sets)}) and no {INDEX} saying which to read")
    if not chosen and sets:
        (total, parts), = sets.items()
        missing = sorted(set(range(1, total + 1)) - parts)
        if missing:
            raise FileNotFoundError(f"{folder} lacks model-{missing[0]:05d}-of-{total:05d}.safetensors of its "
                                    f"{total} shards (and has no {INDEX})")
        chosen = [f"model-{part:05d}-of-{total:05d}.safetensors" for part in range(1, total + 1)]
    ignored = [name for name in present if name not in chosen]
    if ignored:
        warnings.warn(f"{folder}: ignoring {', '.join(ignored)}: without {INDEX} only {SINGLE} or one set of "
                      "model-XXXXX-of-YYYYY.safetensors shards is read", stacklevel=4)
    if not chosen:
        raise FileNotFoundError(f"{folder} holds no *.safetensors file of a Hugging Face checkpoint (expected "
                                f"config.json and {SINGLE}, or model-XXXXX-of-YYYYY.safetensors shards and {INDEX}; "
                                "pickled *.bin weights are not read)")
    return [folder / name for name in chosen], None


class CheckpointFiles:
    """The tensors of ``folder``: the shards ``shard_paths`` picks (each checked to be a file of the folder,
    its header checked, every tensor stored once and where the index says). ``dtype``: what ``read``
    returns (float32 or float64)."""

    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float32, device=None):
        self.folder = Path(folder)
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"from_safetensors: dtype must be torch.float32 or torch.float64 (the analyses' "
                             f"precision), got {dtype}")
        self.dtype, self.device = dtype, torch.device(device or "cpu")
        check_links(self.folder)
        shards, weight_map = shard_paths(self.folder)
        self.paths, self.indexed = shards, weight_map is not None  # the shards read; whether an index named them
        self.shard: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in shards:
            if not path.is_file():
                raise FileNotFoundError(f"from_safetensors: {self.folder / INDEX} names the shard {path.name}, "
                                        "which is missing")
            for key, (shape, _) in read_header(path).items():
                if key in self.shard:
                    raise CheckpointError(f"{self.folder}: tensor {key!r} is stored twice, in {self.shard[key].name} "
                                          f"and in {path.name}; a checkpoint stores each tensor once")
                self.shard[key], self.shapes[key] = path, shape
        for key, path in self.shard.items() if weight_map is not None else ():
            if weight_map.get(key) != path.name:
                raise CheckpointError(f"{self.folder / INDEX}: weight_map puts {key!r} in {weight_map.get(key)!r}, "
                                      f"but {path.name} holds it")
        for key, name in (weight_map or {}).items():
            if key not in self.shard:
                raise CheckpointError(f"{self.folder / INDEX}: weight_map puts {key!r} in {name}, whose header has "
                                      "no such tensor")
        self.nbytes = sum(path.stat().st_size for path in shards)
        self.rename({})

    def rename(self, names: dict[str, str]) -> None:
        """Address tensors by the model's names: ``names`` maps a stored key to the module path the
        model loads it into (``from_safetensors`` takes the map from transformers' own renaming)."""
        self.stored = {names.get(key, key): key for key in self.shard}
        self._prefixes = {key.rsplit(".", n)[0] for key in self.stored for n in range(1, key.count(".") + 1)}

    def __contains__(self, key: str) -> bool:
        return key in self.stored

    def shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[self.stored[key]]

    def has_prefix(self, prefix: str) -> bool:
        """Whether some tensor's name starts with ``prefix + "."`` (a module in the tree)."""
        return prefix in self._prefixes

    def read(self, key: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``key`` in its stored shape (``rows``: only those rows of its first dim, ``[n_rows, ...]``) in
        ``self.dtype`` on ``self.device``:
        the shard is mapped only while it is copied. Refuses integer (quantized) and non-finite
        tensors, naming the stored key."""
        from safetensors import SafetensorError, safe_open

        stored = self.stored[key]
        try:
            with safe_open(self.shard[stored], framework="pt") as f:
                tensor = f.get_tensor(stored) if rows is None else f.get_slice(stored)[rows]
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"from_safetensors: cannot read {stored} from {self.shard[stored]}: {err}") from err
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"from_safetensors: {stored} in {self.shard[stored].name} has dtype {tensor.dtype}; "
                            "expected floating-point weights (quantized checkpoints are not read)")
        tensor = tensor.to(device=self.device, dtype=self.dtype)
        # one pass: a NaN or inf makes the sum non-finite (so does an overflowing sum, then counted exactly)
        if not bool(torch.isfinite(tensor.sum())):
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise CheckpointError(f"from_safetensors: {stored} in {self.shard[stored].name} has {bad} non-finite "
                                 "values (NaN or inf); weights must be finite")
        return tensor


class ModuleTree:
    """The module at ``prefix`` (``""``: the causal LM) of a checkpoint: attributes are submodules
    or, for a stored tensor (``weight``, ``bias``), that tensor read from the shard; ``[i]`` and
    iteration give numbered submodules (the layers). ``conv1d``: every linear layer stores
    ``[in, out]`` (GPT-2's ``Conv1D``), which ``hf._linear`` reads as a loaded ``Conv1D``.
    ``output``: the module ``get_output_embeddings`` returns (``lm_head``, or the token embedding
    of a checkpoint saved with tied embeddings). ``rows``: stored keys read as a block of rows
    (``{key: slice}``: a block of the vocabulary of the embeddings), the rest whole."""

    def __init__(self, files: CheckpointFiles, prefix: str = "", conv1d: bool = False, output: str = "",
                 rows: dict[str, slice] | None = None):
        self.files, self.prefix, self.conv1d, self.output, self.rows = files, prefix, conv1d, output, rows or {}

    def _key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def __getattr__(self, name: str):
        if name.startswith("_"):  # python's protocol lookups and hf._unwrap's bridge check
            raise AttributeError(name)
        key = self._key(name)
        if key in self.files:
            return self.files.read(key, self.rows.get(key))
        if self.files.has_prefix(key):
            return ModuleTree(self.files, key, self.conv1d, self.output, self.rows)
        raise AttributeError(f"{self.files.folder} has no tensor or module {key!r}")

    def __getitem__(self, index: int) -> ModuleTree:
        return getattr(self, str(index))

    def __len__(self) -> int:
        n = 0
        while self.files.has_prefix(self._key(str(n))):
            n += 1
        return n

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def get_output_embeddings(self) -> ModuleTree:
        return ModuleTree(self.files, self.output, self.conv1d, self.output, self.rows)
