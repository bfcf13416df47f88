"""The local-disk tier: one file per block under a folder, bounded by bytes.

A block's file is written to a temporary name in the same folder and renamed
into place, so a reader sees a whole file or none. Its header carries the
CRC32 of the payload and the payload's length::

    <hash as 16 hex digits>.kv:
    | magic "PDKVBLK1" (8) | crc32 (u32) | 0 (u32) | payload bytes (u64) | payload ... |

A file whose length is not the header's, whose payload does not match its
checksum, or that vanished is corrupt: a miss, counted, the file removed. The
files outlive the process: a server restarted on the same folder indexes them
(oldest modification first) and serves them again.
"""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import torch

from engine.tiers.tier import Tier

MAGIC = b"PDKVBLK1"
HEADER = struct.Struct("<8sIIQ")
SUFFIX = ".kv"


class DiskTier(Tier):
    name = "disk"

    def __init__(self, folder: str | Path, max_bytes: int, queue_blocks: int = 256) -> None:
        super().__init__(max_bytes, queue_blocks)
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._index_folder()
        self.start()

    def path(self, h: int) -> Path:
        """Where block ``h``'s file lives."""
        return self.folder / f"{h:016x}{SUFFIX}"

    def _index_folder(self) -> None:
        """List the blocks a previous process left, oldest first; remove its unfinished temporary files."""
        found = []
        for entry in self.folder.iterdir():
            if entry.name.endswith(".tmp"):
                entry.unlink(missing_ok=True)
            elif entry.name.endswith(SUFFIX) and len(entry.name) == 16 + len(SUFFIX):
                try:
                    found.append((entry.stat().st_mtime, int(entry.name[:16], 16), entry.stat().st_size))
                except (OSError, ValueError):
                    continue
        for _, h, size in sorted(found):
            self._index_existing(h, size)

    def _persist(self, h: int, data: torch.Tensor, checksum: int) -> int:
        final = self.path(h)
        tmp = self.folder / f".{h:016x}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, checksum, 0, data.numel()))
                f.write(memoryview(data.numpy()))
            os.replace(tmp, final)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        return HEADER.size + data.numel()

    def _fetch(self, h: int) -> tuple[torch.Tensor, int] | None:
        try:
            with open(self.path(h), "rb") as f:
                raw = bytearray(os.fstat(f.fileno()).st_size)
                if f.readinto(raw) != len(raw):
                    return None
        except OSError:
            return None
        if len(raw) <= HEADER.size:
            return None
        magic, checksum, _, length = HEADER.unpack_from(raw)
        if magic != MAGIC or len(raw) - HEADER.size != length:
            return None
        return torch.frombuffer(raw, dtype=torch.uint8, offset=HEADER.size), checksum

    def _discard(self, h: int) -> None:
        self.path(h).unlink(missing_ok=True)
