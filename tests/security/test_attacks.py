"""Each attack a process on the same host can make, replayed against a real
cluster on 127.0.0.1: the server stays healthy and correct (greedy equals
transformers), no block leaks, and the attack shows in a metric."""

from __future__ import annotations

import base64
import json
import os
import socket
import stat
import time

import httpx
import pytest
import zmq

from tests.security.conftest import (
    HEADER_TIMEOUT_S,
    MAX_CONNECTIONS,
    SERVER_HEADER_TIMEOUT_S,
    SERVER_MAX_CONNECTIONS,
    SERVER_RESERVED_CONNECTIONS,
)
from tests.security.wire import bound_socket, connect_as, ping, sender_hello, write_frames
from tests.support.loopback import closed_by_peer
from tests.support.oracle import PROMPTS, expected_completion
from tests.waiting import wait_until
from transfer.messages import Done, encode

pytestmark = pytest.mark.integration
MAX_TOKENS = 8


def discarded(target, reason: str) -> float:
    return target.cluster.metric("d0", f'pdserve_transfers_discarded_total{{reason="{reason}"}}')


def still_correct(target, tiny_model, n: int = 2) -> None:
    """``n`` requests through the router equal transformers; afterwards no block is held."""
    client = target.cluster.client()
    for prompt in PROMPTS[:n]:
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == expected_completion(tiny_model, prompt, MAX_TOKENS)[0]
    target.cluster.wait_idle(10.0)
    for server in target.cluster.servers:
        assert target.cluster.http.get(f"{server['url']}/health").status_code == 200


class Reservation:
    """A /generate stream held open on d0 (with the secret, as the router would): its reservation."""

    def __init__(self, target, rid: str) -> None:
        body = {"request_id": rid, "prompt_token_ids": list(range(3, 40)), "sampling": {"max_tokens": 4}}
        self._stream = target.cluster.http.stream("POST", f"{target.cluster.server('d0')['url']}/generate", json=body)
        self._lines = self._stream.__enter__().iter_lines()  # kept: dropping it would close the stream
        self.transfer_id = json.loads(next(self._lines))["reservation"]["transfer_id"]

    def close(self) -> None:
        self._stream.__exit__(None, None, None)


def test_an_oversized_write_header_is_dropped_before_allocating_and_the_server_keeps_serving(target, tiny_model):
    ctx = zmq.Context()
    before = discarded(target, "oversized")
    answer = target.cluster.http.post(
        f"{target.cluster.server('d0')['url']}/kv/hello",
        json={"hello": base64.b64encode(sender_hello("mallory", target.model, target.layout)).decode()},
    )
    assert answer.status_code == 200
    sock = bound_socket(ctx, base64.b64decode(answer.json()["hello"]))
    reservation = Reservation(target, "victim")
    try:
        for _ in range(20):  # used to kill the transfer thread at the first one
            sock.send_multipart(write_frames(reservation.transfer_id, 0, [0], [16], nbytes=1 << 50))
        assert not ping(sock, "sync").ok
    finally:
        reservation.close()
        sock.close()
        ctx.term()
    assert discarded(target, "oversized") - before == 20
    still_correct(target, tiny_model, n=3)


def test_a_stranger_announcing_the_prefill_servers_name_takes_nothing_over(target, tiny_model):
    ctx = zmq.Context()
    before = discarded(target, "unbound_identity")
    impostor = connect_as(ctx, target.kv_endpoint, b"p0")
    try:
        impostor.send_multipart(write_frames("d0-0000000000000000", 0, [0], [16]))
        impostor.send(encode(Done("d0-0000000000000000", "p0", (1,), 0, 1, (0,), 0, "none")))
        wait_until(lambda: discarded(target, "unbound_identity") - before >= 2)
        still_correct(target, tiny_model, n=3)  # the real p0 is served while the impostor stays connected
        assert not impostor.poll(0)  # no Ack or Cancel meant for p0 reached it
    finally:
        impostor.close()
        ctx.term()


def test_reservations_need_the_internal_secret_which_launch_generated(target):
    d0 = target.cluster.server("d0")["url"]
    body = {"request_id": "flood", "prompt_token_ids": list(range(3, 500)), "sampling": {"max_tokens": 1}}
    for headers in ({}, {"authorization": "Bearer not-the-secret-0123456789"}):
        resp = httpx.post(f"{d0}/generate", json=body, headers=headers)
        assert resp.status_code == 401 and resp.json()["code"] == "unauthorized"
    secret_file = target.cluster.run_dir / "internal_secret"
    assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
    assert target.secret not in (target.cluster.run_dir / "cluster.json").read_text()
    target.cluster.wait_idle(5.0)


