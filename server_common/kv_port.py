"""The small transfer interface the servers are written against.

The transfer package (KV layouts, copy plans, NIXL/ZeroMQ/in-process
backends) sits behind these two protocols; ``server_common.kv_adapter`` is
the thin adapter from them to ``transfer``'s KVSender/KVReceiver. The
servers never see a backend, a byte offset or a wire frame.

Decode side::

    target = receiver.expect(transfer_id, block_ids, num_tokens, deadline)   # JSON for the router
    ... receiver thread later calls on_complete(transfer_id, first_token, None)
                                 or on_complete(transfer_id, None, "checksum mismatch")
    receiver.cancel(transfer_id)          # lease expired / request gone: late data is discarded

Prefill side (all on the engine thread)::

    sender.begin(transfer_id, target, num_tokens)
    sender.send_layer(transfer_id, layer, kv, src_block_ids, start, end)   # from the engine's layer_hook
    nbytes = sender.finish(transfer_id, first_token, kv, src_block_ids)    # waits for the writes, sends the notice
    sender.abort(transfer_id)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

OnComplete = Callable[[str, int | None, str | None], None]


class TransferFailed(RuntimeError):
    """The KV could not be delivered (peer gone, refused, timed out)."""


class KVReceiverPort(Protocol):
    def start(self, on_complete: OnComplete) -> None: ...

    def expect(self, transfer_id: str, block_ids: list[int], num_tokens: int, deadline: float) -> dict: ...

    def cancel(self, transfer_id: str) -> None: ...

    def close(self) -> None: ...


class KVSenderPort(Protocol):
    def begin(self, transfer_id: str, target: dict, num_tokens: int) -> None: ...

    def send_layer(self, transfer_id: str, layer: int, kv: torch.Tensor, src_block_ids: list[int],
                   start: int, end: int) -> None: ...

    def finish(self, transfer_id: str, first_token_id: int, kv: torch.Tensor, src_block_ids: list[int]) -> int: ...

    def abort(self, transfer_id: str) -> None: ...

    def close(self) -> None: ...
