"""Human-readable views of an inventory (rich tables)."""

from __future__ import annotations

from collections import Counter
from itertools import combinations

from rich.console import Console
from rich.table import Table

from zorse_lightning.cluster.inventory import ClusterInventory

MAX_MACHINES_FOR_ALL_PAIRS = 12
"""Beyond this many machines the pairwise link table would drown the output; only overrides are listed."""


def _gpu_summary(types: list[str]) -> str:
    return ", ".join(f"{n}x {t}" for t, n in Counter(types).items())


def inventory_tables(inventory: ClusterInventory) -> list[Table]:
    title = f"cluster {inventory.name}" + (" (CPU ranks emulating GPU types)" if inventory.emulated else "")
    machines = Table(title=title)
    for column in ("machine", "datacenter", "ranks", "GPUs", "memory GiB", "peak TFLOPS", "inside Gb/s", "inside us"):
        machines.add_column(
            column, justify="left" if column in ("machine", "datacenter", "GPUs") else "right", no_wrap=True
        )
    rank = 0
    for machine in inventory.machines:
        gpus = machine.gpus
        machines.add_row(
            machine.name,
            machine.datacenter,
            f"{rank}-{rank + len(gpus) - 1}" if len(gpus) > 1 else str(rank),
            _gpu_summary([g.gpu_type.name for g in gpus]),
            f"{sum(g.memory_gib for g in gpus):g}",
            f"{sum(g.gpu_type.peak_tflops for g in gpus):g}",
            f"{machine.intra_bandwidth_gbps:g}",
            f"{inventory.latency_us(rank, rank + 1):g}" if len(gpus) > 1 else "",
        )
        rank += len(gpus)
    machines.add_section()
    machines.add_row(
        "total",
        f"{len({m.datacenter for m in inventory.machines})} dc",
        str(inventory.world_size),
        _gpu_summary([g.gpu_type.name for g in inventory.gpus]),
        f"{inventory.total_memory_gib:g}",
        f"{inventory.total_peak_tflops:g}",
        "",
        "",
    )
    tables = [machines]
    if 1 < len(inventory.machines) <= MAX_MACHINES_FOR_ALL_PAIRS:
        links = Table(title="links between machines")
        for column in ("machine", "machine", "kind", "Gb/s", "latency us"):
            links.add_column(column)
        first_rank = {}
        for index, gpu in enumerate(inventory.gpus):
            first_rank.setdefault(gpu.machine, index)
        for a, b in combinations(inventory.machines, 2):
            ra, rb = first_rank[a.name], first_rank[b.name]
            links.add_row(
                a.name,
                b.name,
                inventory.link_kind(ra, rb).value,
                f"{inventory.bandwidth_gbps(ra, rb):g}",
                f"{inventory.latency_us(ra, rb):g}",
            )
        tables.append(links)
    elif len(inventory.machines) > MAX_MACHINES_FOR_ALL_PAIRS:
        links = Table(title=f"links between machines: {inventory.inter_machine_bandwidth_gbps:g} Gb/s unless listed")
        for column in ("between", "and", "Gb/s"):
            links.add_column(column)
        for link in inventory.machine_links:
            links.add_row(link.machine_a, link.machine_b, f"{link.bandwidth_gbps:g}")
        for link in inventory.datacenter_links:
            links.add_row(f"datacenter {link.datacenter_a}", f"datacenter {link.datacenter_b}", f"{link.bandwidth_gbps:g}")
        tables.append(links)
    return tables


def print_inventory(inventory: ClusterInventory, console: Console | None = None) -> None:
    console = console or Console(width=120)
    for table in inventory_tables(inventory):
        console.print(table)
