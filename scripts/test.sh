#!/usr/bin/env bash
# Set up (scripts/setup.sh; Chromium for the dashboard's browser test where apt is available)
# and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/setup-browser.sh || echo "test.sh: no Chromium; the dashboard's browser test will skip" >&2
.venv/bin/python -m pytest "$@"
