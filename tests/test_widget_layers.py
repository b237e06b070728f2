"""The widgets layer's imports point one way: ``views`` -> ``core``, ``sharing`` -> ``core``; ``core``
imports neither at module import (the base reaches the export stack only inside the methods that
write a page or a picture), nothing in ``analysis`` or ``models`` imports the widgets, and ``corpus`` sits
between them. No module of the package imports another module's underscore names: what one module
offers another is public."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).parents[1] / "pycircuits_widgets"


def imported_modules(path: pathlib.Path, *, top_level_only: bool) -> set[str]:
    """Absolute module names ``path`` imports (relative imports resolved)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = parts[:len(parts) - node.level] if node.level else ()
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def layer_files(layer: str):
    return sorted((PACKAGE / "widgets" / layer).glob("*.py"))


@pytest.mark.parametrize("layer, forbidden, top_level_only", [
    ("core", ("views", "sharing"), True),
    ("views", ("sharing",), False),
    ("sharing", ("views",), False),
])
def test_imports_point_one_way(layer, forbidden, top_level_only):
    files = layer_files(layer)
    assert len(files) >= 5
    for path in files:
        bad = [m for m in imported_modules(path, top_level_only=top_level_only)
               if any(m.startswith(f"pycircuits_widgets.widgets.{f}") for f in forbidden)]
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_the_analysis_core_never_imports_the_widgets():
    for path in [*(PACKAGE / "analysis").glob("*.py"), *(PACKAGE / "models").rglob("*.py"), PACKAGE / "factored.py"]:
        bad = [m for m in imported_modules(path, top_level_only=False) if m.startswith("pycircuits_widgets.widgets")
               or m.split(".")[0] in ("anywidget", "ipywidgets", "IPython")]
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_corpus_work_sits_between_the_widgets_and_the_analysis():
    """``corpus/`` imports the analysis and the models, never the widgets; the analysis and the models never
    import ``corpus/`` (views read a sweep, the core never runs one)."""
    files = sorted((PACKAGE / "corpus").glob("*.py"))
    assert len(files) >= 5
    for path in files:
        bad = [m for m in imported_modules(path, top_level_only=False) if m.startswith("pycircuits_widgets.widgets")
               or m.split(".")[0] in ("anywidget", "ipywidgets", "IPython")]
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"
    for path in [*(PACKAGE / "analysis").glob("*.py"), *(PACKAGE / "models").rglob("*.py")]:
        bad = [m for m in imported_modules(path, top_level_only=False) if m.startswith("pycircuits_widgets.corpus")]
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def private_imports(path: pathlib.Path) -> list[str]:
    """``module.name`` for every underscore name ``path`` imports from another module, anywhere in it
    (``from m import _x``, ``import m._x``; dunder modules such as ``__future__`` are not names)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            module = "." * node.level + (node.module or "")
            out += [f"{module}.{alias.name}" for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")]
        elif isinstance(node, ast.Import):
            out += [alias.name for alias in node.names
                    if any(p.startswith("_") and not p.startswith("__") for p in alias.name.split("."))]
    return out


def test_no_module_imports_another_modules_underscore_names():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) >= 50
    bad = {str(path.relative_to(PACKAGE)): names for path in files if (names := private_imports(path))}
    assert not bad, f"underscore names imported across modules: {bad}"
