"""Decode steps replayed as CUDA graphs, one per padded batch size (``cuda_graphs``, off by default).

A step of decode rows only (one token each, no prefill, no layer hook) launches the same kernels with
the same shapes every time but for the batch size, so each bucket size B in ``BUCKETS`` (up to the
engine's ``max_num_seqs``) is captured once at start over static tensors: B token ids, positions, KV
slots and context lengths, and a block table of B rows as wide as the longest context
(``max_model_len``). A step of n rows runs as the smallest bucket B >= n: its inputs go into the first n
rows (one copy to the device), and the other B - n rows repeat its last row, so they write the same
K/V into the same slot as that row (a second write of equal values) and read only that row's blocks;
their logits are dropped. No scratch block is needed and no other request's block is touched.

It needs a decode kernel that reads each row's context in place with no mask (Triton's on CUDA), and
one rank (tensor parallelism's collectives are not captured). On CPU the same padded buffers run
eagerly (``capture=False``): the arithmetic of a replay without the capture, which the tests check
against transformers (tests/engine/test_decode_graphs.py).

::

    staged (one int64 tensor, one copy per step; every segment is `largest` rows long)
    [ ids | positions | slots | lengths | block table (largest x width) ]
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata, DecodeGroup
from engine.tp_wire import StepInputs

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeGraphs:
    def __init__(
        self,
        model: Callable[..., torch.Tensor | None],
        kv: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        decode_kernel: Callable,
        decode_windows: bool,
        hnd: bool,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        capture: bool,
    ) -> None:
        self.model, self.kv, self.cos, self.sin_signed = model, kv, cos, sin_signed
        self.decode_kernel, self.decode_windows = decode_kernel, decode_windows
        self.hnd, self.block_size = hnd, block_size
        self.buckets = sorted({b for b in BUCKETS if b < max_num_seqs} | {min(max_num_seqs, BUCKETS[-1])})
        self.largest = self.buckets[-1]
        self.width = -(-max_model_len // block_size)
        device = kv.device
        self.staged = torch.zeros(self.largest * (4 + self.width), dtype=torch.long, device=device)
        rows = self.largest
        self.ids, self.positions, self.slots, self.lengths = self.staged[: 4 * rows].view(4, rows)
        self.table = self.staged[4 * rows :].view(rows, self.width)
        self.lengths.fill_(1)  # every captured row reads one key until a step writes its own
        self.rows = torch.arange(rows, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served from the padded buffers
        if capture:
            self._capture()

    def fits(self, inputs: StepInputs) -> bool:
        """A step of decode rows only, one group, every row sampled, at most the largest bucket."""
        n = len(inputs.token_ids)
        return (
            0 < n <= self.largest
            and not inputs.prefills
            and len(inputs.decodes) == 1
            and len(inputs.decodes[0][1]) == n
            and inputs.logits_rows == list(range(n))
        )

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [n, vocab] of a step that ``fits``."""
        n = len(inputs.token_ids)
        bucket = next(b for b in self.buckets if b >= n)
        _, lengths, table = inputs.decodes[0]
        pad = bucket - n
        host = torch.zeros(self.staged.shape[0], dtype=torch.long)
        columns = host[: 4 * self.largest].view(4, self.largest)
        for column, values in enumerate((inputs.token_ids, inputs.positions, inputs.slots, lengths)):
            columns[column, :bucket] = torch.tensor(values + values[-1:] * pad)
        blocks = host[4 * self.largest :].view(self.largest, self.width)
        rows = torch.tensor(table + table[-1:] * pad)
        blocks[:bucket, : rows.shape[1]] = rows
        self.staged.copy_(host, non_blocking=True)
        self.replays += 1
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:n]
        logits = self._forward(bucket)
        assert logits is not None
        return logits[:n]

    def _forward(self, bucket: int) -> torch.Tensor | None:
        """The model over the first ``bucket`` rows of the static buffers."""
        lengths = self.lengths[:bucket]
        meta = AttentionMetadata(
            slot_mapping=self.slots[:bucket],
            num_decodes=bucket,
            decodes=[DecodeGroup(0, bucket, self.table[:bucket], lengths, None)],
            prefills=[],
            hnd=self.hnd,
            decode_kernel=self.decode_kernel,
            decode_windows=self.decode_windows,
        )
        positions = self.positions[:bucket]
        cos = self.cos.index_select(1, positions).unsqueeze(2)
        sin_signed = self.sin_signed.index_select(1, positions).unsqueeze(2)
        return self.model(self.ids[:bucket], cos, sin_signed, self.kv, meta, self.rows[:bucket])

    @torch.inference_mode()
    def _capture(self) -> None:
        """One graph per bucket, largest first, sharing one memory pool. Each bucket runs once outside
        the capture first (Triton compiles its kernels then). Called before any request: the rows'
        zero slots write into block 0, which holds nothing yet."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket in self.buckets:
                self._forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        pool = None
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(bucket)
            assert out is not None
            self.graphs[bucket], self.outputs[bucket] = graph, out
            pool = graph.pool()
        torch.cuda.synchronize()
