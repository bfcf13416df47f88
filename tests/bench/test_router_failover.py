"""bench/micro/router_failover.py's pure parts, no cluster: the SSE reading, the seam check that counts
lost and duplicated events, the summaries and the table, the generated config, the command line."""

from __future__ import annotations

import pytest

from bench.micro import router_failover as rf
from deploy.config import load_config


def events(*seqs: int, close: bool = True) -> list[dict]:
    """Deltas with these sequence numbers, the last one a ``response.completed`` when ``close``."""
    out = [{"type": "response.output_text.delta", "sequence_number": s, "delta": f"<{s}>"} for s in seqs]
    if close and out:
        out[-1] = {"type": "response.completed", "sequence_number": seqs[-1]}
    return out


def test_sse_events_are_the_data_lines_up_to_done():
    lines = [
        "event: response.created",
        'data: {"type": "response.created", "sequence_number": 0}',
        "",
        ": a comment",
        'data:{"sequence_number": 1}',
        "data: [DONE]",
        'data: {"sequence_number": 2}',
    ]
    assert list(rf.sse_events(lines)) == [{"type": "response.created", "sequence_number": 0}, {"sequence_number": 1}]


def test_a_whole_stream_has_nothing_lost_or_duplicated():
    assert rf.check_sequence(events(0, 1, 2, 3)) == rf.SeamCheck(lost=0, duplicated=0, in_order=True, closed=True)


def test_the_seam_check_counts_a_gap_as_lost_and_a_repeat_as_duplicated():
    assert rf.check_sequence(events(0, 1, 4, 5)) == rf.SeamCheck(lost=2, duplicated=0, in_order=True, closed=True)
    resumed_too_early = events(0, 1, 2, 1, 2, 3)
    assert rf.check_sequence(resumed_too_early) == rf.SeamCheck(lost=0, duplicated=2, in_order=False, closed=True)
    assert rf.check_sequence(events(0, 2, 1, 3)) == rf.SeamCheck(lost=0, duplicated=0, in_order=False, closed=True)


def test_a_stream_without_its_closing_event_is_unclosed_and_losing_its_head_counts():
    assert rf.check_sequence(events(0, 1, 2, close=False)) == rf.SeamCheck(0, 0, True, False)
    assert rf.check_sequence(events(2, 3)) == rf.SeamCheck(lost=2, duplicated=0, in_order=True, closed=True)
    assert rf.check_sequence([]) == rf.SeamCheck(0, 0, True, False)


def test_texts_of_events_and_of_a_response_object():
    assert rf.response_text(events(0, 1, 2)) == "<0><1>"
    response = {
        "output": [
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "no"}]},
            {
                "type": "message",
                "content": [{"type": "output_text", "text": "Par"}, {"type": "output_text", "text": "is"}],
            },
        ]
    }
    assert rf.output_text(response) == "Paris"
    assert rf.output_text({"output": []}) == ""


def test_metric_value_reads_the_unlabelled_sample():
    text = (
        "# HELP pdserve_router_background_adoptions_total Background responses ...\n"
        "# TYPE pdserve_router_background_adoptions_total counter\n"
        "pdserve_router_background_adoptions_total 3.0\n"
        "pdserve_router_background_adoptions_created 1.7e9\n"
    )
    assert rf.metric_value(text, rf.ADOPTIONS) == 3.0
    assert rf.metric_value(text, "pdserve_router_missing_total") is None


def test_the_chat_load_is_split_at_the_kill():
    outcomes = [
        rf.ChatOutcome("ok", 0.0, 5.0),  # before
        rf.ChatOutcome("failed", 8.0, 10.5),  # cut by the kill at 10
        rf.ChatOutcome("ok", 9.0, 11.0),  # in flight on the other router
        rf.ChatOutcome("ok", 10.5, 12.0),
        rf.ChatOutcome("failed", 10.6, 10.7),  # the front not yet told
        rf.ChatOutcome("wrong", 11.0, 13.0),
    ]
    assert rf.summarize_chat(outcomes, 10.0) == {
        "requests": 6,
        "in_flight_at_kill": 2,
        "failed_in_flight_at_kill": 1,
        "begun_after_kill": 3,
        "ok_after_kill": 1,
        "failed_after_kill": 1,
        "failed_total": 2,
        "wrong_texts": 1,
    }


