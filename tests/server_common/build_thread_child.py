"""Child process of test_engine_build_thread: builds an engine on the main thread or with
``build_engine``, steps it on another thread (as a server does) and prints the process's voluntary
context switches per decode step."""

from __future__ import annotations

import json
import os
import resource
import sys
import threading

from engine import EngineConfig, LLMEngine, SamplingParams
from server_common.engine_thread import build_engine

WARMUP, STEPS = 5, 30


def main() -> None:
    where, model = sys.argv[1], sys.argv[2]
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
    # adapt_threads off: on a busy machine the governor would take the team down to one thread (no team)
    config = EngineConfig(model=model, block_size=16, num_blocks=64, num_threads=2, adapt_threads=False)
    engine = LLMEngine(config) if where == "main" else build_engine(config)
    result: dict[str, float] = {}

    def serve() -> None:  # the engine thread of a server
        sampling = SamplingParams(max_tokens=WARMUP + STEPS + 2, temperature=0, ignore_eos=True)
        # four streams: a step of four rows runs every projection as a parallel kernel on any CPU (one row
        # is a single-threaded matrix-vector product where the AVX-512 kernels are not built)
        for i in range(4):
            engine.add_request(f"r{i}", list(range(3 + i, 40 + i)), sampling)
        for _ in range(WARMUP):
            engine.step()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        for _ in range(STEPS):
            engine.step()
        result["switches_per_step"] = (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before) / STEPS

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
