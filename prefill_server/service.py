"""The prefill server's logic: prefill prompts into decode servers' reservations.

Each ``/prefill`` becomes a job on the engine thread. The engine batches and
chunks prompts as usual; its ``layer_hook`` hands each layer's freshly
written K/V of every job to the KV sender right away, so the transfer of
layer i overlaps the compute of layer i+1. When the engine reports a prompt
"prefilled" (first token sampled), the sender finishes the transfer (waits
for the writes, sends the completion notice with the first token and a
checksum) and only then are the blocks released. Jobs live in ``_jobs``,
touched on the engine thread only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from decode_server.service import engine_sampling
from engine import LLMEngine, PrefillChunk, StepOutput
from server_common.engine_thread import EngineThread
from server_common.kv_port import KVSenderPort
from server_common.metrics import ServerMetrics
from server_common.settings import ServerSettings
from server_common.worker_replies import HealthReport, KVBlocks, PrefillResult
from server_common.worker_requests import PrefillRequest

log = logging.getLogger(__name__)


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
    error: str | None = None  # a layer write failed: the job fails when the prompt is done
    started: float = field(default_factory=time.monotonic)

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
    def __init__(self, settings: ServerSettings, engine: LLMEngine, sender: KVSenderPort) -> None:
        self.settings = settings
        engine.layer_hook = self._on_layer
        self.engine = EngineThread(engine, self._on_outputs, settings.name)
        self.metrics = ServerMetrics(lambda: self.engine.snapshot)
        self._sender = sender
        self._jobs: dict[str, Job] = {}  # engine thread only
        self._pending = 0  # requests between /prefill and their answer (event loop only)

    async def start(self) -> None:
        self.engine.start()

    async def stop(self) -> None:
        self._sender.close()
        self.engine.stop()

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        loop = asyncio.get_running_loop()
        rid, res = req.request_id, req.reservation
        job = Job(rid, res.transfer_id, len(req.prompt_token_ids), loop.create_future(), loop)
        sampling = engine_sampling(req.sampling)

        def add(e: LLMEngine) -> None:
            if rid in self._jobs:
                raise PrefillFailed(409, f"request id {rid!r} is already active", "duplicate_request")
            self._sender.begin(res.transfer_id, res.kv_target, len(req.prompt_token_ids))
            try:
                e.add_request(rid, req.prompt_token_ids, sampling)
            except BaseException:
                self._sender.abort(res.transfer_id)
                raise
            self._jobs[rid] = job

        self._pending += 1
        try:
            try:
                await self.engine.run(add)
            except ValueError as exc:
                raise PrefillFailed(400, str(exc), "bad_request") from exc
            except PrefillFailed:
                raise
            except Exception as exc:
                raise PrefillFailed(502, f"cannot reach decode server {res.instance}: {exc}", "transfer_failed") from exc
            result = await job.done
            self.metrics.requests.labels(outcome="prefilled").inc()
            return result
        except PrefillFailed as exc:
            self.metrics.requests.labels(outcome=exc.code).inc()
            raise
        finally:
            self._pending -= 1

    async def abort(self, request_id: str) -> bool:
        return await self.engine.run(lambda e: self._abort(e, request_id))

    # ---- engine thread ---------------------------------------------------------
    def _abort(self, e: LLMEngine, request_id: str) -> bool:
        job = self._jobs.pop(request_id, None)
        e.abort(request_id)
        if job is None:
            return False
        self._sender.abort(job.transfer_id)
        job.resolve(PrefillFailed(409, f"request {request_id} was aborted", "aborted"))
        return True

    def _on_layer(self, layer: int, chunks: list[PrefillChunk]) -> None:
        kv = self.engine.engine.cache.kv
        for chunk in chunks:
            job = self._jobs.get(chunk.request_id)
            if job is None or job.error is not None:
                continue
            try:
                self._sender.send_layer(job.transfer_id, layer, kv, chunk.block_ids, chunk.start, chunk.end)
            except Exception as exc:  # never let a transfer error break the model step
                job.error = f"{type(exc).__name__}: {exc}"

    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        e = self.engine.engine
        for out in outputs:
            job = self._jobs.pop(out.request_id, None)
            if job is None:
                e.abort(out.request_id)
                continue
            assert out.finish_reason == "prefilled", out
            try:
                if job.error is not None:
                    raise RuntimeError(job.error)
                nbytes = self._sender.finish(job.transfer_id, out.new_token_ids[0], e.cache.kv, out.block_ids)
            except Exception as exc:
                self._sender.abort(job.transfer_id)
                e.release(out.request_id)
                self.metrics.transfer_failed.inc()
                job.resolve(PrefillFailed(502, f"KV transfer failed: {exc}", "transfer_failed"))
                continue
            e.release(out.request_id)
            seconds = time.monotonic() - job.started
            self.metrics.transfer_bytes.inc(nbytes)
            self.metrics.transfer_seconds.observe(seconds)
            job.resolve(PrefillResult(request_id=out.request_id, first_token_id=out.new_token_ids[0],
                                      num_tokens=job.num_tokens, transfer_bytes=nbytes, seconds=seconds))

    def health(self) -> HealthReport:
        s = self.engine.snapshot
        return HealthReport(role="prefill", instance=self.settings.name,
                            kv_blocks=KVBlocks(free=s.free, reserved=s.reserved, running=s.running),
                            queue_depth=s.queue_depth, queued_tokens=s.queued_tokens, num_requests=self._pending)
