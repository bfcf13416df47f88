"""Compiling a client's grammar where it cannot hurt the router: a child process with a time and memory cap.

``check_bounds`` (engine/structured.py) refuses what is too large before
anything is compiled, but what the compiler does inside those bounds is
still the library's: it recurses natively, and a stack overflow there is a
SIGSEGV that no ``try`` catches. So the router never compiles a grammar in
its own process. ``GrammarChecker`` keeps one child process (a fresh
interpreter running this module, so it inherits none of the router's
threads or sockets) that compiles one spec at a time under ``RLIMIT_AS``; a compile that outlasts the timeout is killed,
one that kills the child is reported as such, and either way the client
gets a 400 naming the parameter while the child is started again for the
next request. The servers compile the same spec again in their engine
thread, within ``GRAMMAR_CEILING``, once the router has let it through.

The child is a plain ``subprocess`` talking over a socket pair, not a
``multiprocessing`` process: the spawn method starts a second helper (its
resource tracker) that nobody stops and that outlives the router by a
moment. Here the router owns exactly one child, by pid, and a child whose
router died reads end-of-file and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from engine.request import StructuredSpec
from engine.structured import compile_grammar
from router.errors import OpenAIError
from router.settings import CompileSandbox

log = logging.getLogger(__name__)


def _serve(conn: Connection, memory_bytes: int) -> None:
    """The child: compile each (kind, value) received, answer its error message or None, until EOF."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    while True:
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            return  # the router closed the pipe, or died
        try:
            compile_grammar(StructuredSpec(kind=kind, value=value))
            answer = None
        except ValueError as exc:
            answer = str(exc)
        except MemoryError:
            answer = "compiling it takes more memory than this server allows"
        conn.send(answer)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m router.api.grammar_check",
        description="The router's grammar compiler: a child the router starts itself, answering on a socket.",
    )
    p.add_argument("--fd", type=int, required=True, help="the socket inherited from the router")
    p.add_argument("--memory-bytes", type=int, required=True, help="the address-space cap (RLIMIT_AS)")
    args = p.parse_args(argv)
    _serve(Connection(args.fd), args.memory_bytes)


class GrammarChecker:
    """One compile at a time in a child process; ``check`` raises the client's 400."""

    def __init__(self, sandbox: CompileSandbox = CompileSandbox()) -> None:
        self.sandbox = sandbox
        self._lock = asyncio.Lock()  # one compile at a time: the pipe carries one question and its answer
        self._child: subprocess.Popen | None = None
        self._conn: Connection | None = None  # to the child: set and cleared with it
        self.crashes = 0  # compiles that killed the child or ran past the timeout (tests read it)

    async def check(self, param: str, spec: StructuredSpec) -> None:
        """400 naming ``param`` when ``spec`` does not compile, or compiling it crashes or times out."""
        async with self._lock:
            problem = await asyncio.to_thread(self._compile, spec)
        if problem is not None:
            raise OpenAIError(400, f"{param}: {problem}", param=param)

    def _compile(self, spec: StructuredSpec) -> str | None:
        """Blocking, on a worker thread, under the lock."""
        if self._child is None or self._child.poll() is not None:
            self._start()
        conn = self._conn
        assert conn is not None  # _start opened it
        try:
            conn.send((spec.kind, spec.value))
            if conn.poll(self.sandbox.timeout_s):
                return conn.recv()
            failure = f"compiling it took longer than {self.sandbox.timeout_s:g} s"
        except (EOFError, OSError):
            failure = "compiling it crashed the grammar compiler"
        self.crashes += 1
        log.warning(
            "a %s spec of %d bytes: %s; the compiler process is started again", spec.kind, len(spec.value), failure
        )
        self._stop()
        return failure + "; simplify it (fewer rules, less nesting, fewer alternatives)"

    def _start(self) -> None:
        self._stop()
        ours, theirs = socket.socketpair()
        with ours, theirs:
            fd = theirs.fileno()
            argv = [sys.executable, "-m", __name__, "--fd", str(fd), "--memory-bytes", str(self.sandbox.memory_bytes)]
            root = str(Path(__file__).resolve().parents[2])  # this checkout's code, wherever the router runs
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
            env = dict(os.environ, PYTHONPATH=path)
            self._child = subprocess.Popen(argv, pass_fds=(fd,), stdin=subprocess.DEVNULL, env=env)
            self._conn = Connection(ours.detach())

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._child is not None:
            if self._child.poll() is None:
                self._child.kill()
            self._child.wait()
            self._child = None

    def start(self) -> None:
        """Start the child now (at the router's start, before any request), so the first grammar pays no spawn."""
        if self._child is None:
            self._start()

    def close(self) -> None:
        self._stop()


if __name__ == "__main__":
    main()
