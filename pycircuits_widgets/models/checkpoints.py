"""Safe checkpoint I/O: safetensors for tensors, JSON for configs. Never pickle.

A checkpoint ``NAME`` is two files side by side: ``NAME.safetensors`` (tensors, may be stored
as float16 and are upcast to float32 on load) and ``NAME.json`` (config and metadata).
Anything wrong with them raises ``CheckpointError`` naming the file and the mismatch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, or does not match the model it is loaded into."""


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
    """Write ``tensors`` (``{name: tensor}``, each kept in its shape; optionally cast to ``dtype``) to a
    safetensors file."""
    tensors = {k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach())
               .contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path))


# safetensors header dtype names of real floating tensors (what a checkpoint may hold)
_FLOAT_HEADER_DTYPES = {"F16", "BF16", "F32", "F64"}
# bytes per element of every dtype a safetensors header may name
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_header(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, dtype)}`` from a safetensors file's header, without reading any tensor.

    The header is checked as the format requires (every tensor's ``data_offsets`` hold exactly its
    ``shape`` of its ``dtype``, the tensors tile the data without gap or overlap, nothing past the
    file's end), so a lying header is refused naming the file and the tensor instead of failing
    later, deep inside a read."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file not found: {path}")

    def corrupt(what: str):
        return CheckpointError(f"corrupt checkpoint {path}: not a readable safetensors file ({what})")

    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little") if size >= 8 else None
        if length is None or length > min(_MAX_HEADER_BYTES, size - 8):
            raise corrupt(f"the header length {length} does not fit the file's {size} bytes")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise corrupt(f"the header is not JSON: {str(err)[:200]}") from None
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    data_bytes, spans, shapes = size - 8 - length, [], {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        entry = entry if isinstance(entry, dict) else {}
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        lie = None
        if dtype not in _DTYPE_BYTES:
            lie = f"dtype {dtype!r} is not a safetensors dtype"
        elif not isinstance(shape, list) or not all(map(_is_size, shape)):
            lie = f"shape {shape!r} is not a list of sizes"
        elif not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_size, offsets))
                  and offsets[0] <= offsets[1] <= data_bytes):
            lie = f"data_offsets {offsets!r} do not lie within the file's {data_bytes} data bytes"
        elif offsets[1] - offsets[0] != math.prod(shape) * _DTYPE_BYTES[dtype]:
            lie = (f"shape {shape} of {dtype} needs {math.prod(shape) * _DTYPE_BYTES[dtype]} bytes, its "
                   f"data_offsets {offsets} hold {offsets[1] - offsets[0]}")
        if lie:
            raise CheckpointError(f"corrupt checkpoint {path}: tensor {name!r}: the header's {lie}")
        spans.append((offsets[0], offsets[1], name))
        shapes[name] = (tuple(shape), dtype)
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise CheckpointError(f"corrupt checkpoint {path}: tensor {name!r}: the header's data_offsets start at "
                                  f"byte {begin}, the tensor before it ends at {end} (overlapping or missing data)")
        end = stop
    if end != data_bytes:
        raise corrupt(f"its tensors end at data byte {end} of {data_bytes}")
    return shapes


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
    """Read a safetensors file: ``{name: tensor}`` in the stored shapes; floating tensors are cast to ``dtype``.

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
