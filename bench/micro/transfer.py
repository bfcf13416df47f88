"""`pdserve bench transfer`: KV-shaped transfer bandwidth against memcpy.

A receiver process (spawned here, talked to with raw bytes over a pipe: JSON,
no pickle) reserves contiguous blocks; this process pushes every layer of a
full cache through KVSender, as a prefill server would, and times from the
first push to the receiver's Ack (its checksum verified). memcpy is a
single-threaded ``copy_`` of the same bytes between two warm buffers, in the
same run. Also reported: one-block latency (one 16-token block, all layers,
push to Ack) and the posting overhead per layer (the engine thread's
``push_layer`` call, and the transfer thread's plan + post of one layer).

Across two hosts: ``--listen HOST:PORT`` on the receiving one, ``--peer
HOST:PORT`` on the sending one (bench/micro/transfer_peer.py); the receiver then
runs there instead of in a local process, the KV crosses the network on the
interface of those addresses (NIXL: UCX over TCP unless ``--ucx-tls`` says
otherwise), and memcpy is still measured by the sender in the same run.

``--tp P,D``: a prefill group of P ranks (this process) into a decode group
of D ranks (the receiver process), each rank with its own cache slice and
backend agent; every P rank pushes its heads to the D ranks holding them
(transfer/tp.py) and a run ends when every part's Ack came. Reported: the
bytes of each link (P rank -> D rank) and their sum, against the model's KV
bytes (more than them when D replicates heads).

Wire into the CLI with ``add_arguments(parser)`` and ``run(args) -> int``;
or ``python -m bench.micro.transfer --backend nixl --json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time

import torch

from bench.micro import transfer_peer as bench_peer
from engine.tensor_parallel import kv_heads_for_rank
from transfer.factory import make_backend
from transfer.group import ReceiverGroup, SenderGroup
from transfer.layout import KVLayout
from transfer.messages import group_to_builtins, parse_group
from transfer.receiver import KVReceiver
from transfer.sender import KVSender
from transfer.tp import route_heads

SHAPE_KEYS = bench_peer.SHAPE_KEYS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("nixl", "zmq"), default="nixl")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--blocks", type=int, default=256, help="blocks moved per transfer")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--kv-order",
        choices=("NHD", "HND"),
        default="NHD",
        help="inside a block: slot-major (NHD) or head-major (HND); with --tp, HND keeps a rank's heads contiguous",
    )
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--scatter", action="store_true", help="decode blocks in random order (no contiguous runs to merge)"
    )
    parser.add_argument(
        "--endpoint",
        default=None,
        help="zmq receiver bind address (default: tcp://127.0.0.1:0, or port 0 on the --listen host)",
    )
    parser.add_argument(
        "--ucx-tls",
        default="auto",
        help="UCX_TLS for nixl: auto (cma,tcp without CUDA on one host, tcp across hosts), "
        "a list, or '' for UCX's choice",
    )
    parser.add_argument(
        "--ucx-net-devices",
        default=None,
        help="UCX_NET_DEVICES for nixl (default: lo on one host, across hosts the interface "
        "of the --listen address or the one that reaches the --peer)",
    )
    across = parser.add_mutually_exclusive_group()
    across.add_argument(
        "--listen", metavar="HOST:PORT", help="be the receiving host: wait for one `--peer` sender here, then exit"
    )
    across.add_argument(
        "--peer", metavar="HOST:PORT", help="be the sending host: the receiver is a `--listen` on another host"
    )
    parser.add_argument(
        "--peer-timeout", type=float, default=120.0, help="seconds to keep trying to reach the --peer receiver"
    )
    parser.add_argument(
        "--tp",
        type=_tp_pair,
        default=None,
        metavar="P,D",
        help="tensor parallelism: P prefill ranks into D decode ranks, each rank its own agent (one host only)",
    )


def _tp_pair(text: str) -> tuple[int, int]:
    try:
        p, d = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tp takes two rank counts, P,D (e.g. 2,4), not {text!r}") from None
    if not (1 <= p <= 64 and 1 <= d <= 64):
        raise argparse.ArgumentTypeError(f"--tp {text!r}: rank counts are 1 to 64")
    return p, d


def _layout(args, tp_rank: int = 0, tp_size: int = 1) -> KVLayout:
    """One rank's slice of a cache of ``args.kv_heads`` KV heads (the whole cache for tp_size 1)."""
    heads = kv_heads_for_rank(args.kv_heads, tp_rank, tp_size)
    return KVLayout.for_engine_cache(
        num_layers=args.layers,
        num_blocks=args.blocks,
        block_size=args.block_size,
        num_kv_heads=len(heads),
        head_ids=heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        order=args.kv_order,
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_kv_heads_total=args.kv_heads,
    )


