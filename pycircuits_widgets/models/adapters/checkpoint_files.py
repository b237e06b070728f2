"""A Hugging Face checkpoint folder's ``*.safetensors`` shards, read one tensor at a time.

``CheckpointFiles`` knows every tensor's shard, shape and dtype from the shards' headers (nothing
else is read when it opens). ``read(key)`` memory-maps the tensor's shard, copies that one tensor
out (widened to float32 or float64 for the math) and unmaps the shard again, so the process never
keeps checkpoint pages resident: what it holds is the tensors the caller keeps.

``ModuleTree`` presents the keys as the module tree ``save_pretrained`` wrote them from
(``"model.layers.3.self_attn.q_proj.weight"`` is ``tree.model.layers[3].self_attn.q_proj.weight``),
so ``hf.py`` reads a checkpoint with the same ``Family`` descriptions and layout code it applies
to a loaded model: a ``weight`` or ``bias`` attribute is read when it is accessed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"


class CheckpointFiles:
    """The tensors of ``folder``: the shards ``model.safetensors.index.json`` names, else every
    ``*.safetensors`` file there. ``dtype``: what ``read`` returns (float32 or float64)."""

    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float32, device=None):
        from safetensors import safe_open

        self.folder = Path(folder)
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"from_safetensors: dtype must be torch.float32 or torch.float64 (the analyses' "
                             f"precision), got {dtype}")
        self.dtype, self.device = dtype, torch.device(device or "cpu")
        index = self.folder / INDEX
        if index.is_file():
            shards = sorted({self.folder / name for name in json.loads(index.read_text())["weight_map"].values()})
        else:
            shards = sorted(self.folder.glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"from_safetensors: {self.folder} holds no *.safetensors file (expected a "
                                    "Hugging Face checkpoint folder: config.json and model*.safetensors)")
        self.shard: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in shards:
            if not path.is_file():
                raise FileNotFoundError(f"from_safetensors: {index} names the shard {path.name}, which is missing")
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    self.shard[key] = path
                    self.shapes[key] = tuple(f.get_slice(key).get_shape())
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
        """Tensor ``key`` (``rows``: only those rows of its first dim) in ``self.dtype`` on ``self.device``:
        the shard is mapped only while it is copied. Refuses integer (quantized) and non-finite
        tensors, naming the stored key."""
        from safetensors import safe_open

        stored = self.stored[key]
        with safe_open(self.shard[stored], framework="pt") as f:
            tensor = f.get_tensor(stored) if rows is None else f.get_slice(stored)[rows]
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"from_safetensors: {stored} in {self.shard[stored].name} has dtype {tensor.dtype}; "
                            "expected floating-point weights (quantized checkpoints are not read)")
        tensor = tensor.to(device=self.device, dtype=self.dtype)
        # one pass: a NaN or inf makes the sum non-finite (so does an overflowing sum, then counted exactly)
        if not bool(torch.isfinite(tensor.sum())):
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise ValueError(f"from_safetensors: {stored} in {self.shard[stored].name} has {bad} non-finite "
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

    def __getitem__(self, index: int) -> "ModuleTree":
        return getattr(self, str(index))

    def __len__(self) -> int:
        n = 0
        while self.files.has_prefix(self._key(str(n))):
            n += 1
        return n

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def get_output_embeddings(self) -> "ModuleTree":
        return ModuleTree(self.files, self.output, self.conv1d, self.output, self.rows)
