"""Engine roles of ``tests.transfer.peers``: real engines pushing and
receiving KV layer by layer, the way the prefill and decode servers will.

One process may host several engines (one per block size), each with its own
sender or receiver and agent name, so a test needs only two processes.
"""

from __future__ import annotations

import json
import os
import sys
import time

from engine import EngineConfig, LLMEngine, SamplingParams
from kvlink.factory import cache_layout
from tests.transfer.helpers import backend_options
from transfer.factory import make_backend
from transfer.layout import KVLayout
from transfer.receiver import KVReceiver
from transfer.sender import KVSender


def layout_of(engine: LLMEngine) -> KVLayout:
    return cache_layout(engine.cache)


class PrefillSide:
    """An engine in prefill mode whose layer hook feeds a KVSender."""

    def __init__(self, cfg: dict, spec: dict) -> None:
        self.tids: dict[str, str] = {}
        self.engine = LLMEngine(
            EngineConfig(
                model=cfg["model"], block_size=spec["block_size"], num_blocks=64, mode="prefill", num_threads=1
            )
        )
        backend = make_backend(cfg["backend"], spec["name"], **backend_options(cfg["backend"], None, "send"))
        self.kv = KVSender(backend, self.engine.cache.kv, layout_of(self.engine), name=spec["name"], model="tiny")
        self.kv.start()

    def _hook(self, layer: int, chunks) -> None:
        for chunk in chunks:
            self.kv.push_layer(self.tids[chunk.request_id], layer, chunk.block_ids, chunk.start, chunk.end)

    def prefill(self, cmd: dict) -> dict:
        rid, tid = cmd["rid"], cmd["tid"]
        self.tids[rid] = tid
        self.kv.begin(tid, cmd["peer"], cmd["dst_blocks"], cmd["lease"])
        self.engine.add_request(rid, cmd["prompt"], SamplingParams(max_tokens=1, temperature=0))
        first = None
        while first is None:
            for out in self.engine.step(self._hook):
                if out.finish_reason == "prefilled":
                    first = out.new_token_ids[0]
        self.kv.finish(tid, [first])
        deadline, status = time.monotonic() + cmd["lease"], "timeout"
        while time.monotonic() < deadline and status == "timeout":
            for ended in self.kv.take_finished():
                status = "completed" if ended.ok else ended.reason
            time.sleep(0.002)
        self.engine.release(rid)  # done or failed: the blocks are no longer read
        self.engine.check_integrity()
        return {"first_token": first, "status": status, "blocks": self.engine.block_counts()}


class DecodeSide:
    """An engine in decode mode whose cache a KVReceiver fills."""

    def __init__(self, cfg: dict, spec: dict) -> None:
        self.engine = LLMEngine(
            EngineConfig(
                model=cfg["model"],
                block_size=spec["block_size"],
                num_blocks=64,
                mode="decode",
                num_threads=1,
                kv_layout=spec.get("kv_layout", "NHD"),
            )
        )
        backend = make_backend(cfg["backend"], spec["name"], **backend_options(cfg["backend"], None, "recv"))
        self.kv = KVReceiver(backend, self.engine.cache.kv, layout_of(self.engine), name=spec["name"], model="tiny")
        self.kv.start()
        self.rids: dict[str, str] = {}

    def reserve(self, cmd: dict) -> dict:
        sampling = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0)
        blocks = self.engine.reserve(cmd["rid"], cmd["prompt"], sampling)
        tid = self.kv.expect(blocks, cmd["lease"])
        self.rids[tid] = cmd["rid"]
        return {"tid": tid, "blocks": blocks}

    def decode(self, cmd: dict) -> dict:
        deadline = time.monotonic() + cmd["timeout"]
        while time.monotonic() < deadline:
            for done in self.kv.take_finished():
                if not done.ok:
                    self.engine.abort(self.rids.pop(done.transfer_id))
                    return {"error": done.reason, "blocks": self.engine.block_counts()}
                rid = self.rids.pop(done.transfer_id)
                tokens = [t for o in self.engine.admit_remote(rid, list(done.first_tokens)) for t in o.new_token_ids]
                while self.engine.has_unfinished():
                    for out in self.engine.step():
                        tokens += out.new_token_ids
                self.engine.check_integrity()
                return {"tokens": tokens, "blocks": self.engine.block_counts()}
            time.sleep(0.002)
        return {"error": "timeout"}


def serve_engine(role: str, cfg: dict, reply) -> None:
    side_type = PrefillSide if role == "prefill" else DecodeSide
    sides = {spec["name"]: side_type(cfg, spec) for spec in cfg["engines"]}
    reply(hellos={name: side.kv.hello().hex() for name, side in sides.items()}, pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        side = sides.get(cmd.get("engine", ""))
        if op == "accept":
            reply(reply=side.kv.accept(bytes.fromhex(cmd["hello"])).hex())
        elif op == "connect":
            reply(peer=side.kv.connect(bytes.fromhex(cmd["hello"])))
        elif op == "prefill":
            reply(**side.prefill(cmd))
        elif op == "reserve":
            reply(**side.reserve(cmd))
        elif op == "decode":
            reply(**side.decode(cmd))
        elif op == "quit":
            for s in sides.values():
                s.kv.close()
            reply(bye=True)
            os._exit(0)
