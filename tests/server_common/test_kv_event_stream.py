"""server_common/kv_event_stream.py: a server's event log pushed as NDJSON pages: what it holds,
then each batch the engine thread adds, an empty page on a quiet stream, the end when events
were lost."""

from __future__ import annotations

import asyncio
import json
import threading

from engine.kv_events import KvEventLog
from server_common.kv_event_stream import Changes, event_stream
from tests.waiting import until


def stream(log: KvEventLog, changes: Changes, after: int, heartbeat_s: float = 30.0):
    return event_stream(log, changes, after, block_size=4, salt="s", enabled=True, heartbeat_s=heartbeat_s)


def test_the_held_events_then_each_batch_another_thread_adds():
    log = KvEventLog(epoch="e1")
    log.stored(11)
    log.stored(22)

    async def run():
        changes = Changes(log, asyncio.get_running_loop())
        pages = stream(log, changes, after=1)
        first = json.loads(await anext(pages))
        waiting = asyncio.ensure_future(anext(pages))
        await until(lambda: changes.waiting == 1, 5.0, "the stream waits for a change")
        assert not waiting.done() and changes.streams == 1
        engine = threading.Thread(target=lambda: (log.stored(33), log.evicted(11)))
        engine.start()
        engine.join()
        second = json.loads(await asyncio.wait_for(waiting, 5.0))
        await pages.aclose()
        return first, second, changes.streams

    first, second, streams = asyncio.run(run())
    assert (first["epoch"], first["oldest"], first["last"], first["events"]) == ("e1", 1, 2, [[2, "stored", 22]])
    assert (first["block_size"], first["salt"], first["enabled"]) == (4, "s", True)
    assert second["events"] == [[3, "stored", 33], [4, "evicted", 11]] and second["last"] == 4
    assert streams == 0  # closed streams are not counted


def test_a_quiet_stream_sends_an_empty_page_each_heartbeat():
    log = KvEventLog(epoch="e1")
    log.stored(11)

    async def run():
        changes = Changes(log, asyncio.get_running_loop())
        pages = stream(log, changes, after=1, heartbeat_s=0.05)
        got = [json.loads(await asyncio.wait_for(anext(pages), 5.0)) for _ in range(3)]
        await pages.aclose()
        return got

    assert [(p["events"], p["last"]) for p in asyncio.run(run())] == [([], 1)] * 3


def test_a_reader_behind_the_oldest_event_held_gets_one_page_and_the_end():
    log = KvEventLog(capacity=2, epoch="e1")
    for h in (1, 2, 3, 4):
        log.stored(h)

    async def run():
        changes = Changes(log, asyncio.get_running_loop())
        return [json.loads(line) async for line in stream(log, changes, after=0)]

    (page,) = asyncio.run(run())
    assert (page["oldest"], page["last"], page["events"]) == (3, 4, [[3, "stored", 3], [4, "stored", 4]])


def test_a_full_page_is_followed_at_once_by_the_rest():
    log = KvEventLog(epoch="e1")
    for h in range(5000):
        log.stored(h)

    async def run():
        changes = Changes(log, asyncio.get_running_loop())
        pages = stream(log, changes, after=0)
        got = [json.loads(await asyncio.wait_for(anext(pages), 5.0)) for _ in range(2)]
        await pages.aclose()
        return got

    first, second = asyncio.run(run())
    assert len(first["events"]) == 4096 and second["events"][0][0] == 4097 and second["events"][-1][0] == 5000


def test_events_added_after_the_loop_closed_are_harmless():
    log = KvEventLog(epoch="e1")

    async def make():
        return Changes(log, asyncio.get_running_loop())

    asyncio.run(make())  # its loop is closed now, as at a server's exit while its engine runs
    log.stored(1)
    log.stored(2)
    assert log.since(0).last == 2
