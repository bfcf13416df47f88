"""One request's trip through the cluster (DESIGN.md, "The request path").

``Dispatcher.start`` picks a decode server and opens the ``/generate`` stream
whose first event is the reservation; only then (so a prefill server never
computes for nothing) does the ``Session`` hand the prompt and the
reservation to a prefill server. ``Session.deltas`` yields the decode
server's tokens. ``Session.close`` is idempotent and always runs (the HTTP
layer calls it in ``finally``): if the request did not finish it closes the
decode stream and aborts the request on both servers, which free its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from router.admission import Admission, AdmissionSettings
from router.errors import OpenAIError
from router.policies import Policy
from router.registry import Worker, WorkerRegistry
from router.worker_client import DecodeStream, NoRoom, WorkerClient, WorkerFailed, WorkerUnreachable
from server_common.guard import Drain
from server_common.worker_replies import PrefillResult, TokensEvent
from server_common.worker_requests import GenerateRequest, PrefillRequest, SamplingSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DispatchSettings:
    local_prefill_threshold: int = 0  # prompts shorter than this are prefilled on D
    no_room_cooldown: float = 0.2  # after a decode server said "no room", skip it this long (or until a slot frees)


class Session:
    def __init__(self, dispatcher: Dispatcher, request_id: str, prompt: list[int], sampling: SamplingSpec,
                 decode: Worker, stream: DecodeStream, prefill_slot: bool = False) -> None:
        self.request_id = request_id
        self.decode = decode
        self.prefill: Worker | None = None
        self.prefill_result: PrefillResult | None = None
        self.reservation = stream.reservation  # None: the decode server prefills locally
        self._dispatcher = dispatcher
        self._prompt = prompt
        self._sampling = sampling
        self._stream = stream
        self._queue: asyncio.Queue[TokensEvent | BaseException] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._finished = False
        self._closed = False
        self._prefill_slot = prefill_slot  # one of the dispatcher's prefills_pending, released once

    def _release_prefill_slot(self) -> None:
        if self._prefill_slot:
            self._prefill_slot = False
            self._dispatcher.prefill_ended()

    async def _prefill_then_release(self) -> None:
        try:
            await self._run_prefill()
        finally:
            self._release_prefill_slot()

    async def deltas(self) -> AsyncIterator[TokensEvent]:
        """Token events up to and including the one with a finish_reason.

        Raises ``OpenAIError`` (500, naming the worker) when a server fails.
        """
        self._tasks.append(asyncio.create_task(self._pump_decode()))
        if self.reservation is not None:
            self._tasks.append(asyncio.create_task(self._prefill_then_release()))
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise OpenAIError(500, f"{item} (request id {self.request_id})", code=getattr(item, "code", None))
            if item.finish_reason is not None:
                self._finished = True
            yield item
            if self._finished:
                return

    async def _pump_decode(self) -> None:
        try:
            async for event in self._stream.events():
                self._queue.put_nowait(event)
        except (WorkerFailed, WorkerUnreachable) as exc:
            if isinstance(exc, WorkerUnreachable):
                self._dispatcher.registry.mark_down(self.decode, str(exc))
            self._queue.put_nowait(exc)

    async def _run_prefill(self) -> None:
        """Hand prompt + reservation to a prefill server. One that cannot be
        connected to never saw the request, so the next one is tried."""
        reservation = self.reservation
        assert reservation is not None
        req = PrefillRequest(request_id=self.request_id, prompt_token_ids=self._prompt,
                             sampling=self._sampling, reservation=reservation)
        registry = self._dispatcher.registry
        candidates = self._dispatcher.prefill_policy.order(registry.healthy("prefill"))
        error: Exception = WorkerFailed(self.decode, "no healthy prefill server", "no_prefill")
        for worker in candidates:
            self.prefill = worker
            worker.inflight += 1
            worker.inflight_tokens += len(self._prompt)
            try:
                self.prefill_result = await self._dispatcher.client.prefill(worker, req)
                return
            except WorkerUnreachable as exc:
                registry.mark_down(worker, str(exc))
                error = exc
                if not exc.never_connected:
                    break
            except WorkerFailed as exc:
                error = exc
                break
            finally:
                worker.inflight -= 1
                worker.inflight_tokens -= len(self._prompt)
        self._queue.put_nowait(error)

    async def close(self) -> None:
        """Release everything; aborts on both servers unless the request finished."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._stream.aclose()
        self.decode.inflight -= 1
        self._release_prefill_slot()
        self._dispatcher.session_ended(self)
        if not self._finished:
            client = self._dispatcher.client
            aborts = [client.abort(self.decode, self.request_id)]
            if self.prefill is not None:
                aborts.append(client.abort(self.prefill, self.request_id))
            await asyncio.gather(*aborts)


