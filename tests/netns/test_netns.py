"""The network-namespace harness: shaped links between "machines", torchrun across them, clean-up.

Needs root and iproute2 (as the development machine and CI have); only those
tests skip, with the reason, where either is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.errors import InventoryError
from testing.netns import NetnsCluster, NetnsError, NetnsMachine, NetnsNetwork, netns_unavailable_reason
from zorse_lightning.units import gbps_to_bytes_per_s

pytestmark = [pytest.mark.multiprocess, pytest.mark.root]

UNAVAILABLE = netns_unavailable_reason()
needs_netns = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"network namespaces unavailable: {UNAVAILABLE}")

TWO_DATACENTERS = NetnsCluster(
    "netns_test",
    (
        NetnsMachine("east", ("a100x40",), link_gbps=0.1, datacenter="east", memory_gib=0.4),
        NetnsMachine("west", ("v100x16", "v100x16"), link_gbps=0.025, datacenter="west"),
    ),
)


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_inventory_describes_the_shaped_links_and_launch_order() -> None:
    inventory = load_cluster(TWO_DATACENTERS.inventory_mapping())
    assert inventory.emulated and inventory.world_size == 3
    assert [(g.machine, g.gpu_type.name) for g in inventory.gpus] == [
        ("east", "a100x40"), ("west", "v100x16"), ("west", "v100x16")
    ]
    assert [g.memory_gib for g in inventory.gpus] == [0.4, 16.0, 16.0]
    # east -> west passes east's 100 Mbit/s egress, then the switch's 25 Mbit/s port into west.
    assert inventory.bandwidth_gbps(0, 1) == inventory.bandwidth_gbps(2, 0) == 0.025
    assert inventory.bandwidth_gbps(1, 2) == TWO_DATACENTERS.intra_bandwidth_gbps
    assert inventory.latency_us(0, 2) == TWO_DATACENTERS.link_latency_us
    interleaved = NetnsCluster("x", (NetnsMachine("m", ("t4", "l4", "t4"), link_gbps=1.0),))
    assert [g.gpu_type.name for g in load_cluster(interleaved.inventory_mapping()).gpus] == ["t4", "l4", "t4"]


def test_bad_machines_are_refused_with_the_fix() -> None:
    with pytest.raises(InventoryError, match="link_gbps=0 must be positive"):
        NetnsMachine("m", ("t4",), link_gbps=0)
    with pytest.raises(InventoryError, match="no GPU types"):
        NetnsMachine("m", (), link_gbps=1.0)
    with pytest.raises(InventoryError, match="'m' repeats"):
        NetnsCluster("x", (NetnsMachine("m", ("t4",), 1.0), NetnsMachine("m", ("t4",), 1.0)))


_STREAM = textwrap.dedent(
    """
    import socket, sys, time
    role, host, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "server":
        server = socket.create_server((host, 5001))
        print("listening", flush=True)
        conn, _ = server.accept()
        received, first = 0, None
        while received < size:
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            first = first or time.perf_counter()
            received += len(chunk)
        print(received, received / (time.perf_counter() - first), flush=True)
    else:
        with socket.create_connection((host, 5001)) as conn:
            conn.sendall(b"x" * size)
    """
)


def _stream_bytes_per_s(net: NetnsNetwork, sender: int, receiver: int, size_bytes: int, script: Path) -> float:
    address = net.cluster.address(receiver)
    server = net.popen(receiver, [sys.executable, str(script), "server", address, str(size_bytes)],
                       stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "listening"
    client = net.popen(sender, [sys.executable, str(script), "client", address, str(size_bytes)])
    received, rate = server.communicate(timeout=60)[0].split()
    assert client.wait(timeout=60) == 0 and int(received) == size_bytes
    return float(rate)


@needs_netns
def test_tbf_shapes_each_direction_to_the_slower_end(tmp_path: Path) -> None:
    """100 Mbit/s moves 12.5 MB/s at most (11.9 measured here); into the 25 Mbit/s machine, a quarter."""
    script = tmp_path / "stream.py"
    script.write_text(_STREAM)
    cluster = NetnsCluster("rates", (NetnsMachine("a", ("t4",), 0.1), NetnsMachine("b", ("t4",), 0.1),
                                     NetnsMachine("c", ("t4",), 0.025)))
    with NetnsNetwork(cluster) as net:
        fast = _stream_bytes_per_s(net, 0, 1, 6_000_000, script)
        slow = _stream_bytes_per_s(net, 0, 2, 1_500_000, script)
        back = _stream_bytes_per_s(net, 2, 0, 1_500_000, script)
        sent_a, received_a = net.traffic_bytes(0)
    # Upper bounds are hard (the bucket never lets more through); the lower ones allow TCP's ramp-up and
    # acknowledgements, yet fail for a shaper off by a unit (bits for bytes: 8x) or not applied at all.
    assert 0.8 * gbps_to_bytes_per_s(0.1) < fast <= 1.01 * gbps_to_bytes_per_s(0.1)
    for rate in (slow, back):
        assert 0.8 * gbps_to_bytes_per_s(0.025) < rate <= 1.01 * gbps_to_bytes_per_s(0.025)
    # Machine a's counters saw both streams it sent (plus headers) and the one it received.
    assert sent_a >= 7_500_000 and received_a >= 1_500_000


_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from zorse_lightning.strategy.environment import HeterogeneousEnvironment

    env = HeterogeneousEnvironment()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.main_address, str(env.main_port)
    dist.init_process_group("gloo", rank=env.global_rank(), world_size=env.world_size())
    values = torch.arange(250_000, dtype=torch.float64) * (env.global_rank() + 1)
    dist.all_reduce(values)
    expected = torch.arange(250_000, dtype=torch.float64) * sum(r + 1 for r in range(env.world_size()))
    seen = dict(rank=env.global_rank(), world=env.world_size(), local=env.local_rank(),
                local_world=env.local_world_size(), node=env.node_rank(), master=env.main_address,
                exact=bool(torch.equal(values, expected)))
    dist.destroy_process_group()
    with open(os.path.join(sys.argv[1], f"rank{env.global_rank()}.json"), "w") as f:
        json.dump(seen, f)
    """
)


