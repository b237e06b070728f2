"""Python-only use without a built front end: a copy of the package without ``static/``
(the checkout's own bundle is never touched), run in a fresh interpreter. Importing the
package and its widgets and running the analysis need no bundle and give the same numbers
as here; a view can be made and drawn as its static picture; showing or saving it raises
``BundleMissing`` naming the build command, before any work and without writing a file."""

import json
import pathlib
import shutil
import subprocess
import sys

import torch

import pycircuits_widgets as pcw
from pycircuits_widgets.analysis import composition
from pycircuits_widgets.widgets.core.bundle import BUILD

REPO = pathlib.Path(__file__).resolve().parents[1]
MODEL = "attn-only-2l"

SCRIPT = """
import json, pathlib, sys
import pycircuits_widgets as pcw
from pycircuits_widgets.widgets.core import bundle

out = {"file": pcw.__file__, "static": bundle.STATIC.exists()}
model = pcw.load_pretrained(%(model)r)
out["q_composition"] = pcw.composition_scores(model, "Q").tolist()
w = pcw.ColoredTokens(["alpha", " beta"], [0.25, 0.75], label="loss")
out["picture"] = w._fallback_html()
page = pathlib.Path(sys.argv[1])
for name, action in [("show", w._repr_mimebundle_), ("save", lambda: w.save_html(page))]:
    try:
        action()
        out[name] = None
    except bundle.BundleMissing as exc:
        out[name] = str(exc)
out["page_written"] = page.exists()
print(json.dumps(out))
"""


def test_the_package_works_without_a_built_front_end_and_showing_a_view_names_the_build(tmp_path):
    shutil.copytree(REPO / "pycircuits_widgets", tmp_path / "pycircuits_widgets",
                    ignore=shutil.ignore_patterns("__pycache__", "static"))
    run = subprocess.run([sys.executable, "-c", SCRIPT % {"model": MODEL}, str(tmp_path / "page.html")],
                         cwd=tmp_path, env={"PATH": "", "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["file"] == str(tmp_path / "pycircuits_widgets" / "__init__.py") and not out["static"]
    # the same numbers as the package with its bundle (this process; NaN: pairs not in order)
    expected = pcw.composition_scores(pcw.load_pretrained(MODEL), "Q")
    # another thread count rounds differently: each float32 score is within composition_scores' guarded
    # relative error of the exact one, so the two within twice that
    rtol = 2 * composition.FALLBACK_RELATIVE_ERROR
    torch.testing.assert_close(torch.tensor(out["q_composition"]), expected, rtol=rtol, atol=0, equal_nan=True)
    assert "alpha" in out["picture"] and "beta" in out["picture"]  # the static picture needs no bundle
    for name in ("show", "save"):
        assert out[name] is not None, f"{name} did not raise BundleMissing"
        assert BUILD in out[name] and "static/widget.js is missing" in out[name], out[name]
    assert not out["page_written"]
