"""The router's grammar sandbox (router/api/grammar_check.py): a compile that crashes the compiler or runs
past its time is a 400 and costs only the child process, which the next check starts again."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from engine.request import StructuredSpec
from router.api.grammar_check import GrammarChecker
from router.errors import OpenAIError
from router.settings import CompileSandbox

# 3000 chained rules overflow the compiler's native stack (SIGSEGV): check_bounds refuses them first
# in the router, so only a direct check reaches the compiler with them.
CHAINED = "\n".join(["start: r0"] + [f"r{i}: r{i + 1}" for i in range(2999)] + ['r2999: "a"'])
SMALL = StructuredSpec(kind="lark", value='start: "a" | "b"')


def check(checker: GrammarChecker, spec: StructuredSpec) -> OpenAIError | None:
    try:
        asyncio.run(checker.check("guided_grammar", spec))
    except OpenAIError as exc:
        return exc
    return None


@pytest.fixture
def checker():
    c = GrammarChecker()
    c.start()
    yield c
    c.close()


def test_a_grammar_that_crashes_the_compiler_is_a_400_and_the_next_one_compiles(checker):
    first = checker._child.pid
    exc = check(checker, StructuredSpec(kind="lark", value=CHAINED))
    assert exc.status == 400 and exc.param == "guided_grammar"
    assert "crashed the grammar compiler" in exc.message
    assert checker.crashes == 1
    assert check(checker, SMALL) is None
    assert checker._child.pid != first and os.getpid() != checker._child.pid


def test_a_compile_past_the_timeout_is_a_400_and_its_process_is_killed():
    schema = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(1500)]}
    c = GrammarChecker(CompileSandbox(timeout_s=0.001))
    c.start()
    try:
        slow = c._child
        exc = check(c, StructuredSpec(kind="json_schema", value=json.dumps(schema)))
        assert exc.status == 400 and "took longer than 0.001 s" in exc.message
        assert slow.poll() is not None and c.crashes == 1
    finally:
        c.close()


def test_a_bad_grammar_is_the_compilers_message_and_costs_no_restart(checker):
    pid = checker._child.pid
    exc = check(checker, StructuredSpec(kind="regex", value="a("))
    assert exc.status == 400 and exc.message.startswith("guided_grammar: the regular expression does not compile")
    assert checker.crashes == 0 and checker._child.pid == pid


def children() -> set[int]:
    ours = str(os.getpid())
    found = set()
    for task in os.listdir("/proc"):
        try:
            with open(f"/proc/{task}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue
        if ppid == ours:
            found.add(int(task))
    return found


def test_the_sandbox_is_one_child_the_checker_stops_and_one_that_ends_when_its_router_goes():
    before = children()
    c = GrammarChecker()
    c.start()
    try:
        assert children() - before == {c._child.pid}  # no helper process beside it (a resource tracker)
        assert check(c, SMALL) is None
    finally:
        c.close()
    assert children() == before
    c.start()
    child = c._child
    c._conn.close()  # what the child sees when its router dies: the end of its socket
    assert child.wait(timeout=30) == 0
    c._conn = None
    c.close()
    assert children() == before


ENGINE_COMPILES = """
import sys
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.request import StructuredSpec
from server_common.engine_thread import EngineThread

path, rules = sys.argv[1], int(sys.argv[2])
grammar = "\\n".join(["start: r0"] + [f"r{i}: r{i + 1}" for i in range(rules - 2)] + [f'r{rules - 2}: "a"'])
engine = LLMEngine(EngineConfig(model=path, num_threads=1, num_blocks=16, block_size=4))
thread = EngineThread(engine, lambda e, outputs: None, "t")
thread.start()
sampling = SamplingParams(max_tokens=1, temperature=0, structured=StructuredSpec("lark", grammar))
thread.call(lambda e: e.add_request("r", [5, 6, 7], sampling)).result(120)
thread.stop()
print("compiled")
"""


def test_the_engine_thread_compiles_a_grammar_at_the_ceiling_whatever_the_hosts_stack_limit(tiny_model):
    # The servers compile what the router let through on their engine thread, up to GRAMMAR_CEILING's
    # chained rules; with a thread stack inherited from `ulimit -s 1024` that compile is a SIGSEGV.
    import subprocess
    import sys

    from engine.structured import GRAMMAR_CEILING
    from tests.support.cluster import REPO

    run = subprocess.run(
        [
            "bash",
            "-c",
            'ulimit -s 1024 && exec "$0" -c "$1" "$2" "$3"',
            sys.executable,
            ENGINE_COMPILES,
            tiny_model,
            str(GRAMMAR_CEILING.max_rules),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert (run.returncode, run.stdout.strip().splitlines()[-1:]) == (0, ["compiled"]), run.stderr[-2000:]
