"""The planner's decisions (deploy/planner.py): capacity from the step cost, moves between roles with
hysteresis, confirmation and cooldown, scaling within bounds, and the correction from observed SLOs."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from deploy.planner import (
    SHIFT_LIMIT,
    EngineShape,
    Load,
    Planner,
    PlannerSettings,
    Slo,
    capacity,
    prefill_seconds,
    shift_parts,
    shift_statistic,
    shifted,
    work,
)
from engine.step_cost import DEFAULT_STEP_COST, StepCost, chunk_attn_pairs

COST = DEFAULT_STEP_COST
SHAPE = EngineShape(max_num_seqs=64, max_num_batched_tokens=512, kv_tokens=100_000)
SLO = Slo(ttft_s=1.0, tpot_s=0.05)
INTERVAL = 10.0


def load(rps: float, prompt: int, output: int, ttft_met: float | None = None, tpot_met: float | None = None) -> Load:
    n = round(rps * INTERVAL)
    return Load(INTERVAL, n, n * prompt, n * output, ttft_met, tpot_met)


PROMPT_HEAVY = (16.0, 1000, 10)  # about 1.8 prefill servers' worth and 0.4 of a decode server's
OUTPUT_HEAVY = (4.0, 100, 400)  # about 0.06 and 1.4


def test_prefill_capacity_is_a_prompt_over_its_chunked_steps():
    steps = COST.step_time(512, chunk_attn_pairs(0, 512), 1) + COST.step_time(488, chunk_attn_pairs(512, 1000), 1)
    assert prefill_seconds(COST, 1000, 512) == pytest.approx(steps)
    assert capacity(COST, SHAPE, SLO, 1000, 20).prefill_tps == pytest.approx(1000 / steps)


def test_decode_capacity_is_the_largest_batch_within_the_tpot_target():
    cap = capacity(COST, SHAPE, SLO, 1000, 100)
    context = 1050
    assert COST.decode_time(cap.decode_batch, context) <= SLO.tpot_s < COST.decode_time(cap.decode_batch + 1, context)
    assert cap.decode_tps == pytest.approx(cap.decode_batch / COST.decode_time(cap.decode_batch, context))
    # ... and no more sequences than the KV cache holds; a target no batch meets still leaves one
    assert capacity(COST, EngineShape(64, 512, kv_tokens=3 * 1100), SLO, 1000, 100).decode_batch == 3
    assert capacity(COST, SHAPE, Slo(1.0, tpot_s=0.001), 1000, 100).decode_batch == 1


def run(planner: Planner, loads, prefill: int, decode: int, start: float = 0.0):
    """Apply each decision at once (a switch takes no time here); the counts after each interval."""
    counts, decisions = [], []
    for i, w in enumerate(loads):
        d = planner.decide(w, prefill, decode, start + i * INTERVAL)
        decisions.append(d)
        prefill, decode = d.prefill, d.decode
        counts.append((prefill, decode))
    return counts, decisions


def test_a_pool_moves_one_instance_at_a_time_toward_the_split_the_load_asks_for():
    planner = Planner(PlannerSettings(cooldown_s=25.0), COST, SHAPE, SLO)
    counts, decisions = run(planner, [load(*PROMPT_HEAVY)] * 12, prefill=1, decode=3)
    switches = [(i, d.switch_to) for i, d in enumerate(decisions) if d.action == "switch"]
    # confirmed on the 2nd interval (at 10 s); 3P1D is one more away, and the next decision carries on there
    # without a new confirmation or the cooldown
    assert switches == [(1, "prefill"), (2, "prefill")]
    assert counts[:3] == [(1, 3), (2, 2), (3, 1)] and counts[-1] == (3, 1)
    assert decisions[2].reason == "3P1D puts the busiest role at 0.61 instead of 0.92; carrying on to prefill"
    assert decisions[-1].reason == "every role has room (busiest at 0.61)"
    counts, decisions = run(planner, [load(*OUTPUT_HEAVY)] * 12, *counts[-1], start=1000.0)
    assert counts[-1] == (2, 2)  # decode at 0.79 of its servers there: under the target, so no further move
    assert decisions[-1].reason == "every role has room (busiest at 0.79)"


def test_turning_back_waits_out_the_cooldown_and_a_refused_move_does_not_carry_on():
    planner = Planner(PlannerSettings(cooldown_s=25.0), COST, SHAPE, SLO)
    counts, _ = run(planner, [load(*PROMPT_HEAVY)] * 3, prefill=1, decode=3)  # switched at 10 and 20 s
    assert counts[-1] == (3, 1)
    counts, decisions = run(planner, [load(*OUTPUT_HEAVY)] * 4, 3, 1, start=30.0)
    assert [d.action for d in decisions] == ["hold", "hold", "switch", "hold"]
    assert decisions[0].reason.startswith("wanted 1/2: 1P3D")
    assert decisions[1].reason.startswith("cooling down 5 s more; wanted: 1P3D")  # at 40 s, 20 s after 20 s
    assert counts[-1] == (2, 2)
    # the routers still show 1P3D after a switch to 2P2D (refused, or not yet seen): the next decision confirms
    refused = Planner(PlannerSettings(cooldown_s=0.0), COST, SHAPE, SLO)
    counts, decisions = run(refused, [load(*PROMPT_HEAVY)] * 2, prefill=1, decode=3)
    assert decisions[-1].action == "switch" and counts[-1] == (2, 2)
    assert refused.decide(load(*PROMPT_HEAVY), 1, 3, 20.0).reason.startswith("wanted 1/2: 3P1D")


def test_a_large_pool_moves_up_to_max_moves_in_one_decision_and_no_further_than_the_best_split():
    heavy = load(PROMPT_HEAVY[0] * 8, *PROMPT_HEAVY[1:])  # about 14.6 prefill servers' worth, 3.4 decode
    planner = Planner(PlannerSettings(max_moves=4, confirm=1, cooldown_s=0), COST, SHAPE, SLO)
    counts, decisions = run(planner, [heavy] * 6, prefill=4, decode=28)
    assert [d.moves for d in decisions if d.action == "switch"] == [4, 4, 4, 4]
    assert [c[0] for c in counts] == [8, 12, 16, 20, 20, 20]  # 20P12D is the best split: the last move stops there
    assert all(sum(c) == 32 for c in counts)
    one = Planner(PlannerSettings(confirm=1, cooldown_s=0), COST, SHAPE, SLO).decide(heavy, 4, 28, 0.0)
    assert (one.moves, one.prefill, one.decode) == (1, 5, 27)  # the default: one instance a decision
    with pytest.raises(ValueError, match="max_moves"):
        Planner(PlannerSettings(max_moves=0), COST, SHAPE, SLO)


def test_a_pool_that_may_grow_adds_the_role_short_of_most_up_to_max_and_gives_back_down_to_the_listed():
    settings = PlannerSettings(max_instances=4, min_instances=2, confirm=1, cooldown_s=0)
    planner = Planner(settings, COST, SHAPE, SLO)
    counts, decisions = run(planner, [load(*PROMPT_HEAVY)] * 3, prefill=1, decode=1)
    assert counts == [(2, 1), (3, 1), (3, 1)]  # 1.83 prefill servers' worth: 3 at 0.8 each; then the ceiling
    assert [(d.action, d.switch_to) for d in decisions[:2]] == [("scale", "prefill")] * 2
    assert decisions[0].reason.endswith("start a prefill server (2 instances now, at most 4)")
    counts, decisions = run(planner, [load(*OUTPUT_HEAVY)] * 3, 3, 1, start=100.0)
    assert counts == [(2, 1), (1, 2), (1, 2)]  # one prefill server too many stops, one more switches to decode
    assert (decisions[0].action, decisions[0].switch_to, decisions[1].action) == ("scale", "prefill", "switch")
    counts, decisions = run(planner, [load(0.5, 100, 40)] * 3, 1, 2, start=200.0)
    assert counts == [(1, 1)] * 3  # never below the listed two, nor a role below its minimum
    assert decisions[0].reason.endswith("stop a decode server (3 instances now, at most 4)")


def test_shrinking_waits_for_the_cooldown_and_a_resize_in_flight_holds():
    planner = Planner(PlannerSettings(max_instances=4, min_instances=2, confirm=1, cooldown_s=50), COST, SHAPE, SLO)
    assert planner.decide(load(*PROMPT_HEAVY), 1, 1, 0.0).action == "scale"  # growing waits for no cooldown
    held = planner.decide(load(*PROMPT_HEAVY), 2, 1, 10.0, switching=True)
    assert (held.action, held.prefill) == ("hold", 2) and "in flight" in held.reason
    assert planner.decide(load(0.5, 100, 40), 3, 1, 20.0).reason.startswith("cooling down 30 s")
    assert planner.decide(load(0.5, 100, 40), 3, 1, 60.0).action == "scale"


def test_a_light_load_moves_nothing_however_lopsided():
    planner = Planner(PlannerSettings(confirm=1, cooldown_s=0), COST, SHAPE, SLO)
    counts, decisions = run(planner, [load(0.5, 100, 400)] * 5, prefill=3, decode=1)
    assert counts[-1] == (3, 1) and decisions[-1].reason.startswith("every role has room")


def settles_at_3p1d(planner: Planner, loads: list) -> None:
    """From 2P2D, ``loads`` one a decision: the last switch within the first 10 (100 s), then none, at 3P1D."""
    counts, decisions = run(planner, loads, prefill=2, decode=2)
    switched = [i for i, d in enumerate(decisions) if d.action == "switch"]
    assert switched and switched[-1] < 10  # settled within 100 s
    assert counts[-1] == (3, 1)


def test_a_steady_noisy_load_settles_and_then_never_switches():
    rng = random.Random(7)
    planner = Planner(PlannerSettings(), COST, SHAPE, SLO)
    noisy = []
    for _ in range(300):
        rps, prompt, output = PROMPT_HEAVY
        noisy.append(load(rps * rng.uniform(0.9, 1.1), round(prompt * rng.uniform(0.9, 1.1)), output))
    settles_at_3p1d(planner, noisy)


def test_a_role_never_goes_below_its_minimum_and_a_switch_in_flight_holds():
    planner = Planner(PlannerSettings(min_decode=2, confirm=1, cooldown_s=0), COST, SHAPE, SLO)
    counts, _ = run(planner, [load(*PROMPT_HEAVY)] * 6, prefill=1, decode=3)
    assert counts[-1] == (2, 2)
    planner = Planner(PlannerSettings(confirm=1, cooldown_s=0), COST, SHAPE, SLO)
    d = planner.decide(load(*PROMPT_HEAVY), 1, 3, 0.0, switching=True)
    assert (d.action, d.prefill, d.decode) == ("hold", 1, 3) and "in flight" in d.reason
    with pytest.raises(ValueError, match="at least 1"):
        Planner(PlannerSettings(min_prefill=0), COST, SHAPE, SLO)


def test_no_requests_is_a_hold_that_forgets_what_was_wanted():
    planner = Planner(PlannerSettings(), COST, SHAPE, SLO)
    assert planner.decide(load(*PROMPT_HEAVY), 1, 3, 0.0).reason.startswith("wanted 1/2")
    assert planner.decide(Load(INTERVAL, 0, 0, 0), 1, 3, 10.0).reason == "no requests in the window"
    assert planner.decide(load(*PROMPT_HEAVY), 1, 3, 20.0).reason.startswith("wanted 1/2")


def test_scale_grows_after_confirmation_and_shrinks_only_after_the_cooldown():
    settings = PlannerSettings(orchestrator="scale", max_prefill=3, cooldown_s=60.0)
    planner = Planner(settings, COST, SHAPE, SLO)
    heavy = load(PROMPT_HEAVY[0] * 2, *PROMPT_HEAVY[1:])  # 3.7 prefill servers' worth (bounded to 3), 0.8 decode
    counts, decisions = run(planner, [heavy] * 3, prefill=1, decode=1)
    assert [d.action for d in decisions] == ["hold", "scale", "hold"]
    assert counts[1] == (3, 2) and counts[-1] == (3, 2)
    counts, decisions = run(planner, [load(*OUTPUT_HEAVY)] * 8, 3, 2, start=INTERVAL * 3)
    scaled = [(i, counts[i]) for i, d in enumerate(decisions) if d.action == "scale"]
    assert scaled == [(4, (1, 2))]  # 60 s after the growth at 10 s: at 70 s
    assert "cooling down" in decisions[2].reason


def test_a_missed_slo_the_model_did_not_expect_lowers_that_roles_capacity_within_bounds():
    planner = Planner(PlannerSettings(), COST, SHAPE, SLO)
    light = (1.0, 500, 50)
    planner.decide(load(*light, ttft_met=0.5, tpot_met=0.99), 2, 2, 0.0)
    assert planner.correction == {"prefill": 0.8, "decode": 1.0}
    for i in range(20):
        planner.decide(load(*light, ttft_met=0.5), 2, 2, INTERVAL * (i + 1))
    assert planner.correction["prefill"] == 0.25
    over = Planner(PlannerSettings(), StepCost(base=0.5, per_token=0.01, per_attn=0, per_seq=0), SHAPE, SLO)
    over.decide(load(*PROMPT_HEAVY, ttft_met=0.95), 1, 1, 0.0)
    assert over.correction["prefill"] == pytest.approx(1.1)


def queued(base: Load, tokens: tuple[int, int] = (0, 0), waiting: tuple[int, int] = (0, 0)) -> Load:
    """``base`` with (start, end) prompt tokens queued at the prefill servers and requests in the waiting rooms."""
    return replace(
        base, queued_tokens_before=tokens[0], queued_tokens=tokens[1], waiting_before=waiting[0], waiting=waiting[1]
    )


def test_a_growing_prefill_queue_asks_for_prefill_capacity_and_the_reason_names_it():
    moderate = load(12.0, 1000, 10)  # 1.38 prefill servers' worth: 0.69 of two, room enough without the queue
    planner = Planner(PlannerSettings(), COST, SHAPE, SLO)
    assert planner.decide(moderate, 2, 2, 0.0).reason == "every role has room (busiest at 0.69)"
    # 10,000 queued prompt tokens at the start, 40,000 at the end: draining them in a window adds 4,000 a second
    growing = queued(moderate, tokens=(10_000, 40_000))
    assert work(growing).backlog_tps == {"prefill": 4000.0, "decode": 0.0}
    counts, decisions = run(planner, [growing] * 2, prefill=2, decode=2)
    note = "; growing prefill queue of 40000 tokens: +0.46 prefill servers' worth"
    assert [d.action for d in decisions] == ["hold", "switch"]  # still confirmed over two intervals
    assert decisions[0].reason == "wanted 1/2: 3P1D puts the busiest role at 0.61 instead of 0.92" + note
    assert decisions[1].reason == "3P1D puts the busiest role at 0.61 instead of 0.92" + note
    assert counts[-1] == (3, 1) and decisions[1].utilisation["prefill"] == 0.917


def test_a_queue_that_shrinks_or_stays_is_no_new_demand():
    moderate = load(12.0, 1000, 10)
    for tokens, waiting in (((40_000, 10_000), (0, 0)), ((20_000, 20_000), (5, 5)), ((0, 0), (30, 3))):
        planner = Planner(PlannerSettings(confirm=1, cooldown_s=0), COST, SHAPE, SLO)
        d = planner.decide(queued(moderate, tokens, waiting), 2, 2, 0.0)
        assert (d.action, d.reason) == ("hold", "every role has room (busiest at 0.69)")
        assert d.utilisation == {"prefill": 0.688, "decode": 0.151}


def test_a_growing_waiting_room_owes_both_roles_a_prompt_and_an_answer_each():
    base = load(4.0, 100, 400)  # 40 requests: 100 prompt and 400 output tokens each
    w = queued(base, waiting=(10, 35))
    # 35 waiting: 3,500 prompt tokens and 14,000 output tokens, drained over the 10 s window
    assert work(w).backlog["prefill"] == 3500 and work(w).backlog_tps == {"prefill": 350.0, "decode": 1400.0}
    planner = Planner(PlannerSettings(orchestrator="scale", confirm=1), COST, SHAPE, SLO)
    d = planner.decide(w, 1, 1, 0.0)
    assert (d.action, d.prefill, d.decode) == ("scale", 1, 4)  # 2.95 decode servers' worth: 4 at 0.8 each
    assert d.reason == (
        "demand 0.11 prefill, 2.95 decode servers' worth; growing prefill queue of 3500 tokens: +0.05 prefill"
        " and waiting room of 35 requests: +1.37 decode servers' worth"
    )
    assert planner.decide(base, 1, 1, 10.0).prefill == 1 and planner.decide(base, 1, 1, 20.0).decode == 2


def test_missed_first_tokens_while_the_prefill_queue_shrinks_do_not_lower_its_capacity():
    light = load(1.0, 500, 50, ttft_met=0.5, tpot_met=0.99)
    planner = Planner(PlannerSettings(), COST, SHAPE, SLO)
    planner.decide(queued(light, tokens=(30_000, 20_000)), 2, 2, 0.0)  # the backlog's wait, being served
    assert planner.correction == {"prefill": 1.0, "decode": 1.0}
    planner.decide(queued(light, tokens=(20_000, 20_000)), 2, 2, 10.0)  # not shrinking: missed all the same
    assert planner.correction == {"prefill": 0.8, "decode": 1.0}


def arrivals(base: Load, rps: float, prompt: int, output: int) -> Load:
    """``base`` with the routers' arrival counts: ``rps`` requests a second of ``prompt`` tokens asking for
    ``output`` (max_tokens), and every request that finished having used all of its max_tokens."""
    n = round(rps * INTERVAL)
    return replace(
        base,
        arrived=n,
        arrived_prompt_tokens=n * prompt,
        arrived_max_tokens=n * output,
        finished_output_tokens=base.output_tokens,
        finished_max_tokens=base.output_tokens,
    )


def backlog_admitted(waiting: tuple[int, int]) -> Load:
    """A window just after a prompt-heavy phase: the routers admit its backlog at 12 requests a second of
    1000 prompt tokens (what three prefill servers prefill) and stream their 10-token answers; 20,000 prompt
    tokens stay queued at the prefill servers (as many as their slots hold) and ``waiting`` is the waiting
    room at the window's (start, end)."""
    return queued(load(12.0, 1000, 10), tokens=(20_000, 20_000), waiting=waiting)


