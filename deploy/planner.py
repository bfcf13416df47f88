"""The planner in the loop: how many prefill and decode servers the load asks for, decided every interval.

Every ``interval_s`` the planner gets a ``Load`` (what the routers saw over
the window: prompt and output token rates, request rate, and the share of
first tokens and of per-token times within the SLOs; deploy/planner_signals.py
reads it off the routers' /metrics) and the instances in rotation per role,
and returns a ``Decision``. Its model is the engine's step cost
(engine/step_cost.py: the profile ``pdserve plan --save-profile`` writes,
the one the mock engine sleeps): a prefill server computes
``Capacity.prefill_tps`` prompt tokens a second, a decode server generates
``Capacity.decode_tps`` tokens a second with its largest batch whose step
stays within the TPOT target. A role's *demand* is the rate of its arriving
work over that capacity, in instances; its *utilisation* is demand over the
instances it has.

The rates are those of new work: the routers count each request as it
arrives, before their waiting rooms (``Work``, ``work``): its prompt
tokens for prefill, and for decode its max_tokens times the share of
max_tokens the requests that finished used (an answer's length is known
only at its end; the last share seen stands in for a window where none
finished). What the routers admit is not demand: after a prompt-heavy
phase they go on admitting its backlog for as long as it lasts, and read
as a rate, that backlog would hold prefill servers while the requests
arriving ask for decode. (Routers that do not count arrivals leave
``Load.arrived`` None, and the admitted and streamed tokens stand in.)

A backlog is a term of its own: the prompt tokens queued at the prefill
servers and the requests in the routers' waiting rooms (each owing a mean
prompt and a mean answer, so both roles), read at the window's start and
end. While a role's backlog grows, the arrivals outrun its servers, and the
rate that would drain the backlog within one window is added to its demand;
one that stays or shrinks is being drained by the servers there and adds
nothing, so it holds no server once the arrivals ask for the other role.
The horizon is the window and not the TTFT target: the planner looks again
one interval later and a move needs ``confirm`` intervals, so a horizon of
a TTFT target (often a second or two) would ask for capacity that cannot
come in time, in a term many times the backlog's real rate; and the term
is bounded by the backlog, itself bounded by the waiting room and the
prefill servers' slots. While the prefill backlog shrinks, missed TTFTs
(the backlog's wait) do not lower prefill's capacity (below).

Two ways to act:

* ``pool`` (``pdserve launch``: a fixed set of instances). The planner moves
  instances between the roles (a live role switch, router/admin.py) toward
  the split that minimises the busier role's utilisation, at most
  ``max_moves`` in one decision (one by default; a large pool, whose best
  split can be many instances away, may move several, switched one after
  another), and only when that role is above ``target_utilisation``
  (below it every role has room, and a switch would only cost its
  drain), the move lowers it by ``hysteresis`` (a share of the current
  figure), the same move was wanted ``confirm`` intervals in a
  row, ``cooldown_s`` passed since the last move, and no switch is in
  flight. A role never drops below its ``min_*``. With ``max_instances``
  (a launcher that can start instances) the pool also grows and shrinks,
  one instance a decision: when the roles' demand over
  ``target_utilisation``, rounded up per role, is more instances than it
  has, it asks for one more in the role short of the most (below
  ``max_instances``); when one instance fewer would still leave the role it
  comes from below ``target_utilisation`` less ``hysteresis``, it asks for
  one fewer there (above ``min_instances``, the instances listed). Growing
  waits ``confirm`` intervals; shrinking also the cooldown.
* ``scale`` (Kubernetes): each role's count is its demand over
  ``target_utilisation``, rounded up, within ``min_*`` and ``max_*``;
  growing waits ``confirm`` intervals, shrinking waits as long and the
  cooldown too, so a burst does not remove capacity it just added.

A shift in the mix is read from the window's last part: each decision also
gets ``recent``, the load since the last scrape, and tests its arrivals
against the rest of the window (``shift_parts``: the likelihood ratio of each
part with a request rate and, per role, a mean request of its own against
both sharing them, as Poisson arrivals of exponential sizes). When a role's
figure is beyond ``SHIFT_LIMIT`` (as unlikely without a shift as ``SHIFT_Z``
standard deviations) the mix has shifted, and the decision says so
(``shifted``). Until the window holds nothing from before that shift, its
demand is read from the arrivals since the shift: their sizes at the
window's request rate when only the sizes departed (a new mix at about the
same rate: a phase's first seconds hold too few requests to say the rate,
and the window's hold enough), or the arrivals since alone when the rate
departed too; and each later part is tested against the arrivals since the
shift, not the window's rest (another mix). Without it a window of 8 s holds
the last phase for 4 intervals after a phase changes, and the move comes
several intervals late; a steady load seldom departs by that much, and a
move still needs ``confirm`` intervals, the target and the hysteresis.

A move toward a split several instances away (``max_moves`` short of it)
carries on at the next decision without a new confirmation or the
cooldown, when the counts show the move made and that decision still
wants the same direction: the confirmation was of the direction, and the
cooldown is against turning back, which carrying on is not. Any other
outcome ends it.

The model is corrected by what is observed: when a role misses its SLO
(attainment below the target) while the model says it has room, its
capacity is taken to be lower (x0.8 per interval); when it meets its SLO
while the model says it is over capacity, higher (x1.1); never beyond 4x
either way. The correction is what the model cannot see itself (another
process on the cores, a longer context than the mean, transfer waits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from engine.step_cost import StepCost, chunk_attn_pairs

Role = Literal["prefill", "decode"]
Orchestrator = Literal["pool", "scale"]

CORRECTION_DOWN = 0.8
CORRECTION_UP = 1.1
CORRECTION_BOUND = 4.0
SHIFT_Z = 3.0  # a shift in the mix is as unlikely without one as this many standard deviations...
SHIFT_LIMIT = -2 * math.log(math.erfc(SHIFT_Z / math.sqrt(2)))  # ...the chi-squared (2 degrees) beyond it: 11.8


@dataclass(frozen=True)
class Slo:
    """The targets goodput counts against: a request meets them when its TTFT and its TPOT are within."""

    ttft_s: float
    tpot_s: float
    attainment: float = 0.9  # the share of requests that must meet each


@dataclass(frozen=True)
class Load:
    """What the routers saw over one window, all of them together."""

    seconds: float
    requests: int  # requests that got their first token
    prompt_tokens: int
    output_tokens: int
    ttft_met: float | None = None  # share of first tokens within Slo.ttft_s; None: none in the window
    tpot_met: float | None = None  # share of finished requests within Slo.tpot_s
    queued_tokens: int = 0  # prompt tokens queued at the prefill servers at the window's end
    waiting: int = 0  # requests in the routers' waiting rooms at the window's end
    queued_tokens_before: int = 0  # the same two at the window's start
    waiting_before: int = 0
    arrived: int | None = None  # requests that came in (before the waiting room); None: the routers do not count
    arrived_prompt_tokens: int = 0  # their prompt tokens
    arrived_max_tokens: int = 0  # the tokens they may generate (max_tokens, all choices)
    finished_output_tokens: int = 0  # tokens generated by the requests that finished in the window
    finished_max_tokens: int = 0  # the max_tokens those had

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def prompt_len(self) -> float:
        return self.prompt_tokens / self.requests if self.requests else 0.0

    @property
    def output_len(self) -> float:
        return self.output_tokens / self.requests if self.requests else 0.0

    @property
    def fill(self) -> float | None:
        """The share of their max_tokens the requests that finished in the window generated; None: none did."""
        if self.finished_max_tokens <= 0:
            return None
        return min(1.0, self.finished_output_tokens / self.finished_max_tokens)


@dataclass(frozen=True)
class Work:
    """What a window asks of each role, in tokens: the rate of new work, the mean request, and the backlog."""

    seconds: float
    rate: dict[Role, float]  # tokens a second arriving: prompt tokens for prefill, output tokens for decode
    prompt_len: float
    output_len: float
    backlog: dict[Role, float]  # tokens queued at the window's end
    backlog_before: dict[Role, float]  # and at its start

    @property
    def backlog_tps(self) -> dict[Role, float]:
        """Tokens a second each role needs on top of the arrivals to drain its backlog within a window (the
        horizon), while that backlog grows; one that did not grow is being drained by the servers there, and
        asks for none (0)."""
        if self.seconds <= 0:
            return {"prefill": 0.0, "decode": 0.0}
        roles: tuple[Role, Role] = ("prefill", "decode")
        return {r: self.backlog[r] / self.seconds if self.backlog[r] > self.backlog_before[r] else 0.0 for r in roles}


def work(load: Load, fill: float = 1.0) -> Work:
    """The work in ``load``. With arrivals counted, the rates are theirs: prompt tokens, and max_tokens times
    ``fill`` (the share of max_tokens answers use: ``load.fill`` when some finished, else the caller's last);
    without (routers that do not count them), the tokens the routers admitted and streamed. The backlog:
    prompt tokens queued at the prefill servers, and the waiting requests at the mean prompt (prefill) and
    answer (decode)."""
    fill = load.fill if load.fill is not None else fill
    if load.arrived is None:
        rate: dict[Role, float] = {"prefill": load.prompt_tps, "decode": load.output_tps}
        prompt_len, output_len = load.prompt_len, load.output_len
    else:
        per_s = 1 / load.seconds if load.seconds > 0 else 0.0
        rate = {"prefill": load.arrived_prompt_tokens * per_s, "decode": load.arrived_max_tokens * fill * per_s}
        prompt_len, output_len = load.prompt_len, load.output_len
        if load.arrived:
            prompt_len = load.arrived_prompt_tokens / load.arrived
            output_len = load.arrived_max_tokens * fill / load.arrived
    return Work(
        load.seconds,
        rate,
        prompt_len,
        output_len,
        {"prefill": load.queued_tokens + load.waiting * prompt_len, "decode": load.waiting * output_len},
        {
            "prefill": load.queued_tokens_before + load.waiting_before * prompt_len,
            "decode": load.waiting_before * output_len,
        },
    )


def shift_parts(load: Load, recent: Load) -> tuple[float, dict[Role, float]]:
    """How far the arrivals in ``recent`` (the last part of ``load``'s window) depart from those of the rest of
    the window: twice the log-likelihood ratio of each part with a request rate of its own against both
    sharing one (Poisson arrivals), and per role the same for its mean tokens a request (each an
    exponential's). Under no shift the first is chi-squared with 1 degree of freedom, and so is each role's
    second. (0, {}) when either part is too short to say (no time, or no request before the recent part) or
    the routers do not count arrivals.

    The mean request is a term of its own, each part's against the shared one: a shift in the mix moves it
    (48-token prompts, then 400-token ones at about the same request rate). A test of the recent tokens
    against the rest's rate, with a spread from the whole window's mean request, is blunted by the shift it
    looks for: the new long prompts in the window raise that mean, and the spread with it, and a part of a
    few requests (a phase's first second or two) stays within it."""
    if load.arrived is None or recent.arrived is None:
        return 0.0, {}
    seconds, count = load.seconds - recent.seconds, load.arrived - recent.arrived
    if seconds <= 0 or recent.seconds <= 0 or count <= 0:
        return 0.0, {}
    now, total = recent.arrived, load.arrived
    rate_part = 2 * (
        _xlog(count, load.seconds * count / (total * seconds))
        + _xlog(now, load.seconds * now / (total * recent.seconds))
    )
    tokens: dict[Role, tuple[float, float]] = {  # (the rest's, the recent part's)
        "prefill": (load.arrived_prompt_tokens - recent.arrived_prompt_tokens, recent.arrived_prompt_tokens),
        "decode": (load.arrived_max_tokens - recent.arrived_max_tokens, recent.arrived_max_tokens),
    }
    sizes: dict[Role, float] = {}
    for role, (before, after) in tokens.items():
        size_part = 0.0
        if now > 0 and before + after > 0:
            if before <= 0 or after <= 0:  # requests of no tokens in one part only: as far apart as sizes go
                size_part = math.inf
            else:
                shared = (before + after) / total
                size_part = 2 * (
                    total * math.log(shared) - count * math.log(before / count) - now * math.log(after / now)
                )
        sizes[role] = max(size_part, 0.0)
    return max(rate_part, 0.0), sizes


def shift_statistic(load: Load, recent: Load) -> dict[Role, float]:
    """Per role, the rate's and its sizes' departures (``shift_parts``) together: chi-squared with 2 degrees of
    freedom under no shift; {} when there is nothing to compare."""
    rate_part, sizes = shift_parts(load, recent)
    return {role: rate_part + size for role, size in sizes.items()}


def joined(first: Load, then: Load) -> Load:
    """Two consecutive windows as one: counts added, the queues at the first's start and the second's end,
    the shares within the SLOs the second's (what is read of it is its arrivals and queues)."""
    arrived = None if first.arrived is None or then.arrived is None else first.arrived + then.arrived
    return replace(
        then,
        seconds=first.seconds + then.seconds,
        requests=first.requests + then.requests,
        prompt_tokens=first.prompt_tokens + then.prompt_tokens,
        output_tokens=first.output_tokens + then.output_tokens,
        queued_tokens_before=first.queued_tokens_before,
        waiting_before=first.waiting_before,
        arrived=arrived,
        arrived_prompt_tokens=first.arrived_prompt_tokens + then.arrived_prompt_tokens,
        arrived_max_tokens=first.arrived_max_tokens + then.arrived_max_tokens,
        finished_output_tokens=first.finished_output_tokens + then.finished_output_tokens,
        finished_max_tokens=first.finished_max_tokens + then.finished_max_tokens,
    )


def _xlog(x: float, ratio: float) -> float:
    """x log(ratio), 0 when x is (the limit)."""
    return x * math.log(ratio) if x > 0 else 0.0


def shifted(load: Load, recent: Load) -> list[Role]:
    """The roles whose arrivals in ``recent`` depart from the rest of ``load``'s window by more than
    ``SHIFT_LIMIT`` (``shift_statistic``: as unlikely under no shift as ``SHIFT_Z`` standard deviations);
    [] when either part is too short to say or the routers do not count arrivals."""
    return [role for role, value in shift_statistic(load, recent).items() if value > SHIFT_LIMIT]


@dataclass(frozen=True)
class EngineShape:
    """The engine settings the capacity depends on (each instance's, from the cluster config)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_tokens: int  # tokens a decode server's KV cache holds


@dataclass(frozen=True)
class Capacity:
    prefill_tps: float  # prompt tokens a second one prefill server computes
    decode_tps: float  # tokens a second one decode server generates within the TPOT target
    decode_batch: int  # the batch that gives it


def prefill_seconds(cost: StepCost, prompt_len: int, chunk: int) -> float:
    """One prompt of ``prompt_len`` tokens through steps of at most ``chunk`` tokens."""
    total, start = 0.0, 0
    while start < prompt_len:
        end = min(prompt_len, start + chunk)
        total += cost.step_time(end - start, chunk_attn_pairs(start, end), 1)
        start = end
    return total


def capacity(cost: StepCost, shape: EngineShape, slo: Slo, prompt_len: float, output_len: float) -> Capacity:
    """Per instance: prompt tokens/s of a prefill server, and tokens/s of a decode server at the largest
    batch whose step is within the TPOT target and whose sequences fit its KV cache (at least 1)."""
    prompt = max(1, round(prompt_len))
    prefill_tps = prompt / prefill_seconds(cost, prompt, max(1, shape.max_num_batched_tokens))
    context = max(1, round(prompt_len + output_len / 2))
    fits = max(1, shape.kv_tokens // max(1, round(prompt_len + output_len)))
    batch = 1
    for b in range(1, min(shape.max_num_seqs, fits) + 1):
        if cost.decode_time(b, context) <= slo.tpot_s:
            batch = b
    return Capacity(prefill_tps, batch / cost.decode_time(batch, context), batch)


@dataclass(frozen=True)
class PlannerSettings:
    orchestrator: Orchestrator = "pool"
    min_prefill: int = 1
    min_decode: int = 1
    max_prefill: int = 8  # scale only
    max_decode: int = 8  # scale only
    target_utilisation: float = 0.8  # scale: a role gets demand / this, rounded up; pool: no move below it
    hysteresis: float = 0.15  # pool: a move must lower the busier role's utilisation by this share
    max_moves: int = 1  # pool: instances one decision may switch (one after another, never two at once)
    confirm: int = 2  # intervals in a row that must want the same change
    cooldown_s: float = 30.0  # after a change, before the next one (scale: before shrinking)
    min_instances: int = 0  # pool with max_instances: never fewer instances than this (the ones listed)
    max_instances: int | None = None  # pool: None: a fixed pool; else it may grow to this many


@dataclass(frozen=True)
class Decision:
    at: float
    action: Literal["hold", "switch", "scale"]
    prefill: int  # the counts wanted after this decision
    decode: int
    reason: str
    switch_to: Role | None = None  # "switch": ``moves`` instances of the other role become this; "scale" in a
    # pool: the role of the instance to start (the counts grow) or to stop (they shrink)
    moves: int = 1  # "switch": how many, one after another
    utilisation: dict[str, float] = field(default_factory=dict)  # per role, at the current counts
    shifted: bool = False  # the mix shifted in the recent part (``shifted``): the demand is read from there on
    shift: dict[str, float] = field(default_factory=dict)  # the shift test: "rate", and each role's (``shift_parts``)


class Planner:
    """The decisions of one planner; ``decide`` once an interval. Pure: no clock, no I/O."""

    def __init__(self, settings: PlannerSettings, cost: StepCost, shape: EngineShape, slo: Slo) -> None:
        if settings.min_prefill < 1 or settings.min_decode < 1:
            raise ValueError("min_prefill and min_decode must be at least 1: a cluster needs both roles")
        if settings.max_moves < 1:
            raise ValueError("max_moves must be at least 1")
        self.settings = settings
        self.cost = cost
        self.shape = shape
        self.slo = slo
        self.correction: dict[Role, float] = {"prefill": 1.0, "decode": 1.0}
        self.fill = 1.0  # the share of max_tokens answers used, as last seen (``Load.fill``)
        self._wanted: str | None = None  # the change wanted last interval ("to prefill", "to 3P2D")
        self._streak = 0
        self._last_change = -math.inf
        # a switch short of its best split: the role it moved instances to, and the counts it left
        self._heading: tuple[Role, tuple[int, int]] | None = None
        # the arrivals since the last shift the window still holds time before (``_read_shift``), and whether
        # their rate departed (read alone) or only their sizes (the window's requests at their sizes)
        self._since: Load | None = None
        self._rate_moved = False

    def work(self, load: Load) -> Work:
        """The window's work (``work``), answers' lengths at the share of max_tokens last seen."""
        return work(load, self.fill)

    def demand(self, load: Load, queues: bool = True) -> dict[Role, float]:
        """Each role's load in instances' worth (model capacity times its correction): the rate of its
        arriving work, and with ``queues`` what its growing backlog adds (``Work.backlog_tps``)."""
        w = self.work(load)
        cap = capacity(self.cost, self.shape, self.slo, w.prompt_len, w.output_len)
        backlog = w.backlog_tps if queues else {"prefill": 0.0, "decode": 0.0}
        return {
            "prefill": (w.rate["prefill"] + backlog["prefill"]) / (cap.prefill_tps * self.correction["prefill"]),
            "decode": (w.rate["decode"] + backlog["decode"]) / (cap.decode_tps * self.correction["decode"]),
        }

    def decide(
        self,
        load: Load,
        prefill: int,
        decode: int,
        now: float,
        switching: bool = False,
        recent: Load | None = None,
    ) -> Decision:
        """The counts ``load`` asks for, with ``prefill`` and ``decode`` instances in rotation now; ``recent``:
        the window's last part (since the last scrape), tested for a shift in the mix (``_read_shift``)."""
        if load.requests == 0 and not load.arrived:
            self._forget()
            self._heading = self._since = None
            return Decision(now, "hold", prefill, decode, "no requests in the window")
        if load.fill is not None:
            self.fill = load.fill
        demand = self.demand(load)
        self._correct(load, self._utilisation(demand, prefill, decode))
        basis, note, statistic, moved = self._read_shift(load, recent)
        demand = self.demand(basis)  # with this window's correction
        util = self._utilisation(demand, prefill, decode)
        if self.settings.orchestrator == "scale":
            decision = self._scale(demand, prefill, decode, now)
        else:
            decision = self._pool(demand, prefill, decode, now, switching)
        return replace(
            decision,
            reason=decision.reason + self._queue_note(basis, demand) + note,
            utilisation={r: round(u, 3) for r, u in util.items()},
            shifted=bool(moved),
            shift={r: round(min(v, 1e6), 2) for r, v in statistic.items()},  # inf: tokens in one part only
        )

    def _read_shift(self, load: Load, recent: Load | None) -> tuple[Load, str, dict[str, float], list[Role]]:
        """What the demand is read from (module docstring), the reason's note on it, the shift test's figures
        (``shift_parts``: "rate", and each role's rate and sizes together) and the roles that shifted. The
        recent part is tested against the window's rest, or, while the window still holds time before the
        last shift, against the arrivals since that shift: the ones before it are another mix."""
        since = self._since
        if recent is None or (since is not None and since.seconds + recent.seconds >= load.seconds - 1e-9):
            since = None  # the window holds nothing before the last shift (it started again after a switch)
        reference = load if since is None or recent is None else joined(since, recent)
        rate_part, sizes = shift_parts(reference, recent) if recent is not None else (0.0, {})
        statistic = {role: rate_part + size for role, size in sizes.items()}
        moved = [role for role, value in statistic.items() if value > SHIFT_LIMIT]
        figures: dict[str, float] = {"rate": rate_part} if sizes else {}
        for role, value in statistic.items():
            figures[role] = value
        if moved and recent is not None:
            since, self._rate_moved = recent, rate_part > SHIFT_Z**2
        elif since is not None:
            since = reference
        self._since = since
        if since is None:
            return load, "", figures, moved
        what = f"the mix shifted ({' and '.join(moved)} arrivals)" if moved else "since the shift"
        if self._rate_moved or not since.arrived or not load.arrived:
            return since, f"; {what}: read from the last {since.seconds:.1f} s", figures, moved
        per_request = load.arrived / since.arrived
        basis = replace(
            load,
            arrived_prompt_tokens=round(since.arrived_prompt_tokens * per_request),
            arrived_max_tokens=round(since.arrived_max_tokens * per_request),
        )
        note = f"; {what}: the window's requests at the sizes of the last {since.seconds:.1f} s"
        return basis, note, figures, moved

    def _queue_note(self, load: Load, demand: dict[Role, float]) -> str:
        """What the growing backlogs added to the demand, for the reason; "" when they added nothing."""
        plain = self.demand(load, queues=False)
        added = {role: round(demand[role] - plain[role], 2) for role in demand}  # as the reason shows it
        notes = []
        if added["prefill"] > 0:
            queue = self.work(load).backlog["prefill"]
            notes.append(f"prefill queue of {queue:.0f} tokens: +{added['prefill']:.2f} prefill")
        if added["decode"] > 0:
            notes.append(f"waiting room of {load.waiting} requests: +{added['decode']:.2f} decode")
        return f"; growing {' and '.join(notes)} servers' worth" if notes else ""

    @staticmethod
    def _utilisation(demand: dict[Role, float], prefill: int, decode: int) -> dict[Role, float]:
        return {"prefill": demand["prefill"] / max(prefill, 1), "decode": demand["decode"] / max(decode, 1)}

    def _resize(
        self, demand: dict[Role, float], prefill: int, decode: int, now: float, switching: bool
    ) -> Decision | None:
        """A pool with ``max_instances``: one instance more or fewer (module docstring), a hold while that
        waits, or None: the size is right, and the split is the question."""
        s = self.settings
        if s.max_instances is None:
            return None
        have: dict[Role, int] = {"prefill": prefill, "decode": decode}
        low: dict[Role, int] = {"prefill": s.min_prefill, "decode": s.min_decode}
        want = {r: max(math.ceil(round(demand[r] / s.target_utilisation, 9)), low[r]) for r in have}
        total = prefill + decode
        if sum(want.values()) > total and total < s.max_instances:
            role: Role = max(have, key=lambda r: (want[r] - have[r], r == "prefill"))
            step = 1
        else:
            spare = [
                r
                for r in have
                if have[r] > low[r] and demand[r] / (have[r] - 1) <= s.target_utilisation * (1 - s.hysteresis)
            ]
            if total <= s.min_instances or sum(want.values()) > total - 1 or not spare:
                return None
            role = max(spare, key=lambda r: (have[r] - want[r], r == "decode"))
            step = -1
        counts = (prefill + step, decode) if role == "prefill" else (prefill, decode + step)
        verb = "start" if step > 0 else "stop"
        reason = (
            f"demand {demand['prefill']:.2f} prefill, {demand['decode']:.2f} decode servers' worth: "
            f"{verb} a {role} server ({total} instances now, at most {s.max_instances})"
        )
        held = self._gate(now, f"to {counts[0]}P{counts[1]}D", switching, prefill, decode, reason, cool=step < 0)
        return held or Decision(now, "scale", *counts, reason, switch_to=role)

    def _pool(self, demand: dict[Role, float], prefill: int, decode: int, now: float, switching: bool) -> Decision:
        s = self.settings
        total = prefill + decode
        heading, self._heading = self._heading, None  # kept only by a switch short of its split (below)
        resized = self._resize(demand, prefill, decode, now, switching)
        if resized is not None:
            return resized

        def busiest(p: int) -> float:
            return max(demand["prefill"] / p, demand["decode"] / (total - p))

        choices = range(s.min_prefill, total - s.min_decode + 1)
        if not choices:
            self._forget()
            return Decision(now, "hold", prefill, decode, f"{total} instances cannot hold the roles' minimums")
        best = min(choices, key=lambda p: (round(busiest(p), 9), abs(p - prefill)))
        now_u, best_u = busiest(min(max(prefill, s.min_prefill), total - s.min_decode)), busiest(best)
        if now_u <= s.target_utilisation:
            self._forget()
            return Decision(now, "hold", prefill, decode, f"every role has room (busiest at {now_u:.2f})")
        if best == prefill or now_u - best_u <= s.hysteresis * now_u:
            self._forget()
            why = "balanced" if best == prefill else f"{best}P{total - best}D would gain under {s.hysteresis:.0%}"
            return Decision(now, "hold", prefill, decode, f"{why} (busiest role at {now_u:.2f})")
        to: Role = "prefill" if best > prefill else "decode"
        moves = min(abs(best - prefill), s.max_moves)
        target = (prefill + moves, decode - moves) if to == "prefill" else (prefill - moves, decode + moves)
        reason = f"{best}P{total - best}D puts the busiest role at {best_u:.2f} instead of {now_u:.2f}"
        carrying_on = heading == (to, (prefill, decode))  # the last switch was carried out and fell short
        if carrying_on and not switching:  # carrying on toward the split (module docstring)
            self._forget()
            self._last_change = now
            reason += f"; carrying on to {to}"
        else:
            held = self._gate(now, f"to {to}", switching, prefill, decode, reason)
            if held is not None:
                self._heading = heading if carrying_on else None  # a switch in flight pauses a carrying on
                return held
        if moves < abs(best - prefill):
            self._heading = (to, target)
        return Decision(now, "switch", *target, reason, switch_to=to, moves=moves)

    def _scale(self, demand: dict[Role, float], prefill: int, decode: int, now: float) -> Decision:
        s = self.settings
        want_p = min(max(math.ceil(demand["prefill"] / s.target_utilisation), s.min_prefill), s.max_prefill)
        want_d = min(max(math.ceil(demand["decode"] / s.target_utilisation), s.min_decode), s.max_decode)
        if (want_p, want_d) == (prefill, decode):
            self._forget()
            return Decision(now, "hold", prefill, decode, "the counts meet the demand")
        reason = f"demand {demand['prefill']:.2f} prefill, {demand['decode']:.2f} decode servers' worth"
        shrinking = want_p < prefill or want_d < decode
        held = self._gate(now, f"to {want_p}P{want_d}D", False, prefill, decode, reason, cool=shrinking)
        return held or Decision(now, "scale", want_p, want_d, reason)

    def _gate(
        self,
        now: float,
        wanted: str,
        switching: bool,
        prefill: int,
        decode: int,
        reason: str,
        cool: bool = True,
    ) -> Decision | None:
        """A hold while the change is not yet confirmed, cooling down or behind a switch in flight; None: go."""
        self._streak = self._streak + 1 if self._wanted == wanted else 1
        self._wanted = wanted
        if switching:
            return Decision(now, "hold", prefill, decode, f"a switch is in flight; wanted: {reason}")
        if self._streak < self.settings.confirm:
            return Decision(now, "hold", prefill, decode, f"wanted {self._streak}/{self.settings.confirm}: {reason}")
        if cool and now - self._last_change < self.settings.cooldown_s:
            left = self.settings.cooldown_s - (now - self._last_change)
            return Decision(now, "hold", prefill, decode, f"cooling down {left:.0f} s more; wanted: {reason}")
        self._forget()
        self._last_change = now
        return None

    def _forget(self) -> None:
        self._wanted, self._streak = None, 0

    def _correct(self, load: Load, util: dict[Role, float]) -> None:
        """Move a role's capacity correction toward what its SLO attainment says (module docstring)."""
        observed: tuple[tuple[Role, float | None], ...] = (("prefill", load.ttft_met), ("decode", load.tpot_met))
        w = self.work(load)
        draining = w.backlog["prefill"] < w.backlog_before["prefill"]  # TTFT misses: the backlog's wait
        for role, met in observed:
            if met is None:
                continue
            c = self.correction[role]
            if role == "prefill" and draining and met < self.slo.attainment:
                continue
            if met < self.slo.attainment and util[role] < self.settings.target_utilisation:
                c *= CORRECTION_DOWN
            elif met >= self.slo.attainment and util[role] > 1.0:
                c *= CORRECTION_UP
            self.correction[role] = min(max(c, 1 / CORRECTION_BOUND), CORRECTION_BOUND)
