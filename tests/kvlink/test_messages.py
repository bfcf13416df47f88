"""kvlink/messages.py: rank 0 <-> a rank's agent, as JSON lines on the rank pipes. Every message
comes back equal from its pipe form, bytes travel as base64 text, and anything that is not one
of the messages is refused."""

from __future__ import annotations

import base64
import json

import msgspec
import pytest

from engine.tensor_parallel import kv_heads_for_rank
from kvlink.messages import (
    Abort,
    Accept,
    Answer,
    AskHello,
    Begin,
    CancelPart,
    Connect,
    Expect,
    Finish,
    Forget,
    Open,
    PartEnded,
    Push,
    from_rank,
    to_pipe,
    to_rank,
)
from transfer.layout import KVLayout

LAYOUT = KVLayout.for_engine_cache(
    num_layers=2,
    num_blocks=8,
    block_size=4,
    num_kv_heads=1,
    head_dim=4,
    dtype="bfloat16",
    tp_rank=1,
    tp_size=2,
    num_kv_heads_total=2,
    head_ids=kv_heads_for_rank(2, 1, 2),
    order="HND",
)

TO_RANK = [
    Open(1, "decode", "zmq", "d0-r1", "tiny", 5.0, host="10.0.0.2", advertise="d0.example"),
    AskHello(2),
    Connect(3, b"\x00hello\xff", 2.5),
    Accept(4, b"\x01\x02", 2.5),
    Expect(5, [3, 1, 2], 30.0, 1),
    CancelPart("t-1", "client left"),
    Begin("t-1", "d0-r1", [3, 1], 1234.5, (1,)),
    Push("t-1", 3, [7, 8], 0, 9),
    Finish("t-1", [42, 43]),
    Abort("t-1"),
    Forget("d0"),
]
FROM_RANK = [
    Answer(1, layout=LAYOUT),
    Answer(2, hello=b"\x00\xffhello"),
    Answer(3, peer="d0-r1"),
    Answer(5, tid="t-9"),
    Answer(6, error="no room"),
    PartEnded("t-1", "ok", "", (42,), 99.25),
    PartEnded("t-2", "checksum_mismatch", "block 3", None, 100.0),
]


def through_the_pipe(message) -> dict:
    """The message as the other end reads it: a JSON line."""
    return json.loads(json.dumps(to_pipe(message)))


@pytest.mark.parametrize("message", TO_RANK, ids=lambda m: type(m).__name__)
def test_every_message_to_a_rank_comes_back_equal_from_its_json_line(message):
    assert to_rank(through_the_pipe(message)) == message


@pytest.mark.parametrize("message", FROM_RANK, ids=lambda m: f"{type(m).__name__}")
def test_every_message_from_a_rank_comes_back_equal_from_its_json_line(message):
    assert from_rank(through_the_pipe(message)) == message


def test_each_message_names_itself_with_op():
    ops = [through_the_pipe(m)["op"] for m in TO_RANK + FROM_RANK[:1] + FROM_RANK[-1:]]
    expected = ["open", "hello", "connect", "accept", "expect", "cancel", "begin", "push", "finish", "abort"]
    assert ops == expected + ["forget", "answer", "ended"]


def test_handshake_bytes_travel_as_base64_text():
    line = through_the_pipe(Connect(3, b"\x00hello\xff", 2.5))
    assert line == {"op": "connect", "id": 3, "hello": base64.b64encode(b"\x00hello\xff").decode(), "timeout_s": 2.5}


def test_an_answer_carries_only_its_id_and_what_was_asked_for_defaults_empty():
    assert from_rank({"op": "answer", "id": 7}) == Answer(7, error="", layout=None, hello=b"", peer="", tid="")


@pytest.mark.parametrize(
    "raw",
    [
        {"op": "shutdown"},  # no such message
        {"op": "abort"},  # a field missing
        {"op": "push", "tid": "t", "blocks": ["x"], "start": 0, "end": 1},  # a field of the wrong type
        {"tid": "t"},  # no op
    ],
)
def test_what_is_not_a_message_to_a_rank_is_refused(raw):
    with pytest.raises(msgspec.ValidationError):
        to_rank(raw)


def test_a_rank_s_answer_is_not_a_message_to_a_rank_nor_the_other_way():
    with pytest.raises(msgspec.ValidationError):
        to_rank(through_the_pipe(Answer(1)))
    with pytest.raises(msgspec.ValidationError):
        from_rank(through_the_pipe(Abort("t")))
