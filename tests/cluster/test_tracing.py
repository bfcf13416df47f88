"""One request through a real 1P1D cluster with tracing on: the router, the
decode server and the prefill server each send their spans over OTLP/HTTP to
a collector this test runs on 127.0.0.1, and together they form one trace
under the client's traceparent, nested as docs/architecture.md describes."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.support.cluster import Cluster, free_ports, make_config
from tests.support.oracle import expected_completion
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP trace receiver: keeps (service, name, trace id, span id, parent id, attributes)."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest.FromString(body)
                with lock:
                    for rs in req.resource_spans:
                        service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                spans.append(
                                    {
                                        "service": service,
                                        "name": s.name,
                                        "trace": s.trace_id.hex(),
                                        "id": s.span_id.hex(),
                                        "parent": s.parent_span_id.hex(),
                                        "attributes": {a.key: a.value for a in s.attributes},
                                    }
                                )
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", free_ports(1)[0]), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def by_name(self) -> dict[str, dict]:
        return {s["name"]: s for s in list(self.spans)}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def traced(tmp_path_factory, tiny_model):
    collector = Collector()
    folder = tmp_path_factory.mktemp("traced")
    cluster = Cluster(make_config(folder, "tiny-1p1d", tiny_model, {"tracing": {"endpoint": collector.url}}), folder)
    yield cluster, collector
    cluster.stop()
    collector.close()


def test_one_request_is_one_trace_across_router_decode_and_prefill(traced, tiny_model):
    cluster, collector = traced
    prompt = "a prompt long enough for the prefill server"
    out = cluster.client().completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
    )
    text, count = expected_completion(tiny_model, prompt, 5)
    assert (out.choices[0].text, out.usage.completion_tokens) == (text, count)

    wanted = {
        "pdserve.request",
        "router.admission",
        "router.stream",
        "decode.generate",
        "decode.kv_wait",
        "decode.decode",
        "prefill.prefill",
        "prefill.queue",
        "prefill.compute",
        "prefill.kv_transfer",
    }
    wait_until(lambda: wanted <= set(collector.by_name()), 15, f"spans {sorted(wanted)}")
    s = collector.by_name()
    assert {x["trace"] for x in s.values()} == {TRACE_ID}
    assert s["pdserve.request"]["parent"] == CLIENT_SPAN
    request = s["pdserve.request"]["id"]
    for name in ("router.admission", "router.stream", "decode.generate", "prefill.prefill"):
        assert s[name]["parent"] == request, name
    for name in ("decode.kv_wait", "decode.decode"):
        assert s[name]["parent"] == s["decode.generate"]["id"], name
    for name in ("prefill.queue", "prefill.compute", "prefill.kv_transfer"):
        assert s[name]["parent"] == s["prefill.prefill"]["id"], name
    assert {s[n]["service"] for n in ("pdserve.request", "decode.generate", "prefill.prefill")} == {
        "pdserve-router",
        "pdserve-decode",
        "pdserve-prefill",
    }
    assert s["decode.kv_wait"]["attributes"]["pdserve.outcome"].string_value == "ok"
    assert s["prefill.kv_transfer"]["attributes"]["pdserve.bytes"].int_value > 0
    assert s["pdserve.request"]["attributes"]["pdserve.generated_tokens"].int_value == count
    assert s["pdserve.request"]["attributes"]["pdserve.prefill"].string_value == "p0"
