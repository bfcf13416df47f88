"""What a new user meets first: a fast CLI, clear errors, a launcher that starts
nothing on ports another process holds and accepts health answers only from the
processes it started."""

from __future__ import annotations

import argparse
import asyncio
import http.server
import io
import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from deploy.cli import build_parser
from deploy.config import load_config
from deploy.launcher import Cluster as LaunchedCluster
from deploy.launcher import LaunchError, Proc
from deploy.ports import busy_ports
from deploy.progress import Heartbeat, seconds_since_process_start
from router.cluster.registry import Worker, WorkerRegistry
from tests.support.cluster import REPO, _alive, make_config

# Runs main() in a fresh interpreter and reports which heavy modules it imported.
PROBE = """
import sys
from deploy.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(repr(code), "torch" in sys.modules, "transformers" in sys.modules, file=sys.stderr)
"""
QUICK_S = 5.0  # well under a second on an idle machine; loose for a busy CI runner


def probe(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=REPO, timeout=120)
    return proc, time.monotonic() - started


@pytest.mark.parametrize("args", [["--help"], ["launch", "--help"], ["prefill", "--help"], ["bench", "--help"]])
def test_help_answers_quickly_without_importing_torch(args):
    proc, seconds = probe(*args)
    assert proc.stdout.startswith("usage: pdserve")
    assert proc.stderr.splitlines()[-1] == "0 False False"
    assert seconds < QUICK_S


def test_version_is_the_package_s_without_importing_torch():
    import tomllib

    proc, seconds = probe("--version")
    with open(REPO / "pyproject.toml", "rb") as f:
        assert proc.stdout == f"pdserve {tomllib.load(f)['project']['version']}\n"
    assert proc.stderr.splitlines()[-1] == "0 False False"
    assert seconds < QUICK_S


def test_a_config_error_answers_quickly_without_importing_torch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model: tiny\nrouter: {port: 8000, polcy: round_robin}\n"
        "prefill: [{name: p0, port: 8100}]\ndecode: [{name: d0, port: 8200}]\n"
    )
    proc, seconds = probe("launch", str(bad))
    lines = proc.stderr.splitlines()
    assert lines == [f"pdserve launch: error: {bad}: unknown key 'router.polcy' (value 'round_robin')", "2 False False"]
    assert seconds < QUICK_S


def test_a_model_folder_that_does_not_exist_is_named_as_missing(tmp_path):
    config = make_config(tmp_path, "tiny-1p1d", str(tmp_path / "no-such-model"))
    proc, seconds = probe("launch", str(config), "--run-dir", str(tmp_path / "run"))
    folder = tmp_path / "no-such-model"
    assert proc.stderr.splitlines()[0] == (
        f"pdserve launch: error: model folder {folder} does not exist (a model is a local folder, or one of "
        "the built-in models tiny, tiny-moe, tiny-swa, tiny-mla, smollm2, gemma3-270m, qwen2.5-coder-0.5b)"
    )
    assert proc.stderr.splitlines()[-1] == "2 False False"
    assert not (tmp_path / "run" / "cluster.json").exists()


