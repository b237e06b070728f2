"""Browser test harness: a real Python widget driving its real built view in headless
Chromium (Debian's ``chromium`` through Playwright's ``executable_path``).

The page is the widget's standalone HTML (``pycircuits_widgets.widgets.sharing.standalone``);
the only stand-in is the transport. Where Jupyter would carry comm messages over a
websocket, the harness carries the same ipywidgets messages through Playwright:

* browser -> kernel: ``model.save_changes()`` / ``model.send()`` call an exposed binding
  that applies the change with ``widget.set_state`` (trait validation and observers run)
  or delivers the custom message to the widget's handlers;
* kernel -> browser: the widget's comm is replaced by :class:`HarnessComm`, which
  queues every message ipywidgets sends (state updates, custom messages with buffers)
  and applies it in the page.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import threading
import time

from pycircuits_widgets.widgets.sharing.standalone import page_plan, render_html

CHROMIUM = os.environ.get("PCW_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--disable-quic",
]

def page_room(widgets, rank: int, *, heads=(), more: int = 0) -> int:
    """A ``max_bytes`` with room for what a save's plan (``core.save_plan``) puts up to value rank ``rank``
    (``save_plan.WEIGHTS`` ...) and ``more`` bytes, estimated as the save will (an explorer of a small model:
    its on-demand views computed first, as its save does)."""
    for w in widgets:
        if hasattr(w, "compute"):
            w.compute()
    plan = page_plan(widgets, None, 1 << 40, heads=heads)
    return plan.base_bytes + sum(item.bytes_estimate for item in plan.items if item.value_rank <= rank) + more


def token_as_shown(display: str) -> str:
    """How a view prints a token's display string (oracle of js/src/lib/tokens.js
    ``compactToken``): each run of 5 or more of one whitespace glyph written once with its
    length, e.g. "↵" + 23 "·" -> "↵·×23"; the exact string stays in the token's title."""
    return re.sub(r"([·↵→␍])\1{4,}", lambda m: f"{m.group(1)}×{len(m.group(0))}", display)


_BRIDGE_JS = """
window.pcwPending = [];
window.pcwApply = (messages) => {
  for (const m of messages) {
    const model = window.pcwHost.models.get(m.model_id);
    const bufs = m.buffers.map((b64) => {
      const bin = atob(b64); const u = new Uint8Array(bin.length);
      for (let i = 0; i < bin.length; i++) u[i] = bin.charCodeAt(i);
      return new DataView(u.buffer);
    });
    if (m.method === "update") {
      const state = structuredClone(m.state);
      m.buffer_paths.forEach((path, i) => {
        let o = state; for (const k of path.slice(0, -1)) o = o[k];
        o[path[path.length - 1]] = bufs[i];
      });
      model.update(state);
    } else if (m.method === "custom") {
      model.receive(m.content, bufs);
    }
  }
};
const relay = (p) => p.then((replies) => window.pcwApply(replies));
window.pcwBridge = { hooks: {
  onSave: (id, changes) => relay(window.pcwSave(id, JSON.stringify(changes))),
  onSend: (id, content) => relay(window.pcwSend(id, JSON.stringify(content))),
} };
"""


def open_offline(page, path, *, console_errors: bool = False):
    """Open the page file ``path`` with every non-file request aborted (the network cut) and
    wait until its views are mounted; returns (attempted urls, page errors), the errors
    including console errors when ``console_errors``."""
    attempted, errors = [], []

    def block(route):
        attempted.append(route.request.url)
        route.abort()

    page.route(re.compile(r"^(?!file:|data:|blob:)"), block)
    page.on("pageerror", lambda e: errors.append(str(e)))
    if console_errors:
        page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-pcw-ready]", timeout=15000)
    return attempted, errors


@contextlib.contextmanager
def saved_page_open(browser, path):
    """A fresh 1400 x 1000 page on the saved page file ``path``, network cut (``open_offline``),
    10 s auto-waits; on leaving, asserts the page raised no error."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(10000)
    _, errors = open_offline(page, path)
    yield page
    assert not errors
    context.close()


def explorer_section(page, name):
    """The saved explorer page's section of child view ``name`` (``loss``, ``attention``, ...)."""
    return page.locator(f".pcw-explorer section[data-view={name}]")


