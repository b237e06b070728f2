"""Every script in benchmarks/ runs as documented: ``--help`` prints its options (and runs nothing),
and ``--smoke``, its smallest size, runs end to end.

Each script runs in its own subprocess from the repository root, as its docstring says to run it.
The runs share one pool of ``PARALLEL`` processes (the smoke runs are mostly interpreter and library
start-up, so two cores take them two at a time); each test then reads its script's result. A smoke
run's numbers mean nothing: only that the script finished and printed its table is checked.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
PARALLEL = 2
TIMEOUT_S = 300  # a safety net for a hung run, not a speed check (benchmarks/README.md has the speeds)

# Each smoke run has its own limit (TIMEOUT_S, naming the script); the suite's per-test limit would
# otherwise count the shared fixture's whole pool of runs against the first test that asks for it.
pytestmark = pytest.mark.timeout(func_only=True)

NEEDS = {
    "bench_analysis": ("transformer_lens",),
    "bench_attention": ("circuitsvis", "playwright"),
    "bench_bf16_accuracy": ("transformers",),
    "bench_build": ("transformers",),
    "bench_busy_kernel": ("transformers",),
    "bench_click": ("transformers",),
    "bench_contention": ("transformers",),
    "bench_sections": ("transformers",),
    "bench_composition": ("transformer_lens",),
    "bench_examples": ("pyarrow",),
    "bench_explorer": ("jupyterlab", "playwright"),
    "bench_factored": ("transformer_lens",),
    "bench_give_way": ("transformers",),
    "bench_interventions": ("transformers",),
    "bench_patching": ("transformer_lens",),
    "bench_roundtrip": ("jupyterlab", "playwright"),
    "bench_safetensors": ("safetensors", "transformers"),
    "bench_sharing": ("nbclient",),
    "bench_sweep": ("transformer_lens", "pyarrow"),
    "bench_trigram_counts": ("pyarrow",),
    "bench_verify": ("transformers",),
}
"""The optional packages (the ``bench`` and ``test`` extras) each script's smoke run imports."""


def missing(script: str) -> list[str]:
    return [name for name in NEEDS.get(script, ()) if importlib.util.find_spec(name) is None]


def smoke_args(script: str, tmp: pathlib.Path) -> list[str]:
    """``--smoke`` plus where a script would otherwise write outside ``tmp``."""
    extra = {"bench_safetensors": ["--dir", str(tmp / "checkpoint")], "bench_sweep": ["--save", str(tmp / "sweep.json")]}
    return ["--smoke", *extra.get(script, [])]


def run(script: str, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PCW_PROGRESS": "0", "HF_HUB_OFFLINE": "1"}
    try:
        return subprocess.run([sys.executable, str(BENCHMARKS / f"{script}.py"), *args], check=False, cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(e.cmd, -1, e.stdout or "", f"{script} {' '.join(args)} hung: killed after "
                                                                     f"{TIMEOUT_S} s (TIMEOUT_S)")


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    """``{(script, "help" | "smoke"): CompletedProcess}`` of the scripts whose tests were selected (``-k``);
    the help runs first (each is an interpreter start)."""
    selected = {item.callspec.params["script"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    scripts = [s for s in SCRIPTS if s in selected]
    jobs = [(s, "help", ["--help"]) for s in scripts]
    jobs += [(s, "smoke", smoke_args(s, tmp_path_factory.mktemp(s))) for s in scripts if not missing(s)]
    with ThreadPoolExecutor(PARALLEL) as pool:
        futures = {(s, kind): pool.submit(run, s, args) for s, kind, args in jobs}
        return {key: f.result() for key, f in futures.items()}


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_describes_the_options_and_runs_nothing(results, script):
    proc = results[script, "help"]
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.startswith("usage:"), f"{script} --help did not print argparse's help:\n{explain(proc)}"
    assert "--smoke" in proc.stdout, f"{script} --help names no --smoke option"


@pytest.mark.parametrize("script", SCRIPTS)
def test_smallest_size_runs(results, script):
    absent = missing(script)
    if absent:
        pytest.skip(f"{script} needs {', '.join(absent)} (the bench extra: pip install -e '.[bench]')")
    proc = results[script, "smoke"]
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.strip(), f"{script} --smoke printed no table:\n{explain(proc)}"


def test_every_script_is_listed():
    """Every script NEEDS names exists (a renamed benchmark keeps its skip reason)."""
    assert set(NEEDS) <= set(SCRIPTS), sorted(set(NEEDS) - set(SCRIPTS))