def test_a_prompt_phases_backlog_does_not_hold_prefill_once_the_arrivals_say_decode():
    rooms = [(30, 45), (45, 30), (30, 10), (10, 0)]  # the new requests join the room, then it drains
    for reading in ("arrivals", "admitted"):
        planner = Planner(PlannerSettings(), COST, SHAPE, SLO)
        steady = arrivals(load(*PROMPT_HEAVY), *PROMPT_HEAVY)
        counts, _ = run(planner, [steady] * 3, prefill=3, decode=1)
        assert counts[-1] == (3, 1)  # settled on the prompt phase
        windows = [backlog_admitted(room) for room in rooms]
        if reading == "arrivals":
            windows = [arrivals(w, *OUTPUT_HEAVY) for w in windows]
        counts, decisions = run(planner, windows, 3, 1, start=100.0)
        if reading == "admitted":
            # the admitted backlog read as the rate of prompt tokens: 1.37 prefill servers' worth, so the
            # output phase looks like none, and its room's growth at the backlog's prompt length as prefill
            assert counts == [(3, 1)] * 4
            assert decisions[0].reason.startswith("every role has room (busiest at 0.71); growing prefill queue")
            continue
        # the arrivals: 400 prompt and 1,600 output tokens a second. The first decision after the switch
        # wants decode and the second (``confirm`` = 2 in a row) moves; the backlog, shrinking, adds nothing
        assert [d.action for d in decisions] == ["hold", "switch", "hold", "hold"]
        assert decisions[0].reason.startswith("wanted 1/2: 1P3D")
        assert decisions[1].switch_to == "decode" and counts[1] == (2, 2)
        assert decisions[1].utilisation == {"prefill": 0.019, "decode": 1.571}  # 1,600 tokens/s: 1.57 servers
        assert decisions[1].reason == "1P3D puts the busiest role at 0.52 instead of 1.57"
        assert decisions[-1].reason == "every role has room (busiest at 0.79)"


