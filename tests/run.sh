#!/usr/bin/env bash
# The README's test command: installs what the tests need on a fresh machine and runs
# every tier (JS unit tests, Python tests, browser tests, notebooks, live Jupyter).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v chromium >/dev/null 2>&1; then
  echo "== installing Debian's chromium (browser tests drive it through Playwright)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi

echo "== Python environment (.venv)"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU wheel of torch first: a bare `torch` requirement can pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
# Builds the front end too (npm install + vite build, through hatch-jupyter-builder).
.venv/bin/python -m pip install -q -e ".[test]"

echo "== JS unit tests (vitest)"
(cd js && npm ci --no-audit --no-fund --loglevel=error && npx vitest run)

echo "== lint (ruff, configured in pyproject.toml)"
.venv/bin/ruff check pycircuits_widgets tests benchmarks scripts

echo "== Python, browser and end-to-end tests (pytest)"
.venv/bin/python -m pytest "$@"

if [ $# -eq 0 ]; then
  # oneDNN picks its kernels by CPU, and the screen picks its route by timing them (pycircuits_widgets/screen.py).
  # Capping oneDNN's ISA runs an older CPU kind's kernels on a newer host, so the exact top-k routes are
  # proven there too: AVX2 (no VNNI: int8 pair sums saturate, only the narrow routes are exact) on every
  # x86 host, and AVX-512 VNNI without AMX (the quantised linear on its reference kernel) where the host
  # has AMX, the one kind whose own kernels differ from it.
  isas=(AVX2)
  grep -qw amx_tile /proc/cpuinfo 2>/dev/null && isas+=(AVX512_CORE_VNNI)
  for isa in "${isas[@]}"; do
    echo "== exact top-k tests again on oneDNN's $isa kernels (ONEDNN_MAX_CPU_ISA=$isa)"
    ONEDNN_MAX_CPU_ISA=$isa .venv/bin/python -m pytest -q tests/test_screen.py tests/test_factored.py tests/test_skip_trigrams.py
  done
fi
