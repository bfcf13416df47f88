"""Grammar bombs, deep schemas and multi-MiB prompts against a real router: each gets a 400 naming
the parameter, fast; no process dies or restarts, no block leaks, and a normal client is served,
exact, throughout (a fuzz run of generated grammars, schemas and regexes included)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.oracle import PROMPTS, expected_completion

pytestmark = pytest.mark.integration
MAX_TOKENS = 4
CHAINED = "\n".join(["start: r0"] + [f"r{i}: r{i + 1}" for i in range(2999)] + ['r2999: "a"'])


def deep_schema(levels: int) -> str:
    """A schema of objects nested ``levels`` deep, as JSON text (too deep for json.dumps to write)."""
    return '{"items":' * levels + '{"type":"integer"}' + "}" * levels


BOMBS = [  # (request fields, the parameter the 400 names, what its message says)
    ({"guided_grammar": CHAINED}, "guided_grammar", "3001 rules"),
    ({"structured_outputs": {"grammar": CHAINED}}, "structured_outputs.grammar", "3001 rules"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"anyOf": [{"const": i} for i in range(3000)]}},
            }
        },
        "response_format",
        "3000 alternatives",
    ),
    ({"guided_json": deep_schema(3000)}, "guided_json", "nested too deeply"),
    ({"guided_json": deep_schema(200)}, "guided_json", "levels of nesting"),
    ({"guided_regex": "(" * 40 + "a" + ")" * 40}, "guided_regex", "40 levels of nesting"),
    ({"guided_choice": ["a"] * 600}, "guided_choice", "600 alternatives"),
    ({"guided_regex": "a" * 70000}, "guided_regex", "at most 65536"),
]


class NormalClient:
    """Greedy requests one after another on a thread, each checked against transformers."""

    def __init__(self, target, tiny_model) -> None:
        self.url = f"{target.cluster.router_url}/v1/completions"
        self.expected = expected_completion(tiny_model, PROMPTS[0], MAX_TOKENS)[0]
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self._stop.is_set():
                start = time.monotonic()
                r = http.post(
                    self.url, json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
                )
                self.latencies.append(time.monotonic() - start)
                if r.status_code != 200 or r.json()["choices"][0]["text"] != self.expected:
                    self.failures.append(f"{r.status_code} {r.text[:200]}")

    def __enter__(self) -> NormalClient:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def live_pids(target) -> dict[str, bool]:
    """Whether each process in cluster.json (the launcher rewrites it when it restarts one) still runs."""
    manifest = json.loads((target.cluster.run_dir / "cluster.json").read_text())
    return {p["name"]: Path(f"/proc/{p['pid']}").exists() for p in manifest["processes"]}


def restarts(target) -> int:
    path = target.cluster.run_dir / "restarts.json"
    return len(json.loads(path.read_text())["restarts"]) if path.exists() else 0


def post(target, body: dict, endpoint: str = "completions") -> httpx.Response:
    base = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0}
    if endpoint == "completions":
        base["prompt"] = "x"
    else:
        base["messages"] = [{"role": "user", "content": "x"}]
    return httpx.post(f"{target.cluster.router_url}/v1/{endpoint}", json=base | body, timeout=60)


@pytest.mark.parametrize("fields,param,message", BOMBS)
def test_a_grammar_bomb_is_a_fast_400_naming_the_parameter(target, fields, param, message):
    before = restarts(target)
    for endpoint in ("completions", "chat/completions"):
        start = time.monotonic()
        r = post(target, fields, endpoint)
        elapsed = time.monotonic() - start
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"], error
        assert elapsed < 2.0
    assert restarts(target) == before
    target.cluster.wait_idle(10.0)


def test_a_request_body_nested_thousands_deep_is_a_4xx(target):
    body = (
        '{"model": "tiny", "prompt": "x", "max_tokens": 4, "response_format": {"type": "json_schema", '
        '"json_schema": {"name": "x", "schema": ' + deep_schema(3000) + "}}}"
    )
    r = httpx.post(
        f"{target.cluster.router_url}/v1/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code in (400, 422), r.text[:300]
    assert "error" in r.json()


def test_a_multi_mib_prompt_is_refused_before_tokenizing_while_others_are_served(target, tiny_model):
    huge = "lorem ipsum " * 340_000  # 4.08 MB of text (under the 4 MiB body cap): far more than 4096 tokens
    with NormalClient(target, tiny_model) as normal:
        times = []
        for endpoint, body in (
            ("completions", {"prompt": huge}),
            ("chat/completions", {"messages": [{"role": "user", "content": huge}]}),
        ):
            start = time.monotonic()
            r = httpx.post(
                f"{target.cluster.router_url}/v1/{endpoint}", json={"model": "tiny", "max_tokens": 4} | body, timeout=60
            )
            times.append(time.monotonic() - start)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        deadline = time.monotonic() + 30
        while len(normal.latencies) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the client's progress
    print(f"multi-MiB prompt refused in {max(times) * 1000:.0f} ms; normal client p99 {normal.p99() * 1000:.0f} ms")
    assert max(times) < 1.0 and not normal.failures


def test_an_ambiguous_grammar_with_many_sequences_is_answered_and_takes_nothing_down(target):
    before = restarts(target)
    r = post(target, {"guided_grammar": 'start: e\ne: e e | "a"', "n": 16, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert all(set(c["text"]) <= {"a"} for c in r.json()["choices"])
    assert restarts(target) == before
    target.cluster.wait_idle(10.0)


def _grammars() -> st.SearchStrategy[dict]:
    name = st.sampled_from(["a", "b", "r", "x_1"])
    literal = st.text(alphabet='abc{}[]()|*+?\\"/ .', min_size=1, max_size=6).map(json.dumps)
    lark = st.lists(
        st.tuples(name, st.lists(st.one_of(name, literal), min_size=1, max_size=4)), min_size=1, max_size=6
    ).map(
        lambda rules: (
            "start: "
            + " | ".join(r for r, _ in rules)
            + "\n"
            + "\n".join(f"{r}: {' '.join(body)}" for r, body in rules)
        )
    )
    regex = st.text(alphabet="ab()[]|*+?{}^$.\\0-9,", min_size=0, max_size=40)
    leaf = st.sampled_from(
        [
            {"type": "integer"},
            {"type": "string"},
            {"type": "boolean"},
            {"enum": ["a", 1]},
            {"type": "strinx"},
            {"minimum": "x"},
            {},
        ]
    )
    schema = st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.builds(lambda p: {"type": "object", "properties": p}, st.dictionaries(name, inner, max_size=3)),
            st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, max_size=4)),
            st.builds(lambda x: {"type": "array", "items": x}, inner),
        ),
        max_leaves=12,
    )
    return st.one_of(
        lark.map(lambda g: {"guided_grammar": g}),
        st.text(max_size=60).map(lambda g: {"structured_outputs": {"grammar": g}}),
        regex.map(lambda r: {"guided_regex": r}),
        schema.map(lambda s: {"guided_json": s}),
        schema.map(lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": s}}}),
        st.lists(st.text(max_size=4), max_size=5).map(lambda c: {"guided_choice": c}),
    )


def test_generated_grammars_schemas_and_regexes_never_get_a_5xx(target, tiny_model):
    before = restarts(target)
    assert all(live_pids(target).values())
    statuses: dict[int, int] = {}

    @settings(
        max_examples=60,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(_grammars())
    def one(fields):
        r = post(target, fields)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400), (fields, r.status_code, r.text[:300])

    with NormalClient(target, tiny_model) as normal:
        one()
    print(f"fuzz statuses {statuses}; normal client {len(normal.latencies)} requests, p99 {normal.p99() * 1000:.0f} ms")
    assert not normal.failures and normal.latencies
    assert restarts(target) == before and all(live_pids(target).values()), live_pids(target)
    target.cluster.wait_idle(10.0)
    blocks = target.cluster.blocks()
    assert all(b["free"] == b["total"] for b in blocks.values()), blocks
