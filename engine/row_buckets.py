"""Row counts into oneDNN's matmuls rounded up to a few fixed sizes, so its kernel caches stay bounded.

oneDNN compiles a kernel for every input shape it meets and keeps it (about 2 MB for a step's
projections, in ideep's cache and in its own primitive cache; server_common/kernel_cache.py bounds
both). A projection's row count is the number of tokens a step computes, so a prefill server met a
new shape with nearly every new prompt length: its caches filled, evicted and compiled again for as
long as new lengths came, and its resident memory crept by a few MB at a time (bench/README.md,
"Memory under a steady load"). :class:`engine.model.Linear` pads the rows of its packed path to
:func:`bucket_rows`, eight sizes up to 64 and four an octave above:

    rows     1..8  9..16 ... 57..64 | 65..80 .. 113..128 | 129..160 .. 225..256 | ...
    bucket     8    16   ...   64   |   80   ..    128   |   160    ..    256   | ...

28 sizes up to 2048 rows, 36 up to 8192, for each of a model's few projection shapes; at most a
quarter more rows above 64 (an eighth more on average over a spread of prompt lengths). Each output
row of the inner product depends only on its own input row, so the rows kept are the same numbers
bit for bit (tests/engine/test_row_buckets.py).

Decode-only steps through engine.native's DecodeLayer are not padded: their row count is the batch
size, at most ``max_num_seqs``, already a bounded set, and the projections of a decode step cost in
proportion to their rows (float32 on one core, 17 rows padded to 32 took 1.8x as long).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SMALL_STEP = 8  # up to 64 rows, a multiple of this


def bucket_rows(rows: int) -> int:
    """The fixed size ``rows`` is padded to: a multiple of 8 up to 64, then of a quarter of the
    power of two below it (four sizes an octave)."""
    assert rows > 0, rows
    step = SMALL_STEP if rows <= 64 else 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [rows, in] @ packed`` through oneDNN, ``x`` zero-padded to :func:`bucket_rows` rows and
    the answer sliced back to ``rows``."""
    rows = x.shape[0]
    padded = bucket_rows(rows) if rows else rows
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out[:rows] if padded != rows else out
