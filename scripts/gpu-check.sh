#!/usr/bin/env bash
# One prepared run for a leased GPU (bench/gpu_check.py says what it checks): the CUDA oracle, memory
# bandwidth, engine speed (Triton against torch against transformers), a colocated and a 1P1D cluster over
# ZeroMQ, and TP 2 where two GPUs are present. It prints a table last and writes OUT/gpu-check.json
# ($OUT on the device machine, else --out, else runs/gpu-check).
#
#   bash scripts/gpu-wheels.sh                 # here, once: the wheels the device lacks, into .whl/
#   bash scripts/gpu-check.sh                  # on the device (no package registry there)
#   bash scripts/gpu-check.sh --device cpu     # anywhere: the same parts, small (CI runs it)
#
# With .whl/ present it installs nothing from the network: a virtual environment over the machine's own
# Python (its torch, Triton and transformers) takes the wheels with --no-index. Without .whl/ it runs on
# the Python scripts/python names (scripts/install.sh's).
set -euo pipefail
cd "$(dirname "$0")/.."
case " $* " in
    *" -h "* | *" --help "*) exec "$(bash scripts/python)" -m bench.gpu_check --help ;;
esac
if [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then
    venv="${TMPDIR:-/tmp}/pdserve-gpu-venv"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv --system-site-packages "$venv"
        "$venv/bin/python" -m pip install -q --no-index --find-links .whl .whl/*.whl
    fi
    PY="$venv/bin/python"
else
    PY="$(bash scripts/python)"
fi
exec "$PY" -m bench.gpu_check "$@"
