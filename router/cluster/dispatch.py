"""Admitting a request and opening its decode stream (docs/architecture.md).

``Dispatcher.start`` admits the request (``router.cluster.admission``: a free slot on
a decode server, and on the prefill servers when it needs one, or a bounded
wait, or 429), picks a decode server and opens the ``/generate`` stream
whose first event is the reservation, then hands both to a
``router.cluster.session.Session``, which drives the rest of the request.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from engine.request import SamplingParams
from router.cluster import tenancy
from router.cluster.admission import Admission, AdmissionSettings, Slot
from router.cluster.health import PassiveHealth
from router.cluster.kv_index import KvIndex
from router.cluster.policies import Policy
from router.cluster.registry import Worker, WorkerRegistry
from router.cluster.session import Session, SessionContext
from router.cluster.worker_client import DecodeStream, WorkerClient, WorkerFailed
from router.errors import OpenAIError
from router.metrics import RecoveryMetrics
from router.settings import PrefillFailure, RouterSettings
from server_common.guard import Drain
from transfer.outcome import Outcome
from wire.requests import GenerateRequest

log = logging.getLogger(__name__)

# A decode server that answered with one of these did not take the request: try another one.
TRY_ANOTHER_DECODE = frozenset(
    {
        Outcome.UNREACHABLE,
        Outcome.TIMED_OUT,
        Outcome.NO_ROOM,
        Outcome.DRAINING,
        Outcome.ENGINE_DOWN,
        Outcome.WRONG_ROLE,  # it switched role (deploy/role_server.py): out until it joins in its new one
        Outcome.STALE_EPOCH,
    }
)
TAKEN_OUT = frozenset(TRY_ANOTHER_DECODE - {Outcome.NO_ROOM})
# An open that ended with one of these, after its request was sent, may still be under way on its
# decode server (a reservation being made, or made and not yet answered): it is aborted there, and the
# next open goes under another attempt id.
MAY_LINGER = frozenset({Outcome.TIMED_OUT, Outcome.UNREACHABLE, Outcome.STREAM_CUT, Outcome.WORKER_ERROR})


class OpenIds:
    """The attempt ids one ``Dispatcher.open_stream`` opens under: its own id first, then
    ``<id>-open<k>`` once an open may have left an attempt on a decode server (``MAY_LINGER``) or a
    decode server holds the id already (409 ``duplicate_request``): no open ever meets an earlier
    one of its own under the same id, and every later call (the prefill server's, an abort) names
    the attempt that answered (``DecodeStream.request_id``)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.reopened = 0

    @property
    def current(self) -> str:
        return f"{self.request_id}-open{self.reopened}" if self.reopened else self.request_id

    def spend(self) -> str:
        """The current id, which no later open of this request uses."""
        spent = self.current
        self.reopened += 1
        return spent


class KVShareExceeded(OpenAIError):
    """No decode server's ``max_request_kv_share`` holds a request's whole KV need: its prompt and
    ``n`` sequences of up to ``max_tokens``. ``most``: the largest ``max_tokens`` the best server
    (``best``) would hold (0: not even the prompt). A 400 naming what to lower; ``named`` words it
    with the name the request gave its token limit (``max_completion_tokens`` on chat)."""

    def __init__(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        n: int,
        most: int,
        best: Worker,
        share: float,
        tokens_param: str = "max_tokens",
    ) -> None:
        self.facts = (num_prompt_tokens, max_tokens, n, most, best, share)
        self.most = most
        cap = best.blocks_per_request(share)
        sequences = f"{n} sequences" if n > 1 else "a completion"
        hint = (
            (f"lower {tokens_param} (at most {most} here)" + (" or n" if n > 1 else ""))
            if most >= 1
            else "shorten the prompt" + (" or lower n" if n > 1 else "")
        )
        super().__init__(
            400,
            f"this request may need more KV cache than one request may use: the prompt's {num_prompt_tokens} "
            f"tokens and {sequences} of up to {max_tokens} tokens, over {cap} blocks of {best.block_size} "
            f"tokens ({share:g} of decode server {best.name}'s {best.total_blocks}); {hint}",
            param=tokens_param if most >= 1 or n == 1 else "n",
            code="context_length_exceeded",
        )

    def named(self, tokens_param: str) -> KVShareExceeded:
        return KVShareExceeded(*self.facts, tokens_param=tokens_param)


@dataclass(frozen=True)
class DispatchSettings:
    local_prefill_threshold: int = RouterSettings.local_prefill_threshold  # prompts shorter than this: prefilled on D
    prefill_failure: PrefillFailure = RouterSettings.prefill_failure  # router/cluster/recovery.py
    no_room_cooldown: float = 0.2  # after a decode server said "no room", skip it this long (or until a slot frees)
    max_request_kv_share: float = RouterSettings.max_request_kv_share  # of a decode server's cache, per request
    migration_limit: int = RouterSettings.migration_limit  # decode failures a request survives (recovery.py)


class Dispatcher:
    def __init__(
        self,
        registry: WorkerRegistry,
        decode_policy: Policy,
        prefill_policy: Policy,
        client: WorkerClient,
        settings: DispatchSettings,
        recovery: RecoveryMetrics | None = None,
        admission: Admission | None = None,
        drain: Drain | None = None,
        health: PassiveHealth | None = None,
        kv_index: KvIndex | None = None,
    ) -> None:
        self.registry = registry
        self.kv_index = kv_index  # what each decode server caches (router/cluster/kv_index.py); None: not followed
        self.health = health or PassiveHealth(registry)
        self.decode_policy = decode_policy
        self.client = client
        self.settings = settings
        self.admission = admission or Admission(AdmissionSettings())
        self.drain = drain  # the router's own: once draining, no new session starts
        self.recovery = recovery or RecoveryMetrics(CollectorRegistry())
        self._aborts: set[asyncio.Future] = set()  # aborts of opens given up on (held: tasks are weakly kept)
        self._sessions = SessionContext(
            client=client,
            registry=registry,
            health=self.health,
            prefill_policy=prefill_policy,
            admission=self.admission,
            recovery=self.recovery,
            prefill_failure=settings.prefill_failure,
            open_stream=lambda rid, prompt, sampling, local, trace, generated, avoid: self.open_stream(
                rid, prompt, sampling, local, trace=trace, generated=generated, avoid=avoid
            ),
            migration_limit=settings.migration_limit,
        )

    def move_off(self, name: str) -> int:
        """Migrate every request streaming from decode server ``name`` (which is being drained or
        removed) to other decode servers; how many were told to."""
        worker = self.registry.find(name)
        if worker is None or worker.role != "decode":
            return 0
        moved = sum(session.move_off(worker) for session in list(self._sessions.live))
        if moved:
            log.info("decode server %s leaves: %d requests migrate off it", name, moved)
        return moved

    def wants_local_prefill(self, num_uncached_tokens: int) -> bool:
        """No prefill servers at all (colocated), a prompt whose part the decode server does not
        hold is short enough for D, or (unless recovery is "fail") no prefill server in rotation
        right now. ``num_uncached_tokens``: the prompt less what the router's index says the
        chosen decode server caches (all of it when no index is kept)."""
        if not self.registry.of_role("prefill"):
            return True
        if num_uncached_tokens < self.settings.local_prefill_threshold:
            return True
        return self.settings.prefill_failure != "fail" and not self.registry.healthy("prefill")

    def kv_budget(self, num_prompt_tokens: int, max_tokens: int, n: int, explicit: bool) -> int:
        """``max_tokens``, or less when the client did not set it, such that the request's whole KV
        need (its prompt and ``n`` sequences of ``max_tokens``) is within ``max_request_kv_share``
        of some decode server's cache; ``KVShareExceeded`` when even that cannot be. A request that
        could fill a cache would crowd out everyone else, and one that outgrew it would preempt
        itself for good."""
        refusal = self._over_share(self.registry.healthy("decode"), num_prompt_tokens, max_tokens, n)
        if refusal is None:
            return max_tokens
        if not explicit and refusal.most >= 1:
            return refusal.most
        raise refusal

    def _over_share(
        self, workers: list[Worker], num_prompt_tokens: int, max_tokens: int, n: int
    ) -> KVShareExceeded | None:
        """Why no decode server of ``workers`` holds the request within its share (None: one does,
        or none has said how much it holds)."""
        share = self.settings.max_request_kv_share
        sized = [w for w in workers if w.capacity_tokens]
        if not sized or any(w.holds_request(num_prompt_tokens, max_tokens, n, share) for w in sized):
            return None
        best = max(sized, key=lambda w: w.most_new_tokens(num_prompt_tokens, n, share))
        most = best.most_new_tokens(num_prompt_tokens, n, share)
        return KVShareExceeded(num_prompt_tokens, max_tokens, n, most, best, share)

    async def start(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        trace: str | None = None,
        prefer: str | None = None,
    ) -> Session:
        """Admit the request and open its decode stream (reservation first). ``prefer``: a decode
        server to try before the policy's order (one that holds the conversation's KV), if it can.

        Raises OpenAIError 503 when no decode server is in rotation or the router
        is shutting down, and 429 (with Retry-After) when every one is at its
        in-flight limit or full and the waiting room is full or the wait too
        long (see ``router.cluster.admission``).
        """
        if self.drain is not None and self.drain.draining:
            raise OpenAIError(
                503,
                "the router is shutting down; retry later",
                code="draining",
                retry_after=self.admission.settings.retry_after_s,
            )
        stream, slot = await self.open_stream(
            request_id, prompt, sampling, None, prefill_slot=True, trace=trace, prefer=prefer
        )
        return Session(self._sessions, request_id, prompt, sampling, stream, slot, trace)

    async def open_stream(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        local: bool | None,
        prefill_slot: bool = False,
        trace: str | None = None,
        prefer: str | None = None,
        generated: list[int] | None = None,
        avoid: frozenset[str] = frozenset(),
    ) -> tuple[DecodeStream, Slot]:
        """A decode stream on the first server in policy order with a free slot that takes it,
        waiting for one (``Admission.admit``). ``local``: D prefills the prompt itself; None:
        decided per decode server on the part of the prompt it does not cache
        (``wants_local_prefill``). ``prefill_slot``: also claim one of the prefill servers'
        slots when the request needs a prefill server (a new request; a retry runs its
        prefill without one). ``generated``: the tokens a migrated sequence already produced
        (prefilled on the decode server with the prompt); ``avoid``: decode servers it broke on."""
        req = GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling,
            local_prefill=bool(local) or bool(generated),
            trace=trace,
            generated_token_ids=generated or [],
            # the name, never the key: whose share of the KV store (none for an unattributed request)
            tenant=tenancy.CURRENT.get().ticket.tenant or None,
        )
        if generated:
            local = True
        cost = len(prompt) + sampling.max_tokens * sampling.n  # the work it asks for, in tokens
        ticket = tenancy.CURRENT.get().ticket
        ids = OpenIds(request_id)
        return await self.admission.admit(
            lambda: self._try_open(req, ticket, prefill_slot, local, prefer, avoid, ids), ticket, cost
        )

    def _abort_open(self, worker: Worker, attempt_id: str) -> None:
        """Abort an open given up on (its answer did not come in time, or the caller left): the decode
        server frees whatever it reserved for it, also when its open ends only after the abort came."""
        task = asyncio.ensure_future(self.client.abort(worker, attempt_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _try_open(
        self,
        req: GenerateRequest,
        ticket: tenancy.Ticket,
        prefill_slot: bool,
        local: bool | None,
        prefer: str | None = None,
        avoid: frozenset[str] = frozenset(),
        ids: OpenIds | None = None,
    ) -> tuple[DecodeStream, Slot] | None:
        """None when every decode server in rotation is full or keeps its free slots for other
        tenants (``Admission.may_take``), or, with ``prefill_slot``, the prefill servers are full.
        ``ids``: the attempt ids the request opens under, one per open that may linger (``OpenIds``).
        The prefill slot is claimed with the decode slot, so that no prefill server is sent more
        than its share and no reservation is made that could not be prefilled soon."""
        ids = ids or OpenIds(req.request_id)
        in_rotation = [w for w in self.registry.healthy("decode") if w.name not in avoid]
        if not in_rotation:
            raise OpenAIError(503, "no healthy decode server", retry_after=1)
        # A prompt a server's whole cache cannot hold would wait at the head of its queue until its
        # lease expired, holding up everyone behind it: it goes only where it fits, or nowhere at once.
        # On a decode server the request's whole KV need counts (``kv_budget``).
        need = len(req.prompt_token_ids) + 1  # the prompt and the first token drawn after it
        s = req.sampling
        share = self.settings.max_request_kv_share
        fits = [w for w in in_rotation if w.holds_request(need - 1, s.max_tokens, s.n, share)]
        if not fits:  # kv_budget let it in, but the servers in rotation changed since
            refusal = self._over_share(in_rotation, need - 1, s.max_tokens, s.n)
            assert refusal is not None  # a server that never said how much it holds holds anything
            raise refusal
        in_rotation = fits
        prefills = self.registry.healthy("prefill")
        if local is None and prefills and not any(w.can_hold(need) for w in prefills):
            local = True  # no prefill server could ever hold it: the decode server computes it
        prefill_full = prefill_slot and self.admission.prefill_is_full(self.registry.healthy("prefill"))
        prompt = req.prompt_token_ids
        matched = self.kv_index.matcher(prompt) if self.kv_index is not None else (lambda name: 0)
        free = [w for w in in_rotation if w.has_room() and self.admission.may_take(w, ticket)]
        order = self.decode_policy.order(free, prompt)
        if prefer is not None:  # first, if it is in rotation and has room; then the policy's order
            order = sorted(order, key=lambda w: w.name != prefer)
        for worker in order:
            here = local if local is not None else self.wants_local_prefill(len(prompt) - matched(worker.name))
            if not here and prefill_full:  # it would need a prefill server, and they are all busy
                continue
            slot = self.admission.claim(worker, prefill_slot and not here, ticket.tenant)
            attempt = req.model_copy(update={"local_prefill": here, "request_id": ids.current})
            try:
                stream = await self.client.open_decode(worker, attempt)
            except WorkerFailed as exc:
                slot.cancel()
                if exc.outcome in MAY_LINGER and not exc.never_reached:
                    log.warning("request %s: open on %s given up (%s); aborted", ids.current, worker.name, exc)
                    self._abort_open(worker, ids.spend())
                if exc.outcome is Outcome.DUPLICATE_REQUEST:  # the id is taken there: the next try takes another
                    log.warning("request %s: %s; opening under another id", ids.current, exc)
                    ids.spend()
                    continue
                if exc.outcome in TAKEN_OUT:
                    # Out of rotation now (or counted): while it is busy, no health check would tell.
                    self.health.failed(worker, exc)
                elif exc.outcome in TRY_ANOTHER_DECODE:
                    self.admission.no_room(worker, self.settings.no_room_cooldown)
                else:
                    raise OpenAIError(500, f"{exc} (request id {req.request_id})", code=exc.outcome) from exc
                continue
            except BaseException:  # the caller left while the open was under way
                slot.cancel()
                self._abort_open(worker, ids.spend())
                raise
            if stream.reservation is None:  # the decode server prefills it itself
                slot.release_prefill()
            return stream, slot
        return None
