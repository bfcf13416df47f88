"""The prefill server's logic: prefill prompts into decode servers' reservations.

Each ``/prefill`` becomes a job on the engine thread. The engine batches and
chunks prompts as usual; the engine thread's layer hook queues each layer's
freshly written K/V of every job with the KV sender right away (its own
thread moves the bytes), so the transfer of layer i overlaps the compute of
layer i+1. When the engine reports a prompt "prefilled" (first token
sampled), the sender is told to finish: once the writes landed it sends the
completion notice (first token, checksum) and the decode server
acknowledges it. The engine thread takes ended transfers between two steps;
only then are the blocks released and the HTTP call answered. Jobs are
touched on the engine thread only.

The decode server's cached prefix (``Reservation.num_cached_tokens``) is not
sent: every layer push starts past it. When the decode server holds whole
blocks of it past what this engine's own cache (and tiers) hold, they are read
from it first (decode-to-prefill reuse, kvlink/prefix_read.py: under the
reservation's transfer id, within its lease, checksummed) and offered to the
engine (engine/tiers/offered.py), which then computes only the rest; a read
that fails is a miss, counted, and the prefix is computed here as before. A sliding-window layer (window
W) sends only the prompt's last W - 1 positions: the decode server's first
query, at position ``num_tokens``, sees keys (num_tokens - W, num_tokens],
the last of which it writes itself, and it computes no prompt
log-probabilities (they are computed here). Its prefix cache keeps track of
what it lacks (engine/prefix_cache.py). ``transfer_bytes`` counts what was
pushed.

A failed transfer's outcome goes back to the router unchanged: one in
``transfer.outcome.DECIDED_BY_DECODE`` means the decode server ended the
transfer and tells the router on its own stream what happens next.

An abort stops the job at once: the engine drops the request, the sender
drops its queued writes and ends the transfer, and the id is remembered so
that a /prefill for it still on its way (the router aborts as soon as its
client leaves) is refused instead of computed for nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from engine import LLMEngine, PrefillChunk, StepOutput
from engine.prefix_cache import chain_hashes
from engine.request import window_start
from kvlink.ports import PeerMovedOn, PrefillLinkFactory
from kvlink.prefix_read import PrefixReadError
from prefill_server.pull_rule import PullRule
from server_common.engine_thread import EngineThread
from server_common.faults import FaultInjector
from server_common.guard import Drain
from server_common.metrics import ServerMetrics
from server_common.model_id import model_fingerprint
from server_common.settings import ServerSettings
from server_common.timeline_log import TimelineLog
from server_common.tracing import Tracing
from server_common.vitals import Vitals
from transfer.outcome import Outcome, PeerBound, TransferEnded
from transfer.recent import RecentIds
from wire.replies import (
    HealthReport,
    KVBlocks,
    PrefillResult,
    WorkerError,
    prompt_token_logprobs,
    token_logprobs,
)
from wire.requests import PrefillRequest

log = logging.getLogger(__name__)
REMEMBER_ABORTED = 4096


@dataclass
class Job:
    request_id: str
    transfer_id: str
    num_tokens: int
    num_cached_tokens: int  # the decode server holds these already: they are not sent
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop
    # set once the prompt is computed; the blocks are then held for the transfer
    prefilled_out: StepOutput | None = None
    started: float = field(default_factory=time.monotonic)
    computing: float | None = None  # when the first layer of its first chunk was computed
    prefilled: float | None = None  # when the last layer was computed and the first token sampled
    ended: TransferEnded | None = None  # how and when its transfer ended
    layer_tokens: int = 0  # tokens pushed, summed over layers (a layer's token is one layer's K and V of it)

    def resolve(self, result: PrefillResult | WorkerError) -> None:
        def set_it() -> None:
            if self.done.done():
                return
            if isinstance(result, WorkerError):
                self.done.set_exception(result)
            else:
                self.done.set_result(result)

        self.loop.call_soon_threadsafe(set_it)


def _check_reservation(req: PrefillRequest) -> None:
    """400 for a reservation that does not fit its request (the schema checked each field alone)."""
    res, num_tokens = req.reservation, len(req.prompt_token_ids)
    if res.num_tokens != num_tokens:
        raise WorkerError(
            400, f"reservation.num_tokens is {res.num_tokens} for a {num_tokens}-token prompt", Outcome.BAD_REQUEST
        )
    if res.num_cached_tokens >= num_tokens:
        raise WorkerError(
            400,
            f"the reservation holds {res.num_cached_tokens} cached tokens of a "
            f"{num_tokens}-token prompt: nothing to prefill",
            Outcome.BAD_REQUEST,
        )


class PrefillService:
    def __init__(
        self,
        settings: ServerSettings,
        engine: LLMEngine,
        make_link: PrefillLinkFactory,
        faults: FaultInjector | None = None,
        tracing: Tracing | None = None,
        *,
        engine_thread: EngineThread | None = None,
        role_epoch: int = 0,
        metrics: ServerMetrics | None = None,
    ) -> None:
        """``engine_thread``: one already running ``engine``, which another role's service used (a role
        switch in place, deploy/role_server.py): this service takes it over and leaves it running at
        ``stop``. ``role_epoch``: reported on /health. ``metrics``: the process's, which the services of
        its earlier roles counted in (else its own)."""
        self.settings = settings
        self.faults = faults
        self.role_epoch = role_epoch
        self._owns_thread = engine_thread is None
        self.engine_thread = engine_thread or EngineThread(engine, self._on_outputs, settings.name)
        self.metrics = metrics or ServerMetrics(lambda: self.engine_thread.stats)
        self.kv_events = engine.scheduler.blocks.events  # thread-safe: read by GET /kv/events
        self.tracing = tracing or Tracing(settings.tracing, "pdserve-prefill")
        self.timeline = TimelineLog(settings.timeline_entries)
        self._model_id = model_fingerprint(settings.engine.model)  # reported on /health
        link = make_link(self.engine_thread.wake)
        self._sender, self._peers = link.sender, link.peers
        self.vitals = Vitals(settings.stuck_after_s)  # /health and the watchdog: engine and transfer threads
        self.vitals.add(self.engine_thread.problem)
        self.vitals.add(self._sender.problem)
        # The model's K and V of a token in one layer, every KV head once: what a request's transfer moves
        # from all of this server's ranks together (each holds its heads' share; rank 0's cache alone
        # would count a tensor-parallel server's bytes short).
        c = engine.cache
        self._bytes_per_layer_token = c.bytes_per_token * c.num_kv_heads_total // c.num_kv_heads // c.num_layers
        self._windows = engine.layer_windows  # each layer's sliding window, None for full attention
        self._salt = engine.scheduler.prefix.salt  # the root of this engine's block hash chains
        # Decode-to-prefill reuse: only where the engine can take an offered prefix (LLMEngine.offer_prefix).
        self._pulls = (
            settings.pull_prefix
            and engine.config.prefix_caching
            and engine.ranks is None
            and all(w is None for w in self._windows)
        )
        self._pull_rule = PullRule(settings.pull_prefix_margin)  # read or compute; event loop only
        self._bytes_per_token = c.bytes_per_token  # every layer's K and V of a token: what a read moves per token
        # What a read's answer must be, but for its tokens, to be offered to this cache (LLMEngine.offer_prefix):
        # any other shape is refused before its body is read, a miss, never a failed request.
        self._pull_fits = (c.num_layers, 2, c.num_kv_heads, c.head_dim)
        self.metrics.prefix_read_bytes_per_s.set(self._pull_rule.bytes_per_s)
        self._jobs: dict[str, Job] = {}  # request id -> job; engine thread only
        self._by_transfer: dict[str, str] = {}  # transfer id -> request id; engine thread only
        self._aborted = RecentIds(REMEMBER_ABORTED)  # recently aborted request ids; engine thread only
        self._pending = 0  # requests between /prefill and their answer (event loop only)
        self.drain = Drain(lambda: self._pending)  # draining: new prefills are refused, pending ones finish
        # Last: a running engine thread (another role's, before) calls these from its next round on.
        self.engine_thread.rebind(self._on_outputs, between_steps=self._collect_transfers, layer_hook=self._on_layer)

    async def start(self) -> None:
        self._sender.start()
        self.engine_thread.start()

    async def stop(self) -> None:
        self.tracing.shutdown()
        if self._owns_thread:
            self.engine_thread.stop()
        self._sender.close()
        await self._peers.close()

    def quiet(self) -> bool:
        """Nothing of a request is left here: no prefill pending, no job, no transfer open, nothing on
        the engine (a role switch waits for it)."""
        sizes = self.bookkeeping()
        return not any(sizes[k] for k in ("jobs", "transfers", "pending", "sender_transfers", "engine_requests"))

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        if self.drain.draining:
            self.metrics.requests.labels(outcome=Outcome.DRAINING).inc()
            raise WorkerError(503, f"{self.settings.name} is draining: it takes no new prefills", Outcome.DRAINING)
        self._pending += 1
        span = self.tracing.start(
            "prefill.prefill",
            self.tracing.parent(req.trace),
            pdserve__request_id=req.request_id,
            pdserve__instance=self.settings.name,
            pdserve__prompt_tokens=len(req.prompt_token_ids),
        )
        outcome = Outcome.CANCELLED
        try:
            result = await self._prefill(req, span)
            self.metrics.requests.labels(outcome=Outcome.OK).inc()
            outcome = Outcome.OK
            return result
        except WorkerError as exc:
            self.metrics.requests.labels(outcome=exc.code).inc()
            outcome = exc.code
            raise
        finally:
            self._pending -= 1
            self.tracing.end(span, outcome=outcome)

    async def _prefill(self, req: PrefillRequest, span: object | None) -> PrefillResult:
        loop = asyncio.get_running_loop()
        received = time.monotonic()  # the reservation's lease_s counts from about now
        rid, res = req.request_id, req.reservation
        _check_reservation(req)  # before anything connects to the address it names
        if self.faults is not None:
            await self.faults.hold()
        try:
            route = await self._peers.route(res)
        except PeerMovedOn as exc:  # the decode server decided: its stream (if any) says what happens next
            raise WorkerError(409, str(exc), Outcome.STALE_RESERVATION) from None
        except Exception as exc:
            raise WorkerError(
                502, f"cannot connect to decode server {res.instance}: {exc}", Outcome.HANDSHAKE_FAILED
            ) from exc
        pulled = None
        if self._pulls:  # within the lease: the read is answered only while the reservation waits
            pulled = await self._pull_prefix(req, res.lease_s - (time.monotonic() - received))
        lease_s = res.lease_s - (time.monotonic() - received)
        if lease_s <= 0:
            raise WorkerError(409, f"the reservation on {res.instance} has expired", Outcome.LEASE_EXPIRED)
        job = Job(rid, res.transfer_id, len(req.prompt_token_ids), res.num_cached_tokens, loop.create_future(), loop)
        sampling = req.sampling

        def add(e: LLMEngine) -> None:
            if rid in self._jobs:
                raise WorkerError(409, f"request id {rid!r} is already active", Outcome.DUPLICATE_REQUEST)
            if rid in self._aborted:
                raise WorkerError(409, f"request {rid} was aborted", Outcome.ABORTED)
            try:
                if pulled is not None:  # a shape that does not fit this cache: ValueError, nothing offered
                    start, tokens = pulled
                    self.metrics.prefix_pulled_tokens.inc(e.offer_prefix(rid, req.prompt_token_ids, start, tokens))
                e.add_request(rid, req.prompt_token_ids, sampling, tenant=req.tenant)
            except BaseException:
                e.withdraw_prefix(rid)
                raise
            try:
                self._sender.begin(route, lease_s)  # IncompatiblePeer (a ValueError) before any part starts
            except BaseException:
                e.abort(rid)
                e.withdraw_prefix(rid)
                raise
            self._jobs[rid] = job
            self._by_transfer[res.transfer_id] = rid

        try:  # counted as queued from now, the engine thread busy with a step or not
            await self.engine_thread.run(add, prompt_tokens=len(req.prompt_token_ids))
        except ValueError as exc:
            raise WorkerError(400, str(exc), Outcome.BAD_REQUEST) from exc
        try:
            return await job.done
        finally:
            self._trace_job(span, job)

    async def _pull_prefix(self, req: PrefillRequest, lease_s: float) -> tuple[int, Any] | None:
        """(first token, K/V) of the whole blocks of the decode server's cached prefix that this engine's
        cache and tiers lack, read from it (kvlink/prefix_read.py); None when there is none, when computing
        them is estimated faster (prefill_server/pull_rule.py), or when the read failed (both counted in
        ``pdserve_kv_prefix_pulls_total``: the prompt is computed here)."""
        res, bs = req.reservation, self.settings.engine.block_size
        end = res.num_cached_tokens  # D's may end in a kept tail (engine/block_manager.py): read that too
        if end < bs or req.sampling.prompt_logprobs is not None:
            return None
        # What this server holds of the prompt, from its block events (thread-safe, no wait for the engine
        # thread): a hint; the offered blocks go by hash, so a block evicted or cached meanwhile only makes
        # the admission take fewer of them (engine/tiers/offered.py). Only as far as D's cached prefix: nothing
        # past it can be read, and hashing a long prompt here would hold the event loop.
        limit = min(len(req.prompt_token_ids) - 1, end) // bs
        hashes = chain_hashes(self._salt, req.prompt_token_ids[: limit * bs], bs)
        start = self.kv_events.held_run(hashes) * bs
        if (end - start) // bs <= 0:
            return None
        counters = self.engine_thread.stats.counters
        rule = self._pull_rule
        rule.observe_engine(counters.prompt_tokens, counters.step_seconds["prefill"] + counters.step_seconds["mixed"])
        self.metrics.prefix_compute_tokens_per_s.set(rule.tokens_per_s or 0.0)
        if not rule.worth_reading(end - start, (end - start) * self._bytes_per_token):
            self.metrics.prefix_pulls.labels(outcome=Outcome.NOT_WORTH_IT).inc()
            return None
        asked = time.monotonic()
        try:
            timeout_s = min(self.settings.transfer_timeout_s, lease_s / 2)
            tokens = await self._peers.read_prefix(res, start, end, timeout_s, self._pull_fits)
        except PrefixReadError as exc:
            self.metrics.prefix_pulls.labels(outcome=exc.outcome).inc()
            log.warning("request %s: prefix read from %s failed (%s); computing it", req.request_id, res.instance, exc)
            return None
        seconds, nbytes = time.monotonic() - asked, tokens.numel() * tokens.element_size()
        rule.observe_read(nbytes, seconds)
        self.metrics.prefix_read_bytes_per_s.set(rule.bytes_per_s)
        self.metrics.prefix_pulls.labels(outcome=Outcome.OK).inc()
        self.metrics.prefix_pull_seconds.observe(seconds)
        self.metrics.prefix_pulled_bytes.inc(nbytes)
        return start, tokens

    def _trace_job(self, span: object | None, job: Job) -> None:
        """The job's stages into the timeline log and as spans (tracing on). Its timestamps were
        written on the engine thread before ``job.done`` was resolved, so they are complete here."""
        self.timeline.add(
            job.request_id,
            received=job.started,
            computing=job.computing,
            prefilled=job.prefilled,
            transfer_ended=job.ended.at if job.ended else None,
        )
        if span is None or job.computing is None:
            return
        now = time.monotonic()
        self.tracing.record("prefill.queue", span, job.started, job.computing)
        self.tracing.record("prefill.compute", span, job.computing, job.prefilled or now)
        ended = job.ended
        self.tracing.record(
            "prefill.kv_transfer",
            span,
            job.computing,
            ended.at if ended else now,
            ended.outcome if ended else Outcome.ABORTED,
            pdserve__transfer_id=job.transfer_id,
            pdserve__bytes=job.layer_tokens * self._bytes_per_layer_token,
            pdserve__cached_tokens=job.num_cached_tokens,
        )

    # ---- decode peers (the router's discovery) --------------------------------------
    def add_peer(self, name: str, url: str) -> None:
        try:
            self._peers.add(name, url)
        except PeerBound as exc:
            self.metrics.peer_refusals.labels(reason="configured_peer").inc()
            log.warning("refused to re-point a decode server: %s", exc)
            raise WorkerError(409, str(exc), Outcome.PEER_BOUND) from None

    def forget_peer(self, name: str) -> bool:
        return self._peers.forget(name)

    def peers(self) -> dict[str, str]:
        return self._peers.known()

    async def abort(self, request_id: str) -> bool:
        return await self.engine_thread.run(lambda e: self._abort(e, request_id))

    # ---- engine thread ---------------------------------------------------------
    def _abort(self, e: LLMEngine, request_id: str) -> bool:
        """Stop computing now and free the blocks. Writes already queued for this
        transfer may still read them; the decode side has cancelled or will refuse
        the transfer id, so whatever they carry is never used."""
        job = self._jobs.pop(request_id, None)
        e.abort(request_id)
        e.withdraw_prefix(request_id)
        self._aborted.add(request_id)
        if job is None:
            return False
        self._by_transfer.pop(job.transfer_id, None)
        self._sender.abort(job.transfer_id)
        job.resolve(WorkerError(409, f"request {request_id} was aborted", Outcome.ABORTED))
        return True

    def _on_layer(self, layer: int, chunks: list[PrefillChunk]) -> None:
        window = self._windows[layer]
        for chunk in chunks:
            job = self._jobs.get(chunk.request_id)
            if job is not None:
                if job.computing is None:
                    job.computing = time.monotonic()
                start = max(chunk.start, job.num_cached_tokens)
                if window is not None:  # the decode server's first query, at num_tokens, reads keys from here
                    start = max(start, window_start(job.num_tokens, window))
                if start < chunk.end:
                    self._sender.push_layer(job.transfer_id, layer, chunk.block_ids, start, chunk.end)
                    job.layer_tokens += chunk.end - start
        if self.faults is not None:
            self.faults.stall(layer)

    def _on_outputs(self, e: LLMEngine, outputs: list[StepOutput]) -> None:
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:
                e.abort(out.request_id)
                continue
            assert out.finish_reason == "prefilled", out
            e.withdraw_prefix(out.request_id)  # the prompt is computed: an offered prefix was taken, or not
            job.prefilled_out = out
            job.prefilled = time.monotonic()
            computing = job.computing if job.computing is not None else job.prefilled
            self.metrics.prefill_queue_seconds.observe(computing - job.started)
            self.metrics.prefill_compute_seconds.observe(job.prefilled - computing)
            self._sender.finish(job.transfer_id, out.new_token_ids)

    def _collect_transfers(self, e: LLMEngine) -> None:
        """Between two steps: release the blocks of every transfer that ended and answer its call."""
        for ended in self._sender.take_finished():
            self._transfer_ended(e, ended)

    def _transfer_ended(self, e: LLMEngine, ended: TransferEnded) -> None:
        rid = self._by_transfer.pop(ended.transfer_id, None)
        job = self._jobs.pop(rid, None) if rid is not None else None
        if rid is None or job is None:
            return  # aborted earlier
        job.ended = ended
        e.withdraw_prefix(rid)
        out = job.prefilled_out
        if out is not None:
            e.release(rid)
        else:
            e.abort(rid)  # failed before the prompt was done (decode side cancelled, peer gone)
        if not ended.ok:
            self.metrics.transfer_failures.labels(outcome=ended.outcome).inc()
            job.resolve(WorkerError(502, f"KV transfer to the decode server failed: {ended.reason}", ended.outcome))
            return
        seconds = ended.at - job.started
        nbytes = job.layer_tokens * self._bytes_per_layer_token
        self.metrics.transfer_bytes.inc(nbytes)
        self.metrics.transfer_seconds.observe(seconds)
        self.metrics.transfer_request_bytes.observe(nbytes)
        # The wire runs from the first layer pushed to the decode server's ack (overlapping compute).
        on_wire = ended.at - (job.computing if job.computing is not None else job.started)
        self.metrics.transfer_gbps.observe(nbytes / max(on_wire, 1e-9) / 1e9)
        if job.prefilled is not None:
            self.metrics.transfer_exposed_seconds.observe(max(0.0, ended.at - job.prefilled))
        assert out is not None, "a transfer completes only after finish(), sent once the prompt was computed"
        job.resolve(
            PrefillResult(
                request_id=rid,
                first_token_ids=out.new_token_ids,
                num_tokens=job.num_tokens,
                transfer_bytes=nbytes,
                seconds=seconds,
                first_logprobs=token_logprobs(out.logprobs),
                prompt_logprobs=prompt_token_logprobs(out.prompt_logprobs),
            )
        )

    def bookkeeping(self) -> dict[str, int]:
        """Entries of each map here that grows with traffic (GET /debug/bookkeeping). Per request, 0 once
        idle: ``jobs``, ``transfers``, ``pending``, ``sender_transfers``, ``engine_requests``. Bounded:
        ``aborted_remembered`` (REMEMBER_ABORTED), ``timeline_entries``, ``prefix_cached_blocks`` (the
        cache's blocks), ``peers`` (the config's and those the router announced)."""
        scheduler = self.engine_thread.stats.scheduler
        return {
            "jobs": len(self._jobs),
            "transfers": len(self._by_transfer),
            "pending": self._pending,
            "sender_transfers": self._sender.open_transfers(),
            "engine_requests": scheduler.num_requests,
            "aborted_remembered": len(self._aborted),
            "timeline_entries": len(self.timeline),
            "prefix_cached_blocks": scheduler.cached,
            "peers": len(self._peers.known()),
        }

    def health(self) -> HealthReport:
        s = self.engine_thread.stats.scheduler
        return HealthReport(
            status="draining" if self.drain.draining else "ok",
            role="prefill",
            instance=self.settings.name,
            kv_blocks=KVBlocks(
                free=s.free,
                reserved=s.reserved,
                running=s.running,
                total=s.total,
                block_size=self.settings.engine.block_size,
            ),
            queue_depth=s.queue_depth,
            queued_tokens=s.queued_tokens,
            num_requests=self._pending,
            launch_id=self.settings.launch_id,
            model=self._model_id,
            role_epoch=self.role_epoch,
        )