def test_a_backlog_growing_under_steady_arrivals_asks_for_that_role_and_a_standing_one_does_not():
    moderate = arrivals(load(12.0, 1000, 10), 12.0, 1000, 10)  # 1.38 prefill servers' worth: 0.69 of two
    growing = [queued(moderate, tokens=(10_000 * k, 10_000 * (k + 1))) for k in range(1, 4)]
    planner = Planner(PlannerSettings(), COST, SHAPE, SLO)
    counts, decisions = run(planner, growing, prefill=2, decode=2)
    assert [d.action for d in decisions] == ["hold", "switch", "hold"]
    assert decisions[0].reason == (
        "wanted 1/2: 3P1D puts the busiest role at 0.53 instead of 0.80;"
        " growing prefill queue of 20000 tokens: +0.23 prefill servers' worth"
    )
    assert counts[1] == (3, 1)
    # the same backlog standing at 40,000 tokens is being drained by the servers there: no more of them
    planner = Planner(PlannerSettings(confirm=1, cooldown_s=0), COST, SHAPE, SLO)
    counts, decisions = run(planner, [queued(moderate, tokens=(40_000, 40_000))] * 5, prefill=2, decode=2)
    assert counts == [(2, 2)] * 5 and decisions[-1].reason == "every role has room (busiest at 0.69)"


