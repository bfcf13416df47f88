"""deploy/role_file.py: a server's role record, written atomically and read back by its restart; a
missing, garbled, foreign or earlier launch's file means the configured role at epoch 0. A role
server records each switch and a new process given its file starts in the role recorded, in the
epoch after. And deploy.launcher's part: every server it starts names its file in the run folder."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path

import pytest
import yaml

from deploy.config import parse_config
from deploy.launcher import Cluster
from deploy.role_file import RoleFile, RoleRecord, resumed
from deploy.role_server import RoleServer, make_role
from server_common.connections import server_guard
from server_common.engine_thread import build_engine
from tests.deploy.test_role_server import Lifespan, client, settings
from tests.support.cluster import CONFIGS
from wire.names import ROLE_EPOCH_HEADER


def role_file(tmp_path: Path, launch_id: str | None = "l1") -> RoleFile:
    return RoleFile(tmp_path / "roles" / "p1.json", "p1", launch_id)


def test_a_written_record_is_read_back_and_a_restart_resumes_it_in_the_next_epoch(tmp_path):
    f = role_file(tmp_path)
    f.write(RoleRecord("decode", 2))  # its folder is made
    assert f.read() == RoleRecord("decode", 2)
    assert resumed(f, "prefill") == RoleRecord("decode", 3)
    f.write(RoleRecord("prefill", 3))
    assert f.read() == RoleRecord("prefill", 3)
    assert json.loads(f.path.read_text()) == {"instance": "p1", "launch_id": "l1", "role": "prefill", "role_epoch": 3}


def test_the_write_replaces_the_file_whole(tmp_path, monkeypatch):
    f = role_file(tmp_path)
    f.write(RoleRecord("decode", 1))
    replaced: list[tuple[str, str]] = []
    real_replace = os.replace

    def replace(src, dst):
        replaced.append((Path(src).name, Path(dst).name))
        assert json.loads(Path(src).read_text())["role_epoch"] == 2  # complete before it takes the name
        assert f.read() == RoleRecord("decode", 1)  # the old record, whole, until then
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    f.write(RoleRecord("prefill", 2))
    assert replaced == [(".p1.json.tmp", "p1.json")]
    assert f.read() == RoleRecord("prefill", 2)
    assert sorted(p.name for p in f.path.parent.iterdir()) == ["p1.json"]  # no temporary file left


@pytest.mark.parametrize(
    "content",
    [
        "",
        "{not json",
        '{"instance": "p1", "launch_id": "l1", "role": "decode"',  # cut short
        "[1, 2]",
        '{"instance": "p1", "launch_id": "l1", "role": "router", "role_epoch": 1}',
        '{"instance": "p1", "launch_id": "l1", "role": "decode", "role_epoch": -1}',
        '{"instance": "p1", "launch_id": "l1", "role": "decode", "role_epoch": "2"}',
        '{"instance": "p1", "launch_id": "l1", "role": "decode", "role_epoch": true}',
        '{"instance": "p2", "launch_id": "l1", "role": "decode", "role_epoch": 1}',  # another instance's
        '{"instance": "p1", "launch_id": "l0", "role": "decode", "role_epoch": 1}',  # an earlier launch's
    ],
)
def test_a_garbled_or_foreign_record_means_the_configured_role(tmp_path, content):
    f = role_file(tmp_path)
    f.path.parent.mkdir()
    f.path.write_text(content)
    assert f.read() is None
    assert resumed(f, "prefill") == RoleRecord("prefill", 0)


def test_no_file_or_no_role_file_means_the_configured_role(tmp_path):
    assert role_file(tmp_path).read() is None
    assert resumed(role_file(tmp_path), "colocated") == RoleRecord("colocated", 0)
    assert resumed(None, "decode") == RoleRecord("decode", 0)


def test_a_record_that_cannot_be_written_is_not_an_error(tmp_path):
    (tmp_path / "roles").write_text("a file where the folder should be")
    f = role_file(tmp_path)
    f.write(RoleRecord("decode", 1))  # logged, not raised: a restart resumes the configured role
    assert f.read() is None


def test_the_launcher_names_each_servers_role_file_in_its_run_folder(tmp_path):
    path = CONFIGS / "2p2d.yaml"
    c = Cluster(path, parse_config(yaml.safe_load(path.read_text()), path.name), tmp_path)
    assert c.server_args("decode", "d1") == ["decode", "--name", "d1", "--role-file", str(tmp_path / "roles/d1.json")]
    assert c.last_role("d1") is None
    RoleFile(c.role_file("d1"), "d1", c.launch_id).write(RoleRecord("prefill", 1))
    assert c.last_role("d1") == "prefill"
    RoleFile(c.role_file("d0"), "d0", "another launch").write(RoleRecord("prefill", 1))
    assert c.last_role("d0") is None


def test_a_role_server_records_each_switch_and_its_restart_starts_in_the_role_recorded(tmp_path, tiny_model):
    """Over the mock engine, in one process: the record follows the switches; a new process given the
    same file (what the supervisor starts) is a decode server in the epoch after, engine included."""
    s = settings(tiny_model, "prefill")
    f = RoleFile(tmp_path / "roles" / "s0.json", "s0", None)

    def start() -> RoleServer:
        first = resumed(f, s.role)
        engine = build_engine(dataclasses.replace(s.engine, mode=first.role))
        return RoleServer(s, engine, make_role(s, engine, None, server_guard(s)), first, f)

    async def switch_then_restart() -> tuple[dict, dict]:
        server = start()
        assert f.read() == RoleRecord("prefill", 0)
        async with Lifespan(server), client(server) as http:
            resp = await http.post("/admin/role", json={"role": "decode"})
            assert (resp.status_code, f.read()) == (200, RoleRecord("decode", 1))
            resp = await http.post("/admin/role", json={"role": "decode"})  # no change: nothing recorded
            assert (resp.json()["changed"], f.read()) == (False, RoleRecord("decode", 1))
        restarted = start()  # the first one's life ended (as a SIGKILL ends it): the file stays
        assert (restarted.role, restarted.epoch, restarted.engine.config.mode) == ("decode", 2, "decode")
        assert f.read() == RoleRecord("decode", 2)
        async with Lifespan(restarted), client(restarted) as http:
            health = (await http.get("/health")).json()
            stale = await http.post("/generate", json={}, headers={ROLE_EPOCH_HEADER: "1"})
            return health, stale.json()

    health, stale = asyncio.run(switch_then_restart())
    assert (health["role"], health["role_epoch"]) == ("decode", 2)
    assert stale["code"] == "stale_epoch"  # a call for its earlier life is refused
