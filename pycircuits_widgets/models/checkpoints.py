"""Safe checkpoint I/O: safetensors for tensors, JSON for configs. Never pickle.

A checkpoint ``NAME`` is two files side by side: ``NAME.safetensors`` (tensors, may be stored
as float16 and are upcast to float32 on load) and ``NAME.json`` (config and metadata).
Anything wrong with them raises ``CheckpointError`` naming the file and the mismatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, or does not match the model it is loaded into."""


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
    """Write ``tensors`` (optionally cast to ``dtype``) to a safetensors file."""
    tensors = {k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach())
               .contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path))


# safetensors header dtype names of real floating tensors (what a checkpoint may hold)
_FLOAT_HEADER_DTYPES = {"F16", "BF16", "F32", "F64"}


def read_header(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, dtype)}`` from a safetensors file's header, without reading any tensor."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"corrupt checkpoint {path}: not a readable safetensors file ({err})") from err


def check_header(path: str | Path, expected_shapes: dict[str, tuple[int, ...]]) -> None:
    """The file holds exactly ``expected_shapes`` (names and shapes) as floating tensors. Checked on
    the header, before anything the config sizes is allocated: a crafted config cannot make the
    loader allocate more than the file holds."""
    header = read_header(path)
    missing = sorted(set(expected_shapes) - set(header))
    extra = sorted(set(header) - set(expected_shapes))
    if missing or extra:
        raise CheckpointError(f"checkpoint {path} does not match the model: missing tensors {missing}, "
                              f"unexpected tensors {extra}")
    for name, shape in expected_shapes.items():
        if header[name][0] != tuple(shape):
            raise CheckpointError(f"checkpoint {path}: tensor {name!r} has shape {header[name][0]}, "
                                  f"the config expects {tuple(shape)}")
        if header[name][1] not in _FLOAT_HEADER_DTYPES:
            raise CheckpointError(f"checkpoint {path}: tensor {name!r} has dtype {header[name][1]}; expected a "
                                  f"floating-point tensor ({', '.join(sorted(_FLOAT_HEADER_DTYPES))})")


def load_tensors(path: str | Path, expected_shapes: dict[str, tuple[int, ...]] | None = None,
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Read a safetensors file; floating tensors are cast to ``dtype``.

    With ``expected_shapes``, the file must hold exactly those names with exactly those shapes,
    as real floating tensors with finite values (``check_header`` runs before any tensor is read).
    """
    path = Path(path)
    if expected_shapes is not None:
        check_header(path, expected_shapes)
    elif not path.is_file():
        raise CheckpointError(f"checkpoint file not found: {path}")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"corrupt checkpoint {path}: not a readable safetensors file ({err})") from err
    if expected_shapes is not None:
        for name, value in tensors.items():
            if not bool(torch.isfinite(value).all()):
                raise CheckpointError(f"checkpoint {path}: tensor {name!r} has {int((~torch.isfinite(value)).sum())} "
                                      "non-finite values (NaN or inf); weights must be finite")
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}


def save_json(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def load_json(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint config not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"corrupt checkpoint config {path}: {err}") from err
    except RecursionError:
        raise CheckpointError(f"corrupt checkpoint config {path}: JSON nested too deeply to parse "
                              "(a config is a flat object of numbers and strings)") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"corrupt checkpoint config {path}: expected a JSON object")
    return data
