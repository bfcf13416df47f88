"""The decode server's logic: reservations, leases, remote KV, token streams.

A remote request's life on D (all engine state changes on the engine thread)::

    /generate --reserve--> WAITING_FOR_REMOTE_KV --KV complete, verified--> RUNNING --> finished
                  |               |  lease expires / checksum mismatch / transfer failed / client left
                  |               +--> aborted: blocks FREE, error event
                  |               +--> (lease_expiry / checksum_failure: local) blocks FREE, then
                  |                    prefilled here like a local request: reprefill event, tokens
                  +-- no room: 503 at once

With prefix caching, the reservation pins the prompt's cached prefix and says
how many tokens it holds (``num_cached_tokens``): the prefill server writes
only the rest. When only the last prompt token is missing, the server
prefills it itself and no prefill server is involved.

The engine thread takes the receiver's ended transfers between two steps
(``_collect_transfers``). ``_awaiting`` (transfer id -> request id) is
touched only on the engine thread, so exactly one of "KV arrived",
"transfer failed / lease expired" (both reported by the receiver) and
"client left" wins for each reservation; the others find nothing to do.
A colocated server is the same service without a receiver: every request
is prefilled here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import anyio
import torch

from decode_server.stream_trace import StreamTrace
from engine import LLMEngine, NoCapacityError, SamplingParams, StepOutput
from engine.tiers.offered import PinnedRead
from kvlink.ports import Expected, KVReceiverPort, ReceiverFactory
from kvlink.prefix_read import encode_prefix
from server_common.engine_thread import EngineThread
from server_common.faults import FaultInjector
from server_common.guard import Drain
from server_common.metrics import ServerMetrics
from server_common.model_id import model_fingerprint
from server_common.quota import UnfilledBlocks
from server_common.settings import ServerSettings
from server_common.streams import StreamHub
from server_common.timeline_log import TimelineLog
from server_common.tracing import Tracing
from server_common.vitals import Vitals
from transfer.outcome import Outcome, PeerBound, TransferEnded
from wire.replies import (
    STREAM_HEARTBEAT_S,
    AliveEvent,
    ErrorEvent,
    HealthReport,
    KVBlocks,
    ReprefillEvent,
    Reservation,
    ReservationEvent,
    TokensEvent,
    WorkerError,
    tokens_event,
)
from wire.requests import GenerateRequest, KVPrefixRead

log = logging.getLogger(__name__)
BACKSTOP_S = 5.0
READ_COPY_THREADS = 2  # prefix reads copied out at once; the others queue, their blocks pinned meanwhile


@dataclass(frozen=True)
class Awaiting:
    """A reservation waiting for remote KV: what a local re-prefill needs."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    tenant: str | None = None  # whose share of the shared KV store its blocks count against
    reserved_at: float = field(default_factory=time.monotonic)


@dataclass
class Active:
    request_id: str
    queue: asyncio.Queue
    trace: StreamTrace
    transfer_id: str | None = None
    lease: asyncio.TimerHandle | None = None
    finished: bool = False  # every sequence's last event was sent
    moved: bool = False  # draining moved it off: its engine request is already dropped
    sequences: int = 1  # how many sequences' last events the stream waits for (sampling.n)
    started: float = field(default_factory=time.monotonic)
    opened: bool = False  # its open returned: what it took is the stream's to free (else the open's)


