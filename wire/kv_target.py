"""Where a prefill server writes a reservation's KV: ``Reservation.kv_target``.

Typed and checked once, where the reservation enters a process (pydantic, with
the rest of the reservation): the decode server's transfer agent (``peer``,
the name its handshake answers with; rank 0's for a tensor-parallel server),
the epoch it drew at start (a prefill server that sees a new one meets the
restarted server afresh), and for a decode server with tensor-parallel ranks
its group (``tp``: ``transfer.messages.DecodeGroup``, each rank's agent,
transfer id and layout). A decode group of one is not written: the
reservation's own transfer id is then its only part. On the wire::

    {"peer": "d0", "epoch": "9f2c...", "tp": {"tp_size": 2, "ranks": [...]}}
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, WithJsonSchema, model_serializer

from transfer.messages import DecodeGroup, group_to_builtins, parse_group
from wire.names import INSTANCE_NAME

TPGroup = Annotated[
    DecodeGroup,
    PlainValidator(parse_group),
    PlainSerializer(group_to_builtins, return_type=dict),
    WithJsonSchema({"type": "object", "description": "transfer.messages.DecodeGroup"}),
]


class KVTarget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    peer: str = Field(pattern=INSTANCE_NAME)
    epoch: str = Field(default="", max_length=64)
    tp: TPGroup | None = None

    @model_serializer(mode="wrap")
    def _without_a_group_of_one(self, handler: Any) -> dict:
        out = handler(self)
        if out.get("tp") is None:
            out.pop("tp", None)
        return out
