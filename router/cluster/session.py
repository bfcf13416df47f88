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

A step that fails before the first token may start the request over, once
(``router.cluster.recovery``): the attempt is aborted on both servers (its blocks are
freed and its transfer id is dead, so nothing still on its way lands
anywhere) and a new attempt opens under a new id, ``<id>-retry1``. A decode
failure ends the request at once. ``close`` is idempotent and always runs
(the HTTP layer calls it in ``finally``): if the request did not finish it
closes the decode stream and aborts the request on both servers, which free
its blocks. Every admission slot the session holds is released there too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from engine.request import SamplingParams
from router.cluster.admission import Admission, Slot
from router.cluster.health import PassiveHealth
from router.cluster.policies import Policy
from router.cluster.recovery import decide
from router.cluster.registry import Worker, WorkerRegistry
from router.cluster.worker_client import DecodeStream, WorkerClient, WorkerFailed
from router.errors import OpenAIError
from router.metrics import RecoveryMetrics
from router.settings import PrefillFailure
from server_common.worker_replies import PrefillResult, ReprefillEvent, TokensEvent
from server_common.worker_requests import PrefillRequest
from transfer.outcome import DECIDED_BY_DECODE, Outcome

log = logging.getLogger(__name__)

# (attempt id, prompt, sampling, local, traceparent) -> an open decode stream and the admission slot it holds
OpenStream = Callable[[str, list[int], SamplingParams, bool, str | None], Awaitable[tuple[DecodeStream, Slot]]]


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
        self.attempt_id = request_id  # what the servers call the current attempt
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
        self._stream: DecodeStream | None = stream
        self._slot = slot  # the current attempt's; the first one also holds the request's prefill slot
        self._first_slot = slot
        self._tasks: list[asyncio.Task] = []  # the current attempt's decode pump and prefill call
        self._background: set[asyncio.Task] = set()  # aborts of an abandoned prefill
        self._tried_prefill: set[str] = set()
        self._attempts = 1
        self._tokens_sent = False
        self._unfinished = set(range(sampling.n))  # sequences whose last event is still to come
        self._finished = False
        self._closed = False
        ctx.admission.session_started()

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
        assert self._stream is not None
        self._tasks = [asyncio.create_task(self._pump_decode(queue, self._stream))]
        if self.reservation is not None:
            self._tasks.append(asyncio.create_task(self._prefill_then_release(queue, self.attempt_id)))
        return queue

    async def _pump_decode(self, queue: asyncio.Queue, stream: DecodeStream) -> None:
        try:
            async for event in stream.events():
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
        """Start the request over (new attempt) or raise the client's error."""
        ctx = self._ctx
        ctx.recovery.failures.labels(stage=failure.stage, outcome=failure.outcome).inc()
        other = any(w.name not in self._tried_prefill for w in ctx.registry.healthy("prefill"))
        decision = decide(
            ctx.prefill_failure, failure, tokens_sent=self._tokens_sent, attempts=self._attempts, other_prefill=other
        )
        if decision.action == "fail":
            why = f"; {decision.why}" if decision.why else ""
            raise OpenAIError(500, f"{failure}{why} (request id {self.request_id})", code=failure.outcome)
        log.warning("request %s: %s; starting over (%s)", self.attempt_id, failure, decision.action)
        ctx.recovery.retries.labels(action=decision.action, outcome=failure.outcome).inc()
        await self._end_attempt()
        self._attempts += 1
        self.attempt_id = f"{self.request_id}-retry{self._attempts - 1}"
        self.prefill, self.prefill_result = None, None
        self._stream, self._slot = await ctx.open_stream(
            self.attempt_id, self._prompt, self._sampling, decision.action == "local", self._trace
        )
        self.decode = self._stream.worker
        self.reservation = self._stream.reservation
        self._reserved_at = time.monotonic()
        self.cached_tokens = self._stream.num_cached_tokens

    async def _end_attempt(self) -> None:
        """Stop the current attempt's tasks; abort it on both servers unless it finished."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stream, self._stream = self._stream, None
        if stream is None:
            return
        await stream.aclose()
        self._slot.release()
        if not self._finished:
            client = self._ctx.client
            aborts = [client.abort(self.decode, self.attempt_id)]
            if self.prefill is not None:
                aborts.append(client.abort(self.prefill, self.attempt_id))
            await asyncio.gather(*aborts)

    async def close(self) -> None:
        """Release everything; aborts on both servers unless the request finished."""
        if self._closed:
            return
        self._closed = True
        await self._end_attempt()
        self._first_slot.release_prefill()
        self._ctx.admission.session_ended()
        await asyncio.gather(*self._background, return_exceptions=True)