class GenerationService:
    """``/generate`` on a decode or colocated server: reserve blocks for a
    prefill server (or prefill here), then stream the tokens."""

    def __init__(
        self,
        settings: ServerSettings,
        engine: LLMEngine,
        make_receiver: ReceiverFactory | None,
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
        if (settings.role == "decode") != (make_receiver is not None):
            raise ValueError("a decode server needs a KV receiver, a colocated one has none")
        self.settings = settings
        self.faults = faults
        self.role_epoch = role_epoch
        self._owns_thread = engine_thread is None
        self.engine_thread = engine_thread or EngineThread(engine, self._emit, settings.name)
        self.metrics = metrics or ServerMetrics(lambda: self.engine_thread.stats)
        self.kv_events = engine.scheduler.blocks.events  # thread-safe: read by GET /kv/events
        self.vitals = Vitals(settings.stuck_after_s)  # /health and the watchdog: engine and transfer threads
        self.vitals.add(self.engine_thread.problem)
        self.tracing = tracing or Tracing(settings.tracing, f"pdserve-{settings.role}")
        self.timeline = TimelineLog(settings.timeline_entries)
        self._model_id = model_fingerprint(settings.engine.model)  # reported on /health
        self._receiver: KVReceiverPort | None = None
        if make_receiver is not None:
            self._receiver = make_receiver(self.engine_thread.wake)
            self.vitals.add(self._receiver.problem)
            self.metrics.watch_transfers(self._receiver.counters)
        self._awaiting: dict[str, Awaiting] = {}  # transfer id -> reservation; engine thread only
        self.unfilled = UnfilledBlocks(settings.max_unfilled_blocks_per_caller)  # engine thread only
        self._cancelling: dict[str, str] = {}  # cancelled, waiting for the receiver to confirm; engine thread only
        self._active: dict[str, Active] = {}  # event loop only
        self._hub: StreamHub | None = None
        # Draining: new requests are refused; active ones finish here ("wait"), or ("migrate") their streams
        # end at once with a "draining" error, on which the router continues them on another decode server.
        self.drain = Drain(lambda: len(self._active), self._move_streams if settings.drain == "migrate" else None)
        self._loop: asyncio.AbstractEventLoop | None = None
        # Prefix reads' copies (``read_prefix``), off the engine thread: numpy copies (no OpenMP team).
        self._copies = ThreadPoolExecutor(READ_COPY_THREADS, thread_name_prefix=f"kv-read-{settings.name}")
        # Last: a running engine thread (another role's, before) calls these from its next round on.
        self.engine_thread.rebind(self._emit, between_steps=self._collect_transfers if make_receiver else None)

    @property
    def _streams(self) -> StreamHub:
        assert self._hub is not None, "the service has not started"
        return self._hub

    # ---- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._hub = StreamHub(self._loop)
        if self._receiver is not None:
            self._receiver.start()
        self.engine_thread.start()

    async def stop(self) -> None:
        self.tracing.shutdown()
        # Copies not started are cancelled (and unpin); a running one ends on its own and unpins.
        self._copies.shutdown(wait=False, cancel_futures=True)
        if self._owns_thread:
            self.engine_thread.stop()
        if self._receiver is not None:
            self._receiver.close()

    def quiet(self) -> bool:
        """Nothing of a request is left here: no stream, no reservation waiting or being cancelled, no
        transfer open, nothing on the engine (a role switch waits for it)."""
        sizes = self.bookkeeping()
        keys = ("active", "streams", "awaiting", "cancelling", "unfilled_claims", "receiver_transfers")
        return not any(sizes[k] for k in (*keys, "engine_requests", "read_pins"))

    async def accept_sender(self, hello: bytes) -> list[bytes]:
        """Every rank's answer to a prefill rank's hello (one: a server without tensor-parallel ranks)."""
        receiver = self._receiver
        if receiver is None:
            raise ValueError(f"{self.settings.name} is a colocated server: it takes no KV transfers")
        timeout_s = self.settings.transfer_timeout_s
        try:
            return await asyncio.to_thread(receiver.accept, hello, timeout_s)
        except PeerBound as exc:
            self.metrics.peer_refusals.labels(reason="bound_to_live_instance").inc()
            log.warning("refused a KV handshake: %s", exc)
            raise WorkerError(409, str(exc), Outcome.PEER_BOUND) from None

    async def read_prefix(self, req: KVPrefixRead) -> tuple[dict[str, str], memoryview]:
        """A prefill server reads tokens [start, end) of the cached prefix reservation ``transfer_id`` pins
        (decode-to-prefill reuse, kvlink/prefix_read.py) while the reservation still waits for its KV. The
        engine thread only pins the blocks holding them (``LLMEngine.pin_reserved``: a reference each) and
        hands the pin to a copy job (``_copy_out``), which copies their bytes on a thread of the service's
        own and then has the engine thread drop the pin, whatever happens to this call or the reservation
        meanwhile: no step waits on a read's copy, and no pinned block is freed, evicted or handed out
        mid-copy. The answer's headers and body (``encode_prefix``: the copied-out tensor's memory,
        checksummed). WorkerError when no reservation waits under that id (409) or the range is not in its
        cached prefix (400)."""
        if self._receiver is None:
            reason = f"{self.settings.name} is a colocated server: it holds no reservations"
            raise WorkerError(409, reason, Outcome.WRONG_ROLE)

        def pin(e: LLMEngine) -> Future[torch.Tensor]:
            pending = self._awaiting.get(req.transfer_id)
            if pending is None:
                raise WorkerError(409, "no reservation waits for KV under that transfer id", Outcome.STALE_RESERVATION)
            try:
                read = e.pin_reserved(pending.request_id, req.start, req.end)
            except ValueError as exc:
                raise WorkerError(400, str(exc), Outcome.BAD_REQUEST) from None
            try:
                return self._copy_out(read)  # the pin is the copy job's from here: it drops it
            except RuntimeError:  # the service stopped: no copy thread takes it
                e.unpin(read)
                raise WorkerError(503, f"{self.settings.name} is stopping", Outcome.ENGINE_DOWN) from None

        # A call left before it ran takes nothing (the engine thread skips it); one that ran handed its pin on.
        pinning = self.engine_thread.call(pin)
        try:
            copied = await asyncio.wrap_future(pinning)
        except WorkerError as exc:
            self.metrics.prefix_reads.labels(outcome=exc.code).inc()
            raise
        except asyncio.CancelledError:  # the caller left as it pinned: a copy not started is not made
            pinning.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or f.result().cancel())
            raise
        tokens = await asyncio.wrap_future(copied)  # left: a copy not started is cancelled, which unpins
        if self.faults is not None:
            await self.faults.hold_read()  # hold_reads: a read in flight, its tokens out, its answer not sent
        corrupt = self.faults is not None and self.faults.take("corrupt_reads")
        answer = await asyncio.to_thread(encode_prefix, req.transfer_id, req.start, req.end, tokens, corrupt)
        self.metrics.prefix_reads.labels(outcome=Outcome.OK).inc()
        return answer

    def _copy_out(self, read: PinnedRead) -> Future[torch.Tensor]:
        """On the engine thread: a job on the copy threads that copies ``read``'s tokens out and then, copied
        or failed, has the engine thread drop its pin (``unpin`` at its next round)."""

        def unpin() -> None:
            self.engine_thread.call(lambda e: e.unpin(read))  # refused only by an engine thread that ended

        def job() -> torch.Tensor:
            try:
                return read.copy()
            finally:
                unpin()

        def cancelled(f: Future[torch.Tensor]) -> None:
            if f.cancelled():  # before it ran (the service stopping): the pin is dropped all the same
                unpin()

        copied = self._copies.submit(job)
        copied.add_done_callback(cancelled)
        return copied

    # ---- requests -------------------------------------------------------------
    async def open(self, req: GenerateRequest, caller: str = "") -> tuple[ReservationEvent, Active]:
        """Admit a request: reserve blocks (remote prefill) or queue it (local prefill).
        ``caller`` (its address) is what ``server_common.quota`` counts unfilled blocks by."""
        rid = req.request_id
        if rid in self._active:
            raise WorkerError(409, f"request id {rid!r} is already active", Outcome.DUPLICATE_REQUEST)
        if not self.engine_thread.alive:
            raise WorkerError(503, "engine is not running", Outcome.ENGINE_DOWN, retry_after=5)
        if self.drain.draining:
            raise WorkerError(
                503, f"{self.settings.name} is draining: it takes no new requests", Outcome.DRAINING, retry_after=1
            )
        sampling = req.sampling
        local = req.local_prefill or self.settings.role == "colocated"
        active = Active(
            rid,
            self._streams.open(rid),
            sequences=sampling.n,
            trace=StreamTrace(self.tracing, self.timeline, req.trace, rid, not local, self.settings.name),
        )
        self._active[rid] = active
        try:
            if self.faults is not None:
                await self.faults.hold_open()  # hold_opens: an open slower than the router waits for
            if not local:
                reservation = await self._reserve(req, sampling, active, caller)
                if reservation is not None:
                    await self._opened(active)
                    return ReservationEvent(
                        reservation=reservation, num_cached_tokens=reservation.num_cached_tokens
                    ), active

            def add(e: LLMEngine) -> int:
                cached = e.cached_prefix(req.prompt_token_ids + req.generated_token_ids, sampling)
                e.add_request(rid, req.prompt_token_ids, sampling, generated=req.generated_token_ids, tenant=req.tenant)
                return cached

            cached = await self.engine_thread.run(add)
            await self._opened(active)
            active.trace.prefilled_here()
            self.metrics.paths.labels(path="local_prefill").inc()
            return ReservationEvent(reservation=None, num_cached_tokens=cached), active
        except NoCapacityError as exc:
            self._forget(active, Outcome.NO_ROOM)
            self.metrics.requests.labels(outcome=Outcome.NO_ROOM).inc()
            raise WorkerError(503, str(exc), Outcome.NO_ROOM, retry_after=1) from exc
        except ValueError as exc:
            self._forget(active, Outcome.BAD_REQUEST)
            raise WorkerError(400, str(exc), Outcome.BAD_REQUEST) from exc
        except WorkerError as exc:  # _opened: aborted, or moved off by a drain, while it opened
            self._forget(active, exc.code)
            raise
        except BaseException:
            self._forget(active)
            raise

    async def _opened(self, active: Active) -> None:
        """The open took its blocks (a reservation, or the engine's request). Closed meanwhile (its caller
        aborted it: a router whose wait for this open ran out tries again under another attempt id), it
        frees them here, as ``close`` would have, and the open answers 409 ``aborted``. Moved off meanwhile
        (the server began draining with ``drain: migrate``), it frees them too and answers 503 ``draining``,
        on which the router opens the request on another decode server."""
        closed = self._active.get(active.request_id) is not active
        if not closed and not active.moved:
            active.opened = True
            return
        if active.lease is not None:
            active.lease.cancel()
        rid, transfer_id = active.request_id, active.transfer_id
        await asyncio.wrap_future(self.engine_thread.call(lambda e: self._drop(e, rid, transfer_id)))
        if closed:
            raise WorkerError(
                409, f"request {rid!r} was aborted while it opened; its blocks are freed", Outcome.ABORTED
            )
        self.metrics.requests.labels(outcome=Outcome.DRAINING).inc()
        raise WorkerError(
            503,
            f"{self.settings.name} began draining while {rid!r} opened; its blocks are freed",
            Outcome.DRAINING,
            retry_after=1,
        )

    async def _reserve(
        self, req: GenerateRequest, sampling: SamplingParams, active: Active, caller: str = ""
    ) -> Reservation | None:
        """Reserve blocks for a prefill server; None when all but the last prompt token is cached here.
        ``caller`` (its address) is what ``server_common.quota`` counts unfilled blocks by."""
        rid, lease_s = req.request_id, self.settings.lease_s
        started = time.monotonic()  # the receiver's lease starts in reserve(), after this
        receiver = self._receiver
        assert receiver is not None, "a colocated server reserves nothing"
        prompt = req.prompt_token_ids

        def reserve(e: LLMEngine) -> tuple[list[int], Expected, int] | None:
            cached = e.cached_prefix(prompt, sampling)
            if cached and cached >= len(prompt) - 1:
                return None
            block_ids = e.reserve(rid, prompt, sampling, tenant=req.tenant)
            cached = e.num_cached_tokens(rid)
            writable_from = cached // e.config.block_size
            unfilled = len(block_ids) - writable_from
            if not self.unfilled.fits(caller, unfilled):
                e.abort(rid)
                raise NoCapacityError(
                    f"this caller already holds {self.unfilled.held(caller)} reserved blocks "
                    f"waiting for KV (at most {self.unfilled.limit})"
                )
            try:
                expected = receiver.expect(block_ids, lease_s, writable_from=writable_from)
            except BaseException:
                e.abort(rid)
                raise
            self.unfilled.claim(caller, expected.transfer_id, unfilled)
            self._awaiting[expected.transfer_id] = Awaiting(rid, prompt, sampling, req.tenant)
            return block_ids, expected, cached

        reserved = await self.engine_thread.run(reserve)
        if reserved is None:
            return None
        block_ids, expected, cached = reserved
        transfer_id = expected.transfer_id
        active.transfer_id = transfer_id
        # The receiver enforces the lease; this backstop only guards against a transfer layer that never reports.
        active.lease = asyncio.get_running_loop().call_later(lease_s + BACKSTOP_S, self._backstop, transfer_id)
        self.metrics.paths.labels(path="remote_kv").inc()
        return Reservation(
            instance=self.settings.name,
            request_id=rid,
            transfer_id=transfer_id,
            block_ids=block_ids,
            block_size=self.settings.engine.block_size,
            num_tokens=len(prompt),
            lease_s=max(lease_s - (time.monotonic() - started), 1e-3),
            kv_target=expected.target,
            num_cached_tokens=cached,
            role_epoch=self.role_epoch,
        )

    async def events(self, first: ReservationEvent, active: Active) -> AsyncIterator[str]:
        """NDJSON lines: the reservation, then tokens until finished (or an error)."""
        alive = AliveEvent().model_dump_json() + "\n"
        queue = active.queue
        try:
            yield first.model_dump_json() + "\n"
            while True:
                if queue.empty():
                    # A get cancelled by the timeout takes nothing: an event that arrives at that moment
                    # stays queued for the next round. One timer per wait, and no task.
                    try:
                        async with asyncio.timeout(STREAM_HEARTBEAT_S):
                            event = await queue.get()
                    except TimeoutError:
                        yield alive
                        continue
                else:
                    event = queue.get_nowait()
                # Every event already queued goes out in one write: a client that fell behind
                # catches up by several steps at once.
                lines, last = [], False
                while True:
                    active.trace.event(event)
                    lines.append(event.model_dump_json() + "\n")
                    if isinstance(event, ErrorEvent):
                        last = True
                    elif isinstance(event, TokensEvent) and event.finish_reason:
                        active.sequences -= 1
                        last = active.sequences == 0
                    if last or queue.empty():
                        break
                    event = queue.get_nowait()
                yield "".join(lines)
                if last:
                    active.finished = True
                    return
        finally:
            # Shielded: after a disconnect the scope is cancelled and any await would raise at once.
            with anyio.CancelScope(shield=True):
                await self.close(active.request_id)

    async def close(self, request_id: str) -> None:
        """Idempotent end of a request: frees whatever it still holds on the engine."""
        active = self._active.pop(request_id, None)
        if active is None:
            return
        self._streams.close(request_id)
        active.trace.close()
        if active.lease is not None:
            active.lease.cancel()
        if active.moved:
            self.metrics.requests.labels(outcome=Outcome.DRAINING).inc()
            return
        if active.finished:
            self.metrics.requests.labels(outcome=Outcome.OK).inc()
            return
        self.metrics.requests.labels(outcome=Outcome.ABORTED).inc()
        if not active.opened:
            return  # its open is still under way: it frees what it took when it sees the request closed
        await asyncio.wrap_future(self.engine_thread.call(lambda e: self._drop(e, request_id, active.transfer_id)))

    async def abort(self, request_id: str) -> bool:
        """Drop a request (router's /abort); its open stream ends with an error event."""
        active = self._active.get(request_id)
        if active is not None:
            active.queue.put_nowait(ErrorEvent(message="aborted by request", code=Outcome.ABORTED))
        await self.close(request_id)
        return active is not None

    def _move_streams(self) -> None:
        """Draining with ``drain: migrate`` (from SIGTERM's handler or an admin call): every open stream
        ends with a "draining" error, which the router answers by continuing the request elsewhere from
        the tokens it already has; each stream's end frees the request's blocks (``events``)."""
        if self._loop is None:
            return

        def end_all() -> None:
            message = f"{self.settings.name} is draining: its streams move to another decode server"
            for active in list(self._active.values()):
                if active.finished:
                    continue
                active.moved = True
                if not active.opened:
                    continue  # its open is still under way: it frees what it took and answers 503 draining
                active.queue.put_nowait(ErrorEvent(message=message, code=Outcome.DRAINING))
                rid, transfer_id = active.request_id, active.transfer_id
                self.engine_thread.call(functools.partial(self._drop, request_id=rid, transfer_id=transfer_id))
            if self._active:
                log.info("draining: %d streams moved off", len(self._active))

        self._loop.call_soon_threadsafe(end_all)

    def _forget(self, active: Active, outcome: Outcome = Outcome.CANCELLED) -> None:
        if self._active.get(active.request_id) is not active:
            return  # closed already (aborted while it opened); the id may be another request's now
        self._active.pop(active.request_id)
        self._streams.close(active.request_id)
        active.trace.close(outcome)

    # ---- engine-thread callbacks ------------------------------------------------
    def _emit(self, e: LLMEngine, outputs: list[StepOutput]) -> None:
        if self.faults is not None:
            self.faults.step_delay()
        self.metrics.tokens.inc(sum(len(out.new_token_ids) for out in outputs))
        self._streams.publish_many([(out.request_id, tokens_event(out)) for out in outputs])
        if self.faults is not None:
            self.faults.streamed(sum(len(out.new_token_ids) for out in outputs))

    def _drop(self, e: LLMEngine, request_id: str, transfer_id: str | None) -> None:
        """The request's client left. A reservation still waiting for KV is cancelled
        first and freed once the receiver reports the id ended (no write can land)."""
        if transfer_id is not None and self._take_awaiting(transfer_id) is not None:
            self._cancelling[transfer_id] = request_id
            assert self._receiver is not None  # only a decode server waits for KV
            self._receiver.cancel(transfer_id)
            return
        e.abort(request_id)

    def _collect_transfers(self, e: LLMEngine) -> None:
        """Between two steps: act on every transfer the receiver saw end."""
        assert self._receiver is not None  # the engine thread calls it on a decode server only
        for ended in self._receiver.take_finished():
            self._transfer_ended(e, ended)

    def _transfer_ended(self, e: LLMEngine, ended: TransferEnded) -> None:
        cancelled = self._cancelling.pop(ended.transfer_id, None)
        if cancelled is not None:
            e.abort(cancelled)
            return
        pending = self._take_awaiting(ended.transfer_id)
        if pending is None:
            log.info("ignoring the end of unknown transfer %s", ended.transfer_id)
            return
        outcome, reason = ended.outcome, ended.reason
        firsts = list(ended.first_tokens or ())
        if ended.ok:  # one first token per sequence, each one this model has and the grammar allows
            problem = e.remote_token_problem(pending.request_id, firsts)
            if problem is None:
                self.metrics.kv_wait_seconds.observe(max(0.0, ended.at - pending.reserved_at))
                self._emit(e, e.admit_remote(pending.request_id, firsts))
                return
            outcome, reason = Outcome.BAD_NOTICE, problem
        e.abort(pending.request_id)  # the receiver reported the id: no write can land in these blocks now
        self._remote_kv_failed(e, pending, outcome, reason)

    def _take_awaiting(self, transfer_id: str) -> Awaiting | None:
        """The reservation leaves the waiting state: its blocks no longer count as unfilled."""
        self.unfilled.release(transfer_id)
        return self._awaiting.pop(transfer_id, None)

    def _remote_kv_failed(self, e: LLMEngine, pending: Awaiting, outcome: Outcome, reason: str) -> None:
        """The blocks are free. Fail the request, or prefill it here (recovery config)."""
        self.metrics.transfer_failures.labels(outcome=outcome).inc()
        action = {
            Outcome.LEASE_EXPIRED: self.settings.lease_expiry,
            Outcome.CHECKSUM_MISMATCH: self.settings.checksum_failure,
        }.get(outcome, "fail")
        rid = pending.request_id
        if action == "local":
            log.warning("request %s: remote KV failed (%s: %s); prefilling it here", rid, outcome, reason)
            e.add_request(rid, pending.prompt, pending.sampling, tenant=pending.tenant)
            self.metrics.reprefills.labels(outcome=outcome).inc()
            self._streams.publish(
                rid, ReprefillEvent(message=f"remote KV failed ({reason}); prefilling locally", code=outcome)
            )
            return
        self._streams.publish(rid, ErrorEvent(message=f"KV transfer failed: {reason}; blocks freed", code=outcome))

    def _backstop(self, transfer_id: str) -> None:
        def expire(e: LLMEngine) -> None:
            pending = self._take_awaiting(transfer_id)
            rid = pending.request_id if pending is not None else self._cancelling.pop(transfer_id, None)
            if rid is None:
                return  # ended normally
            log.error("transfer %s never ended; freeing request %s without the receiver", transfer_id, rid)
            e.abort(rid)
            self.metrics.transfer_failures.labels(outcome=Outcome.LEASE_EXPIRED).inc()
            self._streams.publish(
                rid, ErrorEvent(message="no KV arrived within the lease; blocks freed", code=Outcome.LEASE_EXPIRED)
            )

        self.engine_thread.call(expire)

    # ---- status ---------------------------------------------------------------
    def bookkeeping(self) -> dict[str, int]:
        """Entries of each map here that grows with traffic (GET /debug/bookkeeping). Per request, 0 once
        idle: ``active``, ``streams``, ``awaiting``, ``cancelling``, ``unfilled_claims``,
        ``receiver_transfers``, ``engine_requests``, ``read_pins`` (prefix reads whose blocks are pinned
        while they are copied out). Bounded: ``timeline_entries``, ``prefix_cached_blocks``
        (the cache's blocks)."""
        scheduler = self.engine_thread.stats.scheduler
        return {
            "active": len(self._active),
            "streams": len(self._hub) if self._hub is not None else 0,
            "awaiting": len(self._awaiting),
            "cancelling": len(self._cancelling),
            "unfilled_claims": len(self.unfilled),
            "receiver_transfers": self._receiver.open_transfers() if self._receiver is not None else 0,
            "engine_requests": scheduler.num_requests,
            "read_pins": scheduler.read_pins,
            "timeline_entries": len(self.timeline),
            "prefix_cached_blocks": scheduler.cached,
        }

    def health(self) -> HealthReport:
        s = self.engine_thread.stats.scheduler
        return HealthReport(
            status="draining" if self.drain.draining else "ok",
            role=self.settings.role,
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
            num_requests=len(self._active),
            launch_id=self.settings.launch_id,
            model=self._model_id,
            role_epoch=self.role_epoch,
        )
