"""Tensor-parallel routes: which prefill rank sends which KV heads to which
decode rank (pure, no torch).

Each side of a transfer is a TP group: ranks ``0..N-1`` of one instance,
each holding the slice of the KV cache for its heads (``KVLayout.head_ids``)
under the same block table. A route is one (prefill rank, decode rank,
heads) triple; the prefill rank writes those heads straight from its own
cache into the decode rank's blocks (``make_plan(..., heads=route.heads)``),
so nothing is gathered through rank 0 and nothing is copied twice::

    4 KV heads, P tp=2 -> D tp=4         2 KV heads, P tp=4 -> D tp=2
    P0 [h0 h1] --h0--> D0 [h0]           P0 [h0] --h0--> D0 [h0]
               --h1--> D1 [h1]           P1 [h0]         (holds h0 too: sends nothing)
    P1 [h2 h3] --h2--> D2 [h2]           P2 [h1] --h1--> D1 [h1]
               --h3--> D3 [h3]           P3 [h1]

Every head a decode rank holds comes from exactly one prefill rank. A head
replicated on the decode side (more D ranks than KV heads) goes to every D
rank holding it; a head replicated on the prefill side (more P ranks than KV
heads) is sent by one of its holders: the holders take turns over the D ranks
that need it, so the sending is spread. A decode rank completes its part when
verified notices cover all its heads (``KVReceiver``); the group completes
when every rank's part did (``transfer.group``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transfer.layout import IncompatiblePeer, KVLayout
from transfer.messages import MAX_TP, DecodeGroup


@dataclass(frozen=True)
class Route:
    """Prefill rank ``src_rank`` writes global KV ``heads`` into decode rank ``dst_rank``."""

    src_rank: int
    dst_rank: int
    heads: tuple[int, ...]


@dataclass(frozen=True)
class Part:
    """What one prefill rank does for one decode rank: ``KVSender.begin(transfer_id, peer, blocks, lease, heads)``."""

    dst_rank: int
    transfer_id: str
    peer: str
    heads: tuple[int, ...]


def check_group(layouts: Sequence[KVLayout], role: str) -> tuple[KVLayout, ...]:
    """The layouts of one instance's TP ranks, in rank order; raises IncompatiblePeer
    unless they are ranks 0..N-1 of tp_size N, with one cache shape (everything but
    the heads equal) and every KV head of the model held by some rank."""
    layouts = tuple(layouts)
    if not 1 <= len(layouts) <= MAX_TP:
        raise IncompatiblePeer(f"{role}: a TP group has 1 to {MAX_TP} ranks, got {len(layouts)}")
    first = layouts[0]
    for rank, layout in enumerate(layouts):
        if (layout.tp_rank, layout.tp_size) != (rank, len(layouts)):
            raise IncompatiblePeer(
                f"{role}: rank {rank} of {len(layouts)} says it is rank {layout.tp_rank} of tp_size {layout.tp_size}"
            )
        if layout.replace(head_ids=first.head_ids, tp_rank=0, tp_size=1) != first.replace(tp_rank=0, tp_size=1):
            raise IncompatiblePeer(f"{role}: rank {rank}'s cache differs from rank 0's in more than its heads")
    missing = set(range(first.num_kv_heads_total)) - {h for layout in layouts for h in layout.head_ids}
    if missing:
        raise IncompatiblePeer(f"{role}: KV heads {sorted(missing)} are held by no rank of tp_size {len(layouts)}")
    return layouts


def route_heads(src: Sequence[KVLayout], dst: Sequence[KVLayout]) -> tuple[Route, ...]:
    """Routes from prefill group ``src`` to decode group ``dst`` (each a list of
    rank layouts), sorted by (src_rank, dst_rank); heads in the source rank's
    local order. Raises IncompatiblePeer for groups of different models (layers,
    head_dim, total KV heads) or a malformed group, naming the values."""
    src, dst = check_group(src, "prefill"), check_group(dst, "decode")
    for name in ("num_layers", "head_dim", "num_kv_heads_total"):
        mine, theirs = getattr(src[0], name), getattr(dst[0], name)
        if mine != theirs:
            raise IncompatiblePeer(f"{name}: prefill has {mine!r}, decode has {theirs!r}; KV cannot be exchanged")
    holders = {h: [r for r, layout in enumerate(src) if h in layout.head_ids] for h in range(src[0].num_kv_heads_total)}
    turn = dict.fromkeys(holders, 0)
    sent: dict[tuple[int, int], set[int]] = {}
    for d, layout in enumerate(dst):
        for h in layout.head_ids:
            s = holders[h][turn[h] % len(holders[h])]
            turn[h] += 1
            sent.setdefault((s, d), set()).add(h)
    return tuple(Route(s, d, tuple(h for h in src[s].head_ids if h in heads)) for (s, d), heads in sorted(sent.items()))


def rank_parts(src: Sequence[KVLayout], target: DecodeGroup) -> dict[int, list[Part]]:
    """For every prefill rank, its parts of a transfer into the decode group a
    reservation names (ranks without a part map to an empty list). The leader
    computes this once per request and hands each rank its list."""
    parts: dict[int, list[Part]] = {r: [] for r in range(len(src))}
    for route in route_heads(src, [rank.layout for rank in target.ranks]):
        rank = target.ranks[route.dst_rank]
        parts[route.src_rank].append(Part(route.dst_rank, rank.transfer_id, rank.peer, route.heads))
    return parts
