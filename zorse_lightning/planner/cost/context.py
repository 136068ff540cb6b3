"""What pricing a plan needs besides the plan itself (:class:`CostContext`), and what one stage
costs (:class:`StageCost`): the two records every part of the cost model passes on, kept apart from
the parts so that each part reads them without importing the whole model."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from zorse_lightning.capabilities import P2PRules
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.planner.cost.comm import LinkTable
from zorse_lightning.planner.cost.compute import MicrobatchTimes, stage_microbatch_times, with_offload_copies
from zorse_lightning.planner.cost.framework_memory import NcclBuffers, nccl_communicators, reserve_gib
from zorse_lightning.planner.cost.memory import (
    RankMemory, offloaded_bytes_per_microbatch,
)
from zorse_lightning.planner.cost.tensor_parallel import split_device_times, split_factor
from zorse_lightning.profiling.profile import ModelProfile
from zorse_lightning.units import gbps_to_bytes_per_s, gib_to_bytes


def _nccl_communicator_bytes(inventory: ClusterInventory, memory_reserve_gib: float | None) -> tuple[float, ...]:
    """Each rank's device memory per NCCL communicator: what its GPU type measured at setup, else NCCL's buffers
    as this process's environment sets them (start-up plans on rank 0, in the job's); none where the ranks are
    emulated (gloo) or the user gave the whole reserve (``memory_reserve_gib``)."""
    if inventory.emulated or memory_reserve_gib is not None:
        return ()
    priced = NcclBuffers.from_environment(os.environ).communicator_bytes
    return tuple(float(g.gpu_type.nccl_communicator_bytes or priced) for g in inventory.gpus)


@dataclass(frozen=True)
class CostContext:
    """What pricing a plan needs besides the plan itself."""

    inventory: ClusterInventory
    profile: ModelProfile
    links: LinkTable
    reserves_bytes: tuple[float, ...]
    """Framework reserve per rank (see :func:`reserve_gib`)."""
    capacities_bytes: tuple[float, ...]
    p2p_rules: P2PRules
    """The rules the run's messages between stages keep, which the simulation plays (:mod:`.simulate`)."""
    nccl_communicator_bytes: tuple[float, ...] = ()
    """Device memory per NCCL communicator, by rank (empty: none priced: emulated ranks, whose groups are gloo's,
    or a reserve the user gave whole)."""
    _microbatch_times: dict = field(default_factory=dict, compare=False, repr=False)
    """Memo of :meth:`microbatch_times`: the search prices the same stages in many plans."""
    _memo: dict = field(default_factory=dict, compare=False, repr=False)
    """Memo of :meth:`memo`: what the search asks for again and again of the same stage."""
    _split_devices: dict = field(default_factory=dict, compare=False, repr=False)
    """Memo of each type's times split over TP groups of each degree (:func:`split_device_times`)."""
    _fastest_layer_ms: dict = field(default_factory=dict, compare=False, repr=False)
    """Memo of :meth:`fastest_layer_ms`: the search's lower bound asks for it per candidate."""
    _timelines: dict = field(default_factory=dict, compare=False, repr=False)
    """Memo of :func:`.simulate.simulate`: the interleaving choice simulates the search's best plan,
    and the search then predicts the plan it returns by the same simulation (seconds at 1024 GPUs)."""
    _programs: dict = field(default_factory=dict, compare=False, repr=False)
    """Memo of :func:`.recorded_programs.schedule_programs`: an interleaved plan's programs, recorded once for its
    memory and its simulation (a play of the 1F1B schedule takes seconds at 1024 GPUs)."""

    def microbatch_times(
        self, gpu_type: str, layers: tuple[int, int], microbatch_size: int, first: bool, last: bool, recompute: bool,
        offload: bool = False, tensor_parallel: int = 1,
    ) -> MicrobatchTimes:
        """:func:`stage_microbatch_times` of this context's profile, computed once per arguments; ``offload``:
        with the activation copies over the type's host link (:func:`with_offload_copies`); ``tensor_parallel``:
        the compute of one rank of a TP group of that many, its collectives apart (:mod:`.tensor_parallel`)."""
        key = (gpu_type, layers, microbatch_size, first, last, recompute, offload, tensor_parallel)
        if key not in self._microbatch_times:
            device = self._device(gpu_type, tensor_parallel)
            times = stage_microbatch_times(
                device, layers, microbatch_size, first=first, last=last, recompute=recompute,
                action_ms=self.action_overhead_ms(gpu_type), overlaps=device.host_overlaps_device,
            )
            if offload:
                times = with_offload_copies(times, self.offload_copy_ms(gpu_type, layers, microbatch_size, recompute))
            self._microbatch_times[key] = times
        return self._microbatch_times[key]

    def memo(self, key: tuple, make):
        """``make()``, computed once per ``key`` (its first item names what is memoized) for this context: the
        search prices the same stages (their parameters, embedding and head) in thousands of plans."""
        try:
            return self._memo[key]  # one lookup where it is made already: its key is hashed once
        except KeyError:
            value = self._memo[key] = make()
            return value

    def _device(self, gpu_type: str, tensor_parallel: int):
        """``gpu_type``'s times, split over TP groups of ``tensor_parallel`` GPUs (:func:`split_device_times`)."""
        device = self.profile.times(gpu_type)
        if tensor_parallel == 1:
            return device
        if (gpu_type, tensor_parallel) not in self._split_devices:
            self._split_devices[gpu_type, tensor_parallel] = split_device_times(device, split_factor(self, gpu_type, tensor_parallel))
        return self._split_devices[gpu_type, tensor_parallel]

    def offload_copy_ms(self, gpu_type: str, layers: tuple[int, int], microbatch_size: int, recompute: bool = False) -> float:
        """One way of one microbatch's activation copies on a stage of ``layers`` at ``gpu_type``'s host link
        (with ``recompute``, of the layers' inputs only)."""
        link_gbps = next(t.host_link_gbps for t in self.inventory.gpu_types if t.name == gpu_type)
        copied = offloaded_bytes_per_microbatch(self.profile, layers, microbatch_size, recompute)
        return copied / gbps_to_bytes_per_s(link_gbps) * 1000.0

    def fastest_layer_ms(self, gpu_type: str, microbatch_size: int) -> float:
        """Forward plus backward of one microbatch through the fastest layer of the profile on ``gpu_type``:
        no ``k`` layers of a stage take less than ``k`` times this."""
        key = (gpu_type, microbatch_size)
        if key not in self._fastest_layer_ms:
            self._fastest_layer_ms[key] = min(
                b.forward.at(microbatch_size) + b.backward.at(microbatch_size) for b in self.profile.times(gpu_type).layers
            )
        return self._fastest_layer_ms[key]

    def action_overhead_ms(self, gpu_type: str) -> float:
        """The engine's own time per action beyond compute on ``gpu_type``, as start-up measured it on
        every rank of that type (:attr:`~zorse_lightning.profiling.profile.DeviceTimes.action_overhead_ms`);
        0 where nothing measured it (reference and estimated profiles)."""
        return self.profile.times(gpu_type).action_overhead_ms or 0.0

    @classmethod
    def build(
        cls, inventory: ClusterInventory, profile: ModelProfile, memory_reserve_gib: float | None = None,
        p2p_rules: P2PRules | None = None,
    ) -> CostContext:
        """``memory_reserve_gib`` None: 0.5 GiB per real GPU, scaled on emulated clusters. ``p2p_rules`` None:
        the backend's own, as :class:`~.phases.CollectiveBackend` takes it from the inventory: NCCL's on GPUs,
        gloo's on an emulated cluster (whose runs keep NCCL's only when asked: start-up passes the run's)."""
        reserves = tuple(
            gib_to_bytes(reserve_gib(g.memory_gib, g.gpu_type.memory_gib, inventory.emulated, memory_reserve_gib))
            for g in inventory.gpus
        )
        rules = p2p_rules or (P2PRules.GLOO if inventory.emulated else P2PRules.NCCL)
        return cls(
            inventory, profile, LinkTable(inventory), reserves, tuple(gib_to_bytes(g.memory_gib) for g in inventory.gpus),
            rules, nccl_communicator_bytes=_nccl_communicator_bytes(inventory, memory_reserve_gib),
        )

    def reserve_bytes(self, rank: int) -> float:
        return self.reserves_bytes[rank]

    def nccl_bytes(
        self, rank: int, group_widths: tuple[int, ...], group_index: int | None, pipelined: bool, tensor_parallel: int = 1
    ) -> float:
        """NCCL's memory on ``rank``, of group ``group_index`` (None: idle) of a plan whose groups of ranks have
        ``group_widths`` (see :func:`~.framework_memory.nccl_communicators`)."""
        if not self.nccl_communicator_bytes:
            return 0.0
        communicators = nccl_communicators(group_widths, group_index, pipelined, tensor_parallel)
        return self.nccl_communicator_bytes[rank] * communicators

    def capacity_bytes(self, rank: int) -> float:
        return self.capacities_bytes[rank]


@dataclass(frozen=True)
class StageCost:
    """One stage's costs. On an interleaved plan the stage is a chunk: ``times``, ``busy_ms``
    and ``latency_ms`` are the chunk's own, while ``sync_ms``, ``memory`` and ``update_ms`` are
    its ranks' (every chunk of their group, the same in each of the group's chunks)."""

    times: tuple[MicrobatchTimes, ...]
    """One microbatch on each rank of the stage."""
    busy_ms: float
    """Its slowest rank's work per iteration, with the gathers of per-microbatch sharding."""
    latency_ms: float
    sync_ms: float
    memory: tuple[RankMemory, ...]
    update_ms: tuple[float, ...]
    """Each rank's optimizer step (:func:`.stage_state.stage_update_ms`), in the order of the stage's ranks."""
