"""Row counts into oneDNN's matmuls rounded up to a few fixed sizes, so its kernel caches stay bounded.

oneDNN compiles a kernel for every input shape it meets and keeps it (about 2 MB each, in ideep's
cache and in its own primitive cache; server_common/kernel_cache.py bounds both). A projection's
row count is the number of tokens a step computes, so a prefill server meets a new shape with
nearly every new prompt length: its caches filled, evicted and compiled again for as long as new
lengths came, and its resident memory crept by a few MB at a time (bench/README.md, "Memory under
a steady load"). Padding the rows to :func:`bucket_rows` leaves at most four sizes an octave:

    rows     1..16  17..32  33..48  49..64 | 65..80 .. 113..128 | 129..160 .. 225..256 | ...
    bucket     16     32      48      64   |   80   ..    128   |   160    ..    256   | ...

32 sizes up to 8192 rows, for each of a model's few projection shapes; at most a quarter more
rows above 64. Each output row of the inner product depends only on its own input row, so the
rows kept are the same numbers bit for bit (tests/engine/test_row_buckets.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SMALLEST_BUCKET = 16


def bucket_rows(rows: int) -> int:
    """The fixed size ``rows`` is padded to: a multiple of 16 up to 64, then of a quarter of the
    power of two below it (four sizes per octave)."""
    assert rows > 0, rows
    step = max(SMALLEST_BUCKET, 1 << max(rows.bit_length() - 3, 0))
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
