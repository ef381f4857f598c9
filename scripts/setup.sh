#!/usr/bin/env bash
# Create .venv (if missing) and install omniload-dask into it, with the extras named by
# OMNILOAD_EXTRAS: by default torch, dashboard and images (what the quickstart and the README's
# commands use); scripts/test.sh asks for `test`, which adds the test tools and the training
# frameworks the integrations are tested with. torch is pinned first to the CPU build this
# project is tested with (the package itself asks for torch>=2.3), and the constraint keeps it
# whatever an extra's frameworks ask for.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
EXTRAS="${OMNILOAD_EXTRAS:-torch,dashboard,images}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[$EXTRAS]"
if [[ ",$EXTRAS," == *",test,"* ]]; then
  # torchtitan without its dependencies (its `datasets` pins fsspec below s3fs's); the data
  # loader adapter needs only these of them (spmd_types: its loss module imports it; triton:
  # its model modules import it; tensorboard: its metrics module imports it; the example's
  # config is checked on CPU).
  .venv/bin/python -m pip install -q -c scripts/constraints.txt --no-deps "torchtitan>=0.2,<0.4"
  .venv/bin/python -m pip install -q -c scripts/constraints.txt "torchdata>=0.11" tyro dill \
    "spmd_types==0.2.3" "triton>=3.5" tensorboard
fi