def test_a_steady_noisy_load_read_from_arrivals_with_a_standing_backlog_never_switches_after_settling():
    rng = random.Random(11)
    planner = Planner(PlannerSettings(), COST, SHAPE, SLO)
    noisy = []
    for _ in range(300):
        rps, prompt, output = PROMPT_HEAVY
        w = load(rps * rng.uniform(0.9, 1.1), round(prompt * rng.uniform(0.9, 1.1)), output)
        w = arrivals(w, rps * rng.uniform(0.9, 1.1), round(prompt * rng.uniform(0.9, 1.1)), output)
        room = (rng.randint(0, 10), rng.randint(0, 10))  # up one window, down the next
        noisy.append(queued(w, tokens=(rng.randint(3_000, 7_000), rng.randint(3_000, 7_000)), waiting=room))
    settles_at_3p1d(planner, noisy)


def test_the_answers_length_is_max_tokens_times_the_share_the_finished_ones_used():
    base = arrivals(load(*OUTPUT_HEAVY), 4.0, 100, 800)  # asking for 800, the finished ones used half
    half = replace(base, finished_output_tokens=4_000, finished_max_tokens=8_000)
    planner = Planner(PlannerSettings(), COST, SHAPE, SLO)
    assert half.fill == 0.5 and work(half, fill=1.0).rate == {"prefill": 400.0, "decode": 1600.0}
    planner.decide(half, 2, 2, 0.0)
    none_finished = replace(base, finished_output_tokens=0, finished_max_tokens=0)
    assert none_finished.fill is None and planner.fill == 0.5  # the last share seen stands in
    assert planner.work(none_finished).rate["decode"] == 1600.0 and planner.work(none_finished).output_len == 400
    # counted arrivals and none came: the backlog being admitted is no rate of either role
    idle = replace(backlog_admitted((5, 0)), arrived=0)
    assert planner.work(idle).rate == {"prefill": 0.0, "decode": 0.0}
    assert planner.decide(idle, 3, 1, 10.0).reason == "every role has room (busiest at 0.00)"


