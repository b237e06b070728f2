"""The first use of the package says it is working: importing torch and the analysis core takes seconds
on a cold start (issue 43: a first notebook cell showed nothing for 13 s), so the lazy import that brings
them in shows a bar while it runs; ``import pycircuits_widgets`` alone stays cheap and silent."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def first_use(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("PCW_PROGRESS", "TQDM_DISABLE")}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                          env={**environ, "PYTHONPATH": str(REPO), **env})


def test_the_import_that_brings_in_torch_shows_a_bar():
    out = first_use("import sys, pycircuits_widgets as pcw\nassert 'torch' not in sys.modules\npcw.run\n"
                    "assert 'torch' in sys.modules")
    assert "importing torch and the analysis core" in out.stderr


def test_the_package_import_alone_and_later_imports_are_silent():
    assert first_use("import pycircuits_widgets").stderr == ""
    out = first_use("import torch, pycircuits_widgets as pcw\npcw.run")  # torch already there: nothing to wait for
    assert "importing torch" not in out.stderr
    assert "importing torch" not in first_use("import pycircuits_widgets as pcw\npcw.run", PCW_PROGRESS="0").stderr
