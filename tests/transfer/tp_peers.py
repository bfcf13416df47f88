"""A TP group of raw caches in one peer process (``tp-send`` / ``tp-recv`` in peers.py).

Every rank has its own cache, its own backend agent (``NAME-rR``) and its own
transfer thread, as the ranks of a TP instance would; the group classes of
``transfer.group`` play the instance's leader. Ranks of a sender hold random
bytes from ``seed + rank``; ranks of a receiver start as zeros.
"""

from __future__ import annotations

import json
import os
import sys
import time

import msgspec
import torch

from tests.transfer.peers import backend_for, reply, seeded_cache
from transfer.copy import region_bytes
from transfer.group import ReceiverGroup, SenderGroup
from transfer.layout import KVLayout
from transfer.messages import group_to_builtins, parse_group
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.tp import rank_parts


def build(role: str, cfg: dict):
    layouts = [msgspec.json.decode(json.dumps(raw), type=KVLayout) for raw in cfg["layouts"]]
    sides = []
    for r, layout in enumerate(layouts):
        rank_cfg = dict(cfg, name=f"{cfg['name']}-r{r}", role=role)
        if role == "send":
            side = KVSender(
                backend_for(rank_cfg),
                seeded_cache(layout, cfg["seed"] + r),
                layout,
                name=rank_cfg["name"],
                model="m",
                checksum="all",
            )
        else:
            cache = torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype))
            side = KVReceiver(
                backend_for(rank_cfg),
                cache,
                layout,
                name=rank_cfg["name"],
                model="m",
                cancel_grace_s=cfg.get("grace", 1.0),
            )
        side.start()
        sides.append(side)
    return sides, (SenderGroup(sides) if role == "send" else ReceiverGroup(sides))


def wait_group(group, timeout_s: float) -> None:
    """Wait for one group transfer to end (or the timeout) and report it."""
    t0 = time.monotonic()
    ended = []
    while time.monotonic() - t0 < timeout_s and not ended:
        ended = group.take_finished()
        time.sleep(0.002)
    reply(
        ended=[[e.transfer_id, str(e.outcome), e.reason, e.first_tokens and list(e.first_tokens)] for e in ended],
        elapsed=time.monotonic() - t0,
    )


def serve_tp(role: str, cfg: dict) -> None:
    sides, group = build(role, cfg)
    reply(hellos=[s.hello().hex() for s in sides], pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "accept":
            reply(reply=sides[cmd["rank"]].accept(bytes.fromhex(cmd["hello"])).hex())
        elif op == "connect":
            reply(peer=sides[cmd["rank"]].connect(bytes.fromhex(cmd["hello"])))
        elif op == "expect":
            gid, target = group.expect(cmd["blocks"], cmd["lease"], writable_from=cmd.get("writable_from", 0))
            reply(gid=gid, target=group_to_builtins(target))
        elif op == "cancel_part":  # one decode rank fails on its own
            sides[cmd["rank"]].cancel(cmd["tid"], cmd["reason"])
            reply(cancelled=True)
        elif op == "send":
            target = parse_group(cmd["target"])
            group.begin(cmd["gid"], target, cmd["dst_blocks"], cmd["lease"])
            if cmd.get("fail_rank") is not None:  # one prefill rank fails on its own
                for part in rank_parts(group.layouts, target)[cmd["fail_rank"]]:
                    sides[cmd["fail_rank"]].abort(part.transfer_id)
            for start, end in cmd["chunks"]:
                for layer in range(group.layouts[0].num_layers):
                    group.push_layer(cmd["gid"], layer, cmd["src_blocks"], start, end)
            group.finish(cmd["gid"], cmd["first_tokens"])
            reply(queued=True)
        elif op == "wait":
            wait_group(group, cmd["timeout"])
        elif op == "dump":
            for r, side in enumerate(sides if role == "recv" else []):
                region_bytes(side._cache).numpy().tofile(f"{cmd['path']}.{r}")
            reply(
                counters=[s.counters() for s in sides] if role == "recv" else [],
                open_parts=[len(s._out) for s in sides] if role == "send" else [],
                open_groups=group.open_transfers(),
            )
        elif op == "quit":
            for side in sides:
                side.close()
            reply(bye=True)
            os._exit(0)  # skip interpreter teardown: the test waits for this pid
