"""One request's trip through the cluster once admitted (docs/architecture.md).

A ``Session`` starts with an open decode stream whose first event was the
reservation; only then (so a prefill server never computes for nothing) does
it hand the prompt and the reservation to a prefill server. ``deltas``
yields the decode server's tokens, sequence by sequence (``sampling.n``).

A prefill server's log-probabilities (the first token of each sequence, the
prompt's) come in its ``PrefillResult``, which is answered only once the KV
landed, so usually after the decode stream sent its first tokens: when the
request asked for them, the first event of each sequence waits for that
result and carries them, as a locally prefilled request's events do.

A prefill step that fails before the first token may start the request
over, once (``router.cluster.recovery``): the attempt is aborted on both
servers (its blocks are freed and its transfer id is dead, so nothing still
on its way lands anywhere) and a new attempt opens under a new id,
``<id>-retry1``.

A decode stream that breaks (the server died, was cut off, froze, or moves
its streams off as it drains) is migrated, at most ``migration_limit``
times per request: the attempt is ended and the request continues on
another decode server under ``<id>-migrate<k>``, the client's stream
untouched. The session counts every token it passed on, per sequence; the
new decode server is sent the prompt and those tokens as
``generated_token_ids`` (wire/requests.py), prefills them
itself (its prefix cache holds what it has seen) and draws the next token
as the old one would have: the same position for the seed, the grammar fed,
``min_tokens``/``max_tokens`` counted across the seam. A request with
``n`` > 1 goes on as one stream per unfinished sequence (sequence i seeded
``seed + i``, its events renumbered i), each from its own tokens. Before any
token was passed on, the request simply opens again elsewhere (prefilled as
a new one would be). Past the limit, or with no other decode server in
rotation, the client gets the decode failure's error. ``close`` is idempotent and always runs
(the HTTP layer calls it in ``finally``): if the request did not finish it
closes the decode stream and aborts the request on both servers, which free
its blocks. Every admission slot the session holds is released there too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

from engine.request import SamplingParams
from router.cluster import tenancy
from router.cluster.admission import Admission, Slot
from router.cluster.health import PassiveHealth
from router.cluster.policies import Policy
from router.cluster.recovery import decide
from router.cluster.registry import Worker, WorkerRegistry
from router.cluster.worker_client import DecodeStream, WorkerClient, WorkerFailed
from router.errors import OpenAIError
from router.metrics import RecoveryMetrics
from router.settings import PrefillFailure
from transfer.outcome import DECIDED_BY_DECODE, Outcome
from wire.replies import PrefillResult, ReprefillEvent, TokensEvent
from wire.requests import PrefillRequest

log = logging.getLogger(__name__)

# (attempt id, prompt, sampling, local (None: the conditional rule), traceparent, generated tokens, decode
# servers to avoid) -> an open decode stream and the admission slot it holds
OpenStream = Callable[
    [str, list[int], SamplingParams, bool | None, str | None, list[int], frozenset[str]],
    Awaitable[tuple[DecodeStream, Slot]],
]


@dataclass
class Leg:
    """One open decode stream of the current attempt: the whole request, or (after a request with
    n > 1 migrated) one sequence of it, whose events come as index 0 and are renumbered ``index``."""

    stream: DecodeStream
    slot: Slot
    attempt_id: str
    index: int | None = None  # None: the stream's events carry the request's own indexes


@dataclass(frozen=True)
class SessionContext:
    """What a session works with; the dispatcher builds it once for all sessions."""

    client: WorkerClient
    registry: WorkerRegistry
    health: PassiveHealth
    prefill_policy: Policy
    admission: Admission
    recovery: RecoveryMetrics
    prefill_failure: PrefillFailure
    open_stream: OpenStream  # for a new attempt (no prefill slot: the first attempt's covers the request)
    migration_limit: int = 2  # decode failures a request survives (router.cluster.recovery)
    live: set[Session] = field(default_factory=set)  # sessions not closed yet (``Dispatcher.move_off``)


_RELEASING: set[asyncio.Task] = set()  # sessions' releases under way (held: a task is only weakly kept)


def _released(task: asyncio.Task) -> None:
    _RELEASING.discard(task)
    exc = None if task.cancelled() else task.exception()
    if exc is not None:  # also raised to the close that awaits it, unless that was cancelled
        log.warning("releasing a session failed: %r", exc)


class Session:
    def __init__(
        self,
        ctx: SessionContext,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        stream: DecodeStream,
        slot: Slot,
        trace: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.attempt_id = stream.request_id or request_id  # what the servers call the current attempt
        self.decode: Worker = stream.worker
        self.prefill: Worker | None = None
        self.prefill_result: PrefillResult | None = None
        self.reservation = stream.reservation  # None: the decode server prefills locally
        self._reserved_at = time.monotonic()  # its lease_s counts from about then
        self.cached_tokens = stream.num_cached_tokens  # usage.prompt_tokens_details.cached_tokens
        self._ctx = ctx
        self._prompt = prompt
        self._sampling = sampling
        self._trace = trace  # the request's traceparent, passed to every server it reaches
        self._tenant = tenancy.CURRENT.get().ticket.tenant or None  # whose share of the shared KV store it fills
        # The current attempt's decode streams; the first one's slot also holds the request's prefill slot.
        self._legs: list[Leg] = [Leg(stream, slot, self.attempt_id)]
        self._first_slot = slot
        self._tasks: list[asyncio.Task] = []  # the current attempt's decode pumps and prefill call
        self._background: set[asyncio.Future] = set()  # aborts of an abandoned prefill or a dead attempt
        self._tried_prefill: set[str] = set()
        self._attempts = 1
        self.migrations = 0
        self._failed_decode: set[str] = set()  # decode servers a stream of this request broke on
        self._tokens_sent = False
        self._generated: dict[int, list[int]] = {i: [] for i in range(sampling.n)}  # passed on, per sequence
        self._unfinished = set(range(sampling.n))  # sequences whose last event is still to come
        self._finished = False
        self._closed = False
        self._queue: asyncio.Queue | None = None  # the current attempt's
        ctx.admission.session_started()
        ctx.live.add(self)

    async def deltas(self) -> AsyncIterator[TokensEvent]:
        """Token events up to and including the one with a finish_reason.

        Raises ``OpenAIError`` (500, naming the worker and the request id) when
        a step fails and the request cannot start over.
        """
        while True:
            queue = self._start_attempt()
            wants = self._sampling.logprobs is not None or self._sampling.prompt_logprobs is not None
            held: list[TokensEvent] | None = [] if wants and self.reservation is not None else None
            result: PrefillResult | None = None  # the prefill server's log-probabilities, once it answered
            seen: set[int] = set()  # sequences whose first event went out
            failure = None
            while failure is None:
                item = await queue.get()
                if isinstance(item, WorkerFailed):
                    failure = item
                    continue
                if isinstance(item, ReprefillEvent):
                    self._prefill_abandoned(item)
                    events, held = held or [], None  # computed here now: the events carry their own
                elif isinstance(item, PrefillResult):
                    result = item if held is not None else None
                    events, held = held or [], None
                elif held is not None:
                    held.append(item)
                    continue
                else:
                    events = [item]
                if result is not None:
                    events = [self._with_prefill_logprobs(e, result, seen) for e in events]
                for event in events:
                    seen.add(event.index)
                    self._tokens_sent = self._tokens_sent or bool(event.token_ids)
                    self._generated[event.index] += event.token_ids
                    if event.finish_reason is not None:
                        self._unfinished.discard(event.index)
                    self._finished = not self._unfinished
                    yield event
                    if self._finished:
                        return
            await self._recover(failure)

    def _with_prefill_logprobs(self, event: TokensEvent, result: PrefillResult, seen: set[int]) -> TokensEvent:
        """A sequence's first event from a remote prefill, with the prefill server's log-probabilities."""
        if event.index in seen:
            return event
        seen.add(event.index)
        update: dict[str, object] = {}
        if result.first_logprobs is not None and event.logprobs is None and event.token_ids:
            update["logprobs"] = [result.first_logprobs[event.index]]
        if event.index == 0 and result.prompt_logprobs is not None:
            update["prompt_logprobs"] = result.prompt_logprobs
        return event.model_copy(update=update) if update else event

    def _start_attempt(self) -> asyncio.Queue:
        # A fresh queue per attempt: whatever an old attempt's tasks still put goes nowhere.
        queue: asyncio.Queue = asyncio.Queue()
        self._queue = queue
        assert self._legs
        self._tasks = [asyncio.create_task(self._pump_decode(queue, leg)) for leg in self._legs]
        if self.reservation is not None:
            self._tasks.append(asyncio.create_task(self._prefill_then_release(queue, self.attempt_id)))
        return queue

    async def _pump_decode(self, queue: asyncio.Queue, leg: Leg) -> None:
        stream = leg.stream
        try:
            async for event in stream.events():
                if leg.index is not None and isinstance(event, TokensEvent):
                    event = event.model_copy(update={"index": leg.index})
                queue.put_nowait(event)
        except WorkerFailed as exc:
            self._ctx.health.failed(stream.worker, exc)
            queue.put_nowait(exc)

    async def _prefill_then_release(self, queue: asyncio.Queue, attempt_id: str) -> None:
        """The first prefill holds the prefill slot the request was admitted with; a retry's runs without one."""
        try:
            await self._run_prefill(queue, attempt_id)
        finally:
            self._first_slot.release_prefill()

    async def _run_prefill(self, queue: asyncio.Queue, attempt_id: str) -> None:
        """Hand prompt + reservation to a prefill server this request has not tried.
        One that never saw the request (not connected, or refused it at once) is
        followed by the next one."""
        reservation = self.reservation
        assert reservation is not None
        ctx = self._ctx
        candidates = [
            w
            for w in ctx.prefill_policy.order(ctx.registry.healthy("prefill"), self._prompt)
            if w.name not in self._tried_prefill and w.can_hold(len(self._prompt) + 1)
        ]
        for worker in candidates:
            self.prefill = worker
            self._tried_prefill.add(worker.name)
            try:
                with ctx.admission.prefilling(worker, len(self._prompt)):
                    # The lease as it stands now: the time the router held the reservation is taken off.
                    left = reservation.lease_s - (time.monotonic() - self._reserved_at)
                    if left <= 0:
                        return  # the decode server's lease ran out: its stream says so, and what follows
                    req = PrefillRequest(
                        request_id=attempt_id,
                        prompt_token_ids=self._prompt,
                        sampling=self._sampling,
                        reservation=reservation.model_copy(update={"lease_s": left}),
                        trace=self._trace,
                        tenant=self._tenant,
                    )
                    self.prefill_result = await ctx.client.prefill(worker, req)
                queue.put_nowait(self.prefill_result)
                return
            except WorkerFailed as exc:
                ctx.health.failed(worker, exc)
                if exc.never_reached:
                    continue
                if exc.outcome in DECIDED_BY_DECODE:
                    return  # the decode server ended the transfer; its stream says what happens next
                queue.put_nowait(exc)
                return
        queue.put_nowait(WorkerFailed("prefill", "", "no healthy prefill server", Outcome.NO_PREFILL))

    def move_off(self, worker: Worker) -> bool:
        """``worker`` (a decode server) is leaving: if this request streams from it, it migrates now, as
        on a stream that broke (the old attempt is aborted there, which frees its blocks)."""
        if self._closed or self._finished or self._queue is None:
            return False
        if not any(leg.stream.worker is worker for leg in self._legs):
            return False
        failure = WorkerFailed.of(worker, "draining: its streams move to another decode server", Outcome.DRAINING)
        self._queue.put_nowait(failure)
        return True

    def _prefill_abandoned(self, event: ReprefillEvent) -> None:
        """The decode server computes the prompt itself: stop the prefill server's part."""
        log.warning("request %s: %s computes the prompt itself (%s)", self.attempt_id, self.decode.name, event.code)
        self._ctx.recovery.reprefills.labels(outcome=event.code).inc()
        for task in self._tasks[1:]:
            task.cancel()
        if self.prefill is not None:
            task = asyncio.create_task(self._ctx.client.abort(self.prefill, self.attempt_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _recover(self, failure: WorkerFailed) -> None:
        """Start the request over (new attempt), migrate it, or raise the client's error."""
        ctx = self._ctx
        ctx.recovery.failures.labels(stage=failure.stage, outcome=failure.outcome).inc()
        other = any(w.name not in self._tried_prefill for w in ctx.registry.healthy("prefill"))
        decision = decide(
            ctx.prefill_failure,
            failure,
            tokens_sent=self._tokens_sent,
            attempts=self._attempts,
            other_prefill=other,
            migrations=self.migrations,
            migration_limit=ctx.migration_limit,
        )
        if decision.action == "fail":
            raise self._failed(failure, decision.why)
        if decision.action == "migrate":
            await self._migrate(failure)
            return
        log.warning("request %s: %s; starting over (%s)", self.attempt_id, failure, decision.action)
        ctx.recovery.retries.labels(action=decision.action, outcome=failure.outcome).inc()
        await self._end_attempt()
        self._attempts += 1
        self.attempt_id = f"{self.request_id}-retry{self._attempts - 1}"
        self.prefill, self.prefill_result = None, None
        stream, slot = await ctx.open_stream(
            self.attempt_id, self._prompt, self._sampling, decision.action == "local", self._trace, [], frozenset()
        )
        self._opened(Leg(stream, slot, self._attempt_of(stream, self.attempt_id)))

    def _failed(self, failure: WorkerFailed, why: str = "") -> OpenAIError:
        why = f"; {why}" if why else ""
        return OpenAIError(500, f"{failure}{why} (request id {self.request_id})", code=failure.outcome)

    def _attempt_of(self, stream: DecodeStream, asked: str) -> str:
        """The id ``stream`` was opened under (``asked``, or another one if an open under ``asked`` was
        given up on: router.cluster.dispatch.OpenIds); the request's current attempt from now on."""
        self.attempt_id = stream.request_id or asked
        return self.attempt_id

    def _opened(self, leg: Leg) -> None:
        """``leg`` joins the current attempt (its first: the one whose reservation a prefill server fills)."""
        if not self._legs:
            self.decode = leg.stream.worker
            self.reservation = leg.stream.reservation
            self._reserved_at = time.monotonic()
            if not self._tokens_sent:
                self.cached_tokens = leg.stream.num_cached_tokens
        self._legs.append(leg)

    async def _migrate(self, failure: WorkerFailed) -> None:
        """Continue the request on other decode servers from the tokens already passed on."""
        ctx = self._ctx
        if failure.worker:
            self._failed_decode.add(failure.worker)
        self.migrations += 1
        ctx.recovery.migrations.labels(cause=failure.outcome).inc()
        log.warning("request %s: %s; migrating it (%d)", self.attempt_id, failure, self.migrations)
        await self._end_attempt(wait_for_aborts=False)  # the dead server's aborts do not hold up the seam
        self.prefill, self.prefill_result = None, None
        attempt = f"{self.request_id}-migrate{self.migrations}"
        self.attempt_id = attempt
        avoid = frozenset(self._failed_decode)
        sampling = self._sampling
        try:
            if not self._tokens_sent:  # nothing reached the client: open again, as a new request would
                self._tried_prefill = set()
                stream, slot = await ctx.open_stream(attempt, self._prompt, sampling, None, self._trace, [], avoid)
                self._opened(Leg(stream, slot, self._attempt_of(stream, attempt)))
            elif sampling.n == 1:
                generated = self._generated[0]
                opened = await ctx.open_stream(attempt, self._prompt, sampling, True, self._trace, generated, avoid)
                self._opened(Leg(*opened, self._attempt_of(opened[0], attempt)))
            else:
                for i in sorted(self._unfinished):
                    one = replace(sampling.for_sequence(i), n=1)
                    if i != 0 or self._generated[0]:  # the prompt's log-probabilities went with sequence 0
                        one = replace(one, prompt_logprobs=None)
                    rid = f"{attempt}-{i}"
                    opened = await ctx.open_stream(rid, self._prompt, one, True, self._trace, self._generated[i], avoid)
                    self._opened(Leg(*opened, opened[0].request_id or rid, index=i))
        except OpenAIError as exc:  # no decode server left (or none with room in time)
            raise self._failed(failure, f"no other decode server could continue it: {exc.message}") from exc

    async def _end_attempt(self, wait_for_aborts: bool = True) -> None:
        """Stop the current attempt's tasks; abort it on its servers unless it finished."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        legs, self._legs = self._legs, []
        if not legs:
            return
        for leg in legs:
            await leg.stream.aclose()
            leg.slot.release()
        if self._finished:
            return
        client = self._ctx.client
        aborts = [client.abort(leg.stream.worker, leg.attempt_id) for leg in legs]
        if self.prefill is not None:
            aborts.append(client.abort(self.prefill, self.attempt_id))
        if wait_for_aborts:
            await asyncio.gather(*aborts)
            return
        task = asyncio.ensure_future(asyncio.gather(*aborts))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Release everything; aborts on both servers unless the request finished. Once begun, the release
        runs to its end in a task of its own, however its caller is cancelled meanwhile (the close is
        marked done at once, so a second close could not finish it)."""
        if self._closed:
            return
        self._closed = True
        self._ctx.live.discard(self)
        task = asyncio.ensure_future(self._release())
        _RELEASING.add(task)
        task.add_done_callback(_released)
        await asyncio.shield(task)

    async def _release(self) -> None:
        await self._end_attempt()
        self._first_slot.release_prefill()
        self._ctx.admission.session_ended()
        await asyncio.gather(*self._background, return_exceptions=True)
