"""NIXL backend: one-sided UCX writes into the peer's registered cache.

Facts this code relies on (nixl 1.5.1, measured on the CPU dev machine):

* The agent is created with ``enable_prog_thread=False``: NIXL's progress
  thread busy-spins a core. Instead the single transfer thread that owns the
  agent drives progress by posting, checking and ``get_new_notifs`` in its loop
  (without progress on both sides writes and notifications stall). Several
  threads calling one agent segfaulted: only the owning thread touches it.
* A plugin that fails to load is only logged, so ``"UCX" in agent.backends``
  is checked after creation.
* UCX transports (``ucx_tls``, default "auto"): ``cma,tcp`` when this machine
  has no CUDA device. cma moves the bytes with process_vm_writev (one-sided,
  no receiver progress needed); tcp carries notifications and connection setup
  and reports a dead peer (NIXL_ERR_REMOTE_DISCONNECT ~10 ms after a kill).
  Measured here (bench, 470 MB bf16 KV): cma,tcp 0.47-0.53x memcpy, UCX's own
  choice the same (it picks cma + tcp), ``tcp`` alone 0.24x (and it spread
  over lo and the other interface), ``shm`` needs error handling off and then
  misses dead peers. With CUDA, "auto" leaves UCX to pick (cuda_ipc,
  cuda_copy, rc...). ``ucx_net_devices``: "lo" keeps a single-host cluster on
  loopback (tests, bench, local launcher); multi-host deployments name their
  NIC (e.g. ``mlx5_0:1``); None lets UCX use every device, and UCX then opens
  a TCP listener on each of them. The servers set ``UCX_NET_DEVICES`` to the
  interface of their configured host before the agent starts
  (``transfer/netdev.py``), so nothing listens beyond it. A variable already
  set in the environment wins over the config (debugging).
* Writes use descriptor lists prepared once per (region, chunk size) and
  ``make_prepped_xfer`` with index arrays for whole chunks; the few ranges that
  are not whole chunks (a partial last block, layout conversions) go through
  ``initialize_xfer`` with explicit descriptors. NIXL merges adjacent ones.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import msgspec
import numpy as np
from nixl._api import nixl_agent, nixl_agent_config  # ImportError handled by make_backend

from transfer.backend import Backend, NoticeIn, TransferError

log = logging.getLogger(__name__)
MAX_PREPPED_DESCS = 1 << 21


class _Region:
    def __init__(self, addr: int, nbytes: int, dev: int, mem: str) -> None:
        self.addr, self.nbytes, self.dev, self.mem = addr, nbytes, dev, mem


def _nixl_logs_to_stderr() -> None:
    """nixl's Python logger writes to stdout, which belongs to our programs'
    output (``bench --json``); move it to stderr."""
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def _descs(region: _Region, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    if len(offsets) and int((offsets + lengths).max()) > region.nbytes:
        raise TransferError(f"range beyond a registered region of {region.nbytes} bytes")
    return np.stack(
        [
            offsets.astype(np.uint64) + np.uint64(region.addr),
            lengths.astype(np.uint64),
            np.full(len(offsets), region.dev, dtype=np.uint64),
        ],
        axis=1,
    )


def _chunk_descs(region: _Region, chunk: int) -> np.ndarray:
    n = region.nbytes // chunk
    return _descs(region, np.arange(n, dtype=np.int64) * chunk, np.full(n, chunk, dtype=np.int64))


class NixlBackend(Backend):
    kind = "nixl"
    one_sided = True

    def __init__(self, name: str, ucx_tls: str | None = "auto", ucx_net_devices: str | None = None) -> None:
        if ucx_tls == "auto":
            import torch

            ucx_tls = None if torch.cuda.is_available() else "cma,tcp"
        for var, value in (("UCX_TLS", ucx_tls), ("UCX_NET_DEVICES", ucx_net_devices)):
            if value and var not in os.environ:
                os.environ[var] = value  # UCX reads its settings only from the environment
            elif var in os.environ:
                log.info("%s=%s from the environment", var, os.environ[var])
        _nixl_logs_to_stderr()
        self.name = name
        try:
            self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as exc:  # nixlBackendError: bad UCX settings
            raise TransferError(
                f"NIXL agent {name!r} could not start UCX ({exc}); check UCX_TLS={os.environ.get('UCX_TLS')!r}"
            ) from exc
        if "UCX" not in self._agent.backends:
            raise TransferError(
                f"NIXL agent {name!r} has no UCX backend (plugin failed to load); use the zmq transfer backend"
            )
        self._regions: dict[str, _Region] = {}
        self._reg_descs: list = []
        self._peers: dict[str, dict] = {}  # name -> {"meta": bytes, "regions": {...}}
        self._local_dlists: dict[tuple[str, int], object] = {}
        self._remote_dlists: dict[tuple[str, int], object] = {}
        self._chunks: dict[tuple[str, str], int] = {}  # (peer, region) -> chunk bytes

    def register(self, region: str, tensor) -> None:
        self._reg_descs.append(self._agent.register_memory(tensor))
        mem = "DRAM" if tensor.device.type == "cpu" else "VRAM"
        dev = 0 if mem == "DRAM" else tensor.device.index or 0
        self._regions[region] = _Region(tensor.data_ptr(), tensor.numel() * tensor.element_size(), dev, mem)

    def metadata(self) -> bytes:
        regions = {k: [r.addr, r.nbytes, r.dev, r.mem] for k, r in self._regions.items()}
        return msgspec.msgpack.encode(
            {"name": self.name, "agent": self._agent.get_agent_metadata(), "regions": regions}
        )

    def connect(self, peer: str, metadata: bytes) -> None:
        meta = msgspec.msgpack.decode(metadata)
        if meta["name"] != peer:
            raise ValueError(f"metadata is for {meta['name']!r}, not {peer!r}")
        known = self._peers.get(peer)
        if known is not None and known["meta"] == meta["agent"]:
            return
        self.disconnect(peer)  # a restarted peer: new agent, same name
        loaded = self._agent.add_remote_agent(meta["agent"])
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != peer:
            raise ValueError(f"NIXL metadata names agent {loaded!r}, expected {peer!r}")
        self._peers[peer] = {"meta": meta["agent"], "regions": {k: _Region(*v) for k, v in meta["regions"].items()}}

    def prepare(self, peer: str, region: str, chunk_bytes: int) -> None:
        local, remote = self._regions[region], self._peers[peer]["regions"]["kv"]
        if chunk_bytes <= 0 or max(local.nbytes, remote.nbytes) // chunk_bytes > MAX_PREPPED_DESCS:
            return
        if (region, chunk_bytes) not in self._local_dlists:
            self._local_dlists[(region, chunk_bytes)] = self._agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", _chunk_descs(local, chunk_bytes), local.mem
            )
        if (peer, chunk_bytes) not in self._remote_dlists:
            self._remote_dlists[(peer, chunk_bytes)] = self._agent.prep_xfer_dlist(
                peer, _chunk_descs(remote, chunk_bytes), remote.mem
            )
        self._chunks[(peer, region)] = chunk_bytes

    def write(self, peer, transfer_id, layer, region, src_offsets, dst_offsets, lengths):
        if peer not in self._peers:
            raise TransferError(f"not connected to {peer!r}")
        src_offsets = np.asarray(src_offsets, dtype=np.int64)
        dst_offsets = np.asarray(dst_offsets, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        handles = []
        chunk = self._chunks.get((peer, region), 0)
        rest = np.ones(len(lengths), dtype=bool)
        try:
            if chunk:
                whole = (src_offsets % chunk == 0) & (dst_offsets % chunk == 0) & (lengths % chunk == 0)
                if whole.any():
                    rest = ~whole
                    counts = lengths[whole] // chunk
                    step = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
                    src_idx = (np.repeat(src_offsets[whole] // chunk, counts) + step).astype(np.int32)
                    dst_idx = (np.repeat(dst_offsets[whole] // chunk, counts) + step).astype(np.int32)
                    handles.append(
                        self._agent.make_prepped_xfer(
                            "WRITE",
                            self._local_dlists[(region, chunk)],
                            src_idx,
                            self._remote_dlists[(peer, chunk)],
                            dst_idx,
                        )
                    )
            if rest.any():
                local, remote = self._regions[region], self._peers[peer]["regions"]["kv"]
                handles.append(
                    self._agent.initialize_xfer(
                        "WRITE",
                        self._agent.get_xfer_descs(_descs(local, src_offsets[rest], lengths[rest]), local.mem),
                        self._agent.get_xfer_descs(_descs(remote, dst_offsets[rest], lengths[rest]), remote.mem),
                        peer,
                    )
                )
            for h in handles:
                if self._agent.transfer(h) == "ERR":
                    raise TransferError(f"NIXL write to {peer!r} failed to post")
        except TransferError:
            self._release(handles)
            raise
        except Exception as exc:  # nixlRemoteDisconnectError and friends
            self._release(handles)
            raise TransferError(f"NIXL write to {peer!r}: {exc}") from exc
        return handles

    def write_done(self, handle) -> bool:
        try:
            states = [self._agent.check_xfer_state(h) for h in handle]
        except Exception as exc:
            self._release(handle)
            raise TransferError(f"NIXL write: {exc}") from exc
        if "ERR" in states:
            self._release(handle)
            raise TransferError("NIXL write failed (peer gone?)")
        if all(s == "DONE" for s in states):
            self._release(handle)
            return True
        return False

    def _release(self, handles) -> None:
        for h in handles:
            try:
                h.release()
            except Exception as exc:  # a transfer that cannot be cancelled
                log.warning("NIXL handle release failed: %s", exc)
        handles.clear()

    def send_notice(self, peer: str, payload: bytes) -> None:
        if peer not in self._peers:
            raise TransferError(f"not connected to {peer!r}")
        try:
            self._agent.send_notif(peer, payload)
        except Exception as exc:
            raise TransferError(f"NIXL notice to {peer!r}: {exc}") from exc

    def poll(self, timeout_s: float = 0.0):
        # NIXL has no blocking wait: look, sleep, look again (each look progresses UCX)
        notifs = self._notifs()
        if not notifs and timeout_s > 0:
            time.sleep(timeout_s)
            notifs = self._notifs()
        return [
            NoticeIn(peer.decode() if isinstance(peer, bytes) else peer, msg)
            for peer, msgs in notifs.items()
            for msg in msgs
        ]

    def _notifs(self) -> dict:
        try:
            return self._agent.get_new_notifs()
        except Exception as exc:
            log.warning("NIXL get_new_notifs: %s", exc)
            return {}

    def disconnect(self, peer: str) -> None:
        if self._peers.pop(peer, None) is None:
            return
        for key in [k for k in self._remote_dlists if k[0] == peer]:
            self._remote_dlists.pop(key).release()
        for key in [k for k in self._chunks if k[0] == peer]:
            del self._chunks[key]
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as exc:
            log.warning("NIXL remove_remote_agent(%s): %s", peer, exc)

    def close(self) -> None:
        for peer in list(self._peers):
            self.disconnect(peer)
        for dlist in self._local_dlists.values():
            dlist.release()
        self._local_dlists.clear()
        for descs in self._reg_descs:
            self._agent.deregister_memory(descs)
        self._reg_descs.clear()
        del self._agent