def background(
    response_id: str, before: list[dict], after: list[dict], times: list[float], logged: int, status: str
) -> rf.BackgroundOutcome:
    """What a client read of one response: ``before`` from router-0, ``after`` from router-1 at ``times``."""
    return rf.BackgroundOutcome(response_id, before, list(zip(times, after, strict=True)), logged, status)


def test_background_responses_are_judged_across_the_seam():
    whole = events(0, 1, 2, 3, 4, 5)
    cut = background("a", whole[:2], whole[2:], [11.0, 15.5, 15.6, 15.7], logged=3, status="incomplete")
    doubled = background("b", whole[:3], whole[1:], [11.0, 11.0, 16.0, 16.1, 16.2], logged=3, status="incomplete")
    done = background("c", whole, [], [], logged=6, status="completed")
    refs = [rf.Reference("<0><1><2><3><4>", "incomplete")] * 2 + [rf.Reference("other", "incomplete")]
    summary = rf.summarize_background([cut, doubled, done], refs, killed_at=10.0)
    rows = summary.pop("rows")
    assert summary == {
        "responses": 3,
        "cut_by_kill": 2,
        "lost_events": 0,
        "duplicated_events": 2,
        "out_of_order": 1,
        "unclosed": 0,
        "wrong_texts": 2,  # b's text has <1><2> twice; c's is another
        "statuses": {"incomplete": 2, "completed": 1},
        "statuses_unlike_reference": 1,
        "kill_to_first_new_s": {"min": 5.5, "p50": 5.75, "max": 6.0},
    }
    # The first event router-0 had not logged (sequence number 3): 5.5 s and 6.0 s after the kill.
    assert [r["kill_to_first_new_s"] for r in rows] == [5.5, 6.0, None]
    assert [r["text_ok"] for r in rows] == [True, False, False]


def report() -> dict:
    chat = rf.summarize_chat([rf.ChatOutcome("failed", 0.0, 2.0), rf.ChatOutcome("ok", 2.0, 3.0)], 1.0)
    whole = events(0, 1, 2)
    outcome = background("a", whole[:1], whole[1:], [6.0, 6.1], logged=1, status="completed")
    bg = rf.summarize_background([outcome], [rf.Reference("<0><1>", "completed")], 1.0)
    return {"chat": chat, "background": bg, "adoptions": 1.0, "held_blocks": 0}


def test_the_table_names_every_figure():
    lines = rf.table(report()).splitlines()
    assert len(lines) == 14
    assert lines[1].split() == ["of", "which", "failed", "(cannot", "be", "saved)", "1"]
    assert lines[7].split()[-5:] == ["0", "/", "0", "/", "0"]
    assert lines[10].endswith("completed 1 / 0")
    assert lines[11].endswith("5.00 s / 5.00 s / 5.00 s")
    assert lines[12].split() == ["router-1", rf.ADOPTIONS, "1"]
    assert lines[13].split()[-1] == "0"


def test_the_generated_config_runs_two_routers_and_restarts_none_during_the_run(tmp_path):
    config = load_config(rf.cluster_config(tmp_path))
    assert config.router.replicas == 2 and len(config.router.replica_ports or []) == 2
    assert config.restart.backoff_s >= rf.NO_RESTART_S
    assert [p.name for p in config.prefill] == ["p0"] and [d.name for d in config.decode] == ["d0"]


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        rf.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in ("--clients", "--background", "--tokens", "--kill-after-deltas", "--json"):
        assert option in text
