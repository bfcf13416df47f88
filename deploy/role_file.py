"""The role an instance is in now, kept in a small file so that a restarted process starts in it.

``pdserve launch`` gives each server ``--role-file RUN_DIR/roles/NAME.json``. The server
(deploy/role_server.py) writes its role and role epoch there when it starts and each time a role
switch commits to a new role, atomically (a temporary file in the same folder, then
``os.replace``: a reader sees the old record or the new one, never half of one). A process that
the supervisor starts again after a crash reads it: it starts directly in the recorded role, in
the epoch after the recorded one, so that anything addressed to the earlier life (a reservation,
a call carrying its epoch) is refused as stale, and the router, seeing a new epoch, joins it
again in that role (router/cluster/discovery.py).

The record names the instance and the launch (``--launch-id``) it belongs to: a missing file, one
that does not parse, one of another instance or of another launch (a run folder used again), or
one naming no known role means the configured role, epoch 0.

A Kubernetes pod has no run folder: a restarted container starts in its configured role at epoch
0, the router joins it again as it reports itself, and the planner decides its role anew.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from engine.config import MODES, EngineMode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleRecord:
    """A role and the role epoch it was entered in."""

    role: EngineMode
    role_epoch: int


@dataclass(frozen=True)
class RoleFile:
    """Instance ``instance``'s role record of launch ``launch_id`` at ``path``."""

    path: Path
    instance: str
    launch_id: str | None

    def read(self) -> RoleRecord | None:
        """The record, or None when there is none of this instance and launch (see the module)."""
        try:
            body = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("role file %s unreadable (%r): starting in the configured role", self.path, exc)
            return None
        if not isinstance(body, dict):
            log.warning("role file %s holds no record: starting in the configured role", self.path)
            return None
        role, epoch = body.get("role"), body.get("role_epoch")
        if (body.get("instance"), body.get("launch_id")) != (self.instance, self.launch_id):
            return None  # another instance's, or an earlier launch's
        if role not in MODES or not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            log.warning("role file %s names no role and epoch: starting in the configured role", self.path)
            return None
        return RoleRecord(cast(EngineMode, role), epoch)

    def write(self, record: RoleRecord) -> None:
        """Atomically; a failure is logged, not raised (a restart then resumes an older role, which the
        router joins again as reported, and the planner re-decides)."""
        body = {
            "instance": self.instance,
            "launch_id": self.launch_id,
            "role": record.role,
            "role_epoch": record.role_epoch,
        }
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as out:
                out.write(json.dumps(body) + "\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not record role %s (epoch %d) in %s: %r", record.role, record.role_epoch, self.path, exc)


def resumed(role_file: RoleFile | None, configured: EngineMode) -> RoleRecord:
    """The role and epoch a process starts in: the recorded role in the next epoch, or the configured
    role at epoch 0."""
    record = role_file.read() if role_file is not None else None
    if record is None:
        return RoleRecord(configured, 0)
    return RoleRecord(record.role, record.role_epoch + 1)