@needs_netns
def test_torchrun_across_namespaces_all_reduces_over_the_shaped_link(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    with NetnsNetwork(TWO_DATACENTERS) as net:
        names = {net.switch, net.namespace(0), net.namespace(1)}
        assert names <= _namespaces()
        net.torchrun([str(script), str(tmp_path)], log_dir=tmp_path, timeout_s=240)
        sent, received = net.traffic_bytes(0)
    assert not names & _namespaces()
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    expected = [(0, 0, 1, 0), (1, 0, 2, 1), (2, 1, 2, 1)]  # (global rank, local rank, processes here, node)
    assert [(s["rank"], s["local"], s["local_world"], s["node"]) for s in seen] == expected
    assert all(s["world"] == 3 and s["exact"] and s["master"] == "10.77.0.1" for s in seen)
    # Rank 0's 2 MB tensor left its machine, and the result came back, through the shaped link only.
    tensor_bytes = 250_000 * 8
    assert sent >= tensor_bytes * 2 / 3 and received >= tensor_bytes * 2 / 3


@needs_netns
def test_namespaces_are_removed_when_the_job_fails(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("import sys, time\nif sys.argv[1] == 'x':\n    raise SystemExit(3)\ntime.sleep(600)\n")
    with pytest.raises(NetnsError, match="exit 1") as failure:
        with NetnsNetwork(TWO_DATACENTERS) as net:
            names = {net.switch, net.namespace(0), net.namespace(1)}
            hanging = net.popen(1, [sys.executable, str(script), "wait"])
            net.torchrun([str(script), "x"], log_dir=tmp_path, timeout_s=120)
    assert "SystemExit" in str(failure.value) or "exitcode" in str(failure.value)
    assert hanging.poll() is not None  # killed on the way out, though it would have slept for 10 minutes
    assert not names & _namespaces()


@needs_netns
def test_namespaces_are_removed_when_the_owner_is_terminated(tmp_path: Path) -> None:
    """``kill`` (SIGTERM) of the process inside ``with NetnsNetwork(...)`` still deletes its namespaces."""
    owner = textwrap.dedent("""
        import sys, time
        from testing.netns import NetnsCluster, NetnsMachine, NetnsNetwork
        cluster = NetnsCluster("term", (NetnsMachine("a", ("t4",), link_gbps=0.1), NetnsMachine("b", ("t4",), link_gbps=0.1)))
        with NetnsNetwork(cluster) as net:
            print(net.switch, net.namespace(0), net.namespace(1), flush=True)
            time.sleep(600)
    """)
    repository = str(Path(__file__).resolve().parents[2])  # testing/ is not installed: the child imports it from here
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repository, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-c", owner], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    names = set(process.stdout.readline().split())
    assert len(names) == 3 and names <= _namespaces()
    process.terminate()
    assert process.wait(timeout=60) == 128 + 15
    assert not names & _namespaces()
