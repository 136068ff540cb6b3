"""The one place that builds a rank's emulation of its GPU type.

Start-up profiling, the run's stage emulation and the :class:`~.callback.EmulateCluster`
callback all charge compute through an emulator made here, so they cannot
disagree on a rank's slowdown or on the calibrated costs (an earlier version
built it in four places, and the step-edge probe ignored ``emulation_slowdown``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.emulation.coverage import named_emulated_modules
from zorse_lightning.emulation.emulator import ComputeEmulator
from zorse_lightning.emulation.spec import DEFAULT_FASTEST_SLOWDOWN, EmulationSpec, emulation_spec_for_rank
from zorse_lightning.emulation.memory import MemoryMeter
from zorse_lightning.emulation.timing import CallCost
from zorse_lightning.errors import ZorseUserError


@dataclass(frozen=True)
class RankEmulation:
    """How one rank emulates its GPU type of ``inventory``: the fastest type runs ``fastest_slowdown`` times
    slower than this CPU, the others in proportion to their peak speed."""

    inventory: ClusterInventory
    rank: int
    fastest_slowdown: float = DEFAULT_FASTEST_SLOWDOWN
    meter: MemoryMeter = field(default_factory=MemoryMeter, compare=False, repr=False)
    """The rank's one memory meter: every emulator made here counts into it, so its peak spans the run from
    the moment the strategy tracks the module (start-up profiling included), not one emulator's life."""

    def __post_init__(self) -> None:
        self.check_slowdown(self.fastest_slowdown)

    @staticmethod
    def check_slowdown(fastest_slowdown: float) -> None:
        if not fastest_slowdown >= 1.0:
            raise ZorseUserError(
                f"emulation_slowdown={fastest_slowdown!r} must be >= 1 (the fastest emulated type runs that many "
                f"times slower than this CPU, so its real compute can meet its deadlines); the default is "
                f"{DEFAULT_FASTEST_SLOWDOWN:g}"
            )

    @property
    def spec(self) -> EmulationSpec:
        return emulation_spec_for_rank(self.inventory, self.rank, self.fastest_slowdown)

    def emulator(self, costs: Mapping[str, CallCost] | None = None) -> ComputeEmulator:
        """A fresh emulator of this rank, on ``costs`` where given (else calibrated at first use)."""
        return ComputeEmulator(self.spec, rank=self.rank, costs=costs, meter=self.meter)

    def instrumented(
        self, root: nn.Module, costs: Mapping[str, CallCost] | None = None,
        named: Sequence[tuple[str, nn.Module]] | None = None,
    ) -> ComputeEmulator:
        """An emulator hooked on ``named`` (default: every emulated module of ``root``, with its name in ``root``,
        so that costs calibrated on the whole model are found by name)."""
        emulator = self.emulator(costs)
        named = named_emulated_modules(root) if named is None else named
        emulator.instrument([m for _, m in named], names=[n for n, _ in named])
        return emulator
