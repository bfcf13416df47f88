#!/usr/bin/env bash
# The whole test suite: installs, checks the code (ruff; the layer rule between packages, import-linter:
# [tool.importlinter] in pyproject.toml; the types of router and deploy, mypy: [tool.mypy]), then runs unit,
# integration and fault tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY="$(bash scripts/python)"
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -c "from importlinter.cli import lint_imports_command; lint_imports_command(['--no-cache'])"  # lint-imports
"$PY" -m mypy
"$PY" -m pytest -q tests "$@"
