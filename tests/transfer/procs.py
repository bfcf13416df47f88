"""Parent side of the two-process tests: start a peer, talk to it, stop it
by its pid."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Peer:
    """One ``tests.transfer.peers`` process."""

    def __init__(self, role: str, cfg: dict) -> None:
        """Spawn without waiting, so several peers start in parallel."""
        self.role = role
        self._first: dict | None = None
        self._log = tempfile.NamedTemporaryFile(prefix=f"peer-{role}-", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.transfer.peers", role, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=ROOT,
            env=env,
            text=True,
            bufsize=1,
        )
        self.pid = self.proc.pid
        self._answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    @property
    def first(self) -> dict:
        """The peer's first answer (its hello), waited for on first use."""
        if self._first is None:
            self._first = self.read(90.0)
        return self._first

    def _pump(self) -> None:
        """Reader thread: answers into a queue (select on a buffered pipe
        misses lines already read into Python's buffer)."""
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._answers.put(json.loads(line[3:]))
        self._answers.put(None)

    def read(self, timeout_s: float) -> dict:
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{self.role} peer said nothing for {timeout_s} s\n{self.log_tail()}") from None
        if answer is None:
            raise RuntimeError(f"{self.role} peer exited ({self.proc.poll()})\n{self.log_tail()}")
        return answer

    def ask(self, timeout_s: float = 30.0, **cmd) -> dict:
        self.first  # noqa: B018 - answers come in order
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout_s)

    def log_tail(self, n: int = 3000) -> str:
        return Path(self._log.name).read_text(errors="replace")[-n:]

    def kill(self) -> None:
        """SIGKILL by pid: the peer gets no chance to say goodbye."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(timeout_s=5, op="quit")
                self.proc.wait(5)
            except (TimeoutError, RuntimeError, OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(10)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self._log.close()
        os.unlink(self._log.name)
