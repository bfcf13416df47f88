"""server_common/streams.py: per-request queues the engine thread feeds and the event loop reads."""

from __future__ import annotations

import asyncio
import threading

import pytest

from server_common.streams import StreamHub


def test_items_published_from_another_thread_arrive_in_order_on_the_loop():
    async def run():
        hub = StreamHub(asyncio.get_running_loop())
        queue = hub.open("r1")
        engine = threading.Thread(target=lambda: [hub.publish("r1", i) for i in range(5)])
        engine.start()
        got = [await asyncio.wait_for(queue.get(), 5.0) for _ in range(5)]
        engine.join()
        return got

    assert asyncio.run(run()) == [0, 1, 2, 3, 4]


def test_publish_many_delivers_each_item_to_its_own_request_in_order():
    async def run():
        hub = StreamHub(asyncio.get_running_loop())
        a, b = hub.open("a"), hub.open("b")
        engine = threading.Thread(target=hub.publish_many, args=([("a", 1), ("b", 10), ("a", 2), ("gone", 99)],))
        engine.start()
        engine.join()
        got_a = [await asyncio.wait_for(a.get(), 5.0) for _ in range(2)]
        got_b = await asyncio.wait_for(b.get(), 5.0)
        return got_a, got_b, a.qsize(), b.qsize()

    assert asyncio.run(run()) == ([1, 2], 10, 0, 0)


def test_items_for_a_closed_request_are_dropped():
    async def run():
        hub = StreamHub(asyncio.get_running_loop())
        old, probe = hub.open("r1"), hub.open("probe")
        hub.close("r1")
        assert "r1" not in hub and len(hub) == 1
        engine = threading.Thread(target=lambda: [hub.publish("r1", "late"), hub.publish("probe", "after")])
        engine.start()
        engine.join()
        # deliveries run in the order published: once the probe's item is in, r1's was handled
        return await asyncio.wait_for(probe.get(), 5.0), old.qsize(), "r1" in hub

    assert asyncio.run(run()) == ("after", 0, False)


def test_a_request_id_already_open_is_refused_and_close_is_idempotent():
    async def run():
        hub = StreamHub(asyncio.get_running_loop())
        hub.open("r1")
        with pytest.raises(KeyError, match="'r1' is already active"):
            hub.open("r1")
        assert "r1" in hub and len(hub) == 1
        hub.close("r1")
        hub.close("r1")
        assert len(hub) == 0

    asyncio.run(run())