def arriving(seconds: float, *parts: tuple[int, int, int]) -> Load:
    """A window of ``seconds`` in which ``parts`` (count, prompt tokens, max_tokens) arrived and were served in
    it, every SLO met and every answer as long as its max_tokens."""
    n = sum(count for count, _, _ in parts)
    prompt = sum(count * p for count, p, _ in parts)
    output = sum(count * o for count, _, o in parts)
    met = 1.0 if n else None
    arrivals = {"arrived": n, "arrived_prompt_tokens": prompt, "arrived_max_tokens": output}
    finished = {"finished_output_tokens": output, "finished_max_tokens": output}
    return Load(seconds, n, prompt, output, met, met, **arrivals, **finished)


def test_a_shift_in_the_mix_is_read_from_the_last_part_of_the_window():
    # 6 s of the prompt-heavy load (16 a second of 1000/10), then 2 s of the output-heavy one (4 of 100/400)
    window, recent = arriving(8.0, (96, 1000, 10), (8, 100, 400)), arriving(2.0, (8, 100, 400))
    assert shifted(window, recent) == ["prefill", "decode"]
    blended = Planner(PlannerSettings(), COST, SHAPE, SLO).decide(window, 3, 1, 0.0)
    assert not blended.shifted and blended.reason == "wanted 1/2: 2P2D puts the busiest role at 0.69 instead of 1.14"
    planner = Planner(PlannerSettings(), COST, SHAPE, SLO)
    first = planner.decide(window, 3, 1, 0.0, recent=recent)
    assert first.shifted and first.reason == (
        "wanted 1/2: 1P3D puts the busiest role at 0.48 instead of 1.43;"
        " the mix shifted (prefill and decode arrivals): read from the last 2.0 s"
    )
    # 2 s on, the window's 8 s hold 4 of each load; the next 2 s are tested against the 2 since the shift (no
    # shift within the output-heavy load), and its rate departed too: the demand is the 4 s since it alone
    window, recent = arriving(8.0, (64, 1000, 10), (16, 100, 400)), arriving(2.0, (8, 100, 400))
    second = planner.decide(window, 3, 1, 2.0, recent=recent)
    assert (second.action, second.prefill, second.decode, second.shifted) == ("switch", 2, 2, False)
    assert second.shift == {"rate": 0.0, "prefill": 0.0, "decode": 0.0}
    assert second.reason == (
        "1P3D puts the busiest role at 0.43 instead of 1.30; since the shift: read from the last 4.0 s"
    )
    # until the window holds nothing from before the shift (at 6 s), then it is read whole again
    window = arriving(8.0, (32, 1000, 10), (24, 100, 400))
    assert planner.decide(window, 2, 2, 4.0, recent=recent).reason.endswith(
        "; since the shift: read from the last 6.0 s"
    )
    assert planner.decide(arriving(8.0, (32, 100, 400)), 2, 2, 6.0, recent=recent).reason == (
        "every role has room (busiest at 0.65)"
    )


