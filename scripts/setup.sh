#!/usr/bin/env bash
# Create .venv (if missing) and install omniload-dask with its test tools into it.
# torch is pinned first to the CPU build this project is tested with; the package itself only
# asks for torch>=2.3.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# The constraint keeps that torch whatever the test extra's frameworks ask for.
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[test]"
# torchtitan without its dependencies (its `datasets` pins fsspec below s3fs's); the data loader
# adapter needs only these of them.
.venv/bin/python -m pip install -q -c scripts/constraints.txt --no-deps "torchtitan>=0.2,<0.4"
.venv/bin/python -m pip install -q -c scripts/constraints.txt "torchdata>=0.11" tyro dill
