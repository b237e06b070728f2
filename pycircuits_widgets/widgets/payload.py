"""Binary payloads for widget traits.

Arrays cross the wire as ``{"view": memoryview, "dtype": str, "shape": list}``; ipywidgets
sends every memoryview found in a trait as a binary buffer (never as a JSON list), and
``js/src/lib/buffers.js`` ``decodeArray`` turns it back into a typed array.
"""

from __future__ import annotations

import numpy as np
import torch

_DTYPES = {"float32", "float64", "uint8", "int8", "uint16", "int16", "int32", "uint32"}


def to_numpy(x, *, name: str = "array") -> np.ndarray:
    """A torch tensor, numpy array or nested list as a numpy array (on the CPU)."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds every bfloat16 exactly
            x = x.float()
        return x.detach().to("cpu").numpy()
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a tensor, array or list of numbers, got {type(x).__name__}") from exc


def encode_array(x, dtype: str = "float32") -> dict:
    """Encode an array as a binary payload of the given dtype (C order)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    arr = np.ascontiguousarray(to_numpy(x), dtype=dtype)
    return {"view": memoryview(arr.tobytes()), "dtype": dtype, "shape": list(arr.shape)}


def decode_array(payload: dict) -> np.ndarray:
    """Inverse of :func:`encode_array` (used by tests and by the kernel side of messages)."""
    buf = payload["view"]
    return np.frombuffer(bytes(buf), dtype=payload["dtype"]).reshape(payload["shape"])


def quantize_unit(x) -> np.ndarray:
    """Values in [0, 1] (attention weights) as uint8 ``round(255 x)``: 1 byte per value,
    absolute error at most 1/510."""
    arr = to_numpy(x, name="values").astype(np.float32)
    return np.rint(np.clip(arr, 0.0, 1.0) * 255.0).astype(np.uint8)
