"""ConnectionGuard's caps (server_common/connections.py): per address, in all, and the reserve."""

from __future__ import annotations

import resource

import pytest

from deploy.config import ClusterConfig
from server_common.connections import FD_HEADROOM, FULL, TOO_MANY, ConnectionGuard


def test_the_last_connections_are_kept_for_trusted_addresses():
    guard = ConnectionGuard(1, 1, max_per_client=3, max_connections=10, reserved=4, trusted=["10.0.0.9"])
    strangers = [guard.claim(f"10.0.1.{i}") for i in range(8)]
    assert strangers == [None] * 6 + [FULL, FULL]  # 10 - 4 for strangers
    assert [guard.claim("10.0.0.9") for _ in range(4)] == [None, None, None, TOO_MANY]  # per address still
    assert [guard.claim("127.0.0.1"), guard.claim("::1")] == [None, FULL]  # loopback is trusted; now 10 open
    guard.release("10.0.1.0")
    assert guard.claim("10.0.1.7") == FULL and guard.claim("127.0.0.1") is None
    assert guard.refused == {"header_timeout": 0, "body_timeout": 0, "too_many": 1, "full": 4}
    assert guard.total == 10


def test_the_cap_stays_under_the_file_descriptor_limit():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    guard = ConnectionGuard(1, 1, max_per_client=3, max_connections=10 ** 9)
    assert guard.max_connections == resource.getrlimit(resource.RLIMIT_NOFILE)[0] - FD_HEADROOM >= soft - FD_HEADROOM


@pytest.mark.parametrize("section, fields", [
    ("router", {"max_connections": 100, "reserved_connections": 100}),
    ("security", {"server_max_connections": 64, "server_reserved_connections": 64})])
def test_a_reserve_as_large_as_the_cap_is_a_config_error(section, fields):
    base = {"model": "tiny", "prefill": [{"name": "p0"}], "decode": [{"name": "d0"}]}
    with pytest.raises(ValueError, match="reserved_connections must be below"):
        ClusterConfig.model_validate(base | {section: fields})
