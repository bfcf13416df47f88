#!/usr/bin/env bash
# The whole test suite: installs, then runs unit, integration and fault tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m pytest -q tests "$@"