def test_no_shift_without_counted_arrivals_or_a_part_before_the_recent_one():
    recent = arriving(2.0, (8, 100, 400))
    assert shifted(replace(arriving(8.0, (96, 1000, 10), (8, 100, 400)), arrived=None), recent) == []
    assert shifted(recent, recent) == []  # the window is the recent part: the first after a switch
    assert shifted(arriving(8.0, (8, 100, 400)), recent) == []  # all 8 came in the last 2 s: no earlier rate


def test_a_new_mean_request_reads_as_a_shift_before_its_tokens_outrun_the_rest():
    # the first decision 1.1 s into the phase-shift bench's mixed phase (tests/deploy/test_planner_loop.py):
    # 23 requests of 48/160 tokens in the 6.06 s before the last 2.02 s, 3 of 400/60 in them
    window, recent = arriving(8.08, (23, 48, 160), (3, 400, 60)), arriving(2.02, (3, 400, 60))
    rate, sizes = shift_parts(window, recent)
    assert (round(rate, 2), round(sizes["prefill"], 2), round(sizes["decode"], 2)) == (2.95, 19.16, 1.99)
    assert shift_statistic(window, recent) == {"prefill": rate + sizes["prefill"], "decode": rate + sizes["decode"]}
    # 1200 prompt tokens against the rest's 363 a 2.02 s: 2.1 standard deviations of the window's mean request
    # (80 tokens, raised by the 3), no shift for the test of tokens alone; the mean request went 48 -> 400
    assert shifted(window, recent) == ["prefill"]
    # the next decision's, had that one been missed: its rest holds the 3 (mean 101), and its 4 stay within
    window = arriving(8.08, (17, 48, 160), (3, 400, 60), (4, 400, 60))
    assert shifted(window, arriving(2.02, (4, 400, 60))) == []
    # the arrivals stopped: the rate alone; the same mix at the same rate: nothing
    assert shifted(arriving(8.0, (30, 48, 160)), arriving(2.0)) == ["prefill", "decode"]
    assert shift_parts(arriving(8.0, (32, 400, 60)), arriving(2.0, (8, 400, 60)))[0] == 0.0
    assert shifted(arriving(8.0, (32, 400, 60)), arriving(2.0, (8, 400, 60))) == []
    assert SHIFT_LIMIT == pytest.approx(11.829, abs=1e-3)  # as unlikely as 3 standard deviations, 2 degrees


