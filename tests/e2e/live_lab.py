"""A real JupyterLab 4 server and a notebook driven in headless Chromium, for end-to-end
tests and the round-trip benchmark.

* :class:`JupyterLab` starts ``jupyter lab`` on 127.0.0.1 (free port, token auth, no
  browser, a temporary root, config, data, runtime and settings dirs so the user's own
  Jupyter setup plays no part), waits until it answers, and shuts it down with its
  kernels. ``window.jupyterapp`` is exposed (``LabApp.expose_app_in_browser``) so tests
  can run JupyterLab commands.
* :func:`open_notebook` opens a notebook in a page and waits for its kernel;
  :func:`run_all_cells` runs it; :func:`kernel_exec` / :func:`kernel_eval` run code in the
  notebook's own kernel (through JupyterLab's session, as the notebook does) to observe
  the kernel side of a click.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import nbformat

REPO = pathlib.Path(__file__).resolve().parents[2]
# Front-end extensions the widgets need, as /lab/api/extensions names them.
REQUIRED_EXTENSIONS = ("anywidget", "@jupyter-widgets/jupyterlab-manager")
# Off: the "receive Jupyter news?" prompt and update checks (no network in tests). On:
# saving widget state with the notebook, as a user sharing a notebook does.
_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyter-widgets/jupyterlab-manager/plugin.jupyterlab-settings": {"saveState": True},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """One JupyterLab server process; use as a context manager."""

    def __init__(self, base: pathlib.Path, *, start_timeout: float = 90.0):
        self.base = pathlib.Path(base)
        self.root = self.base / "root"
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout = start_timeout
        self.log_path = self.base / "jupyter.log"
        self.proc: subprocess.Popen | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> "JupyterLab":
        dirs = {name: self.base / name for name in ("root", "config", "data", "runtime", "settings", "workspaces", "ipython")}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        for rel, value in _SETTINGS.items():
            path = dirs["settings"] / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value), encoding="utf-8")
        env = {
            **os.environ,
            "JUPYTER_CONFIG_DIR": str(dirs["config"]),
            "JUPYTER_DATA_DIR": str(dirs["data"]),
            "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
            "IPYTHONDIR": str(dirs["ipython"]),
            "JUPYTER_PLATFORM_DIRS": "1",
            # the kernel imports the package from this checkout
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        cmd = [
            sys.executable, "-m", "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={dirs['root']}",
            f"--LabApp.user_settings_dir={dirs['settings']}",
            f"--LabApp.workspaces_dir={dirs['workspaces']}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=",
            "--LabApp.extension_manager=readonly",  # the PyPI one queries the network
            "--ServerApp.terminals_enabled=False",
        ]  # fmt: skip
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")  # containers and CI often run as root
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=dirs["root"], env=env, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
            self._check_extensions()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self):
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.api("GET", "/api/status")
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        raise TimeoutError(f"jupyter lab did not answer within {self.start_timeout}s:\n{self.log_tail()}")

    def _check_extensions(self):
        names = {ext["name"] for ext in self.api("GET", "/lab/api/extensions")}
        missing = [name for name in REQUIRED_EXTENSIONS if name not in names]
        if missing:
            raise RuntimeError(
                f"JupyterLab extension(s) {missing} not installed in {sys.prefix}/share/jupyter/labextensions "
                "(pip install anywidget ipywidgets installs them)"
            )

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.api("POST", "/api/shutdown")  # stops the kernels too
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._log.close()

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-n:]

    # -- REST -------------------------------------------------------------------------------
    def api(self, method: str, path: str):
        """Call the server's REST API; returns the decoded JSON reply (or None)."""
        req = urllib.request.Request(
            self.url + path, method=method, headers={"Authorization": f"token {self.token}"}, data=b"" if method == "POST" else None
        )
        with urllib.request.urlopen(req, timeout=10) as reply:
            body = reply.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self):
        """Delete every session (and its kernel): frees the CPU between tests."""
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")

    def notebook_url(self, name: str) -> str:
        return f"{self.url}/lab/tree/{name}?reset&token={self.token}"


def write_notebook(directory: pathlib.Path, name: str, cells: list[str]) -> pathlib.Path:
    """A notebook of code cells (python3 kernel) at ``directory / name``."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = pathlib.Path(directory) / name
    nbformat.write(nb, str(path))
    return path


# -- driving the notebook in the page (JupyterLab's own API via window.jupyterapp) ------------
_PANEL = """
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
async function notebookPanel() {
  while (!window.jupyterapp) await sleep(50);
  await window.jupyterapp.restored;
  let panel;
  while (!(panel = window.jupyterapp.shell.currentWidget) || !panel.sessionContext) await sleep(50);
  await panel.context.ready;
  await panel.sessionContext.ready;
  while (!panel.sessionContext.session?.kernel) await sleep(50);
  return panel;
}
async function idle(panel) {
  while (panel.sessionContext.session.kernel.status !== "idle") await sleep(20);
}
"""


def open_notebook(page, lab: JupyterLab, name: str, timeout: float = 60.0):
    """Open ``name`` (relative to the server root) and wait until its kernel is idle."""
    page.set_default_timeout(timeout * 1000)
    page.goto(lab.notebook_url(name))
    page.evaluate(f"async () => {{ {_PANEL} const p = await notebookPanel(); await idle(p); }}")


def run_all_cells(page):
    """Run every cell (JupyterLab's ``notebook:run-all-cells``) and wait for the kernel;
    raises if a cell failed."""
    errors = page.evaluate(
        f"""async () => {{ {_PANEL}
        const panel = await notebookPanel();
        await window.jupyterapp.commands.execute("notebook:run-all-cells");
        await idle(panel);
        const failed = [];
        for (const cell of panel.content.widgets) {{
          if (cell.model.type !== "code") continue;
          for (const out of cell.model.outputs.toJSON())
            if (out.output_type === "error") failed.push(out.ename + ": " + out.evalue);
        }}
        return failed;
    }}"""
    )
    if errors:
        raise AssertionError(f"notebook cells failed: {errors}")


def kernel_exec(page, code: str) -> str:
    """Run ``code`` in the open notebook's kernel; returns its stdout, raises on error.
    (Not shown in the notebook: JupyterLab only shows outputs of its own requests.)"""
    reply = page.evaluate(
        f"""async (code) => {{ {_PANEL}
        const panel = await notebookPanel();
        const future = panel.sessionContext.session.kernel.requestExecute({{ code, store_history: false }});
        let out = "", error = null;
        future.onIOPub = (msg) => {{
          if (msg.header.msg_type === "stream") out += msg.content.text;
          if (msg.header.msg_type === "error") error = msg.content.ename + ": " + msg.content.evalue;
        }};
        await future.done;
        return {{ out, error }};
    }}""",
        code,
    )
    if reply["error"]:
        raise AssertionError(f"kernel raised {reply['error']} running:\n{code}")
    return reply["out"]


def kernel_eval(page, expr: str):
    """The value of a JSON-able Python expression in the open notebook's kernel."""
    out = kernel_exec(page, f"import json as _pcw_json\nprint(_pcw_json.dumps({expr}))")
    return json.loads(out.strip().splitlines()[-1])


def wait_for_kernel(page, expr: str, expected, timeout: float = 10.0):
    """Poll ``kernel_eval(expr)`` until it equals ``expected`` (comm messages are async)."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = kernel_eval(page, expr)
        if value == expected:
            return value
        time.sleep(0.05)
    raise AssertionError(f"kernel: {expr} = {value!r}, expected {expected!r} within {timeout}s")