class Dispatcher:
    def __init__(self, registry: WorkerRegistry, decode_policy: Policy, prefill_policy: Policy,
                 client: WorkerClient, settings: DispatchSettings, admission: Admission | None = None,
                 drain: Drain | None = None) -> None:
        self.registry = registry
        self.decode_policy = decode_policy
        self.prefill_policy = prefill_policy
        self.client = client
        self.settings = settings
        self.admission = admission or Admission(AdmissionSettings())
        self.drain = drain  # the router's own: once draining, no new session starts
        self.sessions = 0  # sessions open now (a draining router waits for 0)
        self.prefills_pending = 0  # sessions admitted for a prefill server whose prefill has not ended

    def session_ended(self, session: Session) -> None:
        """A session released its decode slot: wake the waiting room."""
        self.sessions -= 1
        session.decode.full_until = 0.0  # its blocks were freed: worth asking again
        self.admission.slot_freed()

    def _claim(self, worker: Worker, prefill_slot: bool) -> None:
        worker.inflight += 1
        self.prefills_pending += prefill_slot

    def _unclaim(self, worker: Worker, prefill_slot: bool) -> None:
        worker.inflight -= 1
        self.prefills_pending -= prefill_slot

    def prefill_ended(self) -> None:
        self.prefills_pending -= 1
        self.admission.slot_freed()

    def wants_local_prefill(self, num_prompt_tokens: int) -> bool:
        """No prefill servers at all (colocated), or a prompt short enough for D."""
        if not self.registry.of_role("prefill"):
            return True
        return num_prompt_tokens < self.settings.local_prefill_threshold

    async def start(self, request_id: str, prompt: list[int], sampling: SamplingSpec) -> Session:
        """Open the decode stream (reservation first).

        Raises OpenAIError 503 when no decode server is in rotation or the router
        is shutting down, and 429
        (with Retry-After) when every one is at its in-flight limit or full and
        the waiting room is full or the wait too long (see ``router.admission``).
        """
        if self.drain is not None and self.drain.draining:
            raise OpenAIError(503, "the router is shutting down; retry later", code="draining",
                              retry_after=self.admission.settings.retry_after)
        req = GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                              local_prefill=self.wants_local_prefill(len(prompt)))
        return await self.admission.admit(lambda: self._try_open(req))

    def _prefill_is_full(self) -> bool:
        """Every prefill server in rotation has a limit and together they are at it."""
        limits = [w.max_inflight for w in self.registry.healthy("prefill")]
        if not limits or None in limits:
            return False  # none in rotation is the prefill call's own error; no limit, no slot
        return self.prefills_pending >= sum(limits)

    async def _try_open(self, req: GenerateRequest) -> Session | None:
        """A session on the first decode server in policy order that takes it; None when all are full.

        A request for a prefill server also needs one of their slots, claimed
        here with the decode slot so that no prefill server is sent more than
        its share and no reservation is made that could not be prefilled soon.
        """
        in_rotation = self.registry.healthy("decode")
        if not in_rotation:
            raise OpenAIError(503, "no healthy decode server", retry_after=1)
        prefill_slot = not req.local_prefill
        if prefill_slot and self._prefill_is_full():
            return None
        now = time.monotonic()
        for worker in self.decode_policy.order([w for w in in_rotation if w.has_room(now)]):
            self._claim(worker, prefill_slot)
            try:
                stream = await self.client.open_decode(worker, req)
            except NoRoom:
                self._unclaim(worker, prefill_slot)
                worker.full_until = time.monotonic() + self.settings.no_room_cooldown
                continue
            except WorkerUnreachable as exc:
                self._unclaim(worker, prefill_slot)
                self.registry.mark_down(worker, str(exc))
                continue
            except WorkerFailed as exc:
                self._unclaim(worker, prefill_slot)
                raise OpenAIError(500, f"{exc} (request id {req.request_id})") from exc
            except BaseException:
                self._unclaim(worker, prefill_slot)
                raise
            if prefill_slot and stream.reservation is None:  # the decode server prefills it itself
                self.prefills_pending -= 1
                prefill_slot = False
            self.sessions += 1
            return Session(self, req.request_id, req.prompt_token_ids, req.sampling, worker, stream, prefill_slot)
        return None
