"""kvlink/ranks.py: a server's KV transfer over its ranks, one outcome per request.

A server without rank processes (``ranks=None``) is a group of one over an in-process
KVSender/KVReceiver pair: a transfer ends as its one part did, with its own reason. With
rank processes, rank 0's part runs here and the others' are driven by ``kvlink.messages``
through ``RankProcesses``; a fake one answers those messages as a rank's agent would and
reports parts ended, so the bookkeeping of every part is checked exactly."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.tensor_parallel import kv_heads_for_rank
from kvlink.messages import (
    Abort,
    Accept,
    Answer,
    Begin,
    CancelPart,
    Expect,
    Finish,
    Open,
    PartEnded,
    Push,
    to_pipe,
    to_rank,
)
from kvlink.ports import Route
from kvlink.ranks import RankReceivers, RankSenders, rank_name
from tests.waiting import wait_until
from transfer.factory import make_backend
from transfer.inproc import InprocHub
from transfer.layout import KVLayout
from transfer.messages import DecodeGroup, DecodeRank, single_rank
from transfer.outcome import Outcome, TransferEnded
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from wire.kv_target import KVTarget

LAYERS, BLOCK, HEADS = 2, 4, 2
LEASE_S = 10.0


def layout(tp_rank: int = 0, tp_size: int = 1) -> KVLayout:
    return KVLayout.for_engine_cache(
        num_layers=LAYERS,
        num_blocks=8,
        block_size=BLOCK,
        num_kv_heads=HEADS // tp_size,
        head_dim=4,
        dtype="float32",
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_kv_heads_total=HEADS,
        head_ids=kv_heads_for_rank(HEADS, tp_rank, tp_size),
    )


def opening(role: str, name: str) -> Open:
    return Open(0, role, "inproc", name, "m", timeout_s=5.0)


class Side:
    """A KVSender or KVReceiver on the in-process backend, with its cache and a flag its
    transfer thread sets whenever a part ended."""

    def __init__(self, kind: type, hub: InprocHub, name: str, kv: KVLayout, cache: torch.Tensor) -> None:
        self.cache = cache
        self.ended = threading.Event()
        self.agent = kind(make_backend("inproc", name, hub=hub), cache, kv, name=name, model="m", notify=self.ended.set)


@pytest.fixture
def hub():
    return InprocHub()


@pytest.fixture
def closing():
    """``closing(link)`` returns ``link`` and closes it when the test ends."""
    links = []
    yield lambda link: links.append(link) or link
    for link in links:
        link.close()


def sender_side(hub, name: str, kv: KVLayout) -> Side:
    return Side(KVSender, hub, name, kv, torch.randn(kv.shape, generator=torch.Generator().manual_seed(3)))


def receiver_side(hub, name: str, kv: KVLayout) -> Side:
    return Side(KVReceiver, hub, name, kv, torch.zeros(kv.shape))


def taken(link, count: int = 1) -> list[TransferEnded]:
    """What ``link.take_finished()`` gave until ``count`` transfers had ended."""
    got: list[TransferEnded] = []
    wait_until(lambda: got.extend(link.take_finished()) or len(got) >= count, what=f"{count} transfer(s) ended")
    return got


# -- a group of one: no rank processes ----------------------------------------------------------


def one_rank_pair(hub, closing):
    p, d = sender_side(hub, "P", layout()), receiver_side(hub, "D", layout())
    senders = closing(RankSenders(p.agent, None, opening("prefill", "P")))
    receivers = closing(RankReceivers(d.agent, None, opening("decode", "D")))
    senders.start()
    receivers.start()
    hellos = senders.rank_hellos()
    answers = receivers.accept(hellos[0], timeout_s=5.0)
    met = senders.connect_ranks([answers], timeout_s=5.0)
    return p, d, senders, receivers, len(hellos), len(answers), met


def test_without_ranks_a_handshake_is_one_hello_one_answer_and_meets_the_decode_agent(hub, closing):
    _, _, senders, receivers, hellos, answers, met = one_rank_pair(hub, closing)
    assert (senders.size, receivers.size) == (1, 1)
    assert (hellos, answers, met) == (1, 1, [["D"]])
    assert senders.peer_layout("D") == layout()


def test_without_ranks_the_target_names_the_agent_and_epoch_and_no_group(hub, closing):
    _, _, _, receivers, *_ = one_rank_pair(hub, closing)
    first = receivers.expect([1, 2], LEASE_S)
    second = receivers.expect([3], LEASE_S)
    assert first.target.peer == "D"
    assert first.target.tp is None
    assert len(first.target.epoch) == 16 and first.target.epoch == second.target.epoch
    assert first.transfer_id != second.transfer_id
    assert receivers.open_transfers() == 2


def test_without_ranks_a_transfer_ends_once_on_each_side_with_the_first_tokens_and_the_blocks_copied(hub, closing):
    p, d, senders, receivers, *_ = one_rank_pair(hub, closing)
    expected = receivers.expect([6, 2], LEASE_S)
    tid = expected.transfer_id
    senders.begin(Route(tid, single_rank(tid, "D", senders.peer_layout("D")), (6, 2)), LEASE_S)
    assert (senders.open_transfers(), receivers.open_transfers()) == (1, 1)
    for layer in range(LAYERS):
        senders.push_layer(tid, layer, [3, 0], 0, 2 * BLOCK)
    senders.finish(tid, [42])

    (arrived,) = taken(receivers)
    (sent,) = taken(senders)
    assert (arrived.transfer_id, arrived.outcome, arrived.first_tokens) == (tid, Outcome.OK, (42,))
    assert (sent.transfer_id, sent.outcome) == (tid, Outcome.OK)
    assert (senders.open_transfers(), receivers.open_transfers()) == (0, 0)
    assert torch.equal(d.cache[:, :, [6, 2]], p.cache[:, :, [3, 0]])
    assert not d.cache[:, :, [0, 1, 3, 4, 5, 7]].any()  # nothing written outside the reservation
    assert senders.take_finished() == [] and receivers.take_finished() == []


def test_without_ranks_a_cancelled_transfer_ends_with_its_own_reason_not_a_rank_s(hub, closing):
    _, _, _, receivers, *_ = one_rank_pair(hub, closing)
    tid = receivers.expect([1], LEASE_S).transfer_id
    receivers.cancel(tid, "client left")
    (ended,) = taken(receivers)
    assert (ended.transfer_id, ended.outcome, ended.reason) == (tid, Outcome.CANCELLED, "client left")
    assert receivers.open_transfers() == 0


def test_without_ranks_an_aborted_transfer_ends_aborted_on_the_prefill_side(hub, closing):
    _, _, senders, receivers, *_ = one_rank_pair(hub, closing)
    tid = receivers.expect([1], LEASE_S).transfer_id
    senders.begin(Route(tid, single_rank(tid, "D", senders.peer_layout("D")), (1,)), LEASE_S)
    senders.abort(tid)
    (ended,) = taken(senders)
    assert (ended.transfer_id, ended.outcome) == (tid, Outcome.ABORTED)
    assert not ended.reason.startswith("rank ")
    assert senders.open_transfers() == 0


# -- rank processes: rank 1 is a fake agent ----------------------------------------------------------


class FakeRanks:
    """``engine.tp_leader.RankProcesses`` with one other rank whose agent this test plays: every
    message goes through the pipe's JSON form and back (``kvlink.messages.to_rank``); those that ask
    are answered at once from ``answers`` (op -> Answer fields)."""

    def __init__(self, size: int = 2, **answers: dict) -> None:
        self.size = size
        self.answers = answers
        self.got: list = []  # (rank, message) in the order sent
        self._on_message = None

    def listen(self, on_message) -> None:
        self._on_message = on_message

    def send_message(self, rank: int, message: dict) -> None:
        parsed = to_rank(message)  # what the rank's agent would read off its pipe
        self.got.append((rank, parsed))
        op = message["op"]
        if "id" in message and op in self.answers:
            self.report(rank, Answer(message["id"], **self.answers[op]))

    def report(self, rank: int, message: Answer | PartEnded) -> None:
        assert self._on_message is not None
        self._on_message(rank, to_pipe(message))

    def sent(self, kind: type) -> list:
        return [(rank, m) for rank, m in self.got if isinstance(m, kind)]


def part_ended(tid: str, outcome: Outcome, reason: str = "", first=None) -> PartEnded:
    return PartEnded(tid, str(outcome), reason, first, time.monotonic())


def two_rank_decode(hub, closing, **answers):
    """A decode server of two ranks: rank 0 an in-process receiver, rank 1 the fake's."""
    d0 = receiver_side(hub, "D", layout(0, 2))
    ranks = FakeRanks(open={"layout": layout(1, 2)}, **answers)
    receivers = closing(RankReceivers(d0.agent, ranks, opening("decode", "D")))
    receivers.start()
    return d0, ranks, receivers


