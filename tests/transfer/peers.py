"""A transfer peer in its own process, driven by JSON lines on stdin.

    python -m tests.transfer.peers ROLE CONFIG_JSON

Roles: ``raw-send`` / ``raw-recv`` (a bare cache: random bytes from a seed,
or zeros), ``tp-send`` / ``tp-recv`` (a TP group: one bare cache, backend agent
and transfer thread per rank, see tp_peers.py) and ``engine-prefill`` / ``engine-decode`` (real engines, see
engine_peers.py). Each answer is one line starting with ``@@ `` on stdout (other
output is ignored by the parent). The parent plays the control plane: it
carries hellos, reservations and transfer ids between the two processes.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time

import msgspec
import numpy as np
import torch

from tests.transfer.helpers import backend_options
from transfer.copy import region_bytes
from transfer.factory import make_backend
from transfer.layout import KVLayout
from transfer.receiver import KVReceiver
from transfer.sender import KVSender


def reply(**msg) -> None:
    sys.stdout.write("@@ " + json.dumps(msg) + "\n")
    sys.stdout.flush()


def seeded_cache(layout: KVLayout, seed: int) -> torch.Tensor:
    """Random bytes the parent can regenerate (dtype-agnostic)."""
    data = np.random.default_rng(seed).integers(0, 256, layout.total_bytes, dtype=np.uint8)
    return torch.from_numpy(data).view(getattr(torch, layout.dtype)).view(layout.shape)


def backend_for(cfg: dict):
    return make_backend(cfg["backend"], cfg["name"], **backend_options(cfg["backend"], None, cfg["role"]))


def events_reply(side, timeout_s: float) -> None:
    """Wait for at least one ended transfer (or the timeout) and report."""
    t0 = time.monotonic()
    completed, failed = [], []
    while time.monotonic() - t0 < timeout_s and not (completed or failed):
        for ended in side.take_finished():
            if ended.ok:
                completed.append([ended.transfer_id, ended.first_tokens and list(ended.first_tokens)])
            else:
                failed.append([ended.transfer_id, ended.reason])
        time.sleep(0.002)
    reply(completed=completed, failed=failed, elapsed=time.monotonic() - t0)


def serve_raw(role: str, cfg: dict) -> None:
    layout = msgspec.json.decode(json.dumps(cfg["layout"]), type=KVLayout)
    cfg["role"] = role
    if role == "send":
        cache = seeded_cache(layout, cfg["seed"])
        side = KVSender(
            backend_for(cfg), cache, layout, name=cfg["name"], model="m", checksum=cfg.get("checksum", "sampled")
        )
    else:
        cache = torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype))
        side = KVReceiver(
            backend_for(cfg), cache, layout, name=cfg["name"], model="m", cancel_grace_s=cfg.get("grace", 1.0)
        )
    side.start()
    reply(hello=side.hello().hex(), pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "accept":
            reply(reply=side.accept(bytes.fromhex(cmd["hello"])).hex())
        elif op == "connect":
            reply(peer=side.connect(bytes.fromhex(cmd["hello"])))
        elif op == "expect":
            reply(tid=side.expect(cmd["blocks"], cmd["lease"]))
        elif op == "send":
            side.begin(cmd["tid"], cmd["peer"], cmd["dst_blocks"], cmd["lease"])
            for layer in range(cmd.get("layers", layout.num_layers)):
                side.push_layer(cmd["tid"], layer, cmd["src_blocks"], cmd["start"], cmd["end"])
            if cmd.get("finish", True):
                side.finish(cmd["tid"], cmd["first_tokens"])
            reply(queued=True)
        elif op == "wait":
            events_reply(side, cmd["timeout"])
        elif op == "dump":
            region_bytes(cache).numpy().tofile(cmd["path"])
            reply(dumped=cmd["path"], counters=side.counters() if role == "recv" else {})
        elif op == "quit":
            side.close()
            reply(bye=True)
            os._exit(0)  # skip interpreter teardown: the test waits for this pid


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 pid` dumps stacks into the peer's log
    torch.set_num_threads(1)
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    if role.startswith("raw-"):
        serve_raw(role[4:], cfg)
    elif role.startswith("tp-"):
        from tests.transfer.tp_peers import serve_tp

        serve_tp(role[3:], cfg)
    else:
        from tests.transfer.engine_peers import serve_engine

        serve_engine(role[7:], cfg, reply)


if __name__ == "__main__":
    main()