def link_bytes(src: list[KVLayout], dst: list[KVLayout], tokens: int) -> dict[str, int]:
    """Bytes each link (``"P<r>->D<r>"``) carries for ``tokens`` tokens of every layer, K and V."""
    return {
        f"P{r.src_rank}->D{r.dst_rank}": tokens * src[0].num_layers * 2 * len(r.heads) * src[0].vec_bytes
        for r in route_heads(src, dst)
    }


def _own_address(args) -> str | None:
    """This host's address on the link to the other host (None: both sides on this machine)."""
    if args.listen:
        return bench_peer.split_address(args.listen)[0]
    if args.peer:
        return bench_peer.local_address_towards(*bench_peer.split_address(args.peer))
    return None


def _backend(args, name: str, role: str):
    address = _own_address(args)
    if args.backend == "zmq":
        if role != "recv":
            return make_backend("zmq", name)
        endpoint = args.endpoint or f"tcp://{address or '127.0.0.1'}:0"
        return make_backend("zmq", name, endpoint=endpoint)
    ucx_tls, devices = args.ucx_tls, args.ucx_net_devices
    if address is not None and ucx_tls == "auto" and not torch.cuda.is_available():
        ucx_tls = "tcp"  # cma would need both processes on one machine
    if devices is None:
        from transfer.netdev import interface_of

        devices = "lo" if address is None else interface_of(address)
    return make_backend("nixl", name, ucx_tls=ucx_tls or None, ucx_net_devices=devices or None)


def _receiver_main(conn, args_dict: dict) -> None:
    """The decode side, in its own process: answers JSON requests on ``conn``."""
    args = argparse.Namespace(**args_dict)
    if args.tp is not None:
        _serve_tp(conn, args)
    else:
        _serve(conn, args)


def _serve_tp(conn, args) -> None:
    """The decode group: one receiver per rank; meets every prefill rank, then issues group transfers."""
    torch.set_num_threads(1)
    ranks = []
    for r in range(args.tp[1]):
        layout = _layout(args, r, args.tp[1])
        cache = torch.ones(layout.shape, dtype=getattr(torch, layout.dtype))  # ones: pages touched
        name = f"bench-decode-r{r}"
        ranks.append(KVReceiver(_backend(args, name, "recv"), cache, layout, name=name, model="bench"))
        ranks[-1].start()
    group = ReceiverGroup(ranks)
    try:
        while True:
            cmd = json.loads(conn.recv_bytes())
            if cmd["op"] == "quit":
                conn.send_bytes(b"{}")
                return
            if cmd["op"] == "accept":
                conn.send_bytes(ranks[cmd["rank"]].accept(bytes.fromhex(cmd["hello"])))
                continue
            group.take_finished()
            gid, target = group.expect(cmd["blocks"], lease_s=60)
            conn.send_bytes(json.dumps({"gid": gid, "target": group_to_builtins(target)}).encode())
    finally:
        for receiver in ranks:
            receiver.close()


def _listen(args) -> int:
    """``--listen``: the decode side on this host, for one ``--peer`` sender, whose first message
    gives the shape of the cache (bench_peer.SHAPE_KEYS)."""
    host, port = bench_peer.split_address(args.listen)
    conn = bench_peer.accept_one(host, port, lambda at: print(f"listening on {at}", file=sys.stderr, flush=True))
    try:
        shape = json.loads(conn.recv_bytes())
        if not isinstance(shape, dict) or set(shape) != set(SHAPE_KEYS):
            raise ValueError(f"the sender's first message is not a cache shape with keys {SHAPE_KEYS}")
        args = argparse.Namespace(**{**vars(args), **shape})
        if _layout(args).total_bytes > bench_peer.MAX_CACHE_BYTES:
            raise ValueError(f"the sender asks for a cache over {bench_peer.MAX_CACHE_BYTES} bytes")
        _serve(conn, args)
    finally:
        conn.close()
    return 0


