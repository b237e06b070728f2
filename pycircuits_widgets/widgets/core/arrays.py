"""Array traits: Python holds numpy arrays, the wire carries binary payloads.

A view declares ``scores = Array("float32").tag(sync=True)`` and sets it to a tensor or array;
readers in the kernel (pictures, the explorer, tests) read a numpy array. The trait's serializer
(ipywidgets' ``to_json`` metadata, as ipydatawidgets' ``NDArray``, jupyter-scatter and lonboard
declare theirs) writes the payload of :mod:`.payload` when the state is sent or saved:
``{"view": memoryview, "dtype", "shape"}`` (``"encoding": "deflate"`` for a compressed trait),
and ``{}`` for None; ipywidgets sends every memoryview as a binary buffer and
``js/src/lib/buffers.js`` ``decodeArray`` reads it. ``from_json`` reads a payload back: the
browser never writes an array, a saved state read for its picture does
(``standalone._SavedView``).

The value is cast to the trait's dtype when it is set (``payload.as_wire``), so the kernel holds
exactly what the page shows: ``"float16"`` is a request (float32 when a finite value is past
float16's range); ``dtype=None`` keeps the array's own dtype, 64-bit ones narrowed to 32 bits
(JavaScript's typed arrays have no int64; an int64 value past int32 is refused). An array
already C-ordered and of the wire dtype is kept, not copied: set a new array rather than
writing into the one a trait holds (a write in place is never sent).

:class:`ArrayDict` is a dict trait whose leaves (at any depth, in dicts and lists) may be arrays: each array leaf is
cast as an :class:`Array` would and serialised as its own payload; other leaves (strings, numbers,
lists) are plain JSON. Composition scores ``{"K": {"correct": [L, H, L, H]}}`` and a head's
eigenvalue detail ``{"ov_re": [d], "ov_im": [d]}`` are ArrayDicts.

:class:`Patterns` holds attention weights quantised when set, ``{"weights": uint8 [..., n, n]
(round(255 a)), "causal": bool, ...}``, and sends a causal pattern as its lower triangle: 1 byte
(about half a byte causal) per weight.
"""

from __future__ import annotations

import numpy as np
import torch
import traitlets

from .payload import as_wire, decode_array, deflate, pack_causal, quantize_unit, unpack_causal


def id_dtype(d_vocab: int) -> str:
    """The dtype of token ids sent to the page: uint16 for vocabularies up to 65536, else int32."""
    return "uint16" if d_vocab <= 1 << 16 else "int32"


def to_payload(arr: np.ndarray | None, compress: bool = False) -> dict:
    """The wire payload of an array held by a trait (``{}`` for None)."""
    if arr is None:
        return {}
    data = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
    payload = {"view": data, "dtype": arr.dtype.name, "shape": list(arr.shape)}
    if compress:
        payload.update(view=memoryview(deflate(data)), encoding="deflate")
    return payload


def _is_payload(value) -> bool:
    return isinstance(value, dict) and "view" in value and "dtype" in value


class Array(traitlets.TraitType):
    """A numpy array (or None), sent as one binary payload (see the module doc).

    dtype: the wire dtype (``"float16"`` a request; None: the array's own, 64-bit narrowed).
    ndim: the number of dimensions required, or None. compress: deflated on the wire (for an
    array saved with the page)."""

    info_text = "a tensor or numpy array of numbers"

    def __init__(self, dtype: str | None = "float32", *, ndim: int | None = None, compress: bool = False,
                 allow_none: bool = True, **kwargs):
        super().__init__(None, allow_none=allow_none, **kwargs)
        self.dtype, self.ndim, self.compress = dtype, ndim, compress
        self.metadata.update(to_json=self._to_json, from_json=self._from_json)

    def validate(self, obj, value):
        if value is None:
            return value if self.allow_none else self.error(obj, value)
        arr = as_wire(value, self.dtype, name=self.name or "array")
        if self.ndim is not None and arr.ndim != self.ndim:
            raise traitlets.TraitError(f"{self.name} must have {self.ndim} dimensions, got shape {list(arr.shape)}")
        return arr

    def _to_json(self, value, _widget) -> dict:
        return to_payload(value, self.compress)

    def _from_json(self, value, _widget):
        return decode_array(value) if _is_payload(value) else None


