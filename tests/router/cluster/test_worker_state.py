"""The router's Worker has one owner: its state changes only through its own methods."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from router.cluster.registry import Worker

ROUTER = Path(__file__).resolve().parents[3] / "router"
STATE = {f.name for f in dataclasses.fields(Worker)} - {"name", "role", "url", "max_inflight", "discovered"}


def direct_writes(source: str) -> list[str]:
    """Assignments to a Worker state field on anything but ``self`` (line: target)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for t in targets:
            if (
                isinstance(t, ast.Attribute)
                and t.attr in STATE
                and not (isinstance(t.value, ast.Name) and t.value.id == "self")
            ):
                found.append(f"{t.lineno}: {ast.unparse(t)}")
    return found


def test_no_router_module_writes_a_workers_state_field_directly():
    writes = {str(p.relative_to(ROUTER.parent)): direct_writes(p.read_text()) for p in sorted(ROUTER.rglob("*.py"))}
    assert {path: w for path, w in writes.items() if w} == {}


def test_the_check_sees_direct_writes():
    source = (
        "def f(worker, slot):\n    worker.inflight += 1\n    slot.worker.healthy = False\n    self.draining = True\n"
    )
    assert direct_writes(source) == ["2: worker.inflight", "3: slot.worker.healthy"]
