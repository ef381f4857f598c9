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
.venv/bin/python -m pip install -q -e ".[test]"
# MosaicML Streaming (its MDSWriter writes the MDS test corpora) pins old numpy and torch:
# installed without its dependencies beside the benchmarks, as they use it
PYTHON=.venv/bin/python benchmarks/setup-thirdparty.sh
