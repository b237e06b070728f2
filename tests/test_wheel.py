"""The package as users install it, without Node.

``python -m build`` makes the sdist (front-end sources, no bundle) and then the wheel *from
that sdist*, so npm and vite run inside the build: one build checks both. The wheel is
installed into a fresh virtual environment (no system site-packages, no editable checkout
on ``sys.path``) whose ``PATH`` holds no ``node`` or ``npm``; the demo and a widget export
run there, and the pages they write render in Chromium offline.

Installing torch into every fresh environment would take minutes, so the environment
reuses the test environment's installed copies of exactly the wheel's declared
dependencies (and theirs), linked into one directory on the new environment's path; pip
then installs the wheel with ``--no-index``, which fails if a declared requirement is not
met by them. A dependency the code imports but the wheel does not declare is absent there.
"""

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from harness import open_offline

pytestmark = pytest.mark.browser

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "pycircuits_widgets"
SHIPPED = [f"{PACKAGE}/static/widget.js", f"{PACKAGE}/static/widget.css", f"{PACKAGE}/checkpoints/tokenizer.json"] + [
    f"{PACKAGE}/checkpoints/attn-only-{n}l.{ext}" for n in (0, 1, 2) for ext in ("json", "safetensors")
]


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """(sdist, wheel) built by ``python -m build``: the sdist from the checkout, the wheel
    from the unpacked sdist (which has no bundle and no node_modules: npm and vite run)."""
    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)], capture_output=True, text=True)
    assert build.returncode == 0, f"python -m build failed:\n{build.stdout[-4000:]}\n{build.stderr[-4000:]}"
    assert "vite build" in build.stdout + build.stderr  # the front end was built from source
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    print(f"wheel {wheel.name}: {wheel.stat().st_size / 1e6:.2f} MB")
    return sdist, wheel


def test_sdist_carries_front_end_sources_and_no_bundle(dist):
    sdist, _ = dist
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for source in ("js/package.json", "js/package-lock.json", "js/vite.config.js", "js/src/index.js"):
        assert source in names
    assert not [n for n in names if n.startswith((f"{PACKAGE}/static/", "js/node_modules/"))]


def test_wheel_carries_the_bundle_and_the_shipped_models(dist):
    _, wheel = dist
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for path in SHIPPED:
            assert path in names and zf.getinfo(path).file_size > 0, path
        # the bundle is the one vite builds from this checkout's sources: every view is in it
        js = zf.read(f"{PACKAGE}/static/widget.js").decode()
    for view in (REPO / "js/src/views").glob("*.svelte"):
        assert view.stem in js, view.stem
    assert not [n for n in names if n.startswith(("js/", "tests/", "notebooks/"))]


def _dependency_closure(requirements: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions that ``requirements`` (and theirs, no extras) resolve to."""
    found, todo = {}, list(requirements)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name not in found:
            found[name] = importlib.metadata.distribution(req.name)
            todo += found[name].requires or []
    return list(found.values())


@pytest.fixture(scope="module")
def wheel_env(dist, tmp_path_factory):
    """``run(args, cwd) -> CompletedProcess``: a command in a fresh venv with the wheel
    installed, ``PATH`` = the venv's bin only (no node, npm), no ``PYTHONPATH``."""
    _, wheel = dist
    base = tmp_path_factory.mktemp("wheel_env")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = pathlib.Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                       capture_output=True, text=True, check=True).stdout.strip())
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    deps = base / "deps"
    deps.mkdir()
    for d in _dependency_closure(requires):
        top = {pathlib.PurePath(f).parts[0] for f in d.files or [] if not str(f).startswith("..")}
        for name in top - {"__pycache__"}:
            target = pathlib.Path(d.locate_file(name))
            if target.exists() and not (deps / name).exists():
                (deps / name).symlink_to(target)
    (site / "_pcw_test_deps.pth").write_text(f"{deps}\n", encoding="utf-8")
    env = {"PATH": str(venv / "bin"), "HOME": str(base), "LANG": "C.UTF-8"}
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index",
                              "--no-cache-dir", "--disable-pip-version-check", str(wheel)],
                             capture_output=True, text=True, env={**env, "PATH": os.environ["PATH"]})
    assert install.returncode == 0, f"pip install of the wheel failed:\n{install.stdout}\n{install.stderr}"

    def run(args, cwd):
        return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)

    return run


PROBE = """
import json, shutil, sys
import pycircuits_widgets as pcw
model = pcw.load_pretrained("attn-only-1l")
out = pcw.run(model, "def f(x):\\n    return x\\n")
page = pcw.ColoredTokens(out.str_tokens[0][1:], out.token_loss[0], label="loss").save_html(sys.argv[1])
print(json.dumps({"package": pcw.__file__, "node": shutil.which("node"), "npm": shutil.which("npm"),
                  "n_tokens": len(out.str_tokens[0]) - 1}))
"""


def test_installed_wheel_runs_the_demo_and_exports_a_widget_without_node(wheel_env, browser, tmp_path):
    probe = wheel_env(["-c", PROBE, str(tmp_path / "tokens.html")], cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr[-4000:]
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert found["node"] is None and found["npm"] is None
    assert "site-packages" in found["package"] and not found["package"].startswith(str(REPO))

    demo = wheel_env(["-m", "pycircuits_widgets.demo", "--out", "demo.html"], cwd=tmp_path)
    assert demo.returncode == 0, demo.stderr[-4000:]
    selected = demo.stdout.split("(head ", 1)[1].split(",", 1)[0]  # the head the demo printed, "L1.H6"
    # a wheel has no notebooks/ folder: the demo shows the notebook line instead of pointing at one
    assert "notebooks" not in demo.stdout and "pcw.CircuitExplorer(pcw.load_pretrained(" in demo.stdout

    context = browser.new_context(offline=True, viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    attempted, errors = open_offline(page, tmp_path / "demo.html")
    assert page.locator("[data-testid=selected-head]").inner_text() == selected
    sections = page.locator(".pcw-explorer section[data-view]")
    assert sections.count() >= 5
    for i in range(sections.count()):
        assert sections.nth(i).is_visible() and sections.nth(i).inner_text().strip()

    page = context.new_page()
    attempted_tokens, errors_tokens = open_offline(page, tmp_path / "tokens.html")
    assert page.locator(".pcw-colored-tokens .token").count() == found["n_tokens"]
    context.close()
    assert attempted == attempted_tokens == [] and errors == errors_tokens == []
