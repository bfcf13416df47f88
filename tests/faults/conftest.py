"""Fault tests: the matrix's per-cell counts are collected here, written as a
markdown table and JSON under the session's tmp dir and printed at the end."""

from __future__ import annotations

import json

import pytest

from tests.faults.client import MAX_TOKENS, PROMPTS
from tests.support.oracle import expected_completion

RESULTS = pytest.StashKey[list]()
FOLDER = pytest.StashKey[object]()
COLUMNS = (
    "layout",
    "fault",
    "stage",
    "requests",
    "correct",
    "clear_errors",
    "left",
    "wrong",
    "leaked_blocks",
    "router_ok",
    "seconds",
    "evidence",
)


def pytest_configure(config) -> None:
    config.stash[RESULTS] = []


@pytest.fixture(scope="session")
def matrix(pytestconfig, tmp_path_factory) -> list[dict]:
    """Append one row per cell."""
    pytestconfig.stash[FOLDER] = tmp_path_factory.mktemp("fault-matrix", numbered=False)
    return pytestconfig.stash[RESULTS]


@pytest.fixture(scope="session")
def expected(tiny_model) -> dict[str, str]:
    """Prompt -> transformers' greedy completion."""
    return {p: expected_completion(tiny_model, p, MAX_TOKENS)[0] for p in PROMPTS}


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    totals = {
        c: sum(r[c] for r in rows) for c in ("requests", "correct", "clear_errors", "left", "wrong", "leaked_blocks")
    }
    lines.append(f"\n{len(rows)} cells; totals: " + ", ".join(f"{k} {v}" for k, v in totals.items()))
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter, config) -> None:
    rows = config.stash.get(RESULTS, [])
    if not rows:
        return
    folder = config.stash[FOLDER]
    table = markdown(rows)
    (folder / "matrix.md").write_text(table + "\n")
    (folder / "matrix.json").write_text(json.dumps(rows, indent=1) + "\n")
    terminalreporter.write_sep("=", f"fault matrix (also in {folder})")
    terminalreporter.write_line(table)