def _serve(conn, args) -> None:
    torch.set_num_threads(1)
    layout = _layout(args)
    cache = torch.ones(layout.shape, dtype=getattr(torch, layout.dtype))  # ones: pages touched
    receiver = KVReceiver(_backend(args, "bench-decode", "recv"), cache, layout, name="bench-decode", model="bench")
    receiver.start()
    conn.send_bytes(receiver.accept(conn.recv_bytes()))
    while True:
        cmd = json.loads(conn.recv_bytes())
        if cmd["op"] == "quit":
            receiver.close()
            conn.send_bytes(b"{}")
            return
        tid = receiver.expect(cmd["blocks"], lease_s=60)
        receiver.take_finished()
        conn.send_bytes(json.dumps({"tid": tid}).encode())


def _ask(conn, **cmd) -> dict:
    conn.send_bytes(json.dumps(cmd).encode())
    return json.loads(conn.recv_bytes())


def _transfer(
    conn, sender: KVSender, ended: threading.Event, peer: str, layout: KVLayout, num_blocks: int, scatter: bool = False
) -> tuple[float, float]:
    """One transfer of ``num_blocks`` blocks: (seconds to Ack, seconds in push_layer calls)."""
    blocks = list(range(num_blocks))
    dst_blocks = torch.randperm(num_blocks).tolist() if scatter else blocks
    tid = _ask(conn, op="expect", blocks=dst_blocks)["tid"]
    sender.begin(tid, peer, dst_blocks, lease_s=60)
    end = num_blocks * layout.block_size
    t0 = time.perf_counter()
    for layer in range(layout.num_layers):
        sender.push_layer(tid, layer, blocks, 0, end)
    pushed = time.perf_counter() - t0
    sender.finish(tid, [0])
    _wait_acked(sender, ended)
    return time.perf_counter() - t0, pushed


def _wait_acked(sender, ended: threading.Event) -> None:
    """Until the bench's one transfer ended (``ended`` is the sender's notify); raises if it failed."""
    while True:
        ended.wait()
        ended.clear()
        for done in sender.take_finished():
            if not done.ok:
                raise RuntimeError(f"bench transfer failed: {done.outcome}: {done.reason}")
            return


def _memcpy_gbps(nbytes: int, iters: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the transfer moves bytes on one thread too
    try:
        dst.copy_(src)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return nbytes / min(times) / 1e9


def _transfer_tp(conn, senders: SenderGroup, ended: threading.Event, layouts: list[KVLayout], num_blocks: int):
    """One group transfer of ``num_blocks`` blocks: seconds from the first push to the last part's Ack."""
    blocks = list(range(num_blocks))
    answer = _ask(conn, op="expect", blocks=blocks)
    target = parse_group(answer["target"])
    senders.begin(answer["gid"], target, blocks, lease_s=60)
    t0 = time.perf_counter()
    for layer in range(layouts[0].num_layers):
        senders.push_layer(answer["gid"], layer, blocks, 0, num_blocks * layouts[0].block_size)
    senders.finish(answer["gid"], [0])
    _wait_acked(senders, ended)
    return time.perf_counter() - t0


def _run_tp(args) -> int:
    """``--tp P,D``: a prefill group here, a decode group in a receiver process."""
    p_size, d_size = args.tp
    src = [_layout(args, r, p_size) for r in range(p_size)]
    dst = [_layout(args, r, d_size) for r in range(d_size)]
    links = link_bytes(src, dst, args.blocks * args.block_size)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child, vars(args)), daemon=True)
    proc.start()
    ended = threading.Event()
    ranks = []
    try:
        for r, layout in enumerate(src):
            cache = torch.randn(layout.shape).to(getattr(torch, layout.dtype))
            name = f"bench-prefill-r{r}"
            sender = KVSender(_backend(args, name, "send"), cache, layout, name=name, model="bench", notify=ended.set)
            sender.start()
            ranks.append(sender)
            for d in range(d_size):
                parent.send_bytes(json.dumps({"op": "accept", "rank": d, "hello": sender.hello().hex()}).encode())
                sender.connect(parent.recv_bytes())
        group = SenderGroup(ranks)
        _transfer_tp(parent, group, ended, src, args.blocks)  # warm-up: connections, page faults
        times = [_transfer_tp(parent, group, ended, src, args.blocks) for _ in range(args.iters)]
        _ask(parent, op="quit")
    finally:
        for sender in ranks:
            sender.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    moved = sum(links.values())
    memcpy = _memcpy_gbps(moved, args.iters)
    gbps = moved / min(times) / 1e9
    result = {
        "backend": args.backend,
        "tp": f"{p_size},{d_size}",
        "model_kv_bytes": _layout(args).total_bytes,
        "bytes": moved,
        "link_bytes": links,
        "gbps": round(gbps, 3),
        "median_gbps": round(moved / statistics.median(times) / 1e9, 3),
        "memcpy_gbps": round(memcpy, 3),
        "ratio": round(gbps / memcpy, 3),
        "ms": round(min(times) * 1e3, 2),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>18}: {value}")
    return 0


