"""The gloo group for host tensors: its interface follows the route to MASTER_ADDR (or another machine's
rank where that route is loopback), GLOO_SOCKET_IFNAME wins, and a group that cannot connect is an error
that names the interface and the fix."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from zorse_lightning.engine import host_group as host_group_module
from zorse_lightning.engine.host_group import (
    INTERFACE_VARIABLE,
    host_group,
    interface_with_address,
    local_interfaces,
    peer_to_route_toward,
    source_address_toward,
)
from zorse_lightning.errors import ZorseUserError
from testing.launch import spawn_ranks

INTERFACES = {"lo": ("127.0.0.1", "::1"), "eth0": ("10.0.0.5", "fd00::5"), "ib0": ("192.168.7.5",)}


def test_the_interface_is_the_one_holding_the_routes_source_address() -> None:
    assert interface_with_address("10.0.0.5", INTERFACES) == "eth0"
    assert interface_with_address("192.168.7.5", INTERFACES) == "ib0"
    assert interface_with_address("fd00::5", INTERFACES) == "eth0"
    assert interface_with_address("127.0.0.1", INTERFACES) == "lo"
    assert interface_with_address("10.9.9.9", INTERFACES) is None


def test_a_loopback_route_on_a_cluster_turns_toward_another_machine() -> None:
    """torchrun's c10d sets MASTER_ADDR to rank 0's host name, which resolves to 127.0.1.1 on rank 0's own
    host (Debian's /etc/hosts): that host routes toward another machine's rank instead."""
    gathered = [("a", "127.0.1.1"), ("a", "127.0.1.1"), ("b", "10.0.0.7"), ("b", "10.0.0.7")]
    assert peer_to_route_toward("a", "127.0.1.1", gathered) == "10.0.0.7"
    assert peer_to_route_toward("b", "10.0.0.7", gathered) is None  # its route to MASTER_ADDR leaves the host
    assert peer_to_route_toward("a", None, gathered) == "10.0.0.7"  # MASTER_ADDR does not resolve here
    alone = [("a", "127.0.0.1"), ("a", "127.0.0.1")]
    assert peer_to_route_toward("a", "127.0.0.1", alone) is None  # one machine: loopback is right


def test_this_hosts_route_to_itself_is_found() -> None:
    source = source_address_toward("127.0.0.1")
    assert source == "127.0.0.1" and interface_with_address(source, local_interfaces()) is not None
    assert source_address_toward("no-such-host.invalid") is None


def _gloo_world_of_one(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """A default group that host_group takes for NCCL's (so it makes its own gloo group)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    monkeypatch.setattr(host_group_module.dist, "get_backend", lambda group=None: "nccl")


@pytest.mark.multiprocess
def test_a_group_that_cannot_connect_names_the_interface_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from testing.launch import free_port

    _gloo_world_of_one(monkeypatch, free_port())
    try:
        monkeypatch.setenv(INTERFACE_VARIABLE, "nosuch0")
        with pytest.raises(ZorseUserError, match=r"did not connect within 0:00:05 on interface nosuch0 "
                                                 r"\(GLOO_SOCKET_IFNAME is set\).*Set GLOO_SOCKET_IFNAME"):
            host_group(timedelta(seconds=5))
        monkeypatch.delenv(INTERFACE_VARIABLE)
        group = host_group(timedelta(seconds=5))  # one host: loopback, gloo's own choice
        assert group is not None and dist.get_world_size(group) == 1
        assert INTERFACE_VARIABLE not in host_group_module.os.environ  # set only while the group is made
    finally:
        dist.destroy_process_group()


def _two_ranks_worker(rank: int, out_dir: Path) -> dict:
    import torch

    dist.init_process_group("gloo")
    try:
        host_group_module.dist.get_backend = lambda group=None: "nccl"  # this process only
        interface = host_group_module.choose_interface("127.0.0.1")
        group = host_group(timedelta(seconds=30), "127.0.0.1")
        total = torch.tensor([rank + 1])
        dist.all_reduce(total, group=group)
        return {"interface": interface.name, "reason": interface.reason, "total": int(total)}
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_ranks_on_one_host_connect_with_the_timeout_given(tmp_path: Path) -> None:
    results = spawn_ranks(_two_ranks_worker, 2, tmp_path)
    assert [r["total"] for r in results] == [3, 3]
    assert all(r["interface"] is None and "every rank is on this host" in r["reason"] for r in results)
