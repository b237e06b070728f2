"""The front-end bundle, sent and saved once per kernel however many views there are.

anywidget syncs ``_esm`` and ``_css`` as traits of every widget instance, so a notebook
saved with widget state stored the 170 KB bundle once per view (six times for one
explorer). Here one hidden :class:`BundleCarrier` widget per kernel carries the bundle;
every view's ``_esm`` is a stub of a few hundred bytes that waits for it; the carrier's
``_esm`` holds the bundle gzipped (:func:`carrier_esm`). In the browser the carrier's model
loads the bundle when it is created (anywidget loads ``_esm`` at
model creation, displayed or not), and the bundle's ``initialize`` resolves a slot on
``globalThis`` keyed by the bundle's hash (``js/src/index.js``); a stub's ``render``
awaits that slot and renders with the bundle. The carrier also carries the CSS, which
anywidget puts in the document once at model creation.

Pages written by :mod:`.standalone` and :mod:`.notebook_export` inline the bundle
(gzipped too) and never use the stub or the carrier.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import pathlib
import threading

import anywidget
import traitlets

STATIC = pathlib.Path(__file__).resolve().parents[2] / "static"

# The slot shape is shared with js/src/index.js (`bundleSlot`): {promise, resolve}.
_STUB = """// pycircuits_widgets view: renders with the bundle its kernel's BundleCarrier loads.
const key = Symbol.for("pycircuits_widgets:%(key)s");
const slot = (globalThis[key] ??= (() => { let resolve; const promise = new Promise((r) => (resolve = r)); return { promise, resolve }; })());
export default { async render(ctx) { return (await slot.promise).render(ctx); } };
"""


def bundle_file(name: str) -> pathlib.Path:
    """Path of a built front-end file (``widget.js``, ``widget.css``); a clear error if
    the front end was never built."""
    path = STATIC / name
    if not path.exists():
        raise FileNotFoundError(
            f"the built front end {path} is missing: install the package with pip (which builds it) "
            "or run `npm --prefix js install && npm --prefix js run build`"
        )
    return path


@functools.cache
def bundle_code() -> tuple[str, str]:
    """(javascript, css) of the built front end."""
    return bundle_file("widget.js").read_text(encoding="utf-8"), bundle_file("widget.css").read_text(encoding="utf-8")


@functools.cache
def bundle_key() -> str:
    """Hash of the bundle: a page holding views of two builds keeps them apart."""
    js, css = bundle_code()
    return hashlib.sha256((js + "\0" + css).encode("utf-8")).hexdigest()[:16]


def stub_esm() -> str:
    """The ``_esm`` of every view: waits for the bundle of the same hash, then renders."""
    return _STUB % {"key": bundle_key()}


# The carrier's `_esm`: the bundle gzipped (a third of its size in a saved notebook, even
# as base64), unpacked with the browser's DecompressionStream and imported from a Blob URL
# as anywidget imports any `_esm`; its default export is the bundle's.
_LOADER = """// pycircuits_widgets front end (gzip, base64)
const packed = "%(packed)s";
const bytes = Uint8Array.from(atob(packed), (c) => c.charCodeAt(0));
const code = await new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"))).text();
const url = URL.createObjectURL(new Blob([code], { type: "text/javascript" }));
const bundle = await import(url);
URL.revokeObjectURL(url);
export default bundle.default;
"""


@functools.cache
def bundle_packed() -> str:
    """The bundle's javascript gzipped, as base64 (unpacked with the browser's
    DecompressionStream): what the carrier and the pages written by :mod:`.standalone` hold."""
    return base64.b64encode(gzip.compress(bundle_code()[0].encode("utf-8"), 9, mtime=0)).decode("ascii")


@functools.cache
def carrier_esm() -> str:
    """The carrier's ``_esm``: a loader holding the gzipped bundle."""
    return _LOADER % {"packed": bundle_packed()}


class BundleCarrier(anywidget.AnyWidget):
    """Hidden widget (never displayed) whose ``_esm``/``_css`` are the whole front end."""

    _esm = carrier_esm()
    _css = bundle_file("widget.css")
    bundle_key = traitlets.Unicode(bundle_key()).tag(sync=True)
    """str: the hash the views' stubs wait for."""


_carrier: BundleCarrier | None = None
_lock = threading.Lock()


def ensure_carrier() -> BundleCarrier:
    """The kernel's carrier, created (its comm opened before any view's) when there is
    none or it was closed (``Widget.close_all()``)."""
    global _carrier
    with _lock:
        if _carrier is None or _carrier.comm is None:
            _carrier = BundleCarrier()
        return _carrier
