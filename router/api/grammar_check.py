"""Compiling a client's grammar where it cannot hurt the router: a child process with a time and memory cap.

``check_bounds`` (engine/structured.py) refuses what is too large before
anything is compiled, but what the compiler does inside those bounds is
still the library's: it recurses natively, and a stack overflow there is a
SIGSEGV that no ``try`` catches. So the router never compiles a grammar in
its own process. ``GrammarChecker`` keeps one child process (spawned, so it
inherits none of the router's threads or sockets) that compiles one spec at
a time under ``RLIMIT_AS``; a compile that outlasts the timeout is killed,
one that kills the child is reported as such, and either way the client
gets a 400 naming the parameter while the child is started again for the
next request. The servers compile the same spec again in their engine
thread, within ``GRAMMAR_CEILING``, once the router has let it through.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import resource
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess

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


class GrammarChecker:
    """One compile at a time in a child process; ``check`` raises the client's 400."""

    def __init__(self, sandbox: CompileSandbox = CompileSandbox()) -> None:
        self.sandbox = sandbox
        self._context = multiprocessing.get_context("spawn")
        self._lock = asyncio.Lock()  # one compile at a time: the pipe carries one question and its answer
        self._child: SpawnProcess | None = None
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
        if self._child is None or not self._child.is_alive():
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
        parent, child = self._context.Pipe()
        self._child = self._context.Process(
            target=_serve, args=(child, self.sandbox.memory_bytes), name="grammar-check", daemon=True
        )
        self._child.start()
        child.close()
        self._conn = parent

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._child is not None:
            if self._child.is_alive():
                self._child.kill()
            self._child.join(timeout=5)
            self._child = None

    def start(self) -> None:
        """Start the child now (at the router's start, before any request), so the first grammar pays no spawn."""
        if self._child is None:
            self._start()

    def close(self) -> None:
        self._stop()
