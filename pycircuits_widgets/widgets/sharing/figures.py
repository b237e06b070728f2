"""A view's figure (SVG or PNG) written from Python: ``CircuitWidget.save_figure``.

The figure is the front end's own (``js/src/lib/figure.js``, the one drawing path of a view's
figure, which its download menu uses too): the view's saved page is opened in headless Chromium
(offline, no network), the view mounts from the same payload a notebook shows, and the page's
``figure`` function returns the bytes written here. Chromium is driven through Playwright, an
optional dependency (``pip install playwright``): Debian's ``chromium`` (or ``PCW_CHROMIUM``) when
present, else Playwright's own browser (``playwright install chromium``).
"""

from __future__ import annotations

import base64
import concurrent.futures
import os
import pathlib
import re
import shutil
import tempfile

from .standalone import render_html, write_atomic

FORMATS = ("svg", "png")
"""The figure formats, named by the path's suffix or ``format=``."""
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu"]
WIDTH = 1000
"""CSS pixels wide, the page a figure's view is laid out in by default: a figure is as wide as what the view
shows, at most this (less the page's margin). 12 px text is 9 pt at the figure's natural size (96 px an inch),
about 6 pt in a 6.5 inch column at this width; a narrower page wraps the view into a taller, larger-type figure."""
HEIGHT = 1000
MOUNT_TIMEOUT_MS = 30_000

_INSTALL = ("save_figure draws the figure in headless Chromium through Playwright: pip install playwright, "
            "and a Chromium: Debian's `apt install chromium` (or set PCW_CHROMIUM to its path), or "
            "`playwright install chromium`")

# the view's root in the page (the only widget on it), its figure as base64
_FIGURE_JS = """async ([format, scale, title]) => {
  const view = document.querySelector(".pcw-cell .pcw-view");
  if (!view) throw new Error("the view did not mount on its page");
  const blob = await window.pcwHost.figure(view, { format, scale, title: title ?? undefined });
  const bytes = new Uint8Array(await blob.arrayBuffer());
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}"""


def figure_format(path: pathlib.Path, format: str | None) -> str:
    """The figure's format: ``format``, else the path's suffix; ValueError naming both otherwise."""
    chosen = (format or path.suffix.lstrip(".")).lower()
    if chosen not in FORMATS:
        raise ValueError(f"save_figure writes {' or '.join(FORMATS)}: got format={format!r} and path {str(path)!r}; "
                         "name the file .svg or .png, or pass format='svg' or 'png'")
    return chosen


def section_view(widget, section: str | None):
    """``(view, title)``: the widget itself and None (its figure is titled by its view's name, as its menu's
    is), or with ``section``, the explorer's section of that name and the section's title. TypeError for
    ``section`` of a view without sections, ValueError naming the sections for one the explorer does not show."""
    if section is None:
        return widget, None
    sections = getattr(widget, "views", None)
    if not callable(sections):
        raise TypeError(f"section={section!r}: {type(widget).__name__} has no sections (the explorer has)")
    shown = sections()
    if section not in shown:
        raise ValueError(f"section={section!r}: this explorer shows {', '.join(shown)}")
    titles = {s["name"]: s["title"] for s in widget.sections}  # the explorer's own record of its sections
    return shown[section], titles[section]


def chromium() -> str | None:
    """The Chromium to launch: ``PCW_CHROMIUM``, else one on the PATH; None: Playwright's own."""
    found = os.environ.get("PCW_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    return found if found and os.path.exists(found) else None


def _draw(page_file: pathlib.Path, format: str, scale: float, title: str | None, width: int) -> bytes:
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError as exc:
        raise ModuleNotFoundError(_INSTALL) from exc
    errors = []
    with sync_playwright() as pw:
        executable = chromium()
        try:
            browser = pw.chromium.launch(args=CHROMIUM_ARGS, **({"executable_path": executable} if executable else {}))
        except Error as exc:
            raise RuntimeError(f"{_INSTALL}; launching {executable or 'Playwright’s Chromium'} failed: {exc}") from exc
        try:
            page = browser.new_page(viewport={"width": width, "height": HEIGHT})
            # the page is the saved page: it fetches nothing (its content policy says so too)
            page.route(re.compile(r"^(?!file:|data:|blob:)"), lambda route: route.abort())
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_file.as_uri())
            page.wait_for_selector("body[data-pcw-ready]", timeout=MOUNT_TIMEOUT_MS)
            if errors:
                raise RuntimeError(f"the view's page failed to mount: {errors[0]}")
            return base64.b64decode(page.evaluate(_FIGURE_JS, [format, scale, title]))
        finally:
            browser.close()


def save_figure(widget, path, *, section: str | None = None, title: str | None = None, format: str | None = None,
                scale: float = 3.0, width: int = WIDTH, budget: float | None = None) -> pathlib.Path:
    """Write the figure of ``widget`` (or of its ``section``) to ``path``: ``CircuitWidget.save_figure``."""
    path = pathlib.Path(path)
    chosen = figure_format(path, format)
    if not scale > 0:
        raise ValueError(f"scale is PNG pixels per CSS pixel, > 0; got {scale!r}")
    if not (isinstance(width, int) and width >= 200):
        raise ValueError(f"width is the page's width in CSS pixels, an int >= 200; got {width!r}")
    view, section_title = section_view(widget, section)
    # the view as it stands: its kernel-less answers to other selections are not drawn (offline=False)
    page = render_html([view], title=title or section_title or type(view).__name__, offline=False, budget=budget)
    with tempfile.TemporaryDirectory() as tmp:
        page_file = pathlib.Path(tmp) / "view.html"
        page_file.write_text(page, encoding="utf-8")
        # Playwright's sync API refuses a thread with a running event loop (a notebook's kernel): its own thread
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            data = pool.submit(_draw, page_file, chosen, scale, title or section_title, width).result()
    if chosen == "svg":
        return write_atomic(path, data.decode("utf-8"))
    path.write_bytes(data)
    return path
