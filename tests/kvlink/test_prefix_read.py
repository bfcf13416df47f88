"""A prefix read's answer (kvlink/prefix_read.py): the K/V bytes as the body, what they are in headers, every
header and the body's length checked before anything is allocated, the checksum after; and ``fetch_prefix``
against a real HTTP server on a free port, whose every failure is a PrefixReadError with its outcome."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from kvlink.prefix_read import (
    CONTENT_TYPE,
    DTYPE_HEADER,
    RANGE_HEADER,
    SHAPE_HEADER,
    TRANSFER_HEADER,
    PrefixReadError,
    check_header,
    decode_prefix,
    encode_prefix,
    fetch_prefix,
)
from transfer.outcome import Outcome

TOKENS = torch.arange(2 * 2 * 5 * 3 * 4, dtype=torch.float32).reshape(2, 2, 5, 3, 4)


def answer(corrupt: bool = False) -> tuple[dict[str, str], bytes]:
    headers, body = encode_prefix("t1", 16, 21, TOKENS, corrupt)
    return headers, bytes(body)


def test_an_answer_round_trips_over_the_bytes_read():
    headers, body = answer()
    meta = check_header(headers, len(body), "t1", 16, 21)
    data = bytearray(body)
    tokens = decode_prefix(meta, data)
    assert torch.equal(tokens, TOKENS)
    assert tokens.data_ptr() == torch.frombuffer(data, dtype=torch.uint8).data_ptr()  # no copy on P


def test_the_body_is_the_tensors_memory():
    tokens = TOKENS.clone()
    _, body = encode_prefix("t1", 16, 21, tokens)
    tokens[0, 0, 0, 0, 0] = -1.0  # D's copied-out tensor, sent as it lies
    assert torch.frombuffer(bytearray(body), dtype=torch.float32)[0] == -1.0


@pytest.mark.parametrize(
    "change",
    [
        {TRANSFER_HEADER: "t2"},
        {RANGE_HEADER: "16-22"},
        {RANGE_HEADER: "sixteen"},
        {DTYPE_HEADER: "int64"},
        {SHAPE_HEADER: "2,2,6,3,4"},  # not the range's tokens
        {SHAPE_HEADER: "2,2,5,12"},
        {SHAPE_HEADER: "2,0,5,3,4"},
    ],
)
def test_a_header_that_does_not_fit_the_read_is_refused_before_the_body(change):
    headers, body = answer()
    with pytest.raises(PrefixReadError) as err:
        check_header({**headers, **change}, len(body), "t1", 16, 21)
    assert err.value.outcome is Outcome.BAD_NOTICE


def test_an_answer_the_readers_cache_cannot_take_is_refused_before_the_body():
    """Another model's layers, heads or width (a decode server answering with what the handshake did not
    agree): a miss before a byte of it is read, never an error of the request the read was for."""
    headers, body = answer()
    assert check_header(headers, len(body), "t1", 16, 21, fits=(2, 2, 3, 4)).shape == (2, 2, 5, 3, 4)
    for fits in ((3, 2, 3, 4), (2, 2, 1, 4), (2, 2, 3, 8)):
        with pytest.raises(PrefixReadError) as err:
            check_header(headers, len(body), "t1", 16, 21, fits=fits)
        assert err.value.outcome is Outcome.BAD_NOTICE and "does not fit" in str(err.value)


def test_a_missing_header_or_a_length_that_is_not_the_shapes_is_refused():
    headers, body = answer()
    for missing in (TRANSFER_HEADER, SHAPE_HEADER):
        with pytest.raises(PrefixReadError) as err:
            check_header({k: v for k, v in headers.items() if k != missing}, len(body), "t1", 16, 21)
        assert err.value.outcome is Outcome.BAD_NOTICE
    for length in (None, len(body) - 1, len(body) + 4):
        with pytest.raises(PrefixReadError) as err:
            check_header(headers, length, "t1", 16, 21)
        assert err.value.outcome is Outcome.BAD_NOTICE


def test_bytes_that_do_not_match_their_checksum_are_refused():
    headers, body = answer(corrupt=True)
    meta = check_header(headers, len(body), "t1", 16, 21)
    with pytest.raises(PrefixReadError) as err:
        decode_prefix(meta, bytearray(body))
    assert err.value.outcome is Outcome.CHECKSUM_MISMATCH


class Answers:
    """What the test server answers the next POST /kv/read with: (status, headers, body, bytes to send)."""

    def __init__(self) -> None:
        self.next: tuple[int, dict[str, str], bytes, int | None] = (200, {}, b"", None)
        self.asked: list[dict] = []


@pytest.fixture
def server() -> Iterator[tuple[str, Answers]]:
    answers = Answers()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            answers.asked.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            status, headers, body, sent = answers.next
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:sent])
            self.close_connection = True

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", answers
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


def test_a_read_is_asked_for_its_range_and_its_answer_checked(server):
    url, answers = server
    headers, body = answer()
    answers.next = (200, {**headers, "content-type": CONTENT_TYPE}, body, None)
    tokens = fetch_prefix(url, {"authorization": "Bearer s"}, "t1", 16, 21, 5.0, fits=(2, 2, 3, 4))
    assert torch.equal(tokens, TOKENS)
    assert answers.asked == [{"transfer_id": "t1", "start": 16, "end": 21}]


def test_a_refusal_a_short_body_and_a_corrupted_one_are_misses(server):
    url, answers = server
    refusal = json.dumps({"error": "gone", "code": "stale_reservation"}).encode()
    answers.next = (409, {"content-type": "application/json"}, refusal, None)
    with pytest.raises(PrefixReadError, match="stale_reservation") as err:
        fetch_prefix(url, {}, "t1", 16, 21, 5.0)
    assert err.value.outcome is Outcome.REFUSED
    headers, body = answer()
    answers.next = (200, {**headers, "content-type": CONTENT_TYPE}, body, len(body) // 2)
    with pytest.raises(PrefixReadError) as err:
        fetch_prefix(url, {}, "t1", 16, 21, 5.0)
    assert err.value.outcome is Outcome.BAD_NOTICE
    headers, body = answer(corrupt=True)
    answers.next = (200, {**headers, "content-type": CONTENT_TYPE}, body, None)
    with pytest.raises(PrefixReadError) as err:
        fetch_prefix(url, {}, "t1", 16, 21, 5.0)
    assert err.value.outcome is Outcome.CHECKSUM_MISMATCH


def test_a_server_that_does_not_answer_or_is_not_there_is_a_miss():
    with socket.socket() as silent:  # listens, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        with pytest.raises(PrefixReadError) as err:
            fetch_prefix(f"http://127.0.0.1:{silent.getsockname()[1]}", {}, "t1", 16, 21, 0.3)
        assert err.value.outcome is Outcome.TIMED_OUT
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(PrefixReadError) as err:
        fetch_prefix(f"http://127.0.0.1:{port}", {}, "t1", 16, 21, 2.0)
    assert err.value.outcome is Outcome.UNREACHABLE