class ArrayDict(traitlets.Dict):
    """A dict whose leaves, at any depth, may be arrays, each sent as its own payload (module doc).

    dtype: the wire dtype of every array leaf (None: each leaf's own, 64-bit narrowed).
    compress: every array leaf deflated."""

    def __init__(self, dtype: str | None = "float32", *, compress: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.dtype, self.compress = dtype, compress
        self.metadata.update(to_json=self._to_json, from_json=self._from_json)

    def validate(self, obj, value):
        return self._cast(super().validate(obj, value), self.name or "dict")

    def _cast(self, value, where: str):
        if isinstance(value, dict):
            return {k: self._cast(v, f"{where}[{k!r}]") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._cast(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, (np.ndarray, torch.Tensor)):
            return as_wire(value, self.dtype, name=where)
        return value

    def _to_json(self, value, _widget):
        return _leafwise(value, lambda arr: to_payload(arr, self.compress), np.ndarray)

    def _from_json(self, value, _widget):
        return _leafwise(value, decode_array, dict, when=_is_payload)


def _leafwise(value, convert, kind, when=None):
    """``value`` with ``convert`` applied to every leaf of type ``kind`` (and ``when``) in its dicts and lists."""
    if isinstance(value, kind) and (when is None or when(value)):
        return convert(value)
    if isinstance(value, dict):
        return {k: _leafwise(v, convert, kind, when) for k, v in value.items()}
    if isinstance(value, list):
        return [_leafwise(v, convert, kind, when) for v in value]
    return value


_PATTERN_WIRE = ("view", "dtype", "shape", "encoding", "layout", "n")


class Patterns(traitlets.Dict):
    """Attention weights: ``{"weights": uint8 [..., n, n], "causal": bool, **extra}``, or ``{}``
    for none. Weights set as floats in [0, 1] are held as ``round(255 a)``
    (``payload.quantize_unit``: what the page shows, so a picture of the kernel's value and of a
    saved page are the same); ``extra``: what the page reads with them (the overview's
    ``factor``, a detail's ``layer`` and ``head``).

    On the wire: the uint8 payload, a causal pattern as its lower triangle (``payload.pack_causal``,
    ``shape [..., n (n + 1) / 2]``), with ``"layout": "causal" | "dense"``, ``"n"`` and ``extra``
    (``js/src/lib/attention.js``). compress: deflated on the wire (the overview, saved with the page)."""

    def __init__(self, *, compress: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.compress = compress
        self.metadata.update(to_json=self._to_json, from_json=self._from_json)

    def validate(self, obj, value):
        value = super().validate(obj, value)
        if not value:
            return {}
        if not {"weights", "causal"} <= value.keys():
            raise traitlets.TraitError(f"{self.name} must be {{'weights': [..., n, n] array, 'causal': bool, ...}}, "
                                       f"got keys {sorted(value)}")
        weights = value["weights"]
        if not (isinstance(weights, np.ndarray) and weights.dtype == np.uint8):
            weights = quantize_unit(as_wire(weights, "float32", name=f"{self.name}['weights']"))
        if weights.ndim < 2 or weights.shape[-1] != weights.shape[-2]:
            raise traitlets.TraitError(f"{self.name}['weights'] must be [..., n, n], got shape {list(weights.shape)}")
        return {**value, "weights": weights, "causal": bool(value["causal"])}

    def _to_json(self, value, _widget) -> dict:
        if not value:
            return {}
        weights, causal = value["weights"], value["causal"]
        extra = {k: v for k, v in value.items() if k not in ("weights", "causal")}
        return {**to_payload(pack_causal(weights) if causal else weights, self.compress), "layout": "causal" if causal else "dense",
                "n": weights.shape[-1], **extra}

    def _from_json(self, value, _widget) -> dict:
        if not _is_payload(value):
            return {}
        extra = {k: v for k, v in value.items() if k not in _PATTERN_WIRE}
        causal = value.get("layout") == "causal"
        weights = decode_array(value)
        return {"weights": unpack_causal(weights, value["n"]) if causal else weights, "causal": causal, **extra}


ARRAY_TRAITS = (Array, ArrayDict, Patterns)
"""The trait types that hold arrays and serialise them at the wire (their ``from_json`` reads a
saved payload back: ``standalone._SavedView``; they cast kernel-less answers: ``offline``)."""
