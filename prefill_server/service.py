"""The prefill server's logic: prefill prompts into decode servers' reservations.

Each ``/prefill`` becomes a job on the engine thread. The engine batches and
chunks prompts as usual; its ``layer_hook`` queues each layer's freshly
written K/V of every job with the KV sender right away (its own thread moves
the bytes), so the transfer of layer i overlaps the compute of layer i+1.
When the engine reports a prompt "prefilled" (first token sampled), the
sender is told to finish: once the writes landed it sends the completion
notice (first token, checksum) and the decode server acknowledges it. Only
when the sender reports the transfer ended are the blocks released and the
HTTP call answered. Jobs are touched on the engine thread only.

An abort stops the job at once: the engine drops the request, the sender
drops its queued writes and ends the transfer, and the id is remembered so
that a /prefill for it still on its way (the router aborts as soon as its
client leaves) is refused instead of computed for nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from decode_server.service import engine_sampling
from engine import LLMEngine, PrefillChunk, StepOutput
from server_common.engine_thread import EngineThread
from server_common.faults import FaultInjector
from server_common.guard import Drain
from server_common.kv_port import KVSenderPort
from server_common.metrics import ServerMetrics
from server_common.settings import ServerSettings
from server_common.vitals import Vitals
from server_common.worker_replies import HealthReport, KVBlocks, PrefillResult
from server_common.worker_requests import PrefillRequest

log = logging.getLogger(__name__)
REMEMBER_ABORTED = 4096
# The sender's failure codes that mean the decode server ended the transfer: it tells
# the router the outcome on its own stream, so the router need not act on ours.
DECODE_DECIDED = {"refused": "decode_refused", "cancelled": "decode_cancelled", "lease_expired": "lease_expired"}


class PrefillFailed(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass
class Job:
    request_id: str
    transfer_id: str
    num_tokens: int
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop
    first_token: int | None = None  # set once the prompt is computed; the blocks are then held for the transfer
    started: float = field(default_factory=time.monotonic)
    prefilled: float | None = None  # when the last layer was computed and the first token sampled

    def resolve(self, result: PrefillResult | PrefillFailed) -> None:
        def set_it() -> None:
            if self.done.done():
                return
            if isinstance(result, PrefillFailed):
                self.done.set_exception(result)
            else:
                self.done.set_result(result)

        self.loop.call_soon_threadsafe(set_it)


class PrefillService:
    def __init__(self, settings: ServerSettings, engine: LLMEngine, sender: KVSenderPort,
                 faults: FaultInjector | None = None) -> None:
        self.settings = settings
        self.faults = faults
        engine.layer_hook = self._on_layer
        self.engine = EngineThread(engine, self._on_outputs, settings.name)
        self.metrics = ServerMetrics(lambda: self.engine.snapshot)
        self.vitals = Vitals(settings.stuck_after_s)  # /health and the watchdog: engine and transfer threads
        self.vitals.add(self.engine.problem)
        if sender is not None:
            self.vitals.add(sender.problem)
        self._sender = sender
        self._bytes_per_token = engine.cache.bytes_per_token
        self._jobs: dict[str, Job] = {}  # request id -> job; engine thread only
        self._by_transfer: dict[str, str] = {}  # transfer id -> request id; engine thread only
        self._aborted: OrderedDict[str, None] = OrderedDict()  # recently aborted request ids; engine thread only
        self._pending = 0  # requests between /prefill and their answer (event loop only)
        self.drain = Drain(lambda: self._pending)  # draining: new prefills are refused, pending ones finish

    async def start(self) -> None:
        self.engine.start()
        self._sender.start(self._on_transfer_ended)

    async def stop(self) -> None:
        self._sender.close()
        self.engine.stop()

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        if self.drain.draining:
            self.metrics.requests.labels(outcome="draining").inc()
            raise PrefillFailed(503, f"{self.settings.name} is draining: it takes no new prefills", "draining")
        self._pending += 1
        try:
            result = await self._prefill(req)
            self.metrics.requests.labels(outcome="prefilled").inc()
            return result
        except PrefillFailed as exc:
            self.metrics.requests.labels(outcome=exc.code).inc()
            raise
        finally:
            self._pending -= 1

    async def _prefill(self, req: PrefillRequest) -> PrefillResult:
        loop = asyncio.get_running_loop()
        rid, res = req.request_id, req.reservation
        if self.faults is not None:
            await self.faults.hold()
        try:
            peer = await self._sender.ensure_peer(res.kv_target)
        except Exception as exc:
            raise PrefillFailed(502, f"cannot connect to decode server {res.instance}: {exc}", "transfer_failed") from exc
        lease_s = res.lease_deadline - time.time()
        if lease_s <= 0:
            raise PrefillFailed(409, f"the reservation on {res.instance} has expired", "lease_expired")
        job = Job(rid, res.transfer_id, len(req.prompt_token_ids), loop.create_future(), loop)
        sampling = engine_sampling(req.sampling)

        def add(e: LLMEngine) -> None:
            if rid in self._jobs:
                raise PrefillFailed(409, f"request id {rid!r} is already active", "duplicate_request")
            if rid in self._aborted:
                raise PrefillFailed(409, f"request {rid} was aborted", "aborted")
            e.add_request(rid, req.prompt_token_ids, sampling)  # ValueError: nothing to undo
            self._sender.begin(res.transfer_id, peer, res.block_ids, lease_s)
            self._jobs[rid] = job
            self._by_transfer[res.transfer_id] = rid

        try:
            await self.engine.run(add)
        except ValueError as exc:
            raise PrefillFailed(400, str(exc), "bad_request") from exc
        return await job.done

    async def abort(self, request_id: str) -> bool:
        return await self.engine.run(lambda e: self._abort(e, request_id))

    # ---- engine thread ---------------------------------------------------------
    def _abort(self, e: LLMEngine, request_id: str) -> bool:
        """Stop computing now and free the blocks. Writes already queued for this
        transfer may still read them; the decode side has cancelled or will refuse
        the transfer id, so whatever they carry is never used."""
        job = self._jobs.pop(request_id, None)
        e.abort(request_id)
        self._aborted[request_id] = None
        while len(self._aborted) > REMEMBER_ABORTED:
            self._aborted.popitem(last=False)
        if job is None:
            return False
        self._by_transfer.pop(job.transfer_id, None)
        self._sender.abort(job.transfer_id)
        job.resolve(PrefillFailed(409, f"request {request_id} was aborted", "aborted"))
        return True

    def _on_layer(self, layer: int, chunks: list[PrefillChunk]) -> None:
        for chunk in chunks:
            job = self._jobs.get(chunk.request_id)
            if job is not None:
                self._sender.push_layer(job.transfer_id, layer, chunk.block_ids, chunk.start, chunk.end)
        if self.faults is not None:
            self.faults.stall(layer)

    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:
                self.engine.engine.abort(out.request_id)
                continue
            assert out.finish_reason == "prefilled", out
            job.first_token = out.new_token_ids[0]
            job.prefilled = time.monotonic()
            self._sender.finish(job.transfer_id, job.first_token)

    def _on_transfer_ended(self, transfer_id: str, error: str | None, code: str | None = None) -> None:
        """Called on the adapter's thread, as soon as the transfer ended."""
        ended = time.monotonic()
        self.engine.call(lambda e: self._transfer_ended(e, transfer_id, error, code, ended))

    def _transfer_ended(self, e: LLMEngine, transfer_id: str, error: str | None, code: str | None,
                        ended: float) -> None:
        rid = self._by_transfer.pop(transfer_id, None)
        job = self._jobs.pop(rid, None) if rid is not None else None
        if job is None:
            return  # aborted earlier
        if job.first_token is not None:
            e.release(rid)
        else:
            e.abort(rid)  # failed before the prompt was done (decode side cancelled, peer gone)
        if error is not None:
            self.metrics.transfer_failed.inc()
            job.resolve(PrefillFailed(502, f"KV transfer to the decode server failed: {error}",
                                      DECODE_DECIDED.get(code or "", "transfer_failed")))
            return
        seconds = ended - job.started
        nbytes = job.num_tokens * self._bytes_per_token
        self.metrics.transfer_bytes.inc(nbytes)
        self.metrics.transfer_seconds.observe(seconds)
        if job.prefilled is not None:
            self.metrics.transfer_exposed_seconds.observe(max(0.0, ended - job.prefilled))
        job.resolve(PrefillResult(request_id=rid, first_token_id=job.first_token, num_tokens=job.num_tokens,
                                  transfer_bytes=nbytes, seconds=seconds))

    def health(self) -> HealthReport:
        s = self.engine.snapshot
        return HealthReport(status="draining" if self.drain.draining else "ok", role="prefill",
                            instance=self.settings.name,
                            kv_blocks=KVBlocks(free=s.free, reserved=s.reserved, running=s.running, total=s.total),
                            queue_depth=s.queue_depth, queued_tokens=s.queued_tokens, num_requests=self._pending)
