"""The gloo group for the host tensors of a step: point-to-point headers, the log merge's flag, the eager
module's broadcast.

Why a module of its own: NCCL carries only device tensors, so a run on GPUs makes a second group over gloo,
and gloo picks its network interface by itself. Unless ``GLOO_SOCKET_IFNAME`` names one, gloo binds to the
address this host's name resolves to, which on many Linux hosts (Debian's and Ubuntu's ``/etc/hosts``) is
127.0.1.1: ranks on other machines cannot reach it, and the group's creation waits out its timeout while
NCCL, which finds its interface itself, works. So here the interface is the one the kernel routes
``MASTER_ADDR`` through (an address every rank reaches already). torchrun's c10d rendezvous sets
``MASTER_ADDR`` to rank 0's host name, which on rank 0's own machine may resolve to that same loopback
address: a machine whose route is loopback while ranks run elsewhere takes the route toward another
machine's address instead. The group is made with the strategy's timeout (gloo's own default is 30 minutes)
and proved by a barrier at setup, whose failure names the interface and the fix.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zorse_lightning.engine.groups import DEFAULT_TIMEOUT
from zorse_lightning.errors import ZorseUserError

INTERFACE_VARIABLE = "GLOO_SOCKET_IFNAME"
"""gloo reads it when a group is made (torch's ProcessGroupGloo constructor); torch offers no other way to
give ``new_group`` a gloo device."""
_SIOCGIFADDR = 0x8915
"""Linux's ioctl for an interface's IPv4 address."""
_ROUTE_PROBE_PORT = 9
"""Any port: connecting a UDP socket only asks the kernel for a route, nothing is sent."""


@dataclass(frozen=True)
class GlooInterface:
    """The interface a rank's gloo group uses, and why."""

    name: str | None
    """None: gloo's own choice (every rank on this host: loopback serves)."""
    reason: str


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def interface_with_address(address: str, interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The interface that holds ``address`` (the source address of a route), None where none does."""
    for name, addresses in interfaces.items():
        if address.split("%")[0] in addresses:
            return name
    return None


def peer_to_route_toward(own_host: str, own_source: str | None, gathered: Sequence[tuple[str, str | None]]) -> str | None:
    """Where this rank's gloo traffic should be routed, given every rank's (host, source address of its route
    to MASTER_ADDR): MASTER_ADDR itself where its route leaves the host (None returned: keep it); else, where
    ranks run on other hosts, the source address of one of theirs (an address of another machine that faces
    this one). None also where every rank is on this host (loopback is right)."""
    if own_source is not None and not is_loopback(own_source):
        return None
    for host, source in gathered:
        if host != own_host and source is not None and not is_loopback(source):
            return source
    return None


def source_address_toward(host: str) -> str | None:
    """The local address the kernel routes ``host`` from (None: ``host`` does not resolve or has no route)."""
    try:
        family, kind, proto, _, target = socket.getaddrinfo(host, _ROUTE_PROBE_PORT, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(target)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def local_interfaces() -> dict[str, tuple[str, ...]]:
    """Each interface of this host with its addresses (IPv4 by ioctl, IPv6 from /proc/net/if_inet6)."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on this interface
                continue
            found.setdefault(name, []).append(socket.inet_ntoa(packed[20:24]))
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                found.setdefault(fields[-1], []).append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    except OSError:  # no IPv6 on this host
        pass
    return {name: tuple(addresses) for name, addresses in found.items()}


def choose_interface(main_address: str) -> GlooInterface:
    """Collective over the default group: this rank's interface for gloo (see the module's docstring)."""
    own_host, source = socket.gethostname(), source_address_toward(main_address)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (own_host, source))  # every rank, whether or not its variable is set
    if os.environ.get(INTERFACE_VARIABLE):
        return GlooInterface(os.environ[INTERFACE_VARIABLE], f"{INTERFACE_VARIABLE} is set")
    peer = peer_to_route_toward(own_host, source, gathered)
    why = f"the route to MASTER_ADDR={main_address}"
    if peer is not None:
        source, why = source_address_toward(peer), f"the route to {peer}, another machine's rank (MASTER_ADDR={main_address} is this host)"
    if source is None:
        raise ZorseUserError(
            f"no route from this host to MASTER_ADDR={main_address!r} nor to another machine's rank, so the gloo "
            f"group for host tensors has no interface to use; set {INTERFACE_VARIABLE} to the interface the "
            f"machines reach each other on (see `ip addr`), or MASTER_ADDR to an address they all reach"
        )
    if is_loopback(source) and all(host == own_host for host, _ in gathered):
        return GlooInterface(None, f"every rank is on this host ({why} is loopback)")
    name = interface_with_address(source, local_interfaces())
    if name is None:
        raise ZorseUserError(
            f"{why} leaves from {source}, which no interface of this host holds; set {INTERFACE_VARIABLE} "
            f"to the interface the machines reach each other on (see `ip addr`)"
        )
    return GlooInterface(name, why)


@contextmanager
def _interface_set(interface: GlooInterface) -> Iterator[None]:
    """``GLOO_SOCKET_IFNAME`` as chosen while a group is made, as it was afterwards."""
    before = os.environ.get(INTERFACE_VARIABLE)
    if interface.name is not None:
        os.environ[INTERFACE_VARIABLE] = interface.name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(INTERFACE_VARIABLE, None)
        else:
            os.environ[INTERFACE_VARIABLE] = before


def host_group(timeout: timedelta = DEFAULT_TIMEOUT, main_address: str | None = None) -> Any:
    """A group for host tensors over all ranks: the default one where it is gloo, else a new gloo group on
    :func:`choose_interface`'s interface, with ``timeout``, proved by a barrier. Collective: every rank calls
    it. ``main_address``: MASTER_ADDR (None: the environment's, as the launcher set it)."""
    if dist.get_backend() == "gloo":
        return None
    address = main_address or os.environ.get("MASTER_ADDR", "127.0.0.1")
    interface = choose_interface(address)
    try:
        with _interface_set(interface):
            group = dist.new_group(backend="gloo", timeout=timeout)
        dist.barrier(group=group)
    except RuntimeError as error:  # torch's DistError and gloo's enforce failures are RuntimeErrors
        raise ZorseUserError(
            f"the gloo group for host tensors did not connect within {timeout} on interface "
            f"{interface.name or 'chosen by gloo (the host name resolves to it)'} ({interface.reason}): {error}. "
            f"Set {INTERFACE_VARIABLE} on every machine to the interface the machines reach each other on "
            f"(see `ip addr`), and check that no firewall blocks TCP between them"
        ) from error
    return group


BROADCAST_BUCKET_BYTES = 256 * 1024 * 1024
"""Bytes per collective when the eager module is broadcast (DDP's figure for its start-up broadcast)."""


@torch.no_grad()
def broadcast_module(module: nn.Module, group: Any = None, src: int = 0) -> None:
    """Give every rank ``src``'s weights (random init differs per process; pretrained weights too).

    The module is still on the host (only the stage reaches the device, after the
    cut), so this goes over a group for host tensors (:func:`host_group`), in a few
    large collectives (tensors packed as DDP packs its own broadcast), not one per
    tensor. A world of one rank has nobody to tell.
    """
    if dist.get_world_size(group) == 1:
        return
    tensors = [t.data for t in (*module.parameters(), *module.buffers())]
    dist._broadcast_coalesced(group or dist.group.WORLD, tensors, BROADCAST_BUCKET_BYTES, src)
