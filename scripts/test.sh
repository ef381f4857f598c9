#!/usr/bin/env bash
# Set up (scripts/setup.sh; Chromium for the dashboard's browser test where apt is available;
# the benchmarks' third-party files, benchmarks/setup-thirdparty.sh: two tokenizer tests read
# them, MosaicML Streaming writes the MDS test corpora), lint and type-check the package (ruff, mypy), then run the whole test suite. Extra
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/setup-browser.sh || echo "test.sh: no Chromium; the dashboard's browser test will skip" >&2
if [ ! -d benchmarks/.thirdparty/mistral_common ] || [ ! -d benchmarks/.thirdparty/streaming ]; then
  PYTHON="$PWD/.venv/bin/python" benchmarks/setup-thirdparty.sh
fi
.venv/bin/ruff check omniload_dask tests benchmarks examples scripts
.venv/bin/ruff format --check omniload_dask tests benchmarks examples scripts
.venv/bin/mypy omniload_dask
.venv/bin/python -m pytest "$@"
