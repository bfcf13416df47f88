"""Which interface UCX is kept to for a configured host (transfer/netdev.py)."""

from __future__ import annotations

import os

import pytest

from transfer.netdev import confine_ucx_to, interface_of

LOOPBACK = "lo"  # Linux's loopback device


def test_loopback_addresses_and_localhost_map_to_the_loopback_device():
    assert {interface_of(h) for h in ("127.0.0.1", "127.0.0.2", "localhost", "::1")} == {LOOPBACK}


def test_a_wildcard_host_leaves_ucx_every_device():
    assert interface_of("0.0.0.0") is None
    assert interface_of("::") is None


def test_an_address_no_interface_holds_is_a_clear_error():
    with pytest.raises(
        ValueError,
        match=r"host '192\.0\.2\.254' \(192\.0\.2\.254\) is not an address of any "
        r"network interface of this machine",
    ):
        interface_of("192.0.2.254")


def test_the_servers_set_ucx_net_devices_unless_the_environment_already_does(monkeypatch):
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    confine_ucx_to("127.0.0.1")
    assert os.environ["UCX_NET_DEVICES"] == LOOPBACK
    monkeypatch.setenv("UCX_NET_DEVICES", "eth9")
    confine_ucx_to("127.0.0.1")
    assert os.environ["UCX_NET_DEVICES"] == "eth9"
    monkeypatch.delenv("UCX_NET_DEVICES")
    confine_ucx_to("0.0.0.0")
    assert "UCX_NET_DEVICES" not in os.environ
