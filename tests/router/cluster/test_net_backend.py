"""router/cluster/net_backend.py: httpcore's network streams on asyncio transports, against real
servers on 127.0.0.1, and the router's worker client on it (httpx's exceptions for each failure).
Every test runs on asyncio's own event loop and on uvloop's, which the router serves on."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
import struct
from pathlib import Path

import httpcore
import httpx
import pytest

from router.cluster import net_backend
from router.cluster.http_pool import worker_http
from router.cluster.net_backend import AsyncioBackend, AsyncioStream
from tests.support.loopback import Handler, refused_port, serve


def sends(data: bytes, after: asyncio.Event | None = None) -> Handler:
    """A server that writes ``data`` (once ``after`` is set, if given) and closes."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if after is not None:
            await after.wait()
        writer.write(data)
        await writer.drain()
        writer.close()

    return handler


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER 0: the peer sees a reset, not an end."""
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def read_all(stream: httpcore.AsyncNetworkStream, timeout: float = 10.0) -> bytes:
    out = bytearray()
    while chunk := await stream.read(1 << 16, timeout=timeout):
        out += chunk
    return bytes(out)


def test_a_stream_reads_what_the_server_wrote_then_the_end(run):
    async def main():
        async def handler(reader, writer):
            line = await reader.readline()
            writer.write(b"echo " + line)
            await writer.drain()
            writer.close()

        server, port = await serve(handler)
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
            assert stream.get_extra_info("server_addr") == ("127.0.0.1", port)
            assert stream.get_extra_info("client_addr")[0] == "127.0.0.1"
            assert stream.get_extra_info("socket").fileno() >= 0
            assert stream.get_extra_info("ssl_object") is None
            await stream.write(b"hello\n", timeout=5)
            assert await read_all(stream) == b"echo hello\n"
            assert await stream.read(100) == b""  # the end stays the end
            assert stream.get_extra_info("is_readable") is True
            await stream.aclose()

    run(main())


def test_a_read_returns_at_most_max_bytes_and_keeps_the_rest_in_order(run):
    payload = bytes(range(256)) * 64  # 16 KiB

    async def main():
        server, port = await serve(sends(payload))
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", port)
            got = bytearray()
            while chunk := await stream.read(1000, timeout=10):
                assert len(chunk) <= 1000
                got += chunk
            assert bytes(got) == payload

    run(main())


def test_a_reader_slower_than_the_server_pauses_the_transport_and_loses_nothing(run):
    payload = bytes(i % 251 for i in range(3 * net_backend.HIGH_WATER))

    async def main():
        server, port = await serve(sends(payload))
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", port)
            assert isinstance(stream, AsyncioStream)
            conn = stream._conn
            first = await stream.read(1, timeout=10)
            while not conn.reading_paused:  # the transport fills the buffer up to the mark, then stops
                await asyncio.wait_for(more_data(conn), 10)
            assert conn.buffered >= net_backend.HIGH_WATER
            rest = await read_all(stream)
            assert first + rest == payload
            assert not conn.reading_paused and conn.buffered == 0

    run(main())


def more_data(conn: net_backend._Connection) -> asyncio.Future:
    """Done when the transport delivers more: what a read waits on, armed at once (no loop turn
    between the caller's look at the buffer and the arming), and read nothing."""
    conn.readable = asyncio.get_running_loop().create_future()
    return conn.readable


def test_a_silent_server_times_a_read_out_and_a_later_read_still_works(run):
    async def main():
        go = asyncio.Event()
        server, port = await serve(sends(b"late", after=go))
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", port)
            with pytest.raises(httpcore.ReadTimeout):
                await stream.read(100, timeout=0.05)
            assert stream.get_extra_info("is_readable") is False
            go.set()
            assert await read_all(stream) == b"late"

    run(main())


def test_a_cancelled_read_leaves_the_stream_usable(run):
    async def main():
        go = asyncio.Event()
        server, port = await serve(sends(b"after", after=go))
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", port)
            task = asyncio.create_task(stream.read(100))
            while stream._conn.readable is None:  # type: ignore[attr-defined]
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert stream._conn.readable is None  # type: ignore[attr-defined]
            go.set()
            assert await read_all(stream) == b"after"

    run(main())


def test_a_reset_connection_is_a_read_error(run):
    async def main():
        async def handler(reader, writer):
            await reader.readline()
            reset(writer)

        server, port = await serve(handler)
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", port)
            await stream.write(b"go\n")
            with pytest.raises(httpcore.ReadError):
                await stream.read(100, timeout=10)
            assert stream.get_extra_info("is_readable") is True

    run(main())


def test_an_idle_connection_turns_readable_when_the_server_closes_it(run):
    async def main():
        close = asyncio.Event()

        async def handler(reader, writer):
            await close.wait()
            writer.close()

        server, port = await serve(handler)
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", port)
            assert stream.get_extra_info("is_readable") is False
            close.set()
            assert await stream.read(100, timeout=10) == b""
            assert stream.get_extra_info("is_readable") is True

    run(main())


def test_writing_to_a_closed_stream_is_a_write_error(run):
    async def main():
        async def handler(reader, writer):
            await reader.read()

        server, port = await serve(handler)
        async with server:
            stream = await AsyncioBackend().connect_tcp("127.0.0.1", port)
            await stream.write(b"")  # nothing to write: nothing happens
            await stream.aclose()
            with pytest.raises(httpcore.WriteError):
                await stream.write(b"x")

    run(main())


def test_a_refused_connection_is_a_connect_error_and_socket_options_are_refused(run):
    async def main():
        with pytest.raises(httpcore.ConnectError):
            await AsyncioBackend().connect_tcp("127.0.0.1", refused_port(), timeout=5)
        with pytest.raises(ValueError, match="socket_options"):
            options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
            await AsyncioBackend().connect_tcp("127.0.0.1", 1, socket_options=options)

    run(main())


def test_a_unix_socket_connects_and_reads(run, tmp_path: Path):
    async def main():
        path = str(tmp_path / "s")
        server = await asyncio.start_unix_server(sends(b"unix"), path)
        async with server:
            stream = await AsyncioBackend().connect_unix_socket(path, timeout=5)
            assert await read_all(stream) == b"unix"
        with pytest.raises(httpcore.ConnectError):
            await AsyncioBackend().connect_unix_socket(str(tmp_path / "none"), timeout=5)

    run(main())


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made here (no network, no CA)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def test_tls_through_start_tls_and_a_certificate_it_does_not_trust(run, tmp_path: Path):
    cert, key = self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def main():
        async def handler(reader, writer):
            line = await reader.readline()
            writer.write(b"tls " + line)
            await writer.drain()
            writer.close()

        server, port = await serve(handler, server_ctx)
        async with server:
            trusting = ssl.create_default_context(cafile=str(cert))
            plain = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
            stream = await plain.start_tls(trusting, server_hostname="127.0.0.1", timeout=5)
            assert stream.get_extra_info("ssl_object") is not None
            await stream.write(b"hi\n")
            assert await read_all(stream) == b"tls hi\n"

            plain = await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)
            with pytest.raises(httpcore.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await plain.start_tls(ssl.create_default_context(), server_hostname="127.0.0.1", timeout=5)

    run(main())


# ---- the router's worker client on it: httpx's exceptions, as the router's fault handling reads them ----


def _chunked(*chunks: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)


def test_the_worker_client_streams_lines_and_reuses_its_connection(run):
    async def main():
        connections = 0

        async def handler(reader, writer):
            nonlocal connections
            connections += 1
            for _ in range(2):
                while (await reader.readline()) not in (b"\r\n", b""):
                    pass
                writer.write(_chunked(b'{"a": 1}\n', b'{"b": 2}\n', b""))
                await writer.drain()
            writer.close()

        server, port = await serve(handler)
        async with server, worker_http(4, 4, 5.0, {}) as http:
            for _ in range(2):
                async with http.stream("GET", f"http://127.0.0.1:{port}/generate") as r:
                    assert r.status_code == 200
                    assert [line async for line in r.aiter_lines()] == ['{"a": 1}', '{"b": 2}']
            assert connections == 1

    run(main())


@pytest.mark.parametrize(
    ("server_does", "expected"),
    [
        ("stall", httpx.ReadTimeout),
        ("cut", httpx.RemoteProtocolError),  # the end in the middle of a chunked body
        ("reset", httpx.ReadError),
        ("refuse", httpx.ConnectError),
    ],
)
def test_the_worker_client_raises_httpx_errors_on_a_broken_stream(run, server_does: str, expected: type[Exception]):
    async def main():
        stall = asyncio.Event()

        async def handler(reader, writer):
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            writer.write(_chunked(b'{"a": 1}\n'))  # one line of a stream that goes on
            await writer.drain()
            if server_does == "stall":
                await stall.wait()
            elif server_does == "reset":
                reset(writer)
            else:
                writer.close()

        server, port = await serve(handler)
        if server_does == "refuse":
            port = refused_port()
        async with server, worker_http(4, 4, 5.0, {}) as http:
            with pytest.raises(expected):
                url = f"http://127.0.0.1:{port}/generate"
                async with http.stream("GET", url, timeout=httpx.Timeout(5.0, read=0.2)) as r:
                    async for _ in r.aiter_lines():
                        pass
            stall.set()

    run(main())
