"""A prefill server's decode peers: which decode servers it may hand KV to, and the handshake.

Hellos are msgpack bytes made by ``transfer``; they cross HTTP
base64-encoded (the decode server's ``/kv/hello``), never pickled.
"""

from __future__ import annotations

import asyncio
import base64
import functools
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from kvlink.ports import PeerMovedOn, Route
from kvlink.prefix_read import PrefixReadError, fetch_prefix
from kvlink.ranks import RankSenders
from server_common.guard import auth_headers
from server_common.settings import ServerSettings
from transfer.messages import DecodeGroup, single_rank
from transfer.outcome import Outcome, PeerBound
from wire.names import ROLE_EPOCH_HEADER
from wire.replies import Reservation

# A decode server's refusals of a handshake from an earlier role epoch (deploy/role_server.py).
STALE = frozenset({Outcome.STALE_EPOCH.value, Outcome.WRONG_ROLE.value})
READ_THREADS = 4  # prefix reads at once (kvlink/prefix_read.py); more wait for a thread


class UnknownPeer(ValueError):
    """A reservation names a decode server this cluster neither lists nor was told about by its router."""


class DecodePeers:
    """The decode servers a prefill server may hand KV to, and the handshake with each: once per
    decode server start (concurrent callers share it; a failed one is retried next time; a
    restarted decode server, with a new epoch, is met again, which replaces the connection to its
    dead predecessor). Event loop only."""

    def __init__(self, settings: ServerSettings, sender: RankSenders) -> None:
        self._settings = settings
        self._sender = sender
        self._met: dict[str, tuple[str, asyncio.Task]] = {}  # peer -> (its epoch, handshake)
        # By name: the config's (never re-pointed), and those the router's discovery announced
        # (POST /admin/peers).
        self._configured: dict[str, str] = dict(settings.decode_peers)
        self._known: dict[str, str] = dict(self._configured)
        self._ranks: dict[str, tuple[str, ...]] = {}  # decode server -> its ranks' agent names, as met
        # Prefix reads block a thread each (kvlink/prefix_read.py fetch_prefix) for up to their timeout: threads
        # of their own, so that reads held by a slow decode server never hold up handshakes.
        self._reads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="prefix-read")

    async def route(self, reservation: Reservation) -> Route:
        """Where the reservation's KV goes, its decode server met if need be. Raises (UnknownPeer,
        RuntimeError, ValueError) when it cannot be met or its group is not the one it met."""
        target = reservation.kv_target
        known = self._met.get(target.peer)
        task = known[1] if known is not None and known[0] == target.epoch else None
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.ensure_future(self._handshake(target.peer, reservation.role_epoch))
            self._met[target.peer] = (target.epoch, task)
        name = await asyncio.shield(task)
        group = target.tp
        if group is None:  # a decode server without ranks: the reservation's transfer is its only part
            group = single_rank(reservation.transfer_id, name, self._sender.peer_layout(name))
        else:
            self._check_group(target.peer, group, reservation.transfer_id)
        return Route(reservation.transfer_id, group, tuple(reservation.block_ids))

    async def _handshake(self, peer: str, role_epoch: int | None = None) -> str:
        """Only with a decode server of this cluster, at the address the cluster config (or the
        router's discovery) gives it, never one a reservation names: the secret goes nowhere
        else; and without echoing what it answered. ``role_epoch``: the reservation's, sent along;
        a server in another epoch refuses (``PeerMovedOn``)."""
        url = self._known.get(peer)
        if url is None:
            raise UnknownPeer(f"decode server {peer[:64]!r} is not one of this cluster's")
        # one handshake per (prefill rank, decode rank) pair: each prefill rank's hello is accepted
        # by every decode rank (kvlink.ranks), whose answers come back in rank order
        sender = self._sender
        hellos = await asyncio.to_thread(sender.rank_hellos)
        answers = []
        headers = auth_headers(self._settings.internal_secret)
        if role_epoch is not None:
            headers[ROLE_EPOCH_HEADER] = str(role_epoch)
        async with httpx.AsyncClient(timeout=self._settings.transfer_timeout_s, headers=headers) as client:
            for hello in hellos:
                resp = await client.post(f"{url}/kv/hello", json={"hello": base64.b64encode(hello).decode()})
                code = _code(resp) if resp.status_code == 409 else ""
                if code in STALE:
                    raise PeerMovedOn(f"decode server {peer} left the role epoch of the reservation ({code})")
                if resp.status_code != 200:
                    raise RuntimeError(f"decode server {peer} refused the handshake (HTTP {resp.status_code})")
                body = resp.json()
                answers.append([base64.b64decode(h) for h in [body["hello"], *(body.get("ranks") or [])]])
        met = await asyncio.to_thread(sender.connect_ranks, answers, self._settings.transfer_timeout_s)
        if any(names != met[0] for names in met):
            raise RuntimeError(f"decode server {peer} answered the prefill ranks as different groups: {met}")
        self._ranks[peer] = tuple(met[0])
        return met[0][0]

    async def read_prefix(
        self,
        reservation: Reservation,
        start: int,
        end: int,
        timeout_s: float,
        fits: tuple[int, int, int, int] | None = None,
    ) -> torch.Tensor:
        """Tokens [start, end) of the cached prefix ``reservation`` pins on its decode server, read back
        (kvlink/prefix_read.py), checked (``fits``: the layers, 2, heads, width the answer must have);
        within ``timeout_s``. Only from a decode server of this cluster at its known address (the secret
        goes nowhere else), and one without ranks. PrefixReadError otherwise."""
        target = reservation.kv_target
        url = self._known.get(target.peer)
        if url is None:
            raise PrefixReadError(Outcome.REFUSED, f"decode server {target.peer[:64]!r} is not one of this cluster's")
        if target.tp is not None:
            raise PrefixReadError(Outcome.INCOMPATIBLE_PEER, "a decode server with ranks holds a slice on each")
        headers = auth_headers(self._settings.internal_secret)
        if reservation.role_epoch is not None:
            headers[ROLE_EPOCH_HEADER] = str(reservation.role_epoch)
        read = functools.partial(fetch_prefix, url, headers, reservation.transfer_id, start, end, timeout_s, fits)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._reads, read)
        except PrefixReadError as exc:
            raise PrefixReadError(exc.outcome, f"decode server {target.peer}: {exc}") from None

    def _check_group(self, peer: str, group: DecodeGroup, transfer_id: str) -> None:
        """Every rank the group names must be one its decode server answered the handshake with,
        and rank 0's transfer the reservation's (ValueError otherwise: it came over the network)."""
        met = self._ranks.get(peer, ())
        strangers = [r.peer for r in group.ranks if r.peer not in met]
        if strangers:
            raise ValueError(f"kv_target.tp names agents {strangers[:4]} its decode server did not answer with")
        if group.ranks[0].transfer_id != transfer_id:
            raise ValueError("kv_target.tp: rank 0's transfer id is not the reservation's")

    def add(self, name: str, url: str) -> None:
        """The router vouches for a decode server that joined (its discovery found it). One the
        config lists keeps the config's address: another raises PeerBound, and nothing changes."""
        configured = self._configured.get(name)
        if configured is not None and url != configured:
            raise PeerBound(f"decode server {name!r} is in the cluster config at {configured}; it is not re-pointed")
        if self._known.get(name) != url:
            self._met.pop(name, None)  # a new address: meet it afresh
        self._known[name] = url

    def forget(self, name: str) -> bool:
        """A decode server left: no handshake with it any more; its transfer state is released."""
        known = self._known.pop(name, None) is not None
        self._met.pop(name, None)
        for agent in self._ranks.pop(name, (name,)):
            self._sender.forget(agent)
        return known

    def known(self) -> dict[str, str]:
        return dict(self._known)

    async def close(self) -> None:
        """The server stops: reads not started are dropped, those under way end by their timeout (each has
        a connection of its own; nothing is kept open between reads)."""
        self._reads.shutdown(wait=False, cancel_futures=True)


def _code(resp: httpx.Response) -> str:
    """The ``code`` of an ErrorReply body ("" when it is none)."""
    try:
        code = resp.json().get("code", "")
    except (ValueError, AttributeError):
        return ""
    return code if isinstance(code, str) else ""
