"""oneDNN's kernel caches stay within the servers' bound, however many batch shapes a server meets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server_common.kernel_cache import CACHE_VARIABLES, bound_kernel_caches

# An engine with the bound set the way a server sets it, then prompts of lengths it has not met yet:
# each length is a new row count for every projection. Prints RSS (MB) before and after.
NEW_LENGTHS = """
import json, sys
from server_common.kernel_cache import bound_kernel_caches
bound_kernel_caches(int(sys.argv[2]))
from engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
engine = LLMEngine(EngineConfig(model=sys.argv[1], block_size=4, num_blocks=256, num_threads=1, prefix_caching=False))
sampling = SamplingParams(max_tokens=1, temperature=0)

def prefill(lengths):
    for n in lengths:
        engine.add_request(f"r{n}", [5 + i % 200 for i in range(n)], sampling)
        while engine.has_unfinished():
            engine.step()

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

prefill(range(9, 40))
before = rss_mb()
prefill(range(40, 240))
print(json.dumps([before, rss_mb()]))
"""


def test_the_bound_is_set_for_both_caches_unless_the_operator_set_one():
    environ = {"LRU_CACHE_CAPACITY": "2048"}
    assert bound_kernel_caches(64, environ) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "2048"}
    assert set(environ) == set(CACHE_VARIABLES)


@pytest.mark.slow
def test_two_hundred_new_prompt_lengths_past_a_bound_of_sixteen_kernels_keep_memory_flat(tiny_model):
    # Unbounded, these 200 lengths kept about 2 MB each (400 MB); bounded, the cache holds 16 kernels.
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    out = subprocess.run(
        [sys.executable, "-c", NEW_LENGTHS, tiny_model, "16"], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert after - before < 40, (before, after)
