"""Binary payloads for widget traits: the wire form the array traits of :mod:`.arrays` write.

Arrays cross the wire as ``{"view": memoryview, "dtype": str, "shape": list}``; ipywidgets
sends every memoryview found in a trait as a binary buffer (never as a JSON list), and
``js/src/lib/buffers.js`` ``decodeArray`` turns it back into a typed array.

A payload saved with the page (a saved notebook stores every buffer as base64) may be
``deflate``d: ``{"encoding": "deflate", ...}`` marks raw-deflate bytes, which the front end
inflates synchronously (fflate) before viewing them. Attention weights (mostly near zero)
shrink about five times; float16 tables by a tenth.
"""

from __future__ import annotations

import json
import zlib

import numpy as np
import torch

_DTYPES = {"float16", "float32", "float64", "uint8", "int8", "uint16", "int16", "int32", "uint32"}


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


DEFLATE_FAST_OVER = 1 << 20
"""Bytes over which :func:`deflate` uses its fastest level (10 MB of GPT-2-XL attention
overviews: 0.6 s at level 6, 0.12 s at level 1, 20% larger)."""


def deflate(data: bytes) -> bytes:
    """Raw deflate (no zlib header), what ``fflate.inflateSync`` reads."""
    packer = zlib.compressobj(6 if len(data) <= DEFLATE_FAST_OVER else 1, zlib.DEFLATED, -15)
    return packer.compress(data) + packer.flush()


FLOAT16_MAX = float(np.finfo(np.float16).max)


def half_or_single(arr: np.ndarray) -> str:
    """``"float16"`` when every finite value of ``arr`` fits float16 (``|x| <= 65504``), else
    ``"float32"``: values past the range would overflow to inf (and numpy warn in the notebook)."""
    finite = arr[np.isfinite(arr)]
    return "float16" if not finite.size or float(np.abs(finite).max()) <= FLOAT16_MAX else "float32"


_NARROW = {"float64": "float32", "int64": "int32", "uint64": "uint32", "bool": "uint8"}


