"""Ids remembered for a while, at most ``capacity`` of them: the newest kept, the oldest forgotten.

What a server remembers about requests or transfers that ended (aborted request ids, transfers the
receiver cancelled) must not grow with traffic: a late message about an id forgotten long ago is
treated like one about an id never seen, which every caller already handles. Not thread-safe: each
owner touches it from one thread.
"""

from __future__ import annotations

from collections import OrderedDict


class RecentIds:
    def __init__(self, capacity: int) -> None:
        assert capacity > 0, capacity
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, id_: str) -> None:
        """Remember ``id_`` as the newest; forget the oldest past ``capacity``."""
        self._ids[id_] = None
        self._ids.move_to_end(id_)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def __contains__(self, id_: object) -> bool:
        return id_ in self._ids

    def __len__(self) -> int:
        return len(self._ids)
