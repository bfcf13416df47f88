"""A throwaway PostgreSQL server for tests, from the distribution's own binaries.

``PostgresServer.start()`` makes a data folder in a new temporary directory (initdb: trust auth for a
superuser ``pdserve``), runs ``postgres`` on 127.0.0.1 on a free port with its unix socket in that
directory, and returns once ``pg_isready`` says it accepts connections (polled, with a deadline).
``stop()`` stops it by its pid (``pg_ctl stop -m fast``, which reads the pid file; a SIGKILL to the pid if
that fails) and deletes the directory. Postgres refuses to run as root: as root, the server runs as the
``postgres`` user the distribution's package makes (Debian: ``apt install postgresql``; its service is
neither needed nor started). ``missing()`` says what is not there, for a skip that names it.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from bench.load.cluster import free_ports

BINARIES = ("initdb", "postgres", "pg_ctl", "pg_isready")
# Where distributions put the server binaries when they are not on PATH (Debian, Ubuntu; Fedora, RHEL).
SEARCH = ("/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin")
RUN_AS_ROOT = "postgres"  # the user the server runs as when the tests run as root
SUPERUSER = "pdserve"
START_TIMEOUT_S = 60.0
POLL_S = 0.05


def _version(folder: str) -> tuple[int, ...]:
    digits = "".join(c if c.isdigit() else " " for c in folder)
    return tuple(int(d) for d in digits.split())


def find_bin() -> Path | None:
    """The folder holding every one of BINARIES: that of ``initdb`` on PATH, else the newest installed."""
    on_path = shutil.which("initdb")
    candidates = [str(Path(on_path).resolve().parent)] if on_path else []
    candidates += sorted((d for pattern in SEARCH for d in glob.glob(pattern)), key=_version, reverse=True)
    for folder in candidates:
        if all(os.access(Path(folder) / name, os.X_OK) for name in BINARIES):
            return Path(folder)
    return None


def missing() -> str | None:
    """Why no server can start here (a skip reason), or None."""
    if find_bin() is None:
        found = [name for name in BINARIES if shutil.which(name)]
        absent = [name for name in BINARIES if name not in found]
        return (
            f"PostgreSQL server binaries not found (apt install postgresql): no {', '.join(absent)} on PATH "
            f"or in {' or '.join(SEARCH)}"
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(RUN_AS_ROOT)
        except KeyError:
            return f"running as root, and there is no {RUN_AS_ROOT!r} user to run the PostgreSQL server as"
    return None


def free_port() -> int:
    (port,) = free_ports(1)
    return port


class PostgresServer:
    def __init__(self) -> None:
        bin_dir = find_bin()
        assert bin_dir is not None, missing()
        self.bin = bin_dir
        self.dir = Path(tempfile.mkdtemp(prefix="pdserve-pg-"))
        self.data, self.sockets, self.log = self.dir / "data", self.dir / "sockets", self.dir / "postgres.log"
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        # As root, every command runs as the postgres user, who owns the directory.
        self.user = pwd.getpwnam(RUN_AS_ROOT) if os.geteuid() == 0 else None
        if self.user is not None:
            os.chmod(self.dir, 0o700)
            os.chown(self.dir, self.user.pw_uid, self.user.pw_gid)

    def _as_server_user(self) -> dict:
        if self.user is None:
            return {"cwd": self.dir}
        return {"cwd": self.dir, "user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}

    def _run(self, *args: str) -> None:
        done = subprocess.run(
            [str(self.bin / args[0]), *args[1:]], capture_output=True, text=True, **self._as_server_user()
        )
        assert done.returncode == 0, f"{' '.join(args)} failed ({done.returncode}): {done.stderr or done.stdout}"

    def start(self) -> PostgresServer:
        try:
            self._run(
                "initdb", "-D", str(self.data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync"
            )
            self._run_server()
        except BaseException:
            self.stop()
            raise
        return self

    def _run_server(self) -> None:
        self._as_server_dir(self.sockets)
        for _ in range(3):  # another process may take the free port first
            self.port = free_port()
            with open(self.log, "wb") as log:  # this attempt's log only
                self.proc = subprocess.Popen(
                    [
                        str(self.bin / "postgres"),
                        "-D",
                        str(self.data),
                        "-h",
                        "127.0.0.1",
                        "-p",
                        str(self.port),
                        "-k",
                        str(self.sockets),
                        "-c",
                        "fsync=off",  # a test database: nothing to keep over a crash
                        "-c",
                        "shared_buffers=16MB",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    **self._as_server_user(),
                )
            deadline = time.monotonic() + START_TIMEOUT_S
            while self.proc.poll() is None and time.monotonic() < deadline:
                if self._ready():
                    return
                time.sleep(POLL_S)
            if self.proc.poll() is None:
                raise AssertionError(f"postgres not ready within {START_TIMEOUT_S} s:\n{self.log_tail()}")
            if "could not bind" not in self.log_tail() and "already in use" not in self.log_tail():
                break
        raise AssertionError(f"postgres exited ({self.proc.returncode}):\n{self.log_tail()}")

    def _as_server_dir(self, path: Path) -> None:
        path.mkdir(mode=0o700)
        if self.user is not None:
            os.chown(path, self.user.pw_uid, self.user.pw_gid)

    def _ready(self) -> bool:
        check = [str(self.bin / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER]
        return subprocess.run(check, cwd=self.dir).returncode == 0

    def log_tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "(no log)"

    def url(self, database: str = "postgres", password: str | None = None) -> str:
        auth = SUPERUSER if password is None else f"{SUPERUSER}:{password}"
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new, empty database; its name."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name

    def drop_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def stop(self) -> None:
        """Stop the server by its pid (fast shutdown: sessions are ended) and delete its directory."""
        if self.proc is not None and self.proc.poll() is None:
            stopped = subprocess.run(
                [str(self.bin / "pg_ctl"), "stop", "-D", str(self.data), "-m", "fast", "-w", "-t", "30"],
                capture_output=True,
                **self._as_server_user(),
            )
            if stopped.returncode != 0 and self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)
