"""No thread dies silently: an incoming item that raises is dropped and
counted; a transfer or engine thread that dies or sticks shows in
``problem`` (hence /health), and a dead one ends the process."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from server_common.engine_thread import EngineThread
from server_common.vitals import EXIT_THREAD_DIED, Vitals
from tests.transfer.helpers import make_receiver, make_sender, meet, push_all, wait_events
from tests.waiting import wait_until
from transfer.inproc import InprocHub
from transfer.layout import KVLayout
from transfer.messages import Done, encode

LAYOUT = KVLayout.for_engine_cache(
    num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32"
)


@pytest.fixture
def pair():
    hub = InprocHub()
    sender, receiver = make_sender("inproc", hub, "P", LAYOUT), make_receiver("inproc", hub, "D", LAYOUT)
    yield sender, receiver
    sender.close()
    receiver.close()


def test_an_incoming_message_that_raises_is_dropped_and_counted_and_the_thread_serves_on(pair):
    sender, receiver = pair
    peer = meet(sender, receiver)

    def broken(peer, done):
        raise RuntimeError("a bug in handling one notice")

    receiver._on_done = broken  # the next Done hits a bug
    sender.backend.send_notice("D", encode(Done("D-x", "P", (1,), 0, 1, (0,), 0, "none")))
    wait_until(lambda: receiver.counters()["contained_errors"] == 1)
    assert receiver.problem(stuck_after_s=5.0) is None
    del receiver._on_done
    tid = receiver.expect([3], lease_s=10)
    sender.begin(tid, peer, [3], lease_s=10)
    push_all(sender, tid, LAYOUT, [1], 0, 4, first_tokens=(5,))
    assert [(c.transfer_id, c.first_tokens) for c in wait_events(receiver).completed] == [(tid, (5,))]


def test_a_dead_transfer_thread_is_reported_and_ends_the_process(pair):
    _, receiver = pair

    def poll(timeout_s=0.0):
        raise RuntimeError("the transport broke")

    receiver.backend.poll = poll
    wait_until(lambda: receiver.problem(stuck_after_s=5.0) is not None)
    assert receiver.problem(stuck_after_s=5.0) == "decode transfer thread died: RuntimeError('the transport broke')"
    vitals = Vitals(stuck_after_s=5.0)
    vitals.add(receiver.problem)
    exits = []
    asyncio.run(vitals.watch(exit_process=exits.append))
    assert exits == [EXIT_THREAD_DIED]


@pytest.fixture
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=16, num_threads=1))


def test_a_dead_engine_thread_is_reported(engine):
    def step(layer_hook=None):
        raise RuntimeError("a bug in a step")

    engine.step = step
    thread = EngineThread(engine, lambda engine, outputs: None, "c0")
    thread.start()
    try:
        thread.call(lambda e: e.add_request("r", [3, 4, 5], SamplingParams(max_tokens=2, temperature=0)))
        wait_until(lambda: thread.problem(60.0) is not None)
        assert thread.problem(60.0) == "engine thread died: RuntimeError('a bug in a step')"
    finally:
        thread.stop()


def test_an_engine_thread_stuck_with_work_is_reported_until_it_moves_again(engine):
    release = threading.Event()
    step = engine.step
    engine.step = lambda layer_hook=None: release.wait(30) and step(layer_hook)
    thread = EngineThread(engine, lambda engine, outputs: None, "c0")
    vitals = Vitals(stuck_after_s=0.3)
    vitals.add(thread.problem)
    thread.start()
    try:
        assert vitals.problem() is None
        thread.call(lambda e: e.add_request("r", [3, 4, 5], SamplingParams(max_tokens=2, temperature=0)))
        wait_until(lambda: vitals.problem() is not None)
        assert vitals.problem().startswith("engine thread made no progress for")
        assert vitals.death() is None  # stuck is not dead: unhealthy, not restarted
        release.set()
        wait_until(lambda: vitals.problem() is None)
    finally:
        release.set()
        thread.stop()
