"""A bound on oneDNN's caches of compiled kernels, set before a server builds its engine.

On CPU a float32 or bfloat16 projection of more than a few rows runs as a oneDNN inner product
(``Linear``'s packed path in engine/model.py). oneDNN compiles a kernel for each input shape, so
for each number of rows a step multiplies, and keeps it in two caches: ideep's
(``LRU_CACHE_CAPACITY``) and oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), each
1024 entries by default. A prefill server meets a new row count with nearly every new prompt length
or batch, and each new one kept about 2 MB, so under a steady mix of prompt lengths its resident
memory grew in ~2 MB steps for as long as new lengths kept coming, and levelled off only once both
caches were full: 1.1 GB for the tiny model, from 330 MB before any request (bench/README.md,
"Memory under a steady load"). A decode server's row counts are its batch sizes: fewer, but the same
kind of growth.

``bound_kernel_caches`` caps both at ``KERNEL_CACHE_ENTRIES``: a few entries for every projection of
every batch size a decode server runs at the default ``max_num_seqs``, far from 1024 of them. An
operator who sets either variable keeps the value set. Both are read by the library when it first
creates a kernel, so this runs first thing in a server's process, before its engine (and any
tensor-parallel rank it starts, which inherits the environment) is built.
"""

from __future__ import annotations

import os

KERNEL_CACHE_ENTRIES = 256
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES, environ=os.environ) -> dict[str, str]:
    """Both caches' capacities, unless already set; returns the values in force."""
    assert entries > 0, entries  # ideep's cache crashes the process at 0
    for name in CACHE_VARIABLES:
        environ.setdefault(name, str(entries))
    return {name: environ[name] for name in CACHE_VARIABLES}
