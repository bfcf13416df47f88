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

Above 64 rows a count just past a bucket is cut instead (:func:`row_pieces`): the largest bucket it
holds, then the rest the same way, where the rest's padded piece is at most half the rows padding
would add; each piece is one matmul of a bucket's rows, the answers stacked. A step of one
1024-token prompt beside three decodes was 1280 rows and is 1024 + 8; two prompts beside two
decodes, 2050 rows, were 2560 and are 2048 + 8: the same kernels, not a quarter of the rows
computed for nothing. A small rest is not cut off (300 rows stay 320, not 256 + 48): a matmul of
few rows computes each more slowly.

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


def row_pieces(rows: int) -> list[int]:
    """The row counts ``rows`` is computed as, each padded to :func:`bucket_rows`: above 64 rows, the
    largest bucket the rows hold (a multiple of the octave's step) and the rest's pieces, where the
    rest's padded piece is at most half the rows padding ``rows`` whole would add; else ``rows``."""
    assert rows > 0, rows
    if rows <= 64:
        return [rows]
    step = 1 << (rows.bit_length() - 3)
    head = rows // step * step
    rest = rows - head
    if not rest or 2 * bucket_rows(rest) > bucket_rows(rows) - rows:
        return [rows]
    return [head, *row_pieces(rest)]


def _padded_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    padded = bucket_rows(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out[:rows] if padded != rows else out


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [rows, in] @ packed`` through oneDNN, over the :func:`row_pieces` of its rows, each
    zero-padded to :func:`bucket_rows` rows and the answers sliced back to ``rows``."""
    rows = x.shape[0]
    if not rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    pieces = row_pieces(rows)
    if len(pieces) == 1:
        return _padded_linear(x, packed, bias)
    return torch.cat([_padded_linear(part, packed, bias) for part in x.split(pieces)])
