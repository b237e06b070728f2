"""The package's lazy exports, checked in a fresh interpreter (nothing imported before)."""

import subprocess
import sys


def fresh(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_subpackages_are_attributes_of_a_fresh_import():
    out = fresh("import sys; import pycircuits_widgets as pcw; "
                "print('pycircuits_widgets.widgets' in sys.modules); "
                "print(pcw.analysis.run is pcw.run, pcw.models.load_pretrained is pcw.load_pretrained, "
                "pcw.factored.FactoredMatrix is pcw.FactoredMatrix, hasattr(pcw.widgets, 'ColoredTokens'))")
    assert out.split() == ["False", "True", "True", "True", "True"]


def test_unknown_attribute_is_an_attribute_error():
    out = fresh("import pycircuits_widgets as pcw\ntry:\n    pcw.nope\nexcept AttributeError as e:\n    print(e)")
    assert out.strip() == "module 'pycircuits_widgets' has no attribute 'nope'"
