"""router/cluster/h1_client.py: the router's HTTP/1.1 client to its workers, against real servers on
127.0.0.1 (asyncio's stream servers speaking raw HTTP): the answers it reads, the connections it keeps
and closes, and httpx's exception for each way a call fails. Every test runs on asyncio's own event
loop and on uvloop's, which the router serves on."""

from __future__ import annotations

import asyncio
import socket
import struct

import httpx
import pytest

from engine.request import SamplingParams
from router.cluster import h1_client
from router.cluster.h1_client import H1Client
from router.cluster.registry import Worker
from router.cluster.worker_client import WorkerClient, WorkerFailed
from tests.support.loopback import Handler, refused_port, serve
from tests.waiting import until
from transfer.outcome import Outcome
from wire.requests import GenerateRequest


async def read_request(reader: asyncio.StreamReader) -> tuple[list[bytes], bytes] | None:
    """One request's head lines and body (by its content-length); None at the connection's end."""
    lines = []
    while (line := await reader.readline()) not in (b"\r\n", b""):
        lines.append(line.rstrip(b"\r\n"))
    if not lines:
        return None
    length = next((int(v) for k, _, v in (x.partition(b": ") for x in lines) if k.lower() == b"content-length"), 0)
    return lines, await reader.readexactly(length)


def chunked(*chunks: bytes, end: bool = True) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
    return head + body + (b"0\r\n\r\n" if end else b"")