def test_the_other_ranks_open_their_agents_under_their_own_names_and_report_their_layouts(hub, closing):
    _, ranks, receivers = two_rank_decode(hub, closing)
    ((rank, message),) = ranks.sent(Open)
    assert (rank, message.role, message.name, message.backend) == (1, "decode", "D-r1", "inproc")
    assert receivers.layouts == (layout(0, 2), layout(1, 2))
    assert [rank_name("D", r) for r in range(3)] == ["D", "D-r1", "D-r2"]


def test_a_decode_group_accepts_a_hello_on_every_rank_answers_in_rank_order(hub, closing):
    p = sender_side(hub, "P", layout())
    _, ranks, receivers = two_rank_decode(hub, closing, accept={"hello": b"rank-1-answer"})
    closing(p.agent).start()
    answers = receivers.accept(p.agent.hello(), timeout_s=5.0)
    assert answers[1] == b"rank-1-answer" and len(answers) == 2
    assert p.agent.connect(answers[0], 5.0) == "D"  # rank 0's own answer, from its receiver
    ((rank, message),) = ranks.sent(Accept)
    assert (rank, message.hello) == (1, p.agent.hello())


def test_a_decode_group_s_target_lists_every_rank_with_its_agent_transfer_id_and_layout(hub, closing):
    _, ranks, receivers = two_rank_decode(hub, closing, expect={"tid": "r1-part"})
    expected = receivers.expect([4, 5], LEASE_S, writable_from=1)
    ((rank, message),) = ranks.sent(Expect)
    assert (rank, message.blocks, message.lease_s, message.writable_from) == (1, [4, 5], LEASE_S, 1)
    group = DecodeGroup(
        2,
        (
            DecodeRank(0, "D", expected.transfer_id, layout(0, 2)),
            DecodeRank(1, "D-r1", "r1-part", layout(1, 2)),
        ),
    )
    assert expected.target == KVTarget(peer="D", epoch=expected.target.epoch, tp=group)
    assert receivers.open_transfers() == 1


