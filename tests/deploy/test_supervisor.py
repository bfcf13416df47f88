"""The supervisor's policy on a fake cluster: which exits are restarted, after
what backoff, when it gives up; every pid handed out is a real process that
the test stops."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.config import RestartConfig
from deploy.launcher import Proc
from deploy.supervisor import Supervisor


class FakeCluster:
    """What the supervisor uses of deploy.launcher.Cluster; processes are short `python -c` runs."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: list[Proc] = []
        self.stopped: set[str] = set()
        self.manifests = 0

    def spawn(self, name: str, code: str) -> Proc:
        popen = subprocess.Popen([sys.executable, "-c", code])
        proc = Proc("prefill", name, "http://127.0.0.1:9", self.run_dir / f"{name}.log", popen)
        self.procs.append(proc)
        return proc

    def restart(self, name: str) -> Proc:
        self.procs = [p for p in self.procs if p.name != name]
        return self.spawn(name, "import time; time.sleep(60)")

    def first_dead(self, skip=frozenset()):
        return next((p for p in self.procs if p.name not in skip and p.popen.poll() is not None), None)

    def write_manifest(self) -> None:
        self.manifests += 1

    def stop(self) -> None:
        """Kill and forget every process (the next crash is then the only one)."""
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.kill()
            p.popen.wait()
        self.procs.clear()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def cluster(tmp_path):
    c = FakeCluster(tmp_path)
    yield c
    c.stop()


def crash(cluster: FakeCluster, name: str, code: int = 9) -> Proc:
    proc = cluster.spawn(name, f"raise SystemExit({code})")
    proc.popen.wait()
    return proc


def test_a_failed_process_is_restarted_after_a_doubling_backoff_until_the_cap(cluster):
    clock, lines = Clock(), []
    sup = Supervisor(
        cluster, RestartConfig(backoff_s=1.0, backoff_max_s=3.0, max_restarts=3, window_s=100), clock, lines.append
    )
    delays = []
    for _ in range(3):
        crash(cluster, "p0")
        assert sup.tick() is None
        started = clock.now
        while not any(p.popen.poll() is None for p in cluster.procs):
            clock.now += 0.25
            assert sup.tick() is None
        delays.append(clock.now - started)
        cluster.stop()
    assert delays == [1.0, 2.0, 3.0]  # doubled, capped at backoff_max_s
    assert sup.counts == {"p0": 3} and cluster.manifests == 3
    crash(cluster, "p0")
    assert sup.tick().name == "p0"  # the fourth failure in the window: give up
    assert "giving up" in lines[-1]
    restarts = (cluster.run_dir / "restarts.json").read_text()
    assert '"p0": 3' in restarts and '"exit_status": 9' in restarts


def test_failures_outside_the_window_do_not_count(cluster):
    clock = Clock()
    sup = Supervisor(cluster, RestartConfig(backoff_s=0.0, max_restarts=1, window_s=10), clock, lambda _: None)
    for _ in range(3):
        crash(cluster, "d0")
        assert sup.tick() is None
        assert sup.tick() is None  # due at once: restarted
        assert cluster.procs[-1].popen.poll() is None
        cluster.stop()
        clock.now += 11
    assert sup.counts == {"d0": 3}


@pytest.mark.parametrize("code", [0, -signal.SIGTERM], ids=["exit-0", "sigterm"])
def test_a_process_someone_stopped_is_not_restarted(cluster, code):
    proc = cluster.spawn("p0", "import time; time.sleep(60)")
    if code == 0:
        proc.popen.kill()
        proc.popen.wait()
        proc.popen.returncode = 0
    else:
        proc.popen.terminate()
        proc.popen.wait()
    sup = Supervisor(cluster, RestartConfig(), Clock(), lambda _: None)
    assert sup.tick() is proc and sup.counts == {}


def test_policy_never_gives_up_at_the_first_failure(cluster):
    proc = crash(cluster, "p0")
    sup = Supervisor(cluster, RestartConfig(policy="never"), Clock(), lambda _: None)
    assert sup.tick() is proc and sup.counts == {}
