"""Notebook hosts other than Jupyter's own front ends, as real servers on 127.0.0.1 (see
live_lab.py's :class:`ServerProcess`): Voilà rendering a notebook as a dashboard, and marimo
running a notebook as an app (``marimo run``). Both are ready once they answer HTTP, and
both stop their kernels when terminated.
"""

from __future__ import annotations

import pathlib
import sys
import urllib.error

from live_lab import ServerProcess


def _answers(server: ServerProcess, path: str) -> bool:
    """True once the server answers HTTP at all (a redirect to a login page or a 404 is an
    answer: the server is up); a refused connection propagates and is retried."""
    try:
        server.get(path)
    except urllib.error.HTTPError:
        pass
    return True


class Voila(ServerProcess):
    """``voila NOTEBOOK``: the notebook's outputs as a page, its widgets live on a kernel
    started for each page load. ``notebook`` is copied into the server's root."""

    name = "voila"

    def __init__(self, base: pathlib.Path, notebook: pathlib.Path, **kwargs):
        super().__init__(base, **kwargs)
        self.notebook = pathlib.Path(notebook)

    def command(self) -> list[str]:
        (self.root / self.notebook.name).write_bytes(self.notebook.read_bytes())
        return [
            sys.executable, "-m", "voila", self.notebook.name,
            "--no-browser",
            "--Voila.ip=127.0.0.1",
            f"--port={self.port}",
            "--Voila.port_retries=0",
            f"--token={self.token}",
            "--show_tracebacks=True",
        ]  # fmt: skip

    def ready(self) -> bool:
        return _answers(self, "/login")

    @property
    def page_url(self) -> str:
        return f"{self.url}/?token={self.token}"


class Marimo(ServerProcess):
    """``marimo run APP``: a marimo notebook (a .py file) served read-only as an app; each
    page connection gets its own kernel session, which runs the cells."""

    name = "marimo"

    def __init__(self, base: pathlib.Path, source: str, **kwargs):
        super().__init__(base, **kwargs)
        self.source = source

    def command(self) -> list[str]:
        (self.root / "app.py").write_text(self.source, encoding="utf-8")
        return [
            sys.executable, "-m", "marimo", "run", "app.py",
            "--headless",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--token-password", self.token,
            "--no-sandbox",
            "--no-skew-protection",
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        # no usage telemetry, no update check (offline)
        return {**super().env(), "MARIMO_SKIP_UPDATE_CHECK": "1"}

    def ready(self) -> bool:
        return _answers(self, "/health")

    @property
    def page_url(self) -> str:
        return f"{self.url}/?access_token={self.token}"


_TOP_ROWS = (
    "([table, want]) => JSON.stringify([...table.querySelectorAll('tr.trigram')].slice(0, want.length).map("
    "(r) => [...r.querySelectorAll('.pcw-tok')].map((t) => t.innerText))) === JSON.stringify(want)"
)


def wait_for_trigram_rows(page, table, rows: list[tuple[str, str, str]]):
    """Wait until the skip-trigram table ``table`` (a locator) shows ``rows`` (source,
    destination, out) as its top rows: the kernel's recompute has arrived in the page."""
    page.wait_for_function(_TOP_ROWS, arg=[table.element_handle(), [list(r) for r in rows]])
