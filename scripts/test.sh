#!/usr/bin/env bash
# The whole test suite: installs, checks the code (ruff; the layer rule between packages, import-linter:
# [tool.importlinter] in pyproject.toml; the types of router and deploy, mypy: [tool.mypy]), then runs unit,
# integration and fault tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check .
lint-imports --no-cache
python3 -m mypy
python3 -m pytest -q tests "$@"
