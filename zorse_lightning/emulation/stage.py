"""Emulating a rank's GPU type for what the rank runs of the plan (its stage, not the whole model).

It joins the engine's cut (which blocks this rank holds, where a stage begins and ends: a
``zorse_lightning.engine.cutting.StageCut``, read through its attributes, since this layer lies below
the engine) to the emulator :class:`~zorse_lightning.emulation.rank.RankEmulation` builds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.hooks import RemovableHandle

from torch import nn
from torch.distributed.tensor import DTensor

from zorse_lightning.emulation.coverage import named_emulated_modules
from zorse_lightning.emulation.emulator import ComputeEmulator
from zorse_lightning.emulation.rank import RankEmulation
from zorse_lightning.emulation.timing import CallCost
from zorse_lightning.module.blocks import StageOutput, find_block_list_or_none

StageCut = Any
"""The engine's cut of the module for this rank (``engine.cutting.StageCut``), None without a pipeline."""


class StageEmulation:
    """Slowed compute of this rank's blocks (and embedding / head where its stage holds them), memory budget."""

    def __init__(self, emulator: ComputeEmulator, boundaries: _StageBoundaries | None = None) -> None:
        self.emulator = emulator
        self._boundaries = boundaries
        self._costs_agreed = False

    @classmethod
    def start(
        cls, emulation: RankEmulation, costs: Mapping[str, CallCost] | None, module: nn.Module, cut: StageCut | None,
        optimizers: list[Any], microbatch_size: int, offload: Any = None, recompute: bool = False,
    ) -> StageEmulation:
        """This rank's emulation of its stage, on ``costs`` (calibrated at start-up when the strategy planned, so
        the run and the profile behind its prediction use the same costs; else calibrated at first use).

        ``offload``: the rank's activation offload where its stage has one (``engine.activation_offload``,
        read through its ``offloaded_bytes`` counter; the cut's, or a one-stage plan's, which has no cut):
        its blocks then last at least their copies at the type's host link. ``recompute``: the stage recomputes
        its blocks' activations (every block the rank holds, as the cut and a one-stage plan checkpoint them):
        their backward is charged their forward again."""
        named = named_emulated_modules(module, cut.blocks.path if cut is not None else None)
        if cut is not None:
            named = _stage_modules(module, cut, named)
        emulator = emulation.instrumented(module, costs, named=named)
        emulator.batch_samples = microbatch_size  # the engine calls the step per microbatch
        if offload is not None:
            emulator.offloaded_bytes = lambda: offload.offloaded_bytes
        found = cut.blocks if cut is not None else find_block_list_or_none(module)
        blocks = found.blocks if found is not None else ()
        if recompute:
            emulator.recomputed = frozenset(id(b) for b in blocks)
        emulator.split = split_block_degrees(blocks)
        boundaries = None
        if cut is not None:
            boundaries = _StageBoundaries(cut)  # after instrument: its hooks run around the emulator's
            emulator.uncharged = _stand_ins(module, cut)
        emulator.track_memory(module, optimizers)
        emulator.check_memory()  # the stage as placed on the device, before its first step
        return cls(emulator, boundaries)

    def after_step(self) -> None:
        if not self._costs_agreed:
            # Costs calibrated at start-up are alike on every rank and stay as they are; any module first
            # called in the run was calibrated by its rank alone. The collective runs on every rank at the same step.
            self.emulator.agree_costs()
            self._costs_agreed = True
        self.emulator.check_memory()

    def stop(self) -> None:
        if self._boundaries is not None:
            self._boundaries.remove()
        self.emulator.remove()


def _stage_modules(
    root: nn.Module, cut: StageCut, named: list[tuple[str, nn.Module]]
) -> list[tuple[str, nn.Module]]:
    """The stage's share of ``named`` (the whole model's emulated modules): its blocks, and the
    modules before the blocks on the first stage and after them on the last.

    Names stay those of the whole model, so the stage finds the costs calibrated
    for the whole model at start-up, and agreeing costs over ranks never lends
    one module's cost to another.
    """
    here = {id(b) for stage in cut.chunks for b in cut.blocks.blocks[slice(*cut.layers_of(stage))]}
    for names, runs_here in ((cut.analysis.pre_modules, cut.is_first), (cut.analysis.post_modules, cut.is_last)):
        if runs_here:
            here.update(id(m) for name in names for m in root.get_submodule(name).modules())
    return [(n, m) for n, m in named if id(m) in here]


def _stand_ins(root: nn.Module, cut: StageCut):
    """``uncharged`` for the emulator: what computes nothing in the running stage. Interleaved, a rank holds
    several chunks; while a later one runs, the blocks of its earlier ones pass their input on, and the
    modules before the blocks (the first group's embedding) give stand-in zeros."""
    stage_of: dict[int, int] = {}
    for index, block in enumerate(cut.blocks.blocks):
        stage = cut.chunk_of_block(index)
        if stage is not None:
            stage_of.update((id(m), stage) for m in block.modules())
    for name in cut.analysis.pre_modules:
        stage_of.update((id(m), 0) for m in root.get_submodule(name).modules())
    return lambda module: stage_of.get(id(module), cut.active) != cut.active


def split_block_degrees(blocks: Sequence[nn.Module]) -> dict[int, int]:
    """Id -> TP degree of each block split over a tensor-parallel group (its weights are DTensors on the group's
    mesh: the engine splits a stage's blocks before the emulation starts); blocks held whole are left out."""
    degrees = {}
    for block in blocks:
        mesh = next((p.device_mesh for p in block.parameters() if isinstance(p, DTensor)), None)
        if mesh is not None and mesh.size() > 1:
            degrees[id(block)] = mesh.size()
    return degrees


class _StageBoundaries:
    """Makes a stage's last block look like an ordinary call to the emulator's hooks.

    The cut ends the stage by raising :class:`StageOutput` *inside* the last
    local block's forward. The emulator hooks the module call around that
    forward, so it would skip the deadline of a forward that raised, and
    calibrate by calling the raising forward. Here the last block returns
    normally, its output raised as :class:`StageOutput` by a hook that runs
    after the emulator's. (The received activation needs nothing here: the cut
    swaps it in with a pre-hook that runs before the emulator's.)
    """

    def __init__(self, cut: StageCut) -> None:
        self._handles: list[RemovableHandle] = []
        self._patched: list[tuple[nn.Module, Any]] = []
        for stage in cut.chunks:  # interleaved: every chunk's end, each active only while its stage runs
            if stage < cut.last_stage:
                self._end_at(cut, cut.layers_of(stage)[1] - 1)

    def _end_at(self, cut: StageCut, index: int) -> None:
        last = cut.blocks.blocks[index]
        raising = last.forward

        def returning(*args: Any, **kwargs: Any) -> Any:
            try:
                return raising(*args, **kwargs)
            except StageOutput as end_of_stage:
                return end_of_stage.output

        def end_stage(module: nn.Module, args: tuple, output: Any) -> None:
            if cut.ends_at(index):
                raise StageOutput(output)

        last.forward = returning
        self._patched.append((last, raising))
        self._handles.append(last.register_forward_hook(end_stage))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, forward in self._patched:
            module.forward = forward
        self._patched.clear()
