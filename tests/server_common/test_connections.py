"""ConnectionGuard's caps (server_common/connections.py): per address, in all, and the reserve."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from deploy.config import ClusterConfig
from server_common.connections import (
    FD_HEADROOM,
    FULL,
    HEADER_TOO_LARGE,
    MAX_HEADER_BYTES,
    MAX_PIPELINED,
    REASONS,
    TOO_MANY,
    ConnectionGuard,
)
from tests.support.loopback import closed_by_peer
from tests.waiting import wait_until


def test_the_last_connections_are_kept_for_trusted_addresses():
    guard = ConnectionGuard(1, 1, max_per_client=3, max_connections=10, reserved=4, trusted=["10.0.0.9"])
    strangers = [guard.claim(f"10.0.1.{i}") for i in range(8)]
    assert strangers == [None] * 6 + [FULL, FULL]  # 10 - 4 for strangers
    assert [guard.claim("10.0.0.9") for _ in range(4)] == [None, None, None, TOO_MANY]  # per address still
    assert [guard.claim("127.0.0.1"), guard.claim("::1")] == [None, FULL]  # loopback is trusted; now 10 open
    guard.release("10.0.1.0")
    assert guard.claim("10.0.1.7") == FULL and guard.claim("127.0.0.1") is None
    assert guard.refused == {
        "header_timeout": 0,
        "body_timeout": 0,
        "too_many": 1,
        "full": 4,
        "header_too_large": 0,
        "pipelined": 0,
    }
    assert guard.total == 10


def test_the_cap_stays_under_the_file_descriptor_limit():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    guard = ConnectionGuard(1, 1, max_per_client=3, max_connections=10**9)
    assert guard.max_connections == resource.getrlimit(resource.RLIMIT_NOFILE)[0] - FD_HEADROOM >= soft - FD_HEADROOM


@pytest.mark.parametrize(
    "section, fields",
    [
        ("router", {"max_connections": 100, "reserved_connections": 100}),
        ("security", {"server_max_connections": 64, "server_reserved_connections": 64}),
    ],
)
def test_a_reserve_as_large_as_the_cap_is_a_config_error(section, fields):
    base = {"model": "tiny", "prefill": [{"name": "p0"}], "decode": [{"name": "d0"}]}
    with pytest.raises(ValueError, match="reserved_connections must be below"):
        ClusterConfig.model_validate(base | {section: fields})


class _Slow:
    """An app whose ``/slow`` response sends one chunk, then its end once ``finish`` is set; every
    other path reads the request's body and answers ``ok``."""

    def __init__(self) -> None:
        self.finish = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/slow":
            while (await receive()).get("more_body"):
                pass
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
        await send({"type": "http.response.body", "body": b"sl", "more_body": True})
        await asyncio.get_running_loop().run_in_executor(None, self.finish.wait)
        await send({"type": "http.response.body", "body": b"ow"})


@contextlib.contextmanager
def _serving(guard: ConnectionGuard, app=None) -> Iterator[tuple[str, int]]:
    """uvicorn on a free loopback port with ``guard``'s protocol, until the block ends (then every
    connection the guard counted has been released)."""
    app = app or _Slow()
    listener = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", http=guard.protocol_class(), timeout_keep_alive=60)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]})
    thread.start()
    try:
        wait_until(lambda: server.started, 30.0, "uvicorn started")
        yield listener.getsockname()
        wait_until(lambda: guard.total == 0, 10.0, "every connection released")
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()


def _answer(sock: socket.socket, end: bytes = b"\r\n\r\nok") -> bytes:
    """One whole response (by default the app's ``ok``); what came before the close if it closed instead."""
    received = b""
    while not received.endswith(end):
        chunk = sock.recv(4096)
        if not chunk:
            return received
        received += chunk
    return received


def test_an_idle_kept_alive_connection_outlives_the_header_timeout():
    """A client that waits between requests on one connection (httpx keeps an idle one 5 s) is not cut
    by the header timeout: that starts at the next request's first byte; idle is uvicorn's keep-alive."""
    guard = ConnectionGuard(header_timeout_s=0.5, body_timeout_s=5, max_per_client=8)
    with _serving(guard) as address, socket.create_connection(address) as sock:
        sock.settimeout(10)
        sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _answer(sock).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)  # the client's idle time under test, three header timeouts long
        sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _answer(sock).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n")  # and never the rest of the headers
        assert sock.recv(4096) == b""
        assert 0.4 < time.monotonic() - started < 5
    assert guard.refused["header_timeout"] == 1


def test_headers_sent_a_byte_at_a_time_are_cut_at_the_header_timeout():
    guard = ConnectionGuard(header_timeout_s=0.5, body_timeout_s=5, max_per_client=8)
    with _serving(guard) as address, socket.create_connection(address) as sock:
        sock.settimeout(10)
        started = time.monotonic()
        sent = 0
        with contextlib.suppress(OSError):  # the server closes while bytes are still coming
            for byte in b"GET / HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 1000:
                sock.sendall(bytes([byte]))
                sent += 1
                if guard.refused["header_timeout"]:
                    break
                time.sleep(0.01)  # the client's pace under test: a byte every 10 ms
        assert closed_by_peer(sock) == b""
        assert 0.4 < time.monotonic() - started < 5 and sent < 1000
    assert guard.refused == dict.fromkeys(REASONS, 0) | {"header_timeout": 1}


