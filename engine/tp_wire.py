"""One engine step's inputs, as plain lists, and their encoding into one int64 tensor.

Rank 0 of a tensor-parallel engine writes each step's ``HEADER`` (op, payload
length) to every other rank's stdin pipe, then broadcasts the payload over
the ranks' process group (engine/tp_group.py), laid out as::

    [n_tokens, n_rows, n_prefills, n_groups, n_copies]
    token_ids[n_tokens] positions[n_tokens] slots[n_tokens] logits_rows[n_rows]
    per prefill:  row, n, context_start, n_blocks, block_ids[n_blocks]
    per group:    first_row, count, max_blocks, lengths[count], table[count * max_blocks]
    per copy:     source, destination

Integers only, nothing pickled; ``decode`` checks that the payload is exactly
consumed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import torch

HEADER = struct.Struct("<qq")  # op, payload elements (OP_MESSAGE: bytes of its body)
OP_STEP = 1
# A message for the rank's agent (``engine.tp_worker.Agent``, e.g. its KV transfer agent): its JSON
# body follows the header on the pipe itself, so it is handled between two steps, in pipe order.
OP_MESSAGE = 2


@dataclass
class StepInputs:
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # flat KV slot of each token
    logits_rows: list[int] = field(default_factory=list)  # rows whose logits are computed
    prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)  # row, n, context start, blocks
    decodes: list[tuple[int, list[int], list[list[int]]]] = field(default_factory=list)  # row, lengths, table
    copies: list[tuple[int, int]] = field(default_factory=list)  # blocks to copy (source, destination) first
    # The window layers' slots, prefill blocks and decode tables, with a window pool (engine/window_pool.py:
    # one rank only, never sent to another)
    window_slots: list[int] = field(default_factory=list)
    window_prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)
    window_decodes: list[tuple[int, list[int], list[list[int]]]] = field(default_factory=list)


def encode(inputs: StepInputs) -> torch.Tensor:
    assert not inputs.window_slots, "a window pool runs on one rank"
    out = [len(inputs.token_ids), len(inputs.logits_rows), len(inputs.prefills), len(inputs.decodes)]
    out.append(len(inputs.copies))
    out += inputs.token_ids + inputs.positions + inputs.slots + inputs.logits_rows
    for row, n, start, blocks in inputs.prefills:
        out += [row, n, start, len(blocks), *blocks]
    for row, lengths, table in inputs.decodes:
        out += [row, len(lengths), len(table[0]), *lengths]
        for line in table:
            out += line
    for src, dst in inputs.copies:
        out += [src, dst]
    return torch.tensor(out, dtype=torch.long)


def decode(payload: torch.Tensor) -> StepInputs:
    values: list[int] = payload.tolist()
    at = 0

    def take(count: int) -> list[int]:
        nonlocal at
        assert count >= 0 and at + count <= len(values), "a step payload shorter than its counts"
        at += count
        return values[at - count : at]

    n_tokens, n_rows, n_prefills, n_groups, n_copies = take(5)
    inputs = StepInputs(take(n_tokens), take(n_tokens), take(n_tokens), take(n_rows))
    for _ in range(n_prefills):
        row, n, start, n_blocks = take(4)
        inputs.prefills.append((row, n, start, take(n_blocks)))
    for _ in range(n_groups):
        row, count, max_blocks = take(3)
        lengths = take(count)
        inputs.decodes.append((row, lengths, [take(max_blocks) for _ in range(count)]))
    for _ in range(n_copies):
        src, dst = take(2)
        inputs.copies.append((src, dst))
    assert at == len(values), "a step payload longer than its counts"
    return inputs
