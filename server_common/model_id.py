"""One short name for "this model": what a worker reports on /health and the
router compares before it routes to a worker it discovered at runtime.

It hashes the model folder's ``config.json`` (architecture, layers, heads,
vocabulary, ...): two folders with the same config hold KV of the same shape,
so their servers can exchange it (the transfer handshake still checks the
layout itself, block size, head split and dtype, and converts between them).
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def model_fingerprint(model_dir: str | Path) -> str:
    try:
        data = (Path(model_dir) / "config.json").read_bytes()
    except OSError:
        return ""
    return hashlib.sha256(data).hexdigest()[:16]