def sized(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n%s" % (status.encode(), len(body), extra, body)


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER 0: the peer sees a reset, not an end."""
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def body_of(reply: h1_client.Reply) -> bytes:
    return b"".join([chunk async for chunk in reply.aiter_bytes()])


def test_answers_stream_and_come_whole_on_one_kept_alive_connection(run):
    async def main():
        connections, seen = 0, []

        async def handler(reader, writer):
            nonlocal connections
            connections += 1
            while (request := await read_request(reader)) is not None:
                seen.append(request)
                if request[0][0].startswith(b"POST /generate"):
                    writer.write(chunked(b'{"a": 1}\n', b'{"b": 2}\n'))
                else:
                    writer.write(sized(b'{"ok": true}', extra=b"x-thing: Yes\r\n"))
                await writer.drain()
            writer.close()

        server, port = await serve(handler)
        async with server, H1Client(4, 4, 5.0, {"authorization": "Bearer s"}) as http:
            reply = await http.request(
                "POST", f"http://127.0.0.1:{port}/generate", '{"q": 1}', {"x-epoch": "3"}, timeout=5, stream=True
            )
            assert (reply.status_code, reply.headers["content-type"]) == (200, "application/x-ndjson")
            assert await body_of(reply) == b'{"a": 1}\n{"b": 2}\n'
            reply = await http.request("POST", f"http://127.0.0.1:{port}/prefill?x=1", b"abc", timeout=5)
            assert (reply.status_code, reply.content, reply.headers["x-thing"]) == (200, b'{"ok": true}', "Yes")
            assert (connections, http.connections) == (1, 1)
        head, body = seen[0]
        assert head[0] == b"POST /generate HTTP/1.1" and body == b'{"q": 1}'
        assert {b"host: 127.0.0.1:%d" % port, b"content-length: 8", b"authorization: Bearer s", b"x-epoch: 3"} <= set(
            head
        )
        assert seen[1][0][0] == b"POST /prefill?x=1 HTTP/1.1" and seen[1][1] == b"abc"

    run(main())


@pytest.mark.parametrize(
    ("server_does", "expected"),
    [
        ("stall", httpx.ReadTimeout),
        ("cut", httpx.RemoteProtocolError),  # the end in the middle of a chunked body
        ("reset", httpx.ReadError),
        ("refuse", httpx.ConnectError),
        ("garbage", httpx.RemoteProtocolError),
    ],
)
def test_a_broken_stream_raises_httpxs_exception_and_frees_its_connection(
    run, server_does: str, expected: type[Exception]
):
    async def main():
        stall = asyncio.Event()

        async def handler(reader, writer):
            await read_request(reader)
            writer.write(chunked(b'{"a": 1}\n', end=False))  # one line of a stream that goes on
            await writer.drain()
            if server_does == "stall":
                await stall.wait()
            elif server_does == "reset":
                reset(writer)
            elif server_does == "garbage":
                writer.write(b"zz\r\nnot a chunk\r\n")
                await writer.drain()
                await stall.wait()
            else:
                writer.close()

        server, port = await serve(handler)
        if server_does == "refuse":
            port = refused_port()
        async with server, H1Client(4, 4, 5.0) as http:
            with pytest.raises(expected):
                url = f"http://127.0.0.1:{port}/generate"
                reply = await http.request("POST", url, b"{}", timeout=5, read_timeout=0.2, stream=True)
                async for _ in reply.aiter_bytes():
                    pass
            assert http.connections == 0
            stall.set()

    run(main())


@pytest.mark.parametrize("server_does", ["close", "reset", "stall"])
def test_no_answer_at_all_is_an_error_before_the_head(run, server_does: str):
    async def main():
        stall = asyncio.Event()

        async def handler(reader, writer):
            await read_request(reader)
            if server_does == "close":
                writer.close()
            elif server_does == "reset":
                reset(writer)
            else:
                await stall.wait()

        server, port = await serve(handler)
        expected = {"close": httpx.RemoteProtocolError, "reset": httpx.ReadError, "stall": httpx.ReadTimeout}
        async with server, H1Client(4, 4, 5.0) as http:
            with pytest.raises(expected[server_does]):
                await http.request("POST", f"http://127.0.0.1:{port}/prefill", b"{}", timeout=0.3)
            assert http.connections == 0
            stall.set()

    run(main())


def test_a_full_pool_waits_for_a_connection_and_times_out(run):
    async def main():
        go_on = asyncio.Event()
        connections = 0

        async def handler(reader, writer):
            nonlocal connections
            connections += 1
            await read_request(reader)
            writer.write(chunked(b"1\n", end=False))
            await writer.drain()
            await go_on.wait()
            writer.write(b"0\r\n\r\n")
            await read_request(reader)
            writer.write(sized(b"second"))
            await writer.drain()

        server, port = await serve(handler)
        url = f"http://127.0.0.1:{port}/x"
        async with server, H1Client(1, 1, 5.0) as http:
            first = await http.request("POST", url, timeout=5, stream=True)
            with pytest.raises(httpx.PoolTimeout):
                await http.request("POST", url, timeout=0.2)
            second = asyncio.ensure_future(http.request("POST", url, timeout=5))
            go_on.set()
            assert await body_of(first) == b"1\n"
            assert (await second).content == b"second"
            assert connections == 1

    run(main())


def test_idle_connections_beyond_the_keepalive_count_or_age_close_and_an_idle_one_to_another_server_makes_room(run):
    async def main():
        opened = {"a": 0, "b": 0}

        def handler(name: str) -> Handler:
            async def answer(reader, writer):
                opened[name] += 1
                while await read_request(reader) is not None:
                    writer.write(sized(b"ok"))
                    await writer.drain()

            return answer

        a, port_a = await serve(handler("a"))
        b, port_b = await serve(handler("b"))
        async with a, b, H1Client(1, 1, 5.0) as http:
            await http.request("POST", f"http://127.0.0.1:{port_a}/x", timeout=5)
            # one connection at most: the idle one to a closes for b's
            assert (await http.request("POST", f"http://127.0.0.1:{port_b}/x", timeout=5)).content == b"ok"
            assert opened == {"a": 1, "b": 1} and http.connections == 1
        async with H1Client(4, 0, 5.0) as none_kept:
            server, port = await serve(handler("a"))
            async with server:
                await none_kept.request("POST", f"http://127.0.0.1:{port}/x", timeout=5)
                assert none_kept.connections == 0
        async with H1Client(4, 4, 0.0) as aged:
            server, port = await serve(handler("b"))
            async with server:
                for _ in range(2):
                    await aged.request("POST", f"http://127.0.0.1:{port}/x", timeout=5)
                assert opened["b"] == 3  # the first one was too old to reuse

    run(main())


def test_connections_the_server_closes_or_asks_to_close_are_not_reused(run):
    async def main():
        opened = 0
        close_after = asyncio.Event()

        async def handler(reader, writer):
            nonlocal opened
            opened += 1
            await read_request(reader)
            if close_after.is_set():
                writer.write(sized(b"bye", extra=b"connection: close\r\n"))
                await writer.drain()
            else:
                writer.write(sized(b"ok"))
                await writer.drain()
                writer.close()  # an idle connection the server closes

        server, port = await serve(handler)
        url = f"http://127.0.0.1:{port}/x"
        async with server, H1Client(4, 4, 5.0) as http:
            await http.request("POST", url, timeout=5)
            await until(lambda: http.connections == 0, what="the server's close takes it out of the pool")
            close_after.set()
            assert (await http.request("POST", url, timeout=5)).content == b"bye"
            assert http.connections == 0
            await http.request("POST", url, timeout=5)
            assert opened == 3

    run(main())


def test_a_stream_closed_before_its_end_closes_its_connection(run):
    async def main():
        ended = asyncio.Event()

        async def handler(reader, writer):
            await read_request(reader)
            writer.write(chunked(b"1\n", end=False))
            await writer.drain()
            assert await reader.read() == b""
            ended.set()

        server, port = await serve(handler)
        async with server, H1Client(4, 4, 5.0) as http:
            reply = await http.request("POST", f"http://127.0.0.1:{port}/generate", timeout=5, stream=True)
            await reply.aclose()
            await asyncio.wait_for(ended.wait(), 5)
            assert http.connections == 0

    run(main())


def test_a_body_to_the_connections_end_and_a_slow_reader_lose_nothing(run, monkeypatch):
    monkeypatch.setattr(h1_client, "HIGH_WATER", 1 << 12)
    payload = bytes(range(256)) * 4096  # 1 MiB

    async def main():
        async def handler(reader, writer):
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\n\r\n" + payload)
            await writer.drain()
            writer.close()

        server, port = await serve(handler)
        async with server, H1Client(4, 4, 5.0) as http:
            reply = await http.request("POST", f"http://127.0.0.1:{port}/x", timeout=5, stream=True)
            got = bytearray()
            async for chunk in reply.aiter_bytes():
                got += chunk
                await asyncio.sleep(0)  # a reader slower than the socket: the transport pauses
            assert bytes(got) == payload
            assert http.connections == 0

    run(main())


def test_the_worker_client_maps_its_failures_to_outcomes(run):
    async def main():
        async def handler(reader, writer):
            await read_request(reader)
            body = b'{"error": "full", "code": "no_room"}'
            head = b"retry-after: 2\r\ncontent-type: application/json\r\n"
            writer.write(sized(body, "503 Service Unavailable", head))
            await writer.drain()

        server, port = await serve(handler)
        async with server, H1Client(4, 4, 5.0) as http:
            client = WorkerClient(http, prefill_timeout_s=5.0)
            req = GenerateRequest(
                request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=2), local_prefill=True
            )
            worker = Worker(name="d0", role="decode", url=f"http://127.0.0.1:{port}")
            with pytest.raises(WorkerFailed) as failed:
                await client.open_decode(worker, req)
            assert (failed.value.outcome, failed.value.never_reached, failed.value.retry_after) == (
                Outcome.NO_ROOM,
                True,
                2.0,
            )
            gone = Worker(name="d1", role="decode", url=f"http://127.0.0.1:{refused_port()}")
            with pytest.raises(WorkerFailed) as failed:
                await client.open_decode(gone, req)
            assert (failed.value.outcome, failed.value.never_reached) == (Outcome.UNREACHABLE, True)

    run(main())
