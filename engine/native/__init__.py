"""CPU kernels of pdserve's own, built on the machine that runs them.

Where a decode step's time goes to torch's dispatch of small kernels, or to a
kernel well below memory speed, ``kernels.cpp`` does the work in one call:

- ``gemv_bf16``: the bfloat16 projection of a few rows, a decode step of
  one to three sequences (``engine.model.Linear``; oneDNN's packed matmul,
  which serves more rows, streams the weights slower for so few);
- ``gemv_f32``: the float32 projection of one to eight rows over the
  input-major weight ``engine.model.Linear`` keeps (oneDNN's packed matmul
  streams the weights slower for so few; torch's one-row matmul as fast);
- ``rms_norm_bf16``: a bfloat16 model's RMSNorm in one pass
  (``engine.model.RMSNorm``; torch's takes eight kernels);
- ``rms_norm_f32``: torch's float32 rms_norm bit for bit, in two calls
  where its composite makes six;
- ``decode_attention``: float32 or bfloat16 decode rows against their
  contexts in the paged cache, read in place through the block table
  (``engine.attention``; torch's path gathers each context into a padded
  copy, then runs its attention over it);
- ``DecodeLayer``: a whole decoder layer for a step of decode rows only
  (``engine.model.DecoderLayer``), bit for bit the layer run op by op: one
  call where the layer makes some twenty.

``logits.cpp`` builds apart, for any x86-64 CPU with AVX2 and FMA:

- ``logits_f32``: the float32 logits of one to eight rows over a weight
  [vocab, hidden] as stored: a tied lm_head's few rows read the embedding
  matrix itself (``engine.model.Linear.read_rows``), each row once for all.

The kernels of ``kernels.cpp`` need AVX-512 with BF16 (Intel Cooper Lake, Sapphire Rapids and later;
AMD Zen 4 and later).

The source is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and
ninja) into ``~/.cache/pdserve/native`` (``PDSERVE_NATIVE_CACHE``), once per
everything the build depends on (``build_key``): ``scripts/install.sh`` does it (``python -m
engine.native``), else the first engine that needs it, tens of seconds, with
a line saying so. Processes that start together build once: the others wait,
with a line saying so, under a lock the kernel drops when its holder dies
(a build killed half way holds up no one). Where the CPU lacks the instructions, or there is no
compiler, or ``PDSERVE_NATIVE=0``, :func:`kernels` is None and the engine
keeps torch's paths (as on CUDA); :func:`status` says which and why.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("pdserve.native")

SOURCE = Path(__file__).with_name("kernels.cpp")
NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")  # /proc/cpuinfo flags the kernel's instructions need
# -fopenmp: at::parallel_for is inline OpenMP, compiled into calls to the runtime torch has loaded
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]
LOGITS_SOURCE = Path(__file__).with_name("logits.cpp")
LOGITS_NEEDS = ("avx2", "fma")
LOGITS_CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-mavx2", "-mfma"]


def build_key(source: Path | None = None, cflags: list[str] | None = None) -> str:
    """Everything the build depends on: the source (its path, which the build names, and its bytes),
    the flags, the compiler named by CXX, the interpreter and the torch it links (their paths, so two
    virtual environments of one torch version still build apart: each build's commands name its own
    include folders, and ninja rebuilds a folder whose commands changed)."""
    source, cflags = source or SOURCE, CFLAGS if cflags is None else cflags
    parts = [
        str(source.resolve()),
        " ".join(cflags),
        os.environ.get("CXX", "c++"),
        sys.executable,
        sys.version,
        torch.__version__,
        str(Path(torch.__file__).resolve().parent),
        str(torch._C._GLIBCXX_USE_CXX11_ABI),
    ]
    return hashlib.sha256("\0".join(parts).encode() + b"\0" + source.read_bytes()).hexdigest()[:12]


def cache_dir(source: Path | None = None, cflags: list[str] | None = None) -> Path:
    """One folder per ``build_key``: a build is reused by every process whose build would be the same,
    and never rebuilt over by one whose build differs."""
    root = os.environ.get("PDSERVE_NATIVE_CACHE") or "~/.cache/pdserve/native"  # set but empty: the default
    return Path(root).expanduser() / f"torch-{torch.__version__.replace('+', '_')}-{build_key(source, cflags)}"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def unavailable(needs: tuple[str, ...] | None = None) -> str | None:
    """Why the kernels cannot run here (None: they can, once built)."""
    if os.environ.get("PDSERVE_NATIVE", "1") == "0":
        return "PDSERVE_NATIVE=0"
    missing = [flag for flag in (NEEDS if needs is None else needs) if flag not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    return None


_failures: dict[str, str | None] = {}


@contextlib.contextmanager
def _build_lock(folder: Path, what: str) -> Iterator[None]:
    """One build or load at a time in ``folder``, held with ``flock``, which the kernel lets go of when
    its holder dies. torch's own lock is a file that only the process that made it removes: a process
    killed while it built (a test's timeout, the OOM killer, Ctrl-C twice) left one behind, and every
    later process on the host then waited for it forever, at the start of every server. Under this lock
    no other pdserve build is under way, so a torch lock file found here is such a leftover and goes."""
    with open(folder / "pdserve-build.lock", "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("pdserve: waiting for another process's build of %s in %s", what, folder)
            fcntl.flock(held, fcntl.LOCK_EX)
        stale = folder / "lock"
        if stale.exists():
            log.warning("pdserve: removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield  # the lock goes with the file's closing


def _build(name: str, source: Path, cflags: list[str], needs: tuple[str, ...]) -> ModuleType | None:
    """One module built (once per ``build_key``) and loaded; None where it cannot run or be built, with
    the reason in ``_failures[name]``."""
    _failures[name] = unavailable(needs)
    if _failures[name] is not None:
        return None
    from torch.utils.cpp_extension import load

    folder = cache_dir(source, cflags)
    started = time.monotonic()
    fresh = False
    try:
        folder.mkdir(parents=True, exist_ok=True)  # a read-only cache folder is a failed build, not a crash
        with _build_lock(folder, source.name):
            fresh = not any(folder.glob(f"{name}*.so"))
            if fresh:
                log.warning(
                    "pdserve: building the native CPU kernels of %s into %s (once; tens of seconds)",
                    source.name,
                    folder,
                )
            module = load(
                name=name, sources=[str(source)], extra_cflags=cflags, build_directory=str(folder), verbose=False
            )
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as exc:
        last = (str(exc).strip().splitlines() or [""])[-1]
        _failures[name] = f"the build failed: {type(exc).__name__}: {last}"
        log.warning(
            "pdserve: native CPU kernels of %s not used: %s; torch's kernels serve instead",
            source.name,
            _failures[name],
        )
        return None
    if fresh or time.monotonic() - started > 5:
        log.warning("pdserve: native CPU kernels of %s built in %.0f s", source.name, time.monotonic() - started)
    return module


@functools.cache
def kernels() -> ModuleType | None:
    """The built kernels of kernels.cpp, building them first if needed; None where they cannot run or be built."""
    return _build("pdserve_native", SOURCE, CFLAGS, NEEDS)


@functools.cache
def logits_kernels() -> ModuleType | None:
    """The built kernel of logits.cpp (AVX2 and FMA), building it first if needed; None where it cannot
    run or be built."""
    return _build("pdserve_logits", LOGITS_SOURCE, LOGITS_CFLAGS, LOGITS_NEEDS)


def kernel(name: str) -> Callable | None:
    """One kernel of the module by name, or None where the kernels are not in use (torch's path then)."""
    found = logits_kernels() if name == "logits_f32" else kernels()
    return None if found is None else getattr(found, name)


def status() -> str:
    """One line: whether the kernels are in use here, and why not."""
    if kernels() is not None:
        return "native CPU kernels: in use"
    return f"native CPU kernels: not used ({_failures['pdserve_native']})"


def logits_status() -> str:
    """One line: whether the logits kernel is in use here, and why not."""
    if logits_kernels() is not None:
        return "native logits kernel: in use"
    return f"native logits kernel: not used ({_failures['pdserve_logits']})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.native",
        description="Builds pdserve's native CPU kernels for this machine (if it can run them) and says "
        "whether the engine will use them. Exit status 0 either way: the engine falls back to torch's kernels.",
    )
    parser.add_argument("--require", action="store_true", help="exit 1 when the kernels are not in use")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    print(f"{status()} ({cache_dir()})")
    print(f"{logits_status()} ({cache_dir(LOGITS_SOURCE, LOGITS_CFLAGS)})")
    return 1 if args.require and kernels() is None else 0


if __name__ == "__main__":
    raise SystemExit(main())