def test_a_rank_that_cannot_expect_fails_the_reservation_and_rank_0_s_part_is_cancelled(hub, closing):
    d0, _, receivers = two_rank_decode(hub, closing, expect={"error": "no room"})
    with pytest.raises(RuntimeError, match="^rank 1: no room$"):
        receivers.expect([1], LEASE_S)
    (ended,) = taken(d0.agent)  # rank 0's receiver itself: the group never opened
    assert (ended.outcome, ended.reason) == (Outcome.CANCELLED, "reservation failed")
    assert receivers.open_transfers() == 0


def test_one_rank_s_failure_ends_the_request_naming_the_rank_and_cancels_the_other_parts(hub, closing):
    d0, ranks, receivers = two_rank_decode(hub, closing, expect={"tid": "r1-part"})
    tid = receivers.expect([1], LEASE_S).transfer_id
    ranks.report(1, part_ended("r1-part", Outcome.CHECKSUM_MISMATCH, "block 1"))
    (ended,) = taken(receivers)
    assert (ended.transfer_id, ended.outcome, ended.reason) == (tid, Outcome.CHECKSUM_MISMATCH, "rank 1: block 1")
    assert ranks.sent(CancelPart) == []  # the part that failed is not cancelled again
    wait_until(d0.ended.is_set, what="rank 0's part cancelled")
    assert receivers.take_finished() == []  # rank 0's cancelled part ends nothing more
    assert receivers.open_transfers() == 0


def test_cancelling_a_request_cancels_every_rank_s_part_with_the_reason(hub, closing):
    _, ranks, receivers = two_rank_decode(hub, closing, expect={"tid": "r1-part"})
    tid = receivers.expect([1], LEASE_S).transfer_id
    receivers.cancel(tid, "client left")
    assert [(r, m.tid, m.reason) for r, m in ranks.sent(CancelPart)] == [(1, "r1-part", "client left")]
    ranks.report(1, part_ended("r1-part", Outcome.CANCELLED, "client left"))
    (ended,) = taken(receivers)
    assert (ended.transfer_id, ended.outcome) == (tid, Outcome.CANCELLED)


@pytest.mark.parametrize(
    ("rank_1_first", "outcome", "first"), [((7,), Outcome.OK, (7,)), ((8,), Outcome.BAD_NOTICE, None)]
)
def test_a_decode_group_s_request_ends_once_every_rank_agrees_on_the_first_tokens(
    hub, closing, rank_1_first, outcome, first
):
    p = sender_side(hub, "P", layout(0, 2))  # fills decode rank 0; rank 1's part is the fake's
    closing(p.agent).start()
    d0, ranks, receivers = two_rank_decode(hub, closing, accept={"hello": b"-"}, expect={"tid": "r1-part"})
    peer = p.agent.connect(receivers.accept(p.agent.hello(), 5.0)[0], 5.0)
    tid = receivers.expect([5, 6], LEASE_S).transfer_id
    p.agent.begin(tid, peer, [5, 6], LEASE_S)
    for layer in range(LAYERS):
        p.agent.push_layer(tid, layer, [1, 2], 0, 2 * BLOCK)
    p.agent.finish(tid, [7])
    wait_until(d0.ended.is_set, what="rank 0's part ended")
    assert receivers.take_finished() == []  # rank 1's part is still open
    ranks.report(1, part_ended("r1-part", Outcome.OK, first=rank_1_first))
    (ended,) = taken(receivers)
    assert (ended.transfer_id, ended.outcome, ended.first_tokens) == (tid, outcome, first)
    assert receivers.open_transfers() == 0
    assert torch.equal(d0.cache[:, :, [5, 6]], p.cache[:, :, [1, 2]])


