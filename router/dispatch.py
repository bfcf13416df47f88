"""One request's trip through the cluster (DESIGN.md, "The request path").

``Dispatcher.start`` admits the request (``router.admission``: a free slot on
a decode server, and on the prefill servers when it needs one, or a bounded
wait, or 429), picks a decode server and opens the ``/generate`` stream
whose first event is the reservation; only then (so a prefill server never
computes for nothing) does the ``Session`` hand the prompt and the
reservation to a prefill server. ``Session.deltas`` yields the decode
server's tokens.

A step that fails before the first token may start the request over, once
(``router.recovery``): the attempt is aborted on both servers (its blocks are
freed and its transfer id is dead, so nothing still on its way lands
anywhere) and a new attempt opens under a new id, ``<id>-retry1``. A decode
failure ends the request at once. ``Session.close`` is idempotent and always
runs (the HTTP layer calls it in ``finally``): if the request did not finish
it closes the decode stream and aborts the request on both servers, which
free its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from router.admission import Admission, AdmissionSettings
from router.errors import OpenAIError
from router.metrics import RecoveryMetrics
from router.policies import Policy
from router.recovery import DECIDED_BY_DECODE, KV_NEVER_ARRIVED, StepFailed, decide
from router.registry import Worker, WorkerRegistry
from router.settings import PrefillFailure, RouterSettings
from router.worker_client import DecodeStream, NoRoom, WorkerClient, WorkerFailed, WorkerUnreachable
from server_common.guard import Drain
from server_common.worker_replies import PrefillResult, ReprefillEvent, TokensEvent
from server_common.worker_requests import GenerateRequest, PrefillRequest, SamplingSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DispatchSettings:
    local_prefill_threshold: int = RouterSettings.local_prefill_threshold  # prompts shorter than this: prefilled on D
    prefill_failure: PrefillFailure = RouterSettings.prefill_failure  # router/recovery.py
    no_room_cooldown: float = 0.2  # after a decode server said "no room", skip it this long (or until a slot frees)


class Session:
    def __init__(self, dispatcher: Dispatcher, request_id: str, prompt: list[int], sampling: SamplingSpec,
                 decode: Worker, stream: DecodeStream, prefill_slot: bool = False) -> None:
        self.request_id = request_id
        self.attempt_id = request_id  # what the servers call the current attempt
        self.decode: Worker | None = decode
        self.prefill: Worker | None = None
        self.prefill_result: PrefillResult | None = None
        self.reservation = stream.reservation  # None: the decode server prefills locally
        self._dispatcher = dispatcher
        self._prompt = prompt
        self._sampling = sampling
        self._stream: DecodeStream | None = stream
        self._tasks: list[asyncio.Task] = []  # the current attempt's decode pump and prefill call
        self._background: set[asyncio.Task] = set()  # aborts of an abandoned prefill
        self._tried_prefill: set[str] = set()
        self._attempts = 1
        self._tokens_sent = False
        self._finished = False
        self._closed = False
        self._prefill_slot = prefill_slot  # one of the admission's prefills_pending, released once

    def _release_prefill_slot(self) -> None:
        if self._prefill_slot:
            self._prefill_slot = False
            self._dispatcher.admission.prefill_ended()

    async def _prefill_then_release(self, queue: asyncio.Queue, attempt_id: str) -> None:
        """The first prefill holds the slot the request was admitted with; a retry's runs without one."""
        try:
            await self._run_prefill(queue, attempt_id)
        finally:
            self._release_prefill_slot()

    async def deltas(self) -> AsyncIterator[TokensEvent]:
        """Token events up to and including the one with a finish_reason.

        Raises ``OpenAIError`` (500, naming the worker and the request id) when
        a step fails and the request cannot start over.
        """
        while True:
            queue = self._start_attempt()
            failure = None
            while failure is None:
                item = await queue.get()
                if isinstance(item, StepFailed):
                    failure = item
                elif isinstance(item, ReprefillEvent):
                    self._prefill_abandoned(item)
                else:
                    self._tokens_sent = self._tokens_sent or bool(item.token_ids)
                    self._finished = item.finish_reason is not None
                    yield item
                    if self._finished:
                        return
            await self._recover(failure)

    def _start_attempt(self) -> asyncio.Queue:
        # A fresh queue per attempt: whatever an old attempt's tasks still put goes nowhere.
        queue: asyncio.Queue = asyncio.Queue()
        assert self.decode is not None and self._stream is not None
        self._tasks = [asyncio.create_task(self._pump_decode(queue, self.decode, self._stream))]
        if self.reservation is not None:
            self._tasks.append(asyncio.create_task(self._prefill_then_release(queue, self.attempt_id)))
        return queue

    async def _pump_decode(self, queue: asyncio.Queue, worker: Worker, stream: DecodeStream) -> None:
        try:
            async for event in stream.events():
                queue.put_nowait(event)
        except WorkerFailed as exc:
            stage = "prefill" if exc.code in KV_NEVER_ARRIVED else "decode"
            queue.put_nowait(StepFailed(stage, worker.name, str(exc), exc.code))
        except WorkerUnreachable as exc:
            self._dispatcher.registry.mark_down(worker, str(exc))
            queue.put_nowait(StepFailed("decode", worker.name, str(exc), "decode_failed"))

    async def _run_prefill(self, queue: asyncio.Queue, attempt_id: str) -> None:
        """Hand prompt + reservation to a prefill server this request has not tried.
        One that cannot be connected to never saw the request, so the next one is tried."""
        reservation = self.reservation
        assert reservation is not None
        req = PrefillRequest(request_id=attempt_id, prompt_token_ids=self._prompt,
                             sampling=self._sampling, reservation=reservation)
        d = self._dispatcher
        candidates = [w for w in d.prefill_policy.order(d.registry.healthy("prefill"))
                      if w.name not in self._tried_prefill]
        for worker in candidates:
            self.prefill = worker
            self._tried_prefill.add(worker.name)
            worker.inflight += 1
            worker.inflight_tokens += len(self._prompt)
            try:
                self.prefill_result = await d.client.prefill(worker, req)
                return
            except WorkerUnreachable as exc:
                d.registry.mark_down(worker, str(exc))
                if exc.never_connected:
                    continue
                failure = StepFailed("prefill", worker.name, str(exc), "prefill_failed")
            except WorkerFailed as exc:
                if exc.code in DECIDED_BY_DECODE:
                    return  # the decode server ended the transfer; its stream says what happens next
                failure = StepFailed("prefill", worker.name, str(exc), exc.code)
            finally:
                worker.inflight -= 1
                worker.inflight_tokens -= len(self._prompt)
            queue.put_nowait(failure)
            return
        queue.put_nowait(StepFailed("prefill", "", "no healthy prefill server", "no_prefill"))

    def _prefill_abandoned(self, event: ReprefillEvent) -> None:
        """The decode server computes the prompt itself: stop the prefill server's part."""
        log.warning("request %s: %s computes the prompt itself (%s)", self.attempt_id,
                    self.decode.name if self.decode else "?", event.code)
        self._dispatcher.recovery.reprefills.labels(cause=event.code).inc()
        for task in self._tasks[1:]:
            task.cancel()
        if self.prefill is not None:
            task = asyncio.create_task(self._dispatcher.client.abort(self.prefill, self.attempt_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _recover(self, failure: StepFailed) -> None:
        """Start the request over (new attempt) or raise the client's error."""
        d = self._dispatcher
        d.recovery.failures.labels(stage=failure.stage, code=failure.code).inc()
        other = any(w.name not in self._tried_prefill for w in d.registry.healthy("prefill"))
        decision = decide(d.settings.prefill_failure, failure, tokens_sent=self._tokens_sent,
                          attempts=self._attempts, other_prefill=other)
        if decision.action == "fail":
            why = f"; {decision.why}" if decision.why else ""
            raise OpenAIError(500, f"{failure.message}{why} (request id {self.request_id})", code=failure.code)
        log.warning("request %s: %s; starting over (%s)", self.attempt_id, failure.message, decision.action)
        d.recovery.retries.labels(action=decision.action, cause=failure.code).inc()
        await self._end_attempt()
        self._attempts += 1
        self.attempt_id = f"{self.request_id}-retry{self._attempts - 1}"
        self.prefill, self.prefill_result = None, None
        self.decode, self._stream = await d.open_stream(self.attempt_id, self._prompt, self._sampling,
                                                        local=decision.action == "local")
        self.reservation = self._stream.reservation

    async def _end_attempt(self) -> None:
        """Stop the current attempt's tasks; abort it on both servers unless it finished."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stream, self._stream = self._stream, None
        if stream is None or self.decode is None:
            return
        await stream.aclose()
        self._dispatcher.admission.decode_freed(self.decode)
        if not self._finished:
            client = self._dispatcher.client
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
        self._release_prefill_slot()
        self._dispatcher.admission.sessions -= 1
        await asyncio.gather(*self._background, return_exceptions=True)


class Dispatcher:
    def __init__(self, registry: WorkerRegistry, decode_policy: Policy, prefill_policy: Policy,
                 client: WorkerClient, settings: DispatchSettings, recovery: RecoveryMetrics | None = None,
                 admission: Admission | None = None, drain: Drain | None = None) -> None:
        self.registry = registry
        self.decode_policy = decode_policy
        self.prefill_policy = prefill_policy
        self.client = client
        self.settings = settings
        self.recovery = recovery or RecoveryMetrics(CollectorRegistry())
        self.admission = admission or Admission(AdmissionSettings())
        self.drain = drain  # the router's own: once draining, no new session starts

    def wants_local_prefill(self, num_prompt_tokens: int) -> bool:
        """No prefill servers at all (colocated), a prompt short enough for D, or
        (unless recovery is "fail") no prefill server in rotation right now."""
        if not self.registry.of_role("prefill"):
            return True
        if num_prompt_tokens < self.settings.local_prefill_threshold:
            return True
        return self.settings.prefill_failure != "fail" and not self.registry.healthy("prefill")

    async def start(self, request_id: str, prompt: list[int], sampling: SamplingSpec) -> Session:
        """Admit the request and open its decode stream (reservation first).

        Raises OpenAIError 503 when no decode server is in rotation or the router
        is shutting down, and 429 (with Retry-After) when every one is at its
        in-flight limit or full and the waiting room is full or the wait too
        long (see ``router.admission``).
        """
        if self.drain is not None and self.drain.draining:
            raise OpenAIError(503, "the router is shutting down; retry later", code="draining",
                              retry_after=self.admission.settings.retry_after)
        local = self.wants_local_prefill(len(prompt))
        worker, stream = await self.open_stream(request_id, prompt, sampling, local=local, prefill_slot=not local)
        self.admission.sessions += 1
        return Session(self, request_id, prompt, sampling, worker, stream,
                       prefill_slot=not local and stream.reservation is not None)

    async def open_stream(self, request_id: str, prompt: list[int], sampling: SamplingSpec, local: bool,
                          prefill_slot: bool = False) -> tuple[Worker, DecodeStream]:
        """A decode stream on the first server in policy order with a free slot that takes it,
        waiting for one (``Admission.admit``). ``prefill_slot``: also claim one of the prefill
        servers' slots (a new request; a retry runs its prefill without one)."""
        req = GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling, local_prefill=local)
        return await self.admission.admit(lambda: self._try_open(req, prefill_slot))

    async def _try_open(self, req: GenerateRequest, prefill_slot: bool) -> tuple[Worker, DecodeStream] | None:
        """None when every decode server in rotation is full (or, with ``prefill_slot``, the prefill
        servers are). The prefill slot is claimed with the decode slot, so that no prefill server is
        sent more than its share and no reservation is made that could not be prefilled soon."""
        in_rotation = self.registry.healthy("decode")
        if not in_rotation:
            raise OpenAIError(503, "no healthy decode server", retry_after=1)
        if prefill_slot and self.admission.prefill_is_full(self.registry.healthy("prefill")):
            return None
        now = time.monotonic()
        for worker in self.decode_policy.order([w for w in in_rotation if w.has_room(now)]):
            self.admission.claim(worker, prefill_slot)
            try:
                stream = await self.client.open_decode(worker, req)
            except NoRoom:
                self.admission.unclaim(worker, prefill_slot)
                worker.full_until = time.monotonic() + self.settings.no_room_cooldown
                continue
            except WorkerUnreachable as exc:
                self.admission.unclaim(worker, prefill_slot)
                self.registry.mark_down(worker, str(exc))
                continue
            except WorkerFailed as exc:
                self.admission.unclaim(worker, prefill_slot)
                raise OpenAIError(500, f"{exc} (request id {req.request_id})") from exc
            except BaseException:
                self.admission.unclaim(worker, prefill_slot)
                raise
            if prefill_slot and stream.reservation is None:  # the decode server prefills it itself
                self.admission.prefills_pending -= 1
            return worker, stream
        return None
