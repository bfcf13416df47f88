"""One side of an alternating micro-benchmark: a worker process of the benchmark's own script, sent a JSON
command a line on its stdin, answering a JSON line on its stdout (decode_step.py, f32_copies.py,
long_prompts.py)."""

from __future__ import annotations

import json
import subprocess
from typing import Any


class WorkerSide:
    def __init__(self, name: str, cmd: list[str], **popen: Any) -> None:
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen)

    def read(self) -> dict:
        """The worker's next JSON line; other lines (py-spy's, when it wraps the worker) are passed over."""
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} worker exited ({self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, cmd: dict) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
