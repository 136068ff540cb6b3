"""Several "machines" on one machine: network namespaces joined by shaped veth links.

Multi-machine behaviour (a slow link between machines or datacenters, ranks
launched per machine by torchrun) must be testable without a cluster
(DESIGN.md, "Testing without GPUs"). Each machine of a :class:`NetnsCluster` is
a network namespace with one interface, ``uplink``, whose other end is a port
of a bridge that lives in a namespace of its own (the "switch"): nothing is
added to the host's network namespace, and only the namespaces' own addresses
(``10.77.0.0/24`` by default) are ever used. Each machine's link is shaped in
both directions with ``tc ... tbf`` to ``link_gbps`` (its egress on
``uplink``, its ingress on the switch port). No delay is added: ``netem`` is
missing from this kernel (only tbf, htb and pfifo are), so latencies are the
veth's own, tens of microseconds, plus the shaper's queue under load. Traffic between two ranks of one machine stays
on that namespace's loopback, unshaped, as inside a real machine.

:meth:`NetnsCluster.inventory_mapping` describes the same machines for
``load_cluster`` (links, latencies, GPU types, ``emulated: true``), and
:class:`NetnsNetwork` creates the namespaces, launches torchrun on each machine
and removes every namespace, link and process it made, also on failure. Needs
root and ``ip``/``tc`` (Debian/Ubuntu package ``iproute2``).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations, groupby
from pathlib import Path
from types import TracebackType
from typing import Any

from zorse_lightning.errors import InventoryError, ZorseUserError
from zorse_lightning.units import gbps_to_bytes_per_s

__all__ = [
    "NetnsCluster", "NetnsError", "NetnsMachine", "NetnsNetwork", "netns_unavailable_reason", "uplink_sent_bytes",
]

UPLINK = "uplink"
"""Each machine's interface (GLOO_SOCKET_IFNAME: gloo binds to it, not to the shared hostname)."""
POLL_S = 0.5
TBF_QUEUE_MS = 100
"""Queue of the shaper: long enough that TCP fills the link, short enough not to add seconds of delay."""
TBF_MIN_BURST_BYTES = 15_000
TBF_BURST_S = 0.001
"""Bucket: one millisecond at the link's rate (at least ten 1500-byte frames), the usual ``rate / HZ``."""


class NetnsError(ZorseUserError):
    """Namespaces cannot be made here, or a command inside them failed (the message says which, and how to fix)."""


@dataclass(frozen=True)
class NetnsMachine:
    """One namespace: its ranks (one per GPU type listed) and its shaped link to the switch."""

    name: str
    gpu_types: tuple[str, ...]
    """One entry per process torchrun starts on this machine, in local rank order."""
    link_gbps: float
    """Rate of the machine's link, each direction (egress and ingress are both shaped)."""
    datacenter: str = "dc0"
    memory_gib: float | None = None
    """Per-rank memory budget in the inventory (None: the GPU type's own)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu_types", tuple(self.gpu_types))
        if not self.gpu_types:
            raise InventoryError(f"netns machine {self.name!r} lists no GPU types; give one per process it runs")
        if not self.link_gbps > 0:
            raise InventoryError(
                f"netns machine {self.name!r}: link_gbps={self.link_gbps!r} must be positive (0.1 is 100 Mbit/s)"
            )


@dataclass(frozen=True)
class NetnsCluster:
    """Machines joined by one switch; what the namespaces emulate and the inventory describes."""

    name: str
    machines: tuple[NetnsMachine, ...]
    intra_bandwidth_gbps: float = 10.0
    """What the inventory says of links inside a machine (gloo over loopback)."""
    link_latency_us: float = 50.0
    """What the inventory says of links between machines (veth and bridge, no delay added)."""
    subnet_prefix: str = "10.77.0"
    """First three octets of the private /24 the machines' uplinks get (machine i: ``.i+1``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "machines", tuple(self.machines))
        if not 1 <= len(self.machines) <= 250:
            raise InventoryError(f"netns cluster {self.name!r} has {len(self.machines)} machines; give 1 to 250")
        repeated = [n for n, c in Counter(m.name for m in self.machines).items() if c > 1]
        if repeated:
            raise InventoryError(f"netns cluster {self.name!r}: machine name {repeated[0]!r} repeats; rename one")

    @property
    def world_size(self) -> int:
        return sum(len(m.gpu_types) for m in self.machines)

    def address(self, machine: int) -> str:
        return f"{self.subnet_prefix}.{machine + 1}"

    def link_gbps(self, a: int, b: int) -> float:
        """Bandwidth from machine ``a`` to ``b``: ``a``'s egress, then the switch port's egress into ``b``."""
        return min(self.machines[a].link_gbps, self.machines[b].link_gbps)

    def inventory_mapping(self) -> dict[str, Any]:
        """The cluster for :func:`zorse_lightning.cluster.config.load_cluster`, links as shaped.

        Every pair of machines gets a ``machine_links`` entry. Datacenter links
        (which the inventory requires between every pair of datacenters) take
        the slowest shaped link between them.
        """
        machines = []
        for m in self.machines:
            # Runs of one type, in local rank order: the inventory's rank order is the launch order.
            groups = [{"type": t, "count": len(list(run))} for t, run in groupby(m.gpu_types)]
            if m.memory_gib is not None:
                groups = [{**g, "memory_gib": m.memory_gib} for g in groups]
            machines.append({
                "name": m.name, "datacenter": m.datacenter, "intra_bandwidth_gbps": self.intra_bandwidth_gbps,
                "gpus": groups,
            })
        pairs = list(combinations(range(len(self.machines)), 2))
        links = [self._link(a, b, ("machine_a", "machine_b"), (self.machines[a].name, self.machines[b].name))
                 for a, b in pairs]
        dc_links = []
        for dc_a, dc_b in combinations(sorted({m.datacenter for m in self.machines}), 2):
            across = [(a, b) for a, b in pairs
                      if {self.machines[a].datacenter, self.machines[b].datacenter} == {dc_a, dc_b}]
            a, b = min(across, key=lambda p: self.link_gbps(*p))
            dc_links.append(self._link(a, b, ("datacenter_a", "datacenter_b"), (dc_a, dc_b)))
        return {
            "name": self.name,
            "description": f"{len(self.machines)} network namespaces joined by shaped veth links",
            "emulated": True,
            "machines": machines,
            "inter_machine_bandwidth_gbps": min(
                (self.link_gbps(a, b) for a, b in pairs), default=self.intra_bandwidth_gbps
            ),
            "machine_links": links,
            "datacenter_links": dc_links,
        }

    def _link(self, a: int, b: int, keys: tuple[str, str], ends: tuple[str, str]) -> dict[str, Any]:
        return {
            keys[0]: ends[0], keys[1]: ends[1], "bandwidth_gbps": self.link_gbps(a, b),
            "latency_us": self.link_latency_us,
        }


