"""Emulating a rank's GPU type for what the rank runs of the plan (its stage, not the whole model)."""

from __future__ import annotations

from typing import Any

from zorse_lightning.engine.emulation import ComputeEmulator, emulated_modules, emulation_spec_for_rank
from zorse_lightning.engine.executor import PipelineEngine


class StageEmulation:
    """Slowed compute of this rank's blocks (and embedding / head where its stage holds them), memory budget."""

    def __init__(self, emulator: ComputeEmulator) -> None:
        self.emulator = emulator
        self._costs_agreed = False

    @classmethod
    def start(cls, strategy: Any, engine: PipelineEngine) -> StageEmulation:
        rank = strategy.global_rank
        emulator = ComputeEmulator(emulation_spec_for_rank(strategy.inventory, rank), rank=rank)
        module = strategy.lightning_module
        cut = engine.cut
        if cut is None:
            modules = emulated_modules(module)
        else:
            start, end = cut.stage.layers
            modules = cut.blocks.blocks[start:end]
            names = (cut.analysis.pre_modules if cut.is_first else ()) + (cut.analysis.post_modules if cut.is_last else ())
            modules += [module.get_submodule(name) for name in names]
        emulator.instrument(modules)
        emulator.track_memory(module, strategy.optimizers)
        return cls(emulator)

    def after_step(self) -> None:
        if not self._costs_agreed:
            # Ranks of one type calibrate alike; the collective runs on every rank at the same step.
            self.emulator.agree_costs()
            self._costs_agreed = True
        self.emulator.check_memory()

    def stop(self) -> None:
        self.emulator.remove()