def run(args) -> int:
    if args.tp is not None:
        if args.listen or args.peer:
            print("--tp runs both groups on this host: no --listen or --peer", file=sys.stderr)
            return 2
        return _run_tp(args)
    if args.listen:
        return _listen(args)
    layout = _layout(args)
    if args.peer:
        proc = None
        parent = bench_peer.connect(*bench_peer.split_address(args.peer), timeout_s=args.peer_timeout)
        parent.send_bytes(json.dumps({key: getattr(args, key) for key in SHAPE_KEYS}).encode())
    else:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_receiver_main, args=(child, vars(args)), daemon=True)
        proc.start()
    cache = torch.randn(layout.shape).to(getattr(torch, layout.dtype))
    ended = threading.Event()
    sender = KVSender(
        _backend(args, "bench-prefill", "send"), cache, layout, name="bench-prefill", model="bench", notify=ended.set
    )
    sender.start()
    try:
        parent.send_bytes(sender.hello())
        peer = sender.connect(parent.recv_bytes())
        _transfer(parent, sender, ended, peer, layout, args.blocks)  # warm-up: connection, page faults
        runs = [_transfer(parent, sender, ended, peer, layout, args.blocks, args.scatter) for _ in range(args.iters)]
        before = sender.stats()
        small = [_transfer(parent, sender, ended, peer, layout, 1)[0] for _ in range(max(args.iters, 5))]
        after = sender.stats()
        stats = {k: after[k] - before[k] for k in after}  # posting overhead: one-block writes
        _ask(parent, op="quit")
    finally:
        sender.close()
        if proc is None:
            parent.close()
        else:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    nbytes = layout.total_bytes
    gbps = nbytes / min(t for t, _ in runs) / 1e9
    memcpy = _memcpy_gbps(nbytes, args.iters)
    result = {
        "backend": args.backend,
        "bytes": nbytes,
        "gbps": round(gbps, 3),
        "memcpy_gbps": round(memcpy, 3),
        "ratio": round(gbps / memcpy, 3),
        "median_gbps": round(nbytes / statistics.median(t for t, _ in runs) / 1e9, 3),
        "one_block_ms": round(statistics.median(small) * 1e3, 3),
        "push_layer_us": round(statistics.median(p for _, p in runs) / layout.num_layers * 1e6, 2),
        "post_layer_us": round(stats["post_s"] / max(stats["writes"], 1) * 1e6, 2),
        "scatter": args.scatter,
        "ucx_tls": os.environ.get("UCX_TLS") if args.backend == "nixl" else None,
        "ucx_net_devices": os.environ.get("UCX_NET_DEVICES") if args.backend == "nixl" else None,
        "peer": args.peer,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>18}: {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