def two_rank_prefill(hub, closing):
    """A prefill server of two ranks (rank 0 in process, rank 1 the fake's) and a decode server of two
    ranks whose rank 0 is a real receiver: P rank r sends its heads to D rank r."""
    p0 = sender_side(hub, "P", layout(0, 2))
    d0 = receiver_side(hub, "D", layout(0, 2))
    ranks = FakeRanks(open={"layout": layout(1, 2)})
    senders = closing(RankSenders(p0.agent, ranks, opening("prefill", "P")))
    senders.start()
    d0.agent.start()
    closing(d0.agent)
    p0.agent.connect(d0.agent.accept(p0.agent.hello()))
    tid = d0.agent.expect([5, 6], LEASE_S)
    group = DecodeGroup(2, (DecodeRank(0, "D", tid, layout(0, 2)), DecodeRank(1, "D-r1", "r1-part", layout(1, 2))))
    return p0, d0, ranks, senders, tid, group


def test_a_prefill_group_begins_pushes_and_finishes_every_rank_s_part(hub, closing):
    p0, d0, ranks, senders, tid, group = two_rank_prefill(hub, closing)
    before = time.monotonic()
    senders.begin(Route(tid, group, (5, 6)), LEASE_S)
    ((rank, begin),) = ranks.sent(Begin)
    assert (rank, begin.tid, begin.peer, begin.blocks, begin.heads) == (1, "r1-part", "D-r1", [5, 6], (1,))
    assert before + LEASE_S <= begin.deadline <= time.monotonic() + LEASE_S
    starts = [0] + [3] * (LAYERS - 1)  # each layer its own range (a window layer's starts later)
    for layer in range(LAYERS):
        senders.push_layer(tid, layer, [1, 2], starts[layer], 2 * BLOCK)
    senders.finish(tid, [7])
    # rank 1 gets every layer's own range, and takes each after the step
    pushes = [(r, m.tid, m.layer, m.blocks, m.start, m.end) for r, m in ranks.sent(Push)]
    assert pushes == [(1, "r1-part", layer, [1, 2], starts[layer], 8) for layer in range(LAYERS)]
    assert [(r, m.tid, m.first_tokens) for r, m in ranks.sent(Finish)] == [(1, "r1-part", [7])]

    (arrived,) = taken(d0.agent)
    assert (arrived.transfer_id, arrived.first_tokens) == (tid, (7,))
    wait_until(p0.ended.is_set, what="rank 0's part ended")
    assert senders.take_finished() == []  # rank 1's part is still open
    assert senders.open_transfers() == 1
    ranks.report(1, part_ended("r1-part", Outcome.OK))  # a sender's part ends without first tokens
    (ended,) = taken(senders)
    assert (ended.transfer_id, ended.outcome, ended.first_tokens) == (tid, Outcome.OK, None)
    assert senders.open_transfers() == 0
    # rank 0's part: each layer's tokens from its own start (NHD: [layer, K|V, block, slot, ...])
    sent, written = p0.cache[:, :, [1, 2]].flatten(2, 3), d0.cache[:, :, [5, 6]].flatten(2, 3)
    for layer in range(LAYERS):
        assert torch.equal(written[layer, :, starts[layer] :], sent[layer, :, starts[layer] :]), layer
        assert not written[layer, :, : starts[layer]].any(), layer  # nothing before a layer's start


def test_a_failed_rank_part_aborts_rank_0_s_and_the_request_ends_once_naming_the_rank(hub, closing):
    p0, _, ranks, senders, tid, group = two_rank_prefill(hub, closing)
    senders.begin(Route(tid, group, (5, 6)), LEASE_S)
    ranks.report(1, part_ended("r1-part", Outcome.PEER_LOST, "D-r1 went away"))
    (ended,) = taken(senders)
    assert (ended.transfer_id, ended.outcome, ended.reason) == (tid, Outcome.PEER_LOST, "rank 1: D-r1 went away")
    assert ranks.sent(Abort) == []
    wait_until(p0.ended.is_set, what="rank 0's part aborted")
    assert senders.take_finished() == []
    assert senders.open_transfers() == 0


def test_aborting_a_request_aborts_the_other_ranks_parts(hub, closing):
    _, _, ranks, senders, tid, group = two_rank_prefill(hub, closing)
    senders.begin(Route(tid, group, (5, 6)), LEASE_S)
    senders.abort(tid)
    assert [(r, m.tid) for r, m in ranks.sent(Abort)] == [(1, "r1-part")]
