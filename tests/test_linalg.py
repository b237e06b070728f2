"""The package's one door to LAPACK (``pycircuits_widgets.linalg``): NaN/inf is refused before any
LAPACK routine runs, so no analysis can kill the process on Intel oneMKL (which aborts on such input
where AMD hosts return NaN), and no other module calls LAPACK itself."""

import ast
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import pycircuits_widgets
from pycircuits_widgets import linalg
from pycircuits_widgets.analysis.finite import NonFiniteError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pycircuits_widgets"

# Intel oneMKL on non-finite input: "Parameter 3 was incorrect on entry to SGEBAL", then SIGSEGV/SIGABRT.
# This host may be an AMD one, where LAPACK returns NaN instead, so a child process installs this
# stand-in first: every LAPACK entry point of torch.linalg aborts the process when handed NaN/inf,
# and otherwise runs as usual. A child that survives it never handed LAPACK a non-finite matrix.
ONEMKL_LIKE = """
import os, torch
def _aborting(fn, spectral=lambda args, kwargs: True):
    def call(x, *args, **kwargs):
        if spectral(args, kwargs) and not bool(torch.isfinite(x).all()):
            os.abort()
        return fn(x, *args, **kwargs)
    return call
for _name in ("eig", "eigvals", "eigh", "eigvalsh", "svd", "svdvals", "qr", "cholesky", "cholesky_ex", "inv",
              "inv_ex", "pinv", "solve", "solve_ex", "lstsq", "det", "slogdet", "matrix_rank", "lu_factor", "cond"):
    setattr(torch.linalg, _name, _aborting(getattr(torch.linalg, _name)))
# matrix_norm is LAPACK only for the spectral and nuclear norms (ord 2, -2, 'nuc'); 'fro' is a reduction
torch.linalg.matrix_norm = _aborting(torch.linalg.matrix_norm,
                                     lambda args, kwargs: kwargs.get("ord", args[0] if args else "fro") in (2, -2, "nuc"))
"""


def child(code: str) -> subprocess.CompletedProcess:
    """``code`` run after ``ONEMKL_LIKE`` in a fresh Python, with this checkout and tests/ importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run([sys.executable, "-c", ONEMKL_LIKE + code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


def test_the_onemkl_stand_in_kills_the_raw_call():
    # the control: without the guard the minimal input dies in the child, as on Intel
    run = child('torch.linalg.eigvals(torch.full((64, 64), float("inf")))\nprint("survived")')
    assert run.returncode == -signal.SIGABRT and "survived" not in run.stdout


def test_the_crashing_inputs_are_refused_before_lapack_in_a_child_process():
    run = child("""
from random_models import paper_model
from pycircuits_widgets import linalg
from pycircuits_widgets.analysis import composition_detail
from pycircuits_widgets.analysis.induction import k_composition_positivity
for attempt in (
    lambda: linalg.eigvals(torch.full((64, 64), float("inf")), "the issue's 64 x 64 inf matrix"),
    # tests/test_non_finite.py's case: W_E * 1e30, whose token Gram W_E^T W_E ~ 1e60 overflows float32
    lambda: composition_detail(_model, "K", (0, 0), (1, 0)),
    lambda: k_composition_positivity(_model),
):
    _model = paper_model(dtype=torch.float32)
    _model.W_E = _model.W_E * 1e30
    try:
        attempt()
        print("no error")
    except Exception as err:
        print(type(err).__name__, "|", err)
