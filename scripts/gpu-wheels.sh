#!/usr/bin/env bash
# Downloads into .whl/ (ignored by git) the wheels scripts/gpu-check.sh needs on a leased GPU machine that
# has no package registry: what pdserve's servers, router and launcher import beyond the machine's own
# torch, Triton, transformers, tokenizers, safetensors, httpx and uvloop. NIXL (hundreds of MB) is left
# out: the check's clusters use the ZeroMQ transfer. The device carries at most 64 MiB of working tree
# and carried files together; this bundle is about 10 MB.
#
#   bash scripts/gpu-wheels.sh [--python-version 3.12]     # then carry .whl to the device
set -euo pipefail
cd "$(dirname "$0")/.."
version=3.12
if [ "${1:-}" = --python-version ]; then
    version="$2"
elif [ -n "${1:-}" ]; then
    echo "usage: bash scripts/gpu-wheels.sh [--python-version X.Y]   (default 3.12, the device's Python)" >&2
    exit 2
fi
abi="cp${version/./}"
rm -rf .whl
mkdir -p .whl
python3 -m pip download -q --disable-pip-version-check --only-binary=:all: -d .whl \
    --python-version "$version" --implementation cp --abi "$abi" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 --platform any \
    fastapi uvicorn httptools pydantic pyzmq msgspec llguidance prometheus-client orjson pyyaml psutil \
    opentelemetry-api
echo "scripts/gpu-wheels.sh: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (Python $version)"
