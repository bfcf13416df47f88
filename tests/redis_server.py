"""A throwaway Redis server for tests, from the distribution's ``redis-server`` (Debian: ``apt install
redis-server``; its service is neither needed nor started).

``RedisServer(max_bytes)`` runs it on 127.0.0.1 on a free port, nothing saved to disk, at most
``max_bytes`` of data with least-recently-used eviction (the shared KV tier's byte limit; ``policy``: another
``maxmemory-policy``, such as ``noeviction`` for a store held to per-tenant shares), and returns once it
answers PING. ``stop()`` stops it by its pid. ``missing()`` says what is not there, for a skip that names
it.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import redis

from tests.postgres_server import free_port
from tests.waiting import wait_until


def missing() -> str | None:
    """Why no server can start here (a skip reason), or None."""
    return None if shutil.which("redis-server") else "no redis-server on PATH (apt install redis-server)"


class RedisServer:
    def __init__(self, max_bytes: int = 64 << 20, policy: str = "allkeys-lru") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = ["--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        args += ["--maxmemory", str(max_bytes), "--maxmemory-policy", policy, "--dir", str(self.dir)]
        self.process = subprocess.Popen(
            ["redis-server", *args], stdout=open(self.dir / "redis.log", "wb"), stderr=subprocess.STDOUT
        )
        self.client = redis.Redis.from_url(self.url, socket_timeout=2)
        wait_until(self._answers, timeout=20, what=f"redis-server on port {self.port} answers PING")

    def _answers(self) -> bool:
        assert self.process.poll() is None, (self.dir / "redis.log").read_text()
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        """Stop the server by its pid and remove its folder; idempotent."""
        self.client.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
