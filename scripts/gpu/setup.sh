#!/usr/bin/env bash
# On a GPU machine with torch and no network: install the wheels carried in .whl/ (dask,
# distributed and what they and the torchtitan adapter need that such an image lacks; see
# docs/guides/trainers.md) into /tmp/site, and make the demo data. Source it:
#   source scripts/gpu/setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d plans/demo-data ] || python3 -m omniload_dask.cli demo-data plans/demo-data >/dev/null
