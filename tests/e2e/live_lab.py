"""Real notebook servers driven in headless Chromium, for end-to-end tests and the
round-trip benchmark.

* :class:`ServerProcess`: one server process on 127.0.0.1 (a free port), in a temporary
  base directory with its own config, data, runtime and home dirs so the user's own setup
  plays no part; it waits for a real readiness signal (an HTTP answer) and is always shut
  down with its kernels. Run as root, the Jupyter servers get ``--allow-root``.
* :class:`JupyterLab` (4) and :class:`JupyterNotebook` (7, built from JupyterLab's
  components): token auth, no browser, ``window.jupyterapp`` exposed
  (``expose_app_in_browser``) so tests can run the application's commands.
  tests/e2e/live_hosts.py has Voilà and marimo.
* :func:`open_notebook` opens a notebook in a page and waits for its kernel;
  :func:`run_all_cells` runs it; :func:`kernel_exec` / :func:`kernel_eval` run code in the
  notebook's own kernel (through the application's session, as the notebook does) to
  observe the kernel side of a click. They work in JupyterLab and Notebook 7 alike.
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


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


class ServerProcess:
    """One server process; use as a context manager. Subclasses give :meth:`command`,
    :meth:`ready` (True once the server answers) and optionally :meth:`shutdown`."""

    name = "server"
    dirs = ("root", "config", "data", "runtime", "home", "ipython")

    def __init__(self, base: pathlib.Path, *, start_timeout: float = 90.0):
        self.base = pathlib.Path(base)
        self.root = self.base / "root"
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout = start_timeout
        self.log_path = self.base / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        d = {name: self.base / name for name in self.dirs}
        return {
            **os.environ,
            "HOME": str(d["home"]),
            "JUPYTER_CONFIG_DIR": str(d["config"]),
            "JUPYTER_DATA_DIR": str(d["data"]),
            "JUPYTER_RUNTIME_DIR": str(d["runtime"]),
            "IPYTHONDIR": str(d["ipython"]),
            "JUPYTER_PLATFORM_DIRS": "1",
            # the kernel imports the package from this checkout
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self):
        for name in self.dirs:
            (self.base / name).mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), cwd=self.root, env=self.env(), stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self):
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.ready():
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)  # polling interval of the readiness probe, not a synchronisation
        raise TimeoutError(f"{self.name} did not answer within {self.start_timeout}s:\n{self.log_tail()}")

    def shutdown(self):
        """Ask the server to stop (the default: terminate the process)."""
        self.proc.terminate()

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.shutdown()
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

    def get(self, path: str, headers: dict | None = None) -> bytes:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        with urllib.request.urlopen(req, timeout=10) as reply:
            return reply.read()


class JupyterLab(ServerProcess):
    """One JupyterLab server process; use as a context manager."""

    name = "jupyter-lab"
    module = "jupyterlab"
    app_class = "LabApp"
    known_page_errors: tuple[str, ...] = ()
    dirs = (*ServerProcess.dirs, "settings", "workspaces")

    def command(self) -> list[str]:
        for rel, value in _SETTINGS.items():
            path = self.base / "settings" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value), encoding="utf-8")
        app = self.app_class
        cmd = [
            sys.executable, "-m", self.module,
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            f"--{app}.user_settings_dir={self.base / 'settings'}",
            f"--{app}.workspaces_dir={self.base / 'workspaces'}",
            f"--{app}.expose_app_in_browser=True",
            "--ServerApp.terminals_enabled=False",
        ]  # fmt: skip
        if app == "LabApp":
            cmd += ["--LabApp.news_url=", "--LabApp.extension_manager=readonly"]  # both query the network
        if is_root():
            cmd.append("--allow-root")  # containers and CI often run as root
        return cmd

    def ready(self) -> bool:
        self.api("GET", "/api/status")
        self._check_extensions()
        return True

    def _check_extensions(self):
        names = {ext["name"] for ext in self.api("GET", "/lab/api/extensions")}
        missing = [name for name in REQUIRED_EXTENSIONS if name not in names]
        if missing:
            raise RuntimeError(
                f"JupyterLab extension(s) {missing} not installed in {sys.prefix}/share/jupyter/labextensions "
                "(pip install anywidget ipywidgets installs them)"
            )

    def shutdown(self):
        self.api("POST", "/api/shutdown")  # stops the kernels too

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


class JupyterNotebook(JupyterLab):
    """One Jupyter Notebook 7 server process (the same REST API and page helpers)."""

    name = "jupyter-notebook"
    module = "notebook"
    app_class = "JupyterNotebookApp"
    # Notebook 7.6.5's own keyboard-shortcuts settings listener throws this on every page
    # load, the file browser included, before any notebook or widget exists.
    known_page_errors = ("Cannot read properties of undefined (reading 'schema')",)

    def ready(self) -> bool:
        self.api("GET", "/api/status")  # Notebook 7 has no /lab/api/extensions listing
        return True

    def notebook_url(self, name: str) -> str:
        return f"{self.url}/notebooks/{name}?token={self.token}"


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
            if (out.output_type === "error") failed.push(out.ename + ": " + out.evalue + " | " + (out.traceback || []).join(" | "));
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
