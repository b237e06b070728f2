"""The front-end bundle, sent and saved once per kernel however many views there are.

anywidget syncs ``_esm`` and ``_css`` as traits of every widget instance, so a notebook
saved with widget state stored the 170 KB bundle once per view (six times for one
explorer). Here one hidden :class:`BundleCarrier` widget per kernel carries the bundle;
every view's ``_esm`` is a stub of a few hundred bytes that waits for it; the carrier's
``_esm`` holds the bundle, its CSS and its javascript, gzipped together (:func:`carrier_esm`:
the CSS costs a fifth of its 22 KB so, not all of it as a ``_css`` trait). In the browser
the carrier's model loads the bundle when it is created (anywidget loads ``_esm`` at
model creation, displayed or not), and the bundle's ``initialize`` resolves a slot on
``globalThis`` keyed by the bundle's hash (``js/src/lib/slot.js``); a stub's ``render``
awaits that slot and renders with the bundle, which adds its CSS to the root the view is
shown in (``js/src/lib/styles.js``: the document once, or a shadow root).

Nothing here reads the bundle at import: the analysis core and the widget classes work
without a built front end, and the first view that needs it (its carrier, a page written by
:mod:`.standalone`) raises :class:`BundleMissing`, naming the build command.

Development mode (:func:`dev_mode`: anywidget's own hot-reload switch ``ANYWIDGET_HMR=1``,
and this package used from a checkout): the carrier's ``_esm``/``_css`` are the built files
themselves, which anywidget watches and re-sends on every change (``npm run dev`` in
``js/`` rebuilds them on every save); the stubs wait under the key :data:`DEV_KEY`, and
each new bundle re-mounts the views already shown, with their current state.

Pages written by :mod:`.standalone` and :mod:`.notebook_export` inline the bundle
(packed the same way) and never use the stub or the carrier.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import os
import pathlib
import threading

import anywidget
import traitlets

STATIC = pathlib.Path(__file__).resolve().parents[2] / "static"

DEV_KEY = "dev"
"""str: the key the stubs wait under in development mode (the bundle changes, its hash too)."""

BUILD = "cd js && npm ci && npm run build"
"""The command (from the repository root) that builds the front end into ``static/``."""


class BundleMissing(FileNotFoundError):
    """The built front end is not there: views cannot be shown or saved (the analysis core
    and the widget classes work without it)."""


def bundle_file(name: str) -> pathlib.Path:
    """Path of a built front-end file (``widget.js``, ``widget.css``); :class:`BundleMissing`,
    naming the fix, if the front end was never built."""
    path = STATIC / name
    if not path.is_file():
        raise BundleMissing(
            f"the built front end {path} is missing, so views cannot be shown or saved (the analysis "
            f"works without it): build it with `{BUILD}` in the repository, or install the package "
            "with pip (`pip install .` builds it; a wheel carries it)"
        )
    return path


def bundle_code() -> tuple[str, str]:
    """(javascript, css) of the built front end, read again when a rebuild changed the files."""
    js, css = bundle_file("widget.js"), bundle_file("widget.css")
    return _read(js, css, _stamp(js), _stamp(css))


def _stamp(path: pathlib.Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=1)
def _read(js: pathlib.Path, css: pathlib.Path, *stamps) -> tuple[str, str]:
    # the files' (mtime, size) stamps are only the cache key: a rebuild reads them again
    return js.read_text(encoding="utf-8"), css.read_text(encoding="utf-8")


def bundle_key() -> str:
    """Hash of the bundle: a page holding views of two builds keeps them apart."""
    return _key(*bundle_code())


@functools.lru_cache(maxsize=1)
def _key(js: str, css: str) -> str:
    return hashlib.sha256((js + "\0" + css).encode("utf-8")).hexdigest()[:16]


def dev_mode() -> bool:
    """True when anywidget hot-reloads files (``ANYWIDGET_HMR=1``) and this package is used
    from a checkout: the carrier then carries the bundle's files, which anywidget watches.
    (anywidget watches no file under ``site-packages``/``dist-packages``: an installed
    package keeps its packed bundle.)"""
    installed = {"site-packages", "dist-packages"} & set(STATIC.parts)
    return os.environ.get("ANYWIDGET_HMR") == "1" and not installed


# The slot shape is shared with js/src/lib/slot.js: {promise, resolve}; the promise read at
# each render, as development mode replaces it with each new bundle's.
_STUB = """// pycircuits_widgets view: renders with the bundle its kernel's BundleCarrier loads.
const key = Symbol.for("pycircuits_widgets:%(key)s");
const slot = (globalThis[key] ??= (() => { let resolve; const promise = new Promise((r) => (resolve = r)); return { promise, resolve }; })());
export default { async render(ctx) { return (await slot.promise).render(ctx); } };
"""


def stub_esm(key: str | None = None) -> str:
    """The ``_esm`` of every view: waits for the bundle under ``key`` (default: the bundle's
    hash; a view uses its carrier's ``bundle_key``), then renders."""
    return _STUB % {"key": key or bundle_key()}


# The carrier's `_esm`: the bundle packed (a third of its size in a saved notebook, even as
# base64), unpacked with the browser's DecompressionStream; the javascript imported from a
# Blob URL as anywidget imports any `_esm`, its CSS handed to it for the views it mounts.
# Its default export is the bundle's.
_LOADER = """// pycircuits_widgets front end: CSS then javascript (gzip, base64)
const packed = "%(packed)s";
const cssBytes = %(css_bytes)d;
const bytes = Uint8Array.from(atob(packed), (c) => c.charCodeAt(0));
const both = await new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"))).blob();
const url = URL.createObjectURL(both.slice(cssBytes, both.size, "text/javascript"));
const bundle = await import(url);
URL.revokeObjectURL(url);
bundle.useStyles(await both.slice(0, cssBytes).text());
export default bundle.default;
"""


def bundle_packed() -> str:
    """The bundle packed: its CSS (:func:`packed_css_bytes` bytes of UTF-8) then its
    javascript, gzipped together, as base64 (unpacked with the browser's
    DecompressionStream): what the carrier and the pages written by :mod:`.standalone` hold."""
    return _packed(*bundle_code())


def packed_css_bytes() -> int:
    """Bytes of CSS at the start of the unpacked bundle (:func:`bundle_packed`); the rest is
    the javascript."""
    return len(bundle_code()[1].encode("utf-8"))


@functools.lru_cache(maxsize=1)
def _packed(js: str, css: str) -> str:
    return base64.b64encode(gzip.compress((css + js).encode("utf-8"), 9, mtime=0)).decode("ascii")


def carrier_esm() -> str:
    """The carrier's ``_esm``: a loader holding the packed bundle, CSS and javascript."""
    return _LOADER % {"packed": bundle_packed(), "css_bytes": packed_css_bytes()}


class BundleCarrier(anywidget.AnyWidget):
    """Hidden widget (never displayed) whose ``_esm`` is the whole front end, CSS included:
    the bundle packed (:func:`carrier_esm`), read when the first view is made. No ``_css``:
    the bundle adds its CSS where its views are shown."""

    bundle_key = traitlets.Unicode().tag(sync=True)
    """str: the key the views' stubs wait for (the bundle's hash, or :data:`DEV_KEY`)."""

    def __init__(self):
        # an instance attribute before anywidget's __init__, which makes a synced trait of it
        self._esm = carrier_esm()
        super().__init__(bundle_key=bundle_key())


@functools.cache
def watching_carrier() -> type[anywidget.AnyWidget]:
    """The development carrier's class, made on first use (the files must exist): its
    ``_esm``/``_css`` are the bundle's file paths, which anywidget reads and, under
    ``ANYWIDGET_HMR=1``, watches, setting the traits on every change."""

    class WatchingBundleCarrier(anywidget.AnyWidget):
        """Development carrier: the bundle's files, watched; the stubs wait under ``DEV_KEY``."""

        _esm = bundle_file("widget.js")
        _css = bundle_file("widget.css")
        bundle_key = traitlets.Unicode(DEV_KEY).tag(sync=True)

    return WatchingBundleCarrier


_carrier: anywidget.AnyWidget | None = None
_lock = threading.Lock()


def ensure_carrier() -> anywidget.AnyWidget:
    """The kernel's carrier (a :class:`BundleCarrier`, or in :func:`dev_mode` a
    :func:`watching_carrier`), created (its comm opened before any view's) when there is
    none or it was closed (``Widget.close_all()``); :class:`BundleMissing` if the front end
    was never built."""
    global _carrier
    with _lock:
        if _carrier is None or _carrier.comm is None:
            _carrier = watching_carrier()() if dev_mode() else BundleCarrier()
        return _carrier
