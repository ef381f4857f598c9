#!/usr/bin/env bash
# Set up (scripts/setup.sh), write the demo data, and run the quickstart plan on an embedded
# LocalCluster with 4 simulated trainer ranks. Extra arguments go to `omniload run`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/omniload run plans/quickstart.yaml --make-demo-data "$@"
echo "The README's next commands run in the environment this made: source .venv/bin/activate" >&2
