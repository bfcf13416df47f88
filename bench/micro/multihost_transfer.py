"""KV transfer bandwidth between two network namespaces, against memcpy.

    sudo python -m bench.micro.multihost_transfer [--backends nixl,zmq] [transfer bench options...]

Makes two hosts with the multi-host test harness (tests/multihost/netns.py:
namespaces ``pdmh-bench-send`` and ``pdmh-bench-recv`` on one bridge,
10.213.0.0/24, deleted at the end), then for each backend runs
`pdserve bench transfer --listen` in the receiving namespace and
`pdserve bench transfer --peer` in the sending one (bench/micro/transfer_peer.py),
with UCX on TCP over the sending host's veth. It prints, per backend, the
sender's figures (GB/s, memcpy GB/s measured in the same run, their ratio,
one-block latency) and the bytes the sender's veth sent during the run
against the KV bytes the benchmark moved, which shows that the bytes took
the link. The other options are handed to `pdserve bench transfer` on both
sides' behalf (the shape of the cache goes from the sender to the receiver).
Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from tests.multihost.netns import Network

REPO = Path(__file__).resolve().parents[2]
PREFIX = "pdmh-bench-"
PORT = 7400


def _one(net: Network, backend: str, extra: list[str], folder: Path) -> dict:
    send, recv = net.hosts["send"], net.hosts["recv"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    bench = [sys.executable, "-m", "bench.micro.transfer", "--backend", backend]
    receiver = net.spawn(
        recv, [*bench, "--listen", f"{recv.address}:{PORT}"], env=env, cwd=str(REPO), log=folder / f"{backend}-recv.log"
    )
    before = net.counters(send)[1]
    sender = net.spawn(
        send,
        [*bench, "--peer", f"{recv.address}:{PORT}", "--json", *extra],
        env=env,
        cwd=str(REPO),
        log=folder / f"{backend}-send.log",
        stdout=folder / f"{backend}.json",
    )
    status = sender.wait()
    sent = net.counters(send)[1] - before
    net.stop(receiver, timeout=30)
    if status != 0:
        raise RuntimeError(
            f"{backend}: the sender failed ({status}):\n"
            + (folder / f"{backend}-send.log").read_text()[-3000:]
            + (folder / f"{backend}-recv.log").read_text()[-3000:]
        )
    result = json.loads((folder / f"{backend}.json").read_text())
    result["link_tx_bytes"] = sent
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.micro.multihost_transfer", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--backends", default="nixl,zmq", help="comma-separated: nixl, zmq")
    parser.add_argument("--iters", type=int, default=5, help="timed transfers of the whole cache, per backend")
    args, extra = parser.parse_known_args(argv)
    extra += ["--iters", str(args.iters)]
    rows = []
    with Network(PREFIX) as net, tempfile.TemporaryDirectory(prefix="pdmh-bench-") as tmp:
        net.add_host("send")
        net.add_host("recv")
        for backend in args.backends.split(","):
            rows.append(_one(net, backend, extra, Path(tmp)))
    print(
        f"{'backend':>8} {'MB':>8} {'GB/s':>7} {'median':>7} {'memcpy':>7} {'ratio':>6} {'1 block ms':>10} "
        f"{'link MB sent':>12} {'KV MB moved':>11}"
    )
    for r in rows:
        moved = r["bytes"] * (args.iters + 1)  # the timed transfers and the warm-up (one-block ones left out)
        print(
            f"{r['backend']:>8} {r['bytes'] / 1e6:8.1f} {r['gbps']:7.3f} {r['median_gbps']:7.3f} "
            f"{r['memcpy_gbps']:7.3f} {r['ratio']:6.3f} {r['one_block_ms']:10.3f} "
            f"{r['link_tx_bytes'] / 1e6:12.1f} {moved / 1e6:11.1f}"
        )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