def _run(argv: Sequence[str]) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def netns_unavailable_reason() -> str | None:
    """Why namespaces with shaped veth links cannot be made here, or None when they can.

    Tries what the harness does (a namespace, a veth pair, a tbf qdisc) in a
    throw-away namespace, so a container without the capability or the kernel
    modules is reported, not only a missing root.
    """
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root, as the development machine and CI do)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2 (apt-get install -y iproute2)"
    probe = f"zlprobe{secrets.token_hex(3)}"
    try:
        _run(["ip", "netns", "add", probe])
    except NetnsError as error:
        return f"cannot create a network namespace here: {error}"
    try:
        _run(["ip", "-n", probe, "link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1"])
        _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "probe0", "root", *_tbf(0.1)])
    except NetnsError as error:
        return f"cannot shape a veth link inside a namespace here: {error}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sent_bytes(statistics: str) -> int:
    match = re.search(r"Sent (\d+) bytes", statistics)
    if match is None:
        raise NetnsError(f"no byte counter in `tc -s qdisc show` output: {statistics!r}")
    return int(match.group(1))


def _tbf(link_gbps: float) -> list[str]:
    rate_bytes_per_s = gbps_to_bytes_per_s(link_gbps)
    burst_bytes = max(TBF_MIN_BURST_BYTES, int(rate_bytes_per_s * TBF_BURST_S))
    return ["tbf", "rate", f"{rate_bytes_per_s:.0f}bps", "burst", str(burst_bytes), "latency", f"{TBF_QUEUE_MS}ms"]


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM as an exception, so that ``with NetnsNetwork(...)`` removes what it made."""
    raise SystemExit(128 + signum)


class NetnsNetwork:
    """The namespaces of a :class:`NetnsCluster`, alive inside a ``with`` block.

    ``with NetnsNetwork(cluster) as net: net.torchrun(...)``. On leaving the
    block (normally or by an exception) every process started through it is
    killed with its process group, any process still inside one of its
    namespaces is killed, and the namespaces are deleted (which deletes their
    veth ends and the bridge). A SIGTERM (``kill``, a CI job's timeout) ends the
    block as an exception does, so it cleans up too; only SIGKILL leaves
    namespaces behind (``ip netns list``, names ``zl<tag>-...``). Names carry a
    random tag, so networks of concurrent tests do not collide; each has its own
    switch, so their equal addresses do not either.
    """

    def __init__(self, cluster: NetnsCluster) -> None:
        self.cluster = cluster
        self.tag = f"zl{secrets.token_hex(3)}"
        self._created: list[str] = []
        self._processes: list[subprocess.Popen] = []
        self._previous_sigterm: Any = None

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def namespace(self, machine: int) -> str:
        return f"{self.tag}-m{machine}"

    def __enter__(self) -> NetnsNetwork:
        reason = netns_unavailable_reason()
        if reason is not None:
            raise NetnsError(reason)
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _create(self) -> None:
        sw = self.switch
        self._add_namespace(sw)
        _run(["ip", "-n", sw, "link", "add", "name", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i, machine in enumerate(self.cluster.machines):
            ns, port = self.namespace(i), f"p{i}"
            self._add_namespace(ns)
            _run(["ip", "-n", sw, "link", "add", "name", port, "type", "veth", "peer", "name", UPLINK, "netns", ns])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.cluster.address(i)}/24", "dev", UPLINK])
            _run(["ip", "-n", ns, "link", "set", UPLINK, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", UPLINK, "root", *_tbf(machine.link_gbps)])
            _run(["ip", "netns", "exec", sw, "tc", "qdisc", "add", "dev", port, "root", *_tbf(machine.link_gbps)])

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)

    def traffic_bytes(self, machine: int) -> tuple[int, int]:
        """(bytes sent, bytes received) by a machine over its link so far, from the shapers' counters."""
        sent = _run(["ip", "netns", "exec", self.namespace(machine), "tc", "-s", "qdisc", "show", "dev", UPLINK])
        received = _run(["ip", "netns", "exec", self.switch, "tc", "-s", "qdisc", "show", "dev", f"p{machine}"])
        return _sent_bytes(sent), _sent_bytes(received)

    def popen(
        self, machine: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """Start ``argv`` inside machine ``machine`` (its own process group, killed on close)."""
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(machine), *argv],
            env={**os.environ, "GLOO_SOCKET_IFNAME": UPLINK, **(env or {})}, start_new_session=True, **kwargs,
        )
        self._processes.append(process)
        return process

    def torchrun(
        self,
        script_and_args: Sequence[str],
        log_dir: Path,
        port: int = 29500,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 300.0,
    ) -> list[str]:
        """Run ``torchrun ... script args`` on every machine at once; returns each machine's output.

        Machine ``i`` runs ``--node-rank=i`` with one process per GPU type it
        lists, so global ranks follow the inventory's order; the master is on
        machine 0's address. Raises :class:`NetnsError` with the outputs when a
        machine fails (the others are then stopped) or the run passes ``timeout_s``.
        """
        machines = self.cluster.machines
        logs = [Path(log_dir) / f"{self.tag}-machine{i}.log" for i in range(len(machines))]
        processes = []
        for i, machine in enumerate(machines):
            argv = [
                sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(machines)}",
                f"--nproc-per-node={len(machine.gpu_types)}", f"--node-rank={i}",
                f"--master-addr={self.cluster.address(0)}", f"--master-port={port}", *script_and_args,
            ]
            with logs[i].open("w") as log:
                processes.append(self.popen(i, argv, env={"OMP_NUM_THREADS": "1", **(env or {})},
                                            stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        # A machine that fails leaves the others blocked in a collective: stop them all at once.
        while time.monotonic() < deadline and not all(p.poll() == 0 for p in processes):
            if any(p.poll() not in (None, 0) for p in processes):
                break
            time.sleep(POLL_S)
        self._kill(processes)
        outputs = [log.read_text() for log in logs]
        codes = [p.returncode for p in processes]
        if any(code != 0 for code in codes):
            shown = "\n".join(
                f"--- machine {i} (exit {c}):\n{o[-3000:]}" for i, (c, o) in enumerate(zip(codes, outputs))
            )
            raise NetnsError(f"torchrun failed or passed {timeout_s:.0f} s on some machine:\n{shown}")
        return outputs

    def _kill(self, processes: Sequence[subprocess.Popen]) -> None:
        for process in processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()

    def close(self) -> None:
        """Kill what runs inside, delete the namespaces (idempotent). Raises if one cannot be deleted."""
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        self._kill(self._processes)
        self._processes = []
        failures = []
        for name in reversed(self._created):
            listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in listed:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            done = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
            if done.returncode != 0:
                failures.append(f"{name}: {done.stderr.strip()}")
        self._created = []
        if failures:
            raise NetnsError(f"could not delete network namespaces {failures}; delete them with `ip netns del NAME`")


def uplink_sent_bytes() -> int:
    """Bytes this machine has sent over its link so far; called from a process inside a machine."""
    return _sent_bytes(_run(["tc", "-s", "qdisc", "show", "dev", UPLINK]))