def as_wire(x, dtype: str | None = "float32", *, name: str = "array") -> np.ndarray:
    """``x`` (tensor, array or list of numbers) as the C-ordered numpy array it is sent as.

    ``"float16"`` is a request: float32 when a finite value is past float16's range
    (``half_or_single``). ``dtype=None``: the array's own dtype, 64-bit ones narrowed to 32 bits
    (a page's typed arrays have no int64; an integer past the narrower type is refused)."""
    arr = to_numpy(x, name=name)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be an array of numbers (a tensor or numpy array), "
                        f"got {type(x).__name__} of dtype {arr.dtype}")
    if dtype is None:
        dtype = _NARROW.get(arr.dtype.name, arr.dtype.name)
        if arr.dtype.kind in "iu" and arr.size and dtype != arr.dtype.name:
            info = np.iinfo(dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise ValueError(f"{name}: {arr.dtype} values in [{arr.min()}, {arr.max()}] do not fit {dtype}, "
                                 "the widest integer a page reads")
    elif dtype == "float16":
        dtype = half_or_single(arr)
    if dtype not in _DTYPES:
        raise ValueError(f"{name}: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return np.ascontiguousarray(arr, dtype=dtype)


def encode_array(x, dtype: str = "float32", *, compress: bool = False) -> dict:
    """Encode an array as a binary payload of the given dtype (C order); ``compress``:
    raw-deflated bytes, marked ``"encoding": "deflate"`` (for payloads saved with a page).
    ``"float16"`` is a request (:func:`as_wire`), the payload's ``dtype`` says which.
    A view declares array traits instead (``arrays.Array(dtype)`` set to the array: the trait
    writes this payload at the wire); this is for payloads outside traits (``encode_json``)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    arr = as_wire(x, dtype)
    dtype = arr.dtype.name
    if compress:
        return {"view": memoryview(deflate(arr.tobytes())), "dtype": dtype, "shape": list(arr.shape), "encoding": "deflate"}
    return {"view": memoryview(arr.tobytes()), "dtype": dtype, "shape": list(arr.shape)}


def encode_json(value) -> dict:
    """A JSON value (strict: no NaN) as a deflated uint8 payload of its UTF-8 text: one binary
    buffer where a notebook would write a list a line per item (``decodeText`` in
    ``js/src/lib/buffers.js`` reads the text back)."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate: the page could not carry it
        near = text[max(exc.start - 20, 0):exc.end + 20]
        raise ValueError(f"cannot encode {exc.object[exc.start:exc.end]!r} (not valid Unicode: a lone surrogate) "
                         f"in {near!r}; display strings go through models.tokenizer.escape_invisible") from None
    return encode_array(np.frombuffer(data, np.uint8), "uint8", compress=True)


def decode_json(payload: dict):
    """Inverse of :func:`encode_json`."""
    return json.loads(decode_array(payload).tobytes().decode("utf-8"))


JSON_BUFFER = {
    "to_json": lambda value, _widget: encode_json(value),
    "from_json": lambda value, _widget: decode_json(value) if isinstance(value, dict) and "view" in value else value,
}
"""Trait metadata (``.tag(sync=True, **JSON_BUFFER)``) for a list or dict trait saved with the
page: Python sees the value, the wire and the saved state carry :func:`encode_json`
(``jsonOf`` in ``js/src/lib/buffers.js``). A notebook writes nested state a line per item:
the paper views' term, pair and vocabulary lists were a third of the saved quick start."""


MAX_INFLATED = 64 << 20
"""Most bytes one deflated payload may inflate to (as ``MAX_INFLATED`` in js/src/lib/buffers.js)."""


def decode_array(payload: dict) -> np.ndarray:
    """Inverse of :func:`encode_array` (used by tests, the kernel side of messages and the
    pictures of a saved page). A deflated payload inflates to exactly the bytes its dtype and
    shape declare, at most MAX_INFLATED: checked before, and while, it is inflated."""
    buf = bytes(payload["view"])
    if payload.get("encoding") == "deflate":
        size = np.dtype(payload["dtype"]).itemsize * int(np.prod(payload["shape"], dtype=object))
        if size > MAX_INFLATED:
            raise ValueError(f"a deflated {payload['dtype']} payload of shape {payload['shape']} would inflate to "
                             f"{size} bytes, over the limit of {MAX_INFLATED}; not inflated")
        inflater = zlib.decompressobj(-15)
        buf = inflater.decompress(buf, size + 1)
        if len(buf) != size:
            raise ValueError(f"a deflated payload inflates to {'more than ' if len(buf) > size else ''}"
                             f"{min(len(buf), size)} bytes, its dtype and shape declare {size}")
    return np.frombuffer(buf, dtype=payload["dtype"]).reshape(payload["shape"])


QUANTIZE_BLOCK = 1 << 20
"""Values quantised per step: the float32 temporaries stay at 4 MiB whatever the input size."""


def quantize_unit(x) -> np.ndarray:
    """Values in [0, 1] (attention weights) as uint8 ``round(255 x)`` (clipped to [0, 1] first):
    1 byte per value, absolute error at most 1/510. Works in blocks of ``QUANTIZE_BLOCK``
    values, so memory above the input is the uint8 result."""
    arr = to_numpy(x, name="values")
    out = np.empty(arr.shape, dtype=np.uint8)
    flat, flat_out = arr.reshape(-1), out.reshape(-1)
    tmp = np.empty(min(QUANTIZE_BLOCK, flat.size), dtype=np.float32)
    for start in range(0, flat.size, QUANTIZE_BLOCK):
        block = flat[start:start + QUANTIZE_BLOCK]
        t = tmp[: block.size]
        np.multiply(block, 255.0, out=t, casting="unsafe")
        np.clip(t, 0.0, 255.0, out=t)
        np.rint(t, out=t)
        flat_out[start:start + block.size] = t
    return out


def pack_causal(x: np.ndarray) -> np.ndarray:
    """Lower triangle (``src <= dest``) of ``x [..., n, n]``, rows concatenated: ``[..., n (n + 1) / 2]``.

    Row ``dest`` holds ``x[..., dest, 0..dest]`` at offset ``dest (dest + 1) / 2``; the masked
    half of a causal pattern is not sent (``js/src/lib/attention.js`` ``unpackCausal``)."""
    n = x.shape[-1]
    out = np.empty(x.shape[:-2] + (n * (n + 1) // 2,), dtype=x.dtype)
    offset = 0
    for dest in range(n):
        out[..., offset:offset + dest + 1] = x[..., dest, :dest + 1]
        offset += dest + 1
    return out


def max_pool(q: np.ndarray, factor: int) -> np.ndarray:
    """``[..., n, n] -> [..., ceil(n/f), ceil(n/f)]``: max over ``f x f`` blocks, a last, smaller
    block where ``f`` does not divide ``n`` (what zero padding gives for weights >= 0). Rows are
    pooled first, as a maximum over whole contiguous rows (``np.maximum.reduceat`` across rows
    ran at ~0.1 G values/s: 1.7 s for 12 heads x 4096 tokens, against 0.1 s this way); no copy
    of the input."""
    if factor == 1:
        return q
    n, lead = q.shape[-1], q.shape[:-2]
    whole, rest = divmod(n, factor)
    m = whole + (rest > 0)
    rows = np.empty((*lead, m, n), q.dtype)
    np.max(q[..., : whole * factor, :].reshape(*lead, whole, factor, n), axis=-2, out=rows[..., :whole, :])
    if rest:
        np.max(q[..., whole * factor:, :], axis=-2, out=rows[..., whole, :])
    out = np.empty((*lead, m, m), q.dtype)
    np.max(rows[..., : whole * factor].reshape(*lead, m, whole, factor), axis=-1, out=out[..., :whole])
    if rest:
        np.max(rows[..., whole * factor:], axis=-1, out=out[..., whole])
    return out


def unpack_causal(packed: np.ndarray, n: int) -> np.ndarray:
    """Inverse of :func:`pack_causal`: ``[..., n, n]`` with zeros above the diagonal."""
    out = np.zeros(packed.shape[:-1] + (n, n), dtype=packed.dtype)
    offset = 0
    for dest in range(n):
        out[..., dest, :dest + 1] = packed[..., offset:offset + dest + 1]
        offset += dest + 1
    return out