def test_the_prefill_server_never_follows_a_hello_url_it_is_given(target):
    """An address in the reservation is refused where it enters (kv_target is typed: no unknown
    field), and a decode server the cluster does not know is never met, whatever it is called."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    before = target.cluster.metric("p0", 'pdserve_requests_total{outcome="handshake_failed"}')
    reservation = {
        "instance": "evil",
        "request_id": "r",
        "transfer_id": "evil-1",
        "block_ids": [0, 1],
        "block_size": 16,
        "num_tokens": 5,
        "lease_s": 30,
        "kv_target": {"peer": "evil", "hello_url": f"http://127.0.0.1:{port}/kv/hello"},
    }

    def prefill(reservation: dict) -> httpx.Response:
        return target.cluster.http.post(
            f"{target.cluster.server('p0')['url']}/prefill",
            json={
                "request_id": "r",
                "prompt_token_ids": [3, 4, 5, 6, 7],
                "sampling": {"max_tokens": 1},
                "reservation": reservation,
            },
        )

    try:
        resp = prefill(reservation)
        assert resp.status_code == 422 and "hello_url" in resp.text
        resp = prefill({**reservation, "kv_target": {"peer": "evil"}})
        assert resp.status_code == 502 and "is not one of this cluster's" in resp.text
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody came: the secret went nowhere
    finally:
        listener.close()
    assert target.cluster.metric("p0", 'pdserve_requests_total{outcome="handshake_failed"}') - before == 1
    target.cluster.wait_idle(5.0)


def test_a_hello_under_the_prefill_servers_name_leaves_its_live_binding_alone(target, tiny_model):
    """Holding the internal secret is not enough to unbind p0: it used to cost every later request
    a whole lease (then a local prefill on d0)."""
    still_correct(target, tiny_model, n=1)  # p0 has met d0
    refused = 'pdserve_peer_refusals_total{reason="bound_to_live_instance"}'
    before = {
        "refused": target.cluster.metric("d0", refused),
        "reprefilled": target.cluster.metric("d0", 'pdserve_reprefills_total{outcome="lease_expired"}'),
        "prefilled": target.cluster.metric("p0", 'pdserve_requests_total{outcome="ok"}'),
    }
    hello = base64.b64encode(sender_hello("p0", target.model, target.layout)).decode()
    answer = target.cluster.http.post(f"{target.cluster.server('d0')['url']}/kv/hello", json={"hello": hello})
    assert answer.status_code == 409 and answer.json()["code"] == "peer_bound", answer.text
    still_correct(target, tiny_model, n=3)
    assert target.cluster.metric("d0", refused) - before["refused"] == 1
    assert target.cluster.metric("p0", 'pdserve_requests_total{outcome="ok"}') - before["prefilled"] == 3
    assert target.cluster.metric("d0", 'pdserve_reprefills_total{outcome="lease_expired"}') == before["reprefilled"]


def test_a_decode_server_the_config_lists_is_never_re_pointed(target, tiny_model):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    p0, d0 = target.cluster.server("p0")["url"], target.cluster.server("d0")["url"]
    refused = 'pdserve_peer_refusals_total{reason="configured_peer"}'
    before = target.cluster.metric("p0", refused)
    try:
        resp = target.cluster.http.post(
            f"{p0}/admin/peers", json={"name": "d0", "url": f"http://127.0.0.1:{listener.getsockname()[1]}"}
        )
        assert resp.status_code == 409 and resp.json()["code"] == "peer_bound", resp.text
        assert target.cluster.http.get(f"{p0}/admin/peers").json()["peers"]["d0"] == d0
        still_correct(target, tiny_model, n=2)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody came: the secret went nowhere
    finally:
        listener.close()
    assert target.cluster.metric("p0", refused) - before == 1


@pytest.mark.parametrize(
    "sampling",
    [
        '{"max_tokens": 1, "temperature": NaN}',
        '{"max_tokens": 1, "temperature": Infinity}',
        '{"max_tokens": 9223372036854775808}',
        '{"max_tokens": 1, "top_k": 1180591620717411303424}',
        '{"max_tokens": 1, "seed": 1180591620717411303424}',
    ],
    ids=["nan", "inf", "max_tokens", "top_k", "seed"],
)
def test_bad_numbers_on_internal_routes_get_a_422_that_names_the_field(target, sampling):
    body = f'{{"request_id": "bad", "prompt_token_ids": [3, 4], "sampling": {sampling}}}'
    resp = target.cluster.http.post(
        f"{target.cluster.server('d0')['url']}/generate", content=body, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 422
    assert resp.json()["code"] == "bad_request" and resp.json()["error"].startswith("body.sampling.")


def bad_reservation(**changes) -> dict:
    reservation = {
        "instance": "d0",
        "request_id": "bad",
        "transfer_id": "t-bad",
        "block_ids": [0, 1],
        "block_size": 16,
        "num_tokens": 5,
        "lease_s": 30,
        "kv_target": {"peer": "d0"},
    }
    return reservation | changes


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"lease_s": "NaN"}, "lease_s"),
        ({"lease_s": "Infinity"}, "lease_s"),
        ({"lease_s": "1e999"}, "lease_s"),
        ({"lease_s": 86400.0}, "lease_s"),
        ({"lease_s": 0}, "lease_s"),
        ({"block_size": 0}, "block_size"),
        ({"num_tokens": -5}, "num_tokens"),
        ({"block_ids": [-1, 0]}, "block_ids"),
        ({"instance": "../d0"}, "instance"),
        ({"num_tokens": 40}, None),
        ({"num_cached_tokens": 6}, None),
    ],
    ids=[
        "nan_lease",
        "inf_lease",
        "huge_lease",
        "lease_a_day",
        "no_lease",
        "block_size_0",
        "negative_tokens",
        "negative_block",
        "bad_instance",
        "blocks_too_few",
        "cached_past_the_prompt",
    ],
)
def test_a_reservation_out_of_range_gets_a_422_naming_the_field_before_any_connection(target, changes, field):
    constants = {k: v for k, v in changes.items() if v in ("NaN", "Infinity", "1e999")}  # json.dumps writes none
    body = json.dumps(
        {
            "request_id": "bad",
            "prompt_token_ids": [3, 4, 5, 6, 7],
            "sampling": {"max_tokens": 1},
            "reservation": bad_reservation(**(changes | {k: f"<{k}>" for k in constants})),
        }
    )
    for key, constant in constants.items():
        body = body.replace(f'"<{key}>"', constant)
    before = target.cluster.metric("p0", 'pdserve_requests_total{outcome="handshake_failed"}')
    resp = target.cluster.http.post(
        f"{target.cluster.server('p0')['url']}/prefill", content=body, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error.startswith(f"body.reservation.{field}" if field else "body.reservation: "), error
    assert target.cluster.metric("p0", 'pdserve_requests_total{outcome="handshake_failed"}') == before


@pytest.mark.parametrize(
    "fields, param",
    [
        ('"temperature": Infinity', "temperature"),
        ('"top_p": 1e999', "top_p"),
        ('"logit_bias": {"5": NaN}', "logit_bias.5"),
        ('"guided_json": {"type": "number", "minimum": NaN}', "guided_json.minimum"),
        ('"user": "u", "extra": [1, -Infinity]', "extra.1"),
    ],
)
def test_the_router_refuses_numbers_that_are_not_json_naming_the_field(target, fields, param):
    resp = target.cluster.http.post(
        f"{target.cluster.router_url}/v1/completions",
        headers={"content-type": "application/json"},
        content=f'{{"model": "tiny", "prompt": "x", {fields}}}',
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    assert "is not a finite number" in resp.json()["error"]["message"]


def test_the_router_answers_400_to_a_nan_temperature(target):
    resp = target.cluster.http.post(
        f"{target.cluster.router_url}/v1/completions",
        headers={"content-type": "application/json"},
        content='{"model": "tiny", "prompt": "x", "temperature": NaN}',
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature"


@pytest.mark.parametrize(("server", "path"), [("d0", "/generate"), ("p0", "/prefill")])
def test_a_64_mib_body_gets_413_before_it_is_read(target, server, path):
    url = httpx.URL(target.cluster.server(server)["url"])
    started = time.monotonic()
    with socket.create_connection((url.host, url.port)) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {target.secret}\r\n"
            f"content-type: application/json\r\ncontent-length: {64 << 20}\r\n\r\n".encode()
        )
        sock.settimeout(10)
        head = sock.recv(4096).decode()
    assert head.startswith("HTTP/1.1 413") and time.monotonic() - started < 5


def test_slow_and_piled_up_connections_are_closed_by_the_router(target, tiny_model):
    url = httpx.URL(target.cluster.router_url)
    metric = 'pdserve_router_connections_refused_total{{reason="{}"}}'
    before = {r: target.cluster.metric("router", metric.format(r)) for r in ("header_timeout", "too_many")}
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS + 4):
            sock = socket.create_connection((url.host, url.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # and never the rest
            sock.settimeout(HEADER_TIMEOUT_S + 10)
            socks.append(sock)
        started = time.monotonic()
        answers = [closed_by_peer(sock) for sock in socks]  # at once past the cap, after the header timeout else
        assert None not in answers
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 5
    finally:
        for sock in socks:
            sock.close()
    refused = [a for a in answers if a]  # past the cap: a 503 saying why, then closed
    assert len(refused) >= 4 and all(a.startswith(b"HTTP/1.1 503") and b"too_many_connections" in a for a in refused), (
        refused
    )
    after = {r: target.cluster.metric("router", metric.format(r)) for r in before}
    assert after["too_many"] - before["too_many"] >= 4
    # Every one of ours was closed (an idle keep-alive connection of the test's own client may be too).
    assert (after["too_many"] - before["too_many"]) + (
        after["header_timeout"] - before["header_timeout"]
    ) >= MAX_CONNECTIONS + 4
    still_correct(target, tiny_model, n=1)


@pytest.mark.parametrize("server", ["d0", "p0"])
def test_a_prefill_or_decode_server_closes_connections_whose_headers_never_come(target, tiny_model, server):
    url = httpx.URL(target.cluster.server(server)["url"])
    metric = 'pdserve_connections_refused_total{reason="header_timeout"}'
    before = target.cluster.metric(server, metric)
    socks = []
    try:
        for _ in range(5):
            sock = socket.create_connection((url.host, url.port))
            sock.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\n")  # and never the rest
            sock.settimeout(SERVER_HEADER_TIMEOUT_S + 10)
            socks.append(sock)
        started = time.monotonic()
        assert [closed_by_peer(sock) for sock in socks] == [b""] * 5
        assert time.monotonic() - started < SERVER_HEADER_TIMEOUT_S + 5
    finally:
        for sock in socks:
            sock.close()
    assert target.cluster.metric(server, metric) - before >= 5
    still_correct(target, tiny_model, n=1)


def connect_from(address: str, url: httpx.URL) -> socket.socket:
    sock = socket.socket()
    sock.bind((address, 0))  # all of 127/8 is this host: many "clients" without leaving it
    sock.connect((url.host, url.port))
    return sock


def health_from(address: str, url: httpx.URL) -> bytes:
    with connect_from(address, url) as sock:
        sock.settimeout(5)
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        return closed_by_peer(sock) or b""


def test_strangers_filling_a_server_s_connections_leave_the_reserve_to_its_cluster(target, tiny_model):
    """Strangers on eight addresses (each under the per-address cap) open as many connections as d0 takes
    in all: the last reserved ones are refused to them, and loopback (the router, the launcher) still
    gets in. Used to take d0 out of rotation once its file descriptors ran out."""
    url = httpx.URL(target.cluster.server("d0")["url"])
    metric = 'pdserve_connections_refused_total{reason="full"}'
    before = target.cluster.metric("d0", metric)
    socks = []
    try:
        opened = time.monotonic()
        for i in range(SERVER_MAX_CONNECTIONS):
            socks.append(connect_from(f"127.0.0.{2 + i % 8}", url))
        wait_until(lambda: target.cluster.metric("d0", metric) - before >= SERVER_RESERVED_CONNECTIONS)
        assert health_from("127.0.0.1", url).startswith(b"HTTP/1.1 200")
        assert b"the server has too many open connections" in health_from("127.0.0.30", url)
        assert time.monotonic() - opened < SERVER_HEADER_TIMEOUT_S  # the strangers' connections were all open
        for sock in socks:
            sock.settimeout(SERVER_HEADER_TIMEOUT_S + 5)
        answers = [closed_by_peer(sock) for sock in socks]  # refused at once; the rest at the header timeout
    finally:
        for sock in socks:
            sock.close()
    refused = [a for a in answers if a]
    assert len(refused) >= SERVER_RESERVED_CONNECTIONS and all(
        a.startswith(b"HTTP/1.1 503") and b"too_many_connections" in a for a in refused
    )
    assert target.cluster.metric("d0", metric) - before == len(refused) + 1  # and 127.0.0.30's
    assert health_from("127.0.0.30", url).startswith(b"HTTP/1.1 200")  # room again
    still_correct(target, tiny_model, n=1)


def test_servers_whose_transfer_thread_died_exit_and_are_restarted_by_the_launcher(target, tiny_model):
    """Last in this module: it restarts both servers."""
    cluster = target.cluster
    for name in ("d0", "p0"):
        armed = cluster.http.post(f"{cluster.server(name)['url']}/admin/faults", json={"break_transport": 1})
        assert armed.status_code == 200

    def restarted() -> list[dict]:
        path = cluster.run_dir / "restarts.json"
        return json.loads(path.read_text())["restarts"] if path.exists() else []

    wait_until(lambda: len([r for r in restarted() if r["back_after_s"] is not None]) == 2, timeout=90)
    assert sorted((r["name"], r["exit_status"]) for r in restarted()) == [("d0", 70), ("p0", 70)]
    for name in ("d0", "p0"):
        log = (cluster.run_dir / f"{name}.log").read_text()
        assert "transfer thread died: RuntimeError('fault injection: the transport broke')" in log
        assert "exiting with status 70" in log
    wait_until(lambda: all(w["healthy"] for w in cluster.http.get(f"{cluster.router_url}/health").json()["workers"]))
    still_correct(target, tiny_model, n=2)