def poisson(rng: random.Random, mean: float) -> int:
    """A Poisson count of ``mean`` (Knuth's: ``mean`` is small here)."""
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k, product = k + 1, product * rng.random()
    return k


def steady_intervals(rng: random.Random, count: int, rps: float, prompt: int, output: int, spread: bool):
    """``count`` intervals of 2 s of Poisson arrivals at ``rps`` of ``prompt``/``output`` tokens: each request of
    exactly those lengths, or with ``spread`` of lengths drawn from an exponential of that mean."""
    out = []
    for _ in range(count):
        n = poisson(rng, rps * 2)
        sizes = [
            (max(1, round(rng.expovariate(1 / prompt))), max(1, round(rng.expovariate(1 / output))))
            if spread
            else (prompt, output)
            for _ in range(n)
        ]
        out.append(arriving(2.0, *((1, p, o) for p, o in sizes)) if sizes else arriving(2.0))
    return out


def joined(parts: list[Load]) -> Load:
    """The window the loop reads over ``parts``, consecutive intervals."""
    total = arriving(sum(p.seconds for p in parts))
    keys = ("requests", "prompt_tokens", "output_tokens", "arrived", "arrived_prompt_tokens", "arrived_max_tokens")
    keys += ("finished_output_tokens", "finished_max_tokens")
    return replace(total, **{k: sum(getattr(p, k) for p in parts) for k in keys})


