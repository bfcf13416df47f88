"""ConnectionGuard's caps (server_common/connections.py): per address, in all, and the reserve."""

from __future__ import annotations

import resource
import socket
import threading
import time

import pytest
import uvicorn

from deploy.config import ClusterConfig
from server_common.connections import FD_HEADROOM, FULL, TOO_MANY, ConnectionGuard
from tests.waiting import wait_until


def test_the_last_connections_are_kept_for_trusted_addresses():
    guard = ConnectionGuard(1, 1, max_per_client=3, max_connections=10, reserved=4, trusted=["10.0.0.9"])
    strangers = [guard.claim(f"10.0.1.{i}") for i in range(8)]
    assert strangers == [None] * 6 + [FULL, FULL]  # 10 - 4 for strangers
    assert [guard.claim("10.0.0.9") for _ in range(4)] == [None, None, None, TOO_MANY]  # per address still
    assert [guard.claim("127.0.0.1"), guard.claim("::1")] == [None, FULL]  # loopback is trusted; now 10 open
    guard.release("10.0.1.0")
    assert guard.claim("10.0.1.7") == FULL and guard.claim("127.0.0.1") is None
    assert guard.refused == {"header_timeout": 0, "body_timeout": 0, "too_many": 1, "full": 4}
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


async def _ok(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _answer(sock: socket.socket) -> bytes:
    """One whole response (this app's: two bytes of body); b"" if the connection was closed instead."""
    received = b""
    while not received.endswith(b"\r\n\r\nok"):
        chunk = sock.recv(4096)
        if not chunk:
            return received
        received += chunk
    return received


def test_an_idle_kept_alive_connection_outlives_the_header_timeout():
    """A client that waits between requests on one connection (httpx keeps an idle one 5 s) is not cut
    by the header timeout: that starts at the next request's first byte; idle is uvicorn's keep-alive."""
    guard = ConnectionGuard(header_timeout_s=0.5, body_timeout_s=5, max_per_client=8)
    listener = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(_ok, log_level="warning", http=guard.protocol_class(), timeout_keep_alive=60)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]})
    thread.start()
    try:
        wait_until(lambda: server.started, 30.0, "uvicorn started")
        with socket.create_connection(listener.getsockname()) as sock:
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
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()
