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
.venv/bin/ruff check pycircuits_widgets

echo "== Python, browser and end-to-end tests (pytest)"
.venv/bin/python -m pytest "$@"

if [ $# -eq 0 ]; then
  # oneDNN picks its int8 kernel by CPU: on AVX2-only CPUs (no VNNI/AMX) its 16-bit pair sums
  # saturate, and the screen's probe must choose int8-narrow. Capping oneDNN at AVX2 runs that
  # branch on every host, so the exact top-k routes are proven on both kinds of CPU.
  echo "== exact top-k tests again on oneDNN's AVX2 kernels (ONEDNN_MAX_CPU_ISA=AVX2)"
  ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python -m pytest -q tests/test_screen.py tests/test_factored.py tests/test_skip_trigrams.py
fi