def test_a_body_that_stops_coming_is_cut_at_the_body_timeout():
    guard = ConnectionGuard(header_timeout_s=5, body_timeout_s=0.5, max_per_client=8)
    with _serving(guard) as address, socket.create_connection(address) as sock:
        sock.settimeout(10)
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b"{" * 10)
        started = time.monotonic()
        assert closed_by_peer(sock) == b""
        assert 0.4 < time.monotonic() - started < 4.5  # the body's timer, not the header's
    assert guard.refused["body_timeout"] == 1 and guard.refused["header_timeout"] == 0


def test_one_connection_past_the_per_client_cap_gets_the_503_at_once():
    guard = ConnectionGuard(header_timeout_s=5, body_timeout_s=5, max_per_client=2)
    with _serving(guard) as address:
        with socket.create_connection(address) as first, socket.create_connection(address) as second:
            wait_until(lambda: guard.total == 2, 10.0, "both connections claimed")
            with socket.create_connection(address) as third:
                third.settimeout(10)
                assert closed_by_peer(third) == TOO_MANY
            for sock in (first, second):  # the two within the cap are served
                sock.settimeout(10)
                sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                assert _answer(sock).startswith(b"HTTP/1.1 200")
    assert guard.refused["too_many"] == 1


def test_connections_past_the_total_cap_get_the_503_at_once():
    guard = ConnectionGuard(header_timeout_s=5, body_timeout_s=5, max_per_client=8, max_connections=3, reserved=1)
    with _serving(guard) as address:
        held = [socket.create_connection(address) for _ in range(3)]  # loopback may use the reserve
        try:
            wait_until(lambda: guard.total == 3, 10.0, "three connections claimed")
            with socket.create_connection(address) as fourth:
                fourth.settimeout(10)
                assert closed_by_peer(fourth) == FULL
        finally:
            for sock in held:
                sock.close()
    assert guard.refused["full"] == 1


def test_headers_over_the_limit_get_a_431_and_headers_under_it_are_served():
    guard = ConnectionGuard(header_timeout_s=5, body_timeout_s=5, max_per_client=8)
    head = b"GET / HTTP/1.1\r\nhost: x\r\n"
    with _serving(guard) as address:
        with socket.create_connection(address) as sock:
            sock.settimeout(10)
            sock.sendall(head + b"x-big: " + b"a" * (MAX_HEADER_BYTES - 100) + b"\r\n\r\n")
            assert _answer(sock).startswith(b"HTTP/1.1 200")
        with socket.create_connection(address) as sock:
            sock.settimeout(10)
            sock.sendall(head + b"x-big: " + b"a" * MAX_HEADER_BYTES)  # all read at once, still no end
            assert closed_by_peer(sock) == HEADER_TOO_LARGE
        with socket.create_connection(address) as sock:  # a flood: cut after the limit, before its end
            sock.settimeout(10)
            with contextlib.suppress(OSError):
                sock.sendall(head + b"x-big: " + b"a" * (64 << 20))
            assert closed_by_peer(sock) in (b"", HEADER_TOO_LARGE)
    assert guard.refused["header_too_large"] == 2


def test_an_invalid_request_gets_uvicorns_400_and_its_connection_is_released():
    guard = ConnectionGuard(header_timeout_s=5, body_timeout_s=5, max_per_client=8)
    with _serving(guard) as address, socket.create_connection(address) as sock:
        sock.settimeout(10)
        sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ntransfer-encoding: chunked\r\n\r\n")
        assert closed_by_peer(sock).startswith(b"HTTP/1.1 400 Bad Request")
    assert sum(guard.refused.values()) == 0


def test_a_streamed_response_is_not_cut_by_the_next_requests_headers_timing_out():
    """The next request's headers, begun while a response is being written, wait on the server: their
    timer starts when that response has ended, and then closes the connection."""
    guard = ConnectionGuard(header_timeout_s=0.5, body_timeout_s=5, max_per_client=8)
    app = _Slow()
    with _serving(guard, app) as address, socket.create_connection(address) as sock:
        sock.settimeout(10)
        sock.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _answer(sock, b"sl").startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n")  # and never the rest of the headers
        time.sleep(1.5)  # the response's time under test, three header timeouts long
        assert guard.refused["header_timeout"] == 0
        app.finish.set()
        started = time.monotonic()
        assert _answer(sock, b"ow") == b"ow"  # the rest of the response, whole
        assert sock.recv(4096) == b""
        assert 0.4 < time.monotonic() - started < 5
    assert guard.refused["header_timeout"] == 1


def test_requests_sent_ahead_past_the_pipelining_cap_are_dropped_and_the_connection_closes():
    """llhttp parses every request of a read at once; past MAX_PIPELINED waiting behind the one being
    served, the rest go unread and the last queued answer ends the connection."""
    guard = ConnectionGuard(header_timeout_s=5, body_timeout_s=5, max_per_client=8)
    app = _Slow()
    request = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
    with _serving(guard, app) as address, socket.create_connection(address) as sock:
        sock.settimeout(10)
        sock.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _answer(sock, b"sl").startswith(b"HTTP/1.1 200")
        sock.sendall(request * (MAX_PIPELINED + 500))
        wait_until(lambda: guard.refused["pipelined"] == 1, 10.0, "the requests past the cap dropped")
        app.finish.set()
        answers = closed_by_peer(sock).split(b"HTTP/1.1 ")
    assert answers[0] == b"ow" and len(answers) == 1 + MAX_PIPELINED
    assert all(a.startswith(b"200 OK") and a.endswith(b"\r\n\r\nok") for a in answers[1:])
    assert b"connection: close" in answers[-1] and not any(b"connection: close" in a for a in answers[1:-1])
    assert guard.refused == dict.fromkeys(REASONS, 0) | {"pipelined": 1}
