"""What one ``ZorseStrategy`` run learns and builds, in one record: the plan, the engine, start-up's result, the
rank's emulation, the data position and what a loaded checkpoint left to apply."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.emulation.rank import RankEmulation
from zorse_lightning.emulation.stage import StageEmulation
from zorse_lightning.engine.checkpoint.relaunch import RemoteFiles
from zorse_lightning.engine.checkpoint.survivors import RecoveryReport, SurvivorKeeper
from zorse_lightning.engine.executor import PipelineEngine
from zorse_lightning.engine.faults import SigtermKeeper, Watchdog
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.startup.plan_at_start import StartupResult
from zorse_lightning.strategy.gradient_stash import GradientStash
from zorse_lightning.strategy.log_capture import LogMerger
from zorse_lightning.strategy.manual_optimization import ManualOptimization
from zorse_lightning.strategy.precision import PrecisionChoice
from zorse_lightning.strategy.sampler import PlanBatchSampler, SamplerState


@dataclass
class ResumeState:
    """Where the data stands and what a loaded checkpoint left to apply."""

    sampler: PlanBatchSampler | None = None
    """The training loader's (the newest, when Lightning reloads it); evaluation loaders' have no position."""
    position: SamplerState | None = None
    """Where the training data continues, the data position a checkpoint records: restored from a checkpoint,
    then moved by each finished step; None before either."""
    checkpoint_global_batch_size: int | None = None
    """The resumed checkpoint's global batch size: a plan made at start keeps it (same data order)."""
    pending_optimizer_states: list[dict[str, Any]] = field(default_factory=list)
    """Applied once the optimizers are restricted to this rank's weights."""
    pending_module_state: Mapping[str, Any] | None = None
    """A checkpoint's weights for a module built on the meta device: read into the stage as it is placed."""
    remote_files: RemoteFiles | None = None
    """Survivors' files some ranks cannot see: sent to the ranks that need them once the plan is known."""

    def train_loader(self, sampler: PlanBatchSampler) -> None:
        """A new training loader continues at the position (a reload, at an epoch start, too)."""
        sampler.require_batches()
        if self.position is not None:
            sampler.restore(self.position)
        self.sampler = sampler

    def step_done(self, batches_done: int, epoch_batches: int) -> None:
        """After ``batches_done`` of the ``epoch_batches`` global batches of this epoch: the position a
        checkpoint taken now records (the next epoch's start after the last batch), and where the sampler's
        next pass starts (its pass of this epoch goes on as it began)."""
        if self.sampler is not None:
            self.position = self.sampler.state(batches_done, epoch_batches)
            self.sampler.restore(self.position)

    def sampler_state(self) -> SamplerState | None:
        if self.position is None and self.sampler is not None:
            return self.sampler.state(0, len(self.sampler))
        return self.position


@dataclass
class RunState:
    """The strategy's state: empty at construction, filled by setup, start-up and the first step."""

    inventory: ClusterInventory | None = None
    """The cluster: given (loaded on first use) or detected at setup."""
    nccl_communicator_bytes: int | None = None
    """What NCCL's first communicator took on this rank's GPU, measured as it was made (None: no NCCL); the
    inventory's GPU types carry it to the memory model."""
    plan: Plan | None = None
    startup: StartupResult | None = None
    """What start-up measured and planned from (None when a plan was given)."""
    engine: PipelineEngine | None = None
    precision_choice: PrecisionChoice | None = None
    rank_emulation: RankEmulation | None = None
    """This rank's emulation of its GPU type, made once: its memory meter counts from setup to the end."""
    emulation: StageEmulation | None = None
    """That emulation applied to the rank's stage, from the first step."""
    watchdog: Watchdog | None = None
    sigterm: SigtermKeeper | None = None
    """Keeps the survivor snapshot on SIGTERM (installed with the snapshots, removed at teardown)."""
    manual: ManualOptimization | None = None
    """Set with the plan for modules that optimise by hand."""
    host_group: Any = None
    """A gloo group over all ranks for host tensors (the default one where it is gloo); None on one rank."""
    log_mergers: dict[str, LogMerger] = field(default_factory=dict)
    """One per hook: the metric layout each merge of that hook's logs reuses (learned again with a new plan)."""
    stashed: GradientStash = field(default_factory=GradientStash)
    """The schedule's gradients of the last ``training_step``, put back in ``backward``."""
    training_prepared: bool = False
    clip_patched: bool = False
    keeper: SurvivorKeeper = field(default_factory=SurvivorKeeper)
    """This rank's survivor snapshots."""
    tensorless_dump: bool = False
    """While set, Lightning's checkpoint dump leaves out tensors (what a snapshot keeps of it)."""
    resume: ResumeState = field(default_factory=ResumeState)
    recovery_report: RecoveryReport | None = None
    """Where the last ``fit(ckpt_path=...)`` resumed from and what it read (None before one)."""