def js_state(page, widget, names):
    """The page host's values of traits ``names`` of ``widget`` (a saved page's model)."""
    return page.evaluate("([id, names]) => names.map((n) => window.pcwHost.models.get(id).get(n))",
                         [widget.model_id, names])


class HarnessComm:
    """Stands in for a widget's comm: collects what ipywidgets sends to the front end."""

    def __init__(self, view: WidgetView, comm_id: str):
        self.comm_id = comm_id
        self._view = view

    def send(self, data=None, metadata=None, buffers=None):
        self._view._queue(self.comm_id, data, buffers or [])

    def close(self, *args, **kwargs):
        pass

    def on_msg(self, callback):
        pass

    def on_close(self, callback):
        pass


def show_explorer(show, explorer):
    """Show ``explorer`` through the ``show`` fixture; its children's messages travel like the explorer's own."""
    view = show(explorer)
    for child in explorer.views().values():
        view.widgets[child.model_id] = child
        child.comm = HarnessComm(view, child.model_id)
    return view


class WidgetView:
    """Widgets rendered in one page, wired to their Python objects."""

    def __init__(self, page, widgets, tmp_path):
        self.page = page
        self.widgets = {w.model_id: w for w in widgets}
        self.errors: list[str] = []
        self.received: list[tuple[str, str]] = []  # (model_id, "update" | "custom") of each browser message
        self.sent: list[tuple[str, set[str]]] = []  # (model_id, the state's keys) of each kernel update
        self._outbox: list[dict] = []
        self._lock = threading.Lock()
        self._main = threading.get_ident()
        self._in_callback = False
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("dialog", lambda d: (self.errors.append(f"dialog opened: {d.message}"), d.dismiss()))
        page.expose_binding("pcwSave", lambda source, mid, changes: self._from_browser(mid, "update", changes))
        page.expose_binding("pcwSend", lambda source, mid, content: self._from_browser(mid, "custom", content))
        page.add_init_script(_BRIDGE_JS)
        path = tmp_path / "view.html"
        path.write_text(render_html(widgets, offline=False, wait=False), encoding="utf-8")  # the harness is the kernel
        self.html_path = path
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-pcw-ready]", timeout=15000)
        # Only now route the widgets' messages to the page (its host holds the models).
        for w in widgets:
            w.comm = HarnessComm(self, w.model_id)

    # -- kernel -> browser ------------------------------------------------------------
    def _queue(self, comm_id, data, buffers):
        if data.get("method") == "echo_update":
            return  # the page already holds the value it sent
        if data["method"] == "update":
            self.sent.append((comm_id, set(data.get("state", {}))))
        msg = {
            "model_id": comm_id,
            "method": data["method"],
            "state": data.get("state", {}),
            "buffer_paths": data.get("buffer_paths", []),
            "content": data.get("content"),
            "buffers": [base64.b64encode(bytes(b)).decode("ascii") for b in buffers],
        }
        with self._lock:
            self._outbox.append(msg)
        if threading.get_ident() == self._main and not self._in_callback:
            self.flush()

    def _take(self):
        with self._lock:
            out, self._outbox = self._outbox, []
        return out

    def flush(self):
        """Deliver queued kernel messages to the page (also those sent from threads)."""
        messages = self._take()
        if messages:
            self.page.evaluate("(m) => window.pcwApply(m)", messages)

    # -- browser -> kernel ------------------------------------------------------------
    def _from_browser(self, model_id, kind, payload_json):
        widget = self.widgets[model_id]
        self.received.append((model_id, kind))
        payload = json.loads(payload_json)
        self._in_callback = True
        try:
            if kind == "update":
                widget.set_state(payload)
            else:
                widget._handle_custom_msg(payload, [])
        finally:
            self._in_callback = False
        return self._take()

    # -- helpers for tests --------------------------------------------------------------
    def wait_until(self, predicate, timeout=10.0, what="condition"):
        """Poll ``predicate()`` (flushing kernel messages sent from other threads)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.flush()
            if predicate():
                return
            self.page.wait_for_timeout(25)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    def js_model(self, widget, name):
        """A trait's value as the page's model holds it."""
        return self.page.evaluate(
            "([id, name]) => window.pcwHost.models.get(id).get(name)", [widget.model_id, name]
        )
