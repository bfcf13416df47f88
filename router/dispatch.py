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

from router.errors import OpenAIError
from router.policies import Policy
from router.registry import Worker, WorkerRegistry
from router.worker_client import DecodeStream, NoRoom, WorkerClient, WorkerFailed, WorkerUnreachable
from server_common.worker_replies import PrefillResult, TokensEvent
from server_common.worker_requests import GenerateRequest, PrefillRequest, SamplingSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DispatchSettings:
    local_prefill_threshold: int = 0  # prompts shorter than this are prefilled on D
    queue_timeout: float = 10.0  # how long to wait for room on some decode server
    retry_interval: float = 0.05


class Session:
    def __init__(self, dispatcher: Dispatcher, request_id: str, prompt: list[int], sampling: SamplingSpec,
                 decode: Worker, stream: DecodeStream) -> None:
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

    async def deltas(self) -> AsyncIterator[TokensEvent]:
        """Token events up to and including the one with a finish_reason.

        Raises ``OpenAIError`` (500, naming the worker) when a server fails.
        """
        self._tasks.append(asyncio.create_task(self._pump_decode()))
        if self.reservation is not None:
            self._tasks.append(asyncio.create_task(self._run_prefill()))
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
        if not self._finished:
            client = self._dispatcher.client
            aborts = [client.abort(self.decode, self.request_id)]
            if self.prefill is not None:
                aborts.append(client.abort(self.prefill, self.request_id))
            await asyncio.gather(*aborts)


class Dispatcher:
    def __init__(self, registry: WorkerRegistry, decode_policy: Policy, prefill_policy: Policy,
                 client: WorkerClient, settings: DispatchSettings) -> None:
        self.registry = registry
        self.decode_policy = decode_policy
        self.prefill_policy = prefill_policy
        self.client = client
        self.settings = settings

    def wants_local_prefill(self, num_prompt_tokens: int) -> bool:
        """No prefill servers at all (colocated), or a prompt short enough for D."""
        if not self.registry.of_role("prefill"):
            return True
        return num_prompt_tokens < self.settings.local_prefill_threshold

    async def start(self, request_id: str, prompt: list[int], sampling: SamplingSpec) -> Session:
        """Open the decode stream (reservation first). Raises OpenAIError 503 when no
        decode server has room within ``queue_timeout``."""
        req = GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                              local_prefill=self.wants_local_prefill(len(prompt)))
        deadline = time.monotonic() + self.settings.queue_timeout
        retry_after = 1.0
        while True:
            candidates = self.decode_policy.order(self.registry.healthy("decode"))
            if not candidates:
                raise OpenAIError(503, "no healthy decode server", retry_after=1)
            for worker in candidates:
                worker.inflight += 1
                try:
                    stream = await self.client.open_decode(worker, req)
                except NoRoom as exc:
                    worker.inflight -= 1
                    retry_after = exc.retry_after
                    continue
                except WorkerUnreachable as exc:
                    worker.inflight -= 1
                    self.registry.mark_down(worker, str(exc))
                    continue
                except WorkerFailed as exc:
                    worker.inflight -= 1
                    raise OpenAIError(500, f"{exc} (request id {request_id})") from exc
                except BaseException:
                    worker.inflight -= 1
                    raise
                return Session(self, request_id, prompt, sampling, worker, stream)
            if time.monotonic() >= deadline:
                raise OpenAIError(503, "all decode servers are full; retry later", retry_after=retry_after)
            await asyncio.sleep(self.settings.retry_interval)
