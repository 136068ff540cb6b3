"""A cluster environment for machines with different numbers of GPUs.

Lightning's ``TorchElasticEnvironment`` and ``SLURMEnvironment`` check that
``devices x num_nodes`` equals the world size, and ``DDPStrategy.set_world_ranks``
computes ``node_rank * devices + local_rank``: both assume every machine runs
as many processes. torchrun and srun already know each process's global rank
and the world size, whatever each machine runs, so this environment takes the
ranks from the launcher as they are, and ignores Lightning's attempts to set
them from that arithmetic.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from typing_extensions import override

from zorse_lightning.errors import ZorseUserError

log = logging.getLogger(__name__)

SLURM_DEFAULT_PORT_BASE = 15000
"""As Lightning's SLURM environment: the port is this plus the job id's last four digits."""


class Launcher(str, Enum):
    TORCHRUN = "torchrun"
    SLURM = "slurm"


@dataclass(frozen=True)
class LaunchRanks:
    """Where this process stands, as its launcher said."""

    launcher: Launcher
    global_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    """Processes on this machine (may differ between machines)."""
    node_rank: int
    main_address: str
    main_port: int


def _torchrun_launched(environ: Mapping[str, str]) -> bool:
    return "TORCHELASTIC_RUN_ID" in environ and "RANK" in environ and "LOCAL_RANK" in environ


def _slurm_launched(environ: Mapping[str, str]) -> bool:
    interactive = environ.get("SLURM_JOB_NAME") in ("bash", "interactive")
    return "SLURM_NTASKS" in environ and "SLURM_PROCID" in environ and not interactive


def _int(environ: Mapping[str, str], name: str, launcher: Launcher) -> int:
    value = environ.get(name)
    if value is None or not value.strip().lstrip("-").isdigit():
        raise ZorseUserError(
            f"launched by {launcher.value} but the environment variable {name}={value!r} is not an integer; "
            f"start the processes with {launcher.value} itself (it sets {name}), or set it by hand"
        )
    return int(value)


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node ``node_id`` from ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``: three nodes of 2, then 1)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ZorseUserError(
                f"SLURM_TASKS_PER_NODE={tasks_per_node!r} is not in SLURM's format (e.g. '2(x3),1'); "
                f"launch with srun, which sets it"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise ZorseUserError(
            f"SLURM_NODEID={node_id} but SLURM_TASKS_PER_NODE={tasks_per_node!r} lists {len(counts)} nodes; "
            f"launch with srun, which sets both consistently"
        )
    return counts[node_id]


def read_launch_ranks(environ: Mapping[str, str]) -> LaunchRanks:
    """Ranks from torchrun's or SLURM's variables; torchrun first (it also runs inside SLURM jobs)."""
    if _torchrun_launched(environ):
        launcher = Launcher.TORCHRUN
        return LaunchRanks(
            launcher=launcher,
            global_rank=_int(environ, "RANK", launcher),
            world_size=_int(environ, "WORLD_SIZE", launcher),
            local_rank=_int(environ, "LOCAL_RANK", launcher),
            local_world_size=_int(environ, "LOCAL_WORLD_SIZE", launcher),
            node_rank=_int(environ, "GROUP_RANK", launcher),
            main_address=environ.get("MASTER_ADDR", "127.0.0.1"),
            main_port=_int(environ, "MASTER_PORT", launcher),
        )
    if _slurm_launched(environ):
        launcher = Launcher.SLURM
        node_rank = _int(environ, "SLURM_NODEID", launcher)
        job_id = environ.get("SLURM_ARRAY_JOB_ID") or environ.get("SLURM_JOB_ID", "0")
        default_port = SLURM_DEFAULT_PORT_BASE + int(job_id[-4:] if job_id[-4:].isdigit() else 0)
        nodes = environ.get("SLURM_NODELIST", "127.0.0.1")
        return LaunchRanks(
            launcher=launcher,
            global_rank=_int(environ, "SLURM_PROCID", launcher),
            world_size=_int(environ, "SLURM_NTASKS", launcher),
            local_rank=_int(environ, "SLURM_LOCALID", launcher),
            local_world_size=slurm_tasks_on_node(environ.get("SLURM_TASKS_PER_NODE", "1"), node_rank),
            node_rank=node_rank,
            main_address=environ.get("MASTER_ADDR") or SLURMEnvironment.resolve_root_node_address(nodes),
            main_port=int(environ.get("MASTER_PORT", default_port)),
        )
    raise ZorseUserError(
        "HeterogeneousEnvironment needs a launcher: no torchrun variables (TORCHELASTIC_RUN_ID, RANK, "
        "LOCAL_RANK) and no SLURM task variables (SLURM_NTASKS, SLURM_PROCID) are set; start with torchrun "
        "or srun, or on one machine let Lightning launch (Trainer(devices=N)) without this environment"
    )


class HeterogeneousEnvironment(ClusterEnvironment):
    """Ranks exactly as torchrun or SLURM assigned them; machines may run different numbers of processes."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._ranks = read_launch_ranks(os.environ if environ is None else environ)

    @property
    def ranks(self) -> LaunchRanks:
        return self._ranks

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return self._ranks.main_address

    @property
    @override
    def main_port(self) -> int:
        return self._ranks.main_port

    @staticmethod
    @override
    def detect() -> bool:
        return _torchrun_launched(os.environ) or _slurm_launched(os.environ)

    @override
    def world_size(self) -> int:
        return self._ranks.world_size

    @override
    def set_world_size(self, size: int) -> None:
        if size != self._ranks.world_size:
            log.debug("world size %d from devices x num_nodes ignored; the launcher's is %d", size, self.world_size())

    @override
    def global_rank(self) -> int:
        return self._ranks.global_rank

    @override
    def set_global_rank(self, rank: int) -> None:
        if rank != self._ranks.global_rank:
            log.debug("global rank %d from node_rank x devices ignored; the launcher's is %d", rank, self.global_rank())

    @override
    def local_rank(self) -> int:
        return self._ranks.local_rank

    def local_world_size(self) -> int:
        """Processes on this machine: what ``Trainer(devices=...)`` should be here."""
        return self._ranks.local_world_size

    @override
    def node_rank(self) -> int:
        return self._ranks.node_rank

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Only this machine's count can be checked: ``devices`` must cover the local ranks, or be one, the
        process's own device. One is what ``devices='auto'`` gives where each process sees only its GPU
        (``srun --gpus-per-task=1``, or ``CUDA_VISIBLE_DEVICES`` set per process), and the strategy's root
        device is then the one it sees (:func:`~zorse_lightning.strategy.accelerator.cuda_index_for`)."""
        if 1 < num_devices < self._ranks.local_world_size:
            raise ZorseUserError(
                f"Trainer(devices={num_devices}) but {self._ranks.launcher.value} started "
                f"{self._ranks.local_world_size} processes on this machine (node {self._ranks.node_rank}): a "
                f"process either sees every GPU of its machine or only its own; pass "
                f"devices={self._ranks.local_world_size} (or 'auto') where each sees all, devices=1 (or 'auto') "
                f"where each sees its own (srun --gpus-per-task=1)"
            )