def test_steady_poisson_arrivals_seldom_read_as_a_shift():
    rng = random.Random(3)
    for spread, most in ((False, 3), (True, 5)):  # of 1,000 windows of 8 s: 0.3 % and 0.5 % at most
        intervals = steady_intervals(rng, 1003, 2.5, 900, 8, spread)
        found = sum(1 for k in range(1000) if shifted(joined(intervals[k : k + 4]), intervals[k + 3]))
        assert found <= most


def test_a_steady_poisson_load_read_with_its_recent_part_settles_and_then_never_switches():
    """The loop's windows (deploy/planner_loop.py): the last 4 intervals of 2 s, again from the interval after a
    switch; each decision also gets its last interval. Requests of one size and of exponential sizes, a
    prompt-heavy load (3P1D) and an output-heavy one (1P3D), 300 decisions each."""
    rng = random.Random(5)
    for mix, split in ((PROMPT_HEAVY, (3, 1)), (OUTPUT_HEAVY, (1, 3))):
        for spread in (False, True):
            planner = Planner(PlannerSettings(cooldown_s=4.0), COST, SHAPE, SLO)
            prefill, decode, kept, switched, shifts = 2, 2, [], [], 0
            for k, interval in enumerate(steady_intervals(rng, 300, *mix, spread)):
                kept = [*kept, interval][-4:]
                d = planner.decide(joined(kept), prefill, decode, 2.0 * k, recent=interval)
                shifts += d.shifted
                if d.action == "switch":
                    switched.append(k)
                    prefill, decode, kept = d.prefill, d.decode, []
            assert switched and switched[-1] < 10 and (prefill, decode) == split, (mix, spread, switched)
            assert shifts <= 6  # of 300 decisions: a false shift reads the sizes of a few seconds, no move