""")
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("NonFiniteError | ") for line in lines), run.stdout
    assert "the issue's 64 x 64 inf matrix (64, 64) is not finite (4096 NaN/inf of 4096 entries): eigvals was not run" in lines[0]
    assert "the eigenvalues of the K-composition token circuit of (0, 0) -> (1, 0) are not finite" in lines[1]
    assert "K-composition token circuits' eigenvalues are not finite" in lines[2]
    assert all("overflows torch.float32" in line for line in lines[1:])


def test_every_non_finite_case_of_the_suite_survives_a_onemkl_like_lapack():
    # tests/test_non_finite.py whole, under the stand-in: each refusal happens before LAPACK
    run = child("import sys, pytest\n"
                "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_non_finite.py']))")
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


# ------------------------------------------------------------------ the guarded routines in process
SQUARE = torch.randn(5, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
ROUTINES = {
    "eigvals": lambda x: linalg.eigvals(x, "M"),
    "eigh": lambda x: linalg.eigh(x + x.mT, "M"),
    "cholesky": lambda x: linalg.cholesky_ex(x @ x.mT, "M"),
    "qr": lambda x: linalg.qr_r(x, "M"),
    "svd": lambda x: linalg.svd(x, "M"),
    "the spectral norm's svd": lambda x: linalg.spectral_norm(x, "M"),
}


@pytest.mark.parametrize("routine", ROUTINES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_each_routine_refuses_nan_and_inf_naming_the_matrix(routine, bad):
    x = SQUARE.clone()
    x[2, 3] = bad
    with pytest.raises(NonFiniteError, match=rf"^M \(5, 5\) is not finite \(\d+ NaN/inf of 25 entries\): {routine} was not run"):
        ROUTINES[routine](x)


def test_each_routine_matches_torch_on_finite_input():
    # oracle: the same LAPACK routine called directly (the guard must not change an answer): the same call
    # on the same float64 tensor (the guard passes it on as is), so the same bits
    torch.testing.assert_close(linalg.eigvals(SQUARE, "M"), torch.linalg.eigvals(SQUARE), rtol=0, atol=0)
    sym = SQUARE + SQUARE.mT
    for ours, theirs in zip(linalg.eigh(sym, "M"), torch.linalg.eigh(sym)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    torch.testing.assert_close(linalg.qr_r(SQUARE, "M"), torch.linalg.qr(SQUARE, mode="r").R, rtol=0, atol=0)
    torch.testing.assert_close(linalg.spectral_norm(SQUARE, "M"), torch.linalg.matrix_norm(SQUARE, 2), rtol=0, atol=0)
    U, S, Vh = linalg.svd(SQUARE[:, :3], "M")
    assert U.shape == (5, 3) and S.shape == (3,) and Vh.shape == (3, 3)  # thin


def test_16_bit_input_runs_in_float32_and_meta_only_carries_shapes():
    assert linalg.eigvals(SQUARE.to(torch.bfloat16), "M").dtype == torch.complex64
    assert linalg.svd(SQUARE.half(), "M")[1].dtype == torch.float32
    assert linalg.qr_r(torch.empty(4, 7, 3, device="meta"), "M").shape == (4, 3, 3)


def test_non_finite_error_is_one_class_importable_from_each_place():
    assert pycircuits_widgets.NonFiniteError is linalg.NonFiniteError is NonFiniteError
    assert issubclass(NonFiniteError, ValueError)


@pytest.mark.parametrize("batch", [(7,), (2, 3), (1,)])
def test_eigvals_splits_a_batch_over_threads_and_keeps_every_matrix_in_place(batch):
    """linalg.eigvals runs chunks of the batch in threads: each matrix's spectrum must come
    back at its own index (oracle: numpy's eigvals of each matrix alone)."""
    x = torch.randn(*batch, 20, 20, generator=torch.Generator().manual_seed(len(batch)), dtype=torch.float64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = linalg.eigvals(x, "M")
    finally:
        torch.set_num_threads(threads)
    assert got.shape == (*batch, 20)
    flat = x.reshape(-1, 20, 20).numpy()
    for i, row in enumerate(got.reshape(-1, 20).numpy()):
        # float64, two LAPACKs: backward errors factorization_tol(20, ||x||, float64) ~ 6e-12, 1e-10 leaves
        # the eigenvalues of these Gaussian matrices a condition number of ~15
        np.testing.assert_allclose(np.sort_complex(row), np.sort_complex(np.linalg.eigvals(flat[i])), rtol=1e-10,
                                   atol=1e-10)


# ------------------------------------------------------------------ no LAPACK call outside linalg.py
LINALG_LAPACK = {
    "cholesky", "cholesky_ex", "cond", "det", "eig", "eigh", "eigvals", "eigvalsh", "householder_product", "inv",
    "inv_ex", "ldl_factor", "ldl_factor_ex", "ldl_solve", "lstsq", "lu", "lu_factor", "lu_factor_ex", "lu_solve",
    "matrix_rank", "pinv", "qr", "slogdet", "solve", "solve_ex", "solve_triangular", "svd", "svdvals",
    "tensorinv", "tensorsolve",
}
TORCH_LAPACK = {
    "cholesky", "cholesky_inverse", "cholesky_solve", "det", "geqrf", "inverse", "linalg_solve", "logdet",
    "lobpcg", "lstsq", "lu", "lu_solve", "ormqr", "pca_lowrank", "pinverse", "qr", "slogdet", "svd",
    "svd_lowrank", "symeig", "triangular_solve", "eig",
}
TENSOR_LAPACK = {  # Tensor methods (any ``x.svd()``: the package's own FactoredMatrix.svd is not called by name)
    "cholesky", "cholesky_inverse", "cholesky_solve", "det", "eig", "geqrf", "inverse", "logdet", "lstsq", "lu",
    "lu_solve", "ormqr", "pinverse", "qr", "slogdet", "svd", "symeig", "triangular_solve",
}
SPECTRAL_ORDS = (2, -2, "nuc")


def _literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def lapack_calls(source: str, filename: str) -> list[str]:
    """``file:line: call`` for each LAPACK call in ``source`` not made through ``pycircuits_widgets.linalg``."""
    tree = ast.parse(source, filename)
    torch_names, linalg_names, found = set(), set(), []
    for node in ast.walk(tree):  # the names torch and torch.linalg are bound to in this file
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or (alias.name.startswith("torch.") and alias.asname is None):
                    torch_names.add(alias.asname or "torch")
                elif alias.name == "torch.linalg":
                    linalg_names.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.linalg"):
            for alias in node.names:
                if node.module == "torch" and alias.name == "linalg":
                    linalg_names.add(alias.asname or "linalg")
                elif alias.name in (TORCH_LAPACK if node.module == "torch" else LINALG_LAPACK | {"matrix_norm", "norm"}):
                    found.append(f"{filename}:{node.lineno}: from {node.module} import {alias.name}")

    def origin(expr) -> str | None:
        """'torch' or 'torch.linalg' if ``expr`` names that module here."""
        if isinstance(expr, ast.Name):
            return "torch" if expr.id in torch_names else "torch.linalg" if expr.id in linalg_names else None
        if isinstance(expr, ast.Attribute) and expr.attr == "linalg" and origin(expr.value) == "torch":
            return "torch.linalg"
        return None

    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, module = node.func.attr, origin(node.func.value)
        where = f"{filename}:{node.lineno}: {ast.unparse(node.func)}(...)"
        if module == "torch.linalg":
            ord_arg = next((k.value for k in node.keywords if k.arg == "ord"), node.args[1] if len(node.args) > 1 else None)
            spectral = name in ("matrix_norm", "norm") and ord_arg is not None and _literal(ord_arg) in SPECTRAL_ORDS
            if name in LINALG_LAPACK or spectral:
                found.append(where)
        elif module == "torch":
            if name in TORCH_LAPACK:
                found.append(where)
        elif name in TENSOR_LAPACK and not (isinstance(node.func.value, ast.Name) and node.func.value.id == "linalg"):
            found.append(where)  # a method call on a tensor (``linalg`` here is pycircuits_widgets.linalg)
        elif name == "norm" and any(_literal(k.value) == "nuc" for k in node.keywords if k.arg == "p"):
            found.append(where)
    return found


def test_the_scan_finds_each_form_of_a_lapack_call():
    # the scanner itself can fail: each line below is a LAPACK call it must report, in that order
    source = "import torch\nimport torch as T\nfrom torch import linalg as LA\nfrom torch.linalg import svd\ntorch.linalg.eigvals(x)\nT.linalg.cholesky_ex(x)\nLA.qr(x, mode='r')\ntorch.linalg.matrix_norm(x, 2)\ntorch.linalg.matrix_norm(x, ord='nuc')\ntorch.svd_lowrank(x)\nx.svd()\n(a @ b).inverse()\nx.norm(p='nuc')\ntorch.linalg.matrix_norm(x)\ntorch.linalg.vector_norm(x, 2)\ntorch.linalg.norm(x)\nlinalg.svd(x, 'M')\nfm.norm()"
    lines = sorted(int(f.split(":")[1]) for f in lapack_calls(source, "example.py"))
    assert lines == list(range(4, 14))


def test_no_lapack_call_outside_the_guarded_module():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != PACKAGE / "linalg.py":
            found += lapack_calls(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "LAPACK called outside pycircuits_widgets/linalg.py (route it through linalg):\n" + "\n".join(found)