# ---- health answers from processes the launch did not start ---------------------------------------------
class _ForeignHealth(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        body = json.dumps(
            {
                "status": "ok",
                "role": "decode",
                "instance": "d0",
                "launch_id": "someone-else",
                "kv_blocks": {"free": 8, "reserved": 0, "running": 0, "total": 8},
                "queue_depth": 0,
                "queued_tokens": 0,
                "num_requests": 0,
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def foreign_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ForeignHealth)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_the_launcher_rejects_a_health_answer_from_a_process_it_did_not_start(tmp_path, foreign_server):
    config = make_config(tmp_path, "tiny-1p1d", "tiny")
    cluster = LaunchedCluster(config, load_config(config), tmp_path)
    # Our "decode server" is alive but silent; a foreign process answers on the URL it should serve.
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        ours = Proc("decode", "d0", foreign_server, tmp_path / "d0.log", silent)
        started = time.monotonic()
        with pytest.raises(LaunchError) as raised:
            cluster.wait_healthy([ours], timeout=30, stop=threading.Event())
        assert time.monotonic() - started < 5
        assert str(raised.value) == (
            f"{foreign_server}/health is answered by a process this launch did not start (launch 'someone-else', "
            f"instance 'd0'), not by decode d0 (pid {silent.pid}); is another cluster on its port?"
        )
    finally:
        silent.kill()
        silent.wait()


def test_the_router_takes_no_worker_whose_health_names_another_launch():
    def handler(request):
        launch = "ours" if request.url.host == "d0" else "theirs"
        return httpx.Response(
            200,
            json={
                "instance": request.url.host,
                "launch_id": launch,
                "kv_blocks": {"free": 7},
                "queue_depth": 0,
                "queued_tokens": 0,
            },
        )

    d0, d1 = Worker("d0", "decode", "http://d0"), Worker("d1", "decode", "http://d1")
    registry = WorkerRegistry([d0, d1], launch_id="ours")

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await registry.check_once(client)

    asyncio.run(run())
    assert (d0.healthy, d0.free_blocks) == (True, 7)
    assert (d1.healthy, d1.free_blocks) == (False, 0)
    assert registry.healthy("decode") == [d0]


def test_the_router_takes_no_worker_that_answers_with_another_instance_name():
    def handler(request):
        return httpx.Response(200, json={"instance": "d9", "launch_id": "ours", "kv_blocks": {"free": 7}})

    d0 = Worker("d0", "decode", "http://d0")
    registry = WorkerRegistry([d0], launch_id="ours")

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await registry.check_once(client)

    asyncio.run(run())
    assert not d0.healthy


# ---- a second cluster on the ports of a running one -------------------------------------------------------
@pytest.mark.integration
def test_a_second_launch_on_ports_in_use_fails_fast_and_leaves_the_first_cluster_alone(tmp_path, one_p_one_d):
    first = one_p_one_d
    pids = {p["name"]: p["pid"] for p in first.manifest["processes"]}
    router_port = int(first.router_url.rsplit(":", 1)[1])
    before = first.client().completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0)
    second_run = tmp_path / "second"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "launch", first.manifest["config"], "--run-dir", str(second_run)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    seconds = time.monotonic() - started
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0].startswith(
        f"pdserve launch: error: port {router_port} on 127.0.0.1 (router) is held by pid {pids['router']} ("
    )
    assert len(lines) == 5  # router, p0 and d0 HTTP, d0 kv_port; then the launch they belong to
    assert any(f"(d0 (kv_port)) is held by pid {pids['d0']} (" in line for line in lines)
    assert lines[4].startswith(
        f"they belong to another `pdserve launch` (pid {first.launcher.pid}, "
        f"run dir {first.run_dir.resolve()}): stop it"
    )
    assert seconds < QUICK_S
    assert not second_run.exists()  # nothing started, not even a run folder
    assert all(_alive(pid) for pid in pids.values())
    after = first.client().completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert after.choices[0].text == before.choices[0].text
    assert first.wait_idle() >= 0
    assert all(b["free"] == b["total"] for b in first.blocks().values())


@pytest.mark.integration
def test_every_process_of_a_launch_reports_the_launch_id_in_its_health(one_p_one_d):
    answers = [httpx.get(f"{p['url']}/health").json() for p in one_p_one_d.manifest["processes"]]
    launch_ids = {a["launch_id"] for a in answers}
    assert len(launch_ids) == 1 and None not in launch_ids
    assert {a.get("instance") for a in answers} == {"p0", "d0", None}  # the router names no instance


def test_a_port_held_by_another_process_is_named_with_its_holder(tmp_path):
    config = load_config(make_config(tmp_path, "tiny-1p1d", "tiny"))
    assert busy_ports(config) == []
    port = config.router.port
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import socket, time; s = socket.socket(); "
            f"s.bind(('127.0.0.1', {port})); s.listen(); print('ok', flush=True); "
            "time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "ok\n"
        busy = busy_ports(config)
        assert len(busy) == 1
        assert busy[0].startswith(
            f"port {port} on 127.0.0.1 (router) is held by pid {holder.pid} ({sys.executable} -c import socket"
        )
    finally:
        holder.kill()
        holder.wait()


# ---- what the launcher prints ---------------------------------------------------------------------------
def test_a_long_step_prints_a_plain_line_every_few_seconds():
    out = io.StringIO()
    with Heartbeat("building model 'tiny'", every=0.05, out=out):
        deadline = time.monotonic() + 10
        while out.getvalue().count("\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2
    assert all(re.fullmatch(r"pdserve: building model 'tiny' \.\.\. \d+ s", line) for line in lines)
    assert "\r" not in out.getvalue()


def test_the_process_start_time_counts_the_interpreter_start():
    seconds = seconds_since_process_start()
    assert seconds is not None and 0 < seconds < 3600


@pytest.mark.integration
def test_a_launch_that_fails_while_starting_stops_what_it_started_without_talk_of_draining(tmp_path, tiny_model):
    config = make_config(tmp_path, "tiny-1p1d", tiny_model)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deploy.cli",
            "launch",
            str(config),
            "--run-dir",
            str(tmp_path / "run"),
            "--health-timeout",
            "0.01",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("pdserve launch: error: not healthy after 0 s: p0, d0")
    assert proc.stdout.splitlines()[-1] == "pdserve: stopping the 2 processes started"
    assert "draining" not in proc.stdout + proc.stderr
    assert started_with(config) == []


def started_with(config) -> list[int]:
    """Pids of live processes whose command line names ``config``."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmdline = open(f"/proc/{entry.name}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if str(config) in cmdline.split("\0") and _alive(int(entry.name)):
                pids.append(int(entry.name))
    return pids


def test_every_option_of_every_command_says_what_it_does():
    def undocumented(parser: argparse.ArgumentParser, path: str) -> list[str]:
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += undocumented(sub, f"{path} {name}")
            elif action.help is None and not isinstance(action, argparse._HelpAction):
                found.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
        return found

    assert undocumented(build_parser(), "pdserve") == []
