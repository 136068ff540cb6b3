"""``ZorseStrategy``: Lightning's view of a zorse plan.

The strategy owns the step. Lightning calls ``training_step`` once per global
batch; inside it the engine runs the plan's schedule, calling the user's own
``training_step`` per microbatch, with backward included. Lightning's
``backward`` therefore only runs its hooks, and ``optimizer_step`` reduces the
gradients (weighted by samples, over each weight's stages) before Lightning's
clipping and the optimizer; clipping uses the global norm over all stages.
``self.log`` inside microbatches is captured and replayed once per step.
A module that optimises by hand owns its step instead (strategy/manual_optimization.py).

Start-up is one call: :func:`~zorse_lightning.startup.plan_at_start.run_startup`
takes the first batch and the user's step and returns the plan (and what the
emulation reuses). This file holds the construction, setup, start-up and data;
the step hooks are in :mod:`.step_hooks`, checkpoint and failure hooks in
:mod:`.checkpoint_hooks`. No rank holds more than its stage: nothing moves to
the device before the engine's cut, and a module built on the meta device
(``configure_model``, ``init_module(empty_init=True)``) is materialized per stage.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader
from typing_extensions import override

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.cluster.detection import check_detected_devices, local_device_report
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.emulation.emulator import DEFAULT_FASTEST_SLOWDOWN
from zorse_lightning.emulation.rank import RankEmulation
from zorse_lightning.strategy.stage_emulation import StageEmulation
from zorse_lightning.engine.executor import PipelineEngine, broadcast_module, host_group
from zorse_lightning.module.materialize import InitialValues, has_meta_tensors, holds_values
from zorse_lightning.module.stage_weights import WeightSource
from zorse_lightning.engine.faults import FaultPolicy
from zorse_lightning.engine.groups import DEFAULT_TIMEOUT, build_groups
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.planner.plan import Plan
from zorse_lightning.startup.detection import detect_cluster
from zorse_lightning.startup.plan_at_start import StartupResult, run_startup
from zorse_lightning.strategy import checkpoint_io
from zorse_lightning.strategy.checkpoint_hooks import ResumeState
from zorse_lightning.strategy.step_hooks import StepHooks
from zorse_lightning.strategy.environment import HeterogeneousEnvironment
from zorse_lightning.strategy.gradient_stash import GradientStash
from zorse_lightning.strategy.fast_recovery import RecoveryPolicy, RecoveryReport, SurvivorKeeper, SurvivorSnapshots
from zorse_lightning.strategy.log_capture import LogMerger, quiet_merged_metric_advice
from zorse_lightning.strategy.manual_optimization import ManualOptimization, check_manual_plan
from zorse_lightning.strategy.plan_checks import check_plan_against, check_schedule, resolve_plan, with_schedule
from zorse_lightning.strategy.precision import PrecisionChoice, resolve_precision
from zorse_lightning.strategy.recovery import start_watchdog
from zorse_lightning.strategy.sampler import plan_dataloader
from zorse_lightning.strategy.start import quiet_training_step, rank_emulation, startup_inputs, training_loader
from zorse_lightning.strategy.validation import check_plan_for_module

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
ClusterSource = str | Path | Mapping[str, Any] | ClusterInventory
PrecisionName = Literal["auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"]


class ZorseStrategy(StepHooks):
    """Trains one LightningModule over the mixed GPUs of ``cluster`` by a planned pipeline.

    Args:
        cluster: the inventory: a name in ``conf/cluster/`` (``"cpu_sim4"``), a YAML path, a mapping or a
            :class:`~zorse_lightning.cluster.inventory.ClusterInventory`. None: detected from the ranks' devices.
        plan: a :class:`~zorse_lightning.planner.plan.Plan` or a ``plan.json`` to run as it is; None: profiled
            and planned at start on the cluster.
        planner_options: the planner's knobs and pins (:class:`~zorse_lightning.planner.options.PlannerOptions`);
            only used when planning at start.
        schedule: pins the pipeline schedule (``"1f1b"``, ``"gpipe"``) for planning at start, so the planner
            prices what runs; with a given ``plan`` it must match the plan's schedule.
        block_path: attribute path of the block list (``"model.layers"``); None: the longest list of
            same-class modules.
        weights: pretrained weights each rank reads only its stage's tensors from (a state dict, a
            ``.safetensors`` file, a sharded ``*.index.json`` or its directory, a torch or Lightning checkpoint
            file), into a module built on the meta device (``configure_model``, ``init_module(empty_init=True)``).
        weights_prefix: module name = prefix + name in ``weights`` (``"model."`` for a Hugging Face model held as
            ``self.model``); None: detected.
        seed: of the sampler's shuffling (the order of global batches, whatever the plan), and of the initial
            values of a module built on the meta device (``configure_model``, ``init_module(empty_init=True)``).
        precision: None: the Trainer's (``Trainer(precision=...)``, as for any Lightning strategy); ``"auto"``:
            chosen for the cluster (bf16 where every GPU type has it, else fp16 with loss scaling, fp32 on CPU);
            or one of Lightning's modes (``"bf16-mixed"``, ``"32-true"``, ...). Checked against every GPU type.
        emulate: CPU ranks emulate their GPU types (speed and memory); None: when the cluster is emulated.
        emulation_slowdown: how many times slower than this CPU the fastest emulated type runs (>= 1); raise it
            where many ranks share few cores and overrun their deadlines.
        faults: how long a silent rank may be before every other rank stops with an error naming it.
        recovery: where survivors of a lost rank keep their state, read first by ``fit(ckpt_path=...)``.
        timeout: of torch.distributed's collectives.
        start_method: how Lightning starts the processes of one machine (``"popen"``: a script per rank;
            ``"spawn"``, ``"fork"``, ``"forkserver"``: multiprocessing). torchrun and srun start their own.
        cluster_environment, checkpoint_io, precision_plugin: Lightning's, as for any strategy; the
            environment defaults to one that reads torchrun's or SLURM's ranks as they are.
    """

    strategy_name = "zorse"

    def __init__(
        self,
        cluster: ClusterSource | None = None,
        plan: Plan | str | Path | None = None,
        *,
        planner_options: PlannerOptions | None = None,
        schedule: str | None = None,
        block_path: str | None = None,
        weights: WeightSource | Mapping[str, torch.Tensor] | str | Path | None = None,
        weights_prefix: str | None = None,
        seed: int = 0,
        precision: PrecisionName | None = None,
        emulate: bool | None = None,
        emulation_slowdown: float = DEFAULT_FASTEST_SLOWDOWN,
        faults: FaultPolicy = FaultPolicy(),
        recovery: RecoveryPolicy = RecoveryPolicy(),
        timeout: timedelta = DEFAULT_TIMEOUT,
        start_method: StartMethod = "popen",
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        if cluster_environment is None and HeterogeneousEnvironment.detect():
            cluster_environment = HeterogeneousEnvironment()
        super().__init__(
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin
        )
        self._cluster_source = cluster
        self._inventory: ClusterInventory | None = None
        self._plan_source = plan
        self._planner_options = with_schedule(planner_options or PlannerOptions(), schedule)
        RankEmulation.check_slowdown(emulation_slowdown)
        self.emulation_slowdown = emulation_slowdown
        self._precision = precision
        self._precision_choice: PrecisionChoice | None = None
        self.block_path = block_path
        self._weights = WeightSource(weights) if weights is not None else None
        self._weights_prefix = weights_prefix
        self.seed = seed
        self._emulate = emulate
        self._timeout = timeout
        self._faults = faults
        self._recovery = recovery
        self._start_method = start_method
        self._num_nodes = 1
        self._keeper = SurvivorKeeper()
        self._tensorless_dump = False
        self.recovery_report: RecoveryReport | None = None
        """Where the last ``fit(ckpt_path=...)`` resumed from and what it read (None before one)."""
        self._resume = ResumeState()
        self._startup: StartupResult | None = None
        self._plan: Plan | None = None
        self._watchdog = None
        self._engine: PipelineEngine | None = None
        self._emulation: StageEmulation | None = None
        self._rank_emu: RankEmulation | None = None
        self._clip_patched = False
        self._log_mergers: dict[str, LogMerger] = {}
        self._host_group = None
        """A gloo group over all ranks for host tensors (the default one where it is gloo); None on one rank."""
        """One per hook: the metric layout each merge of that hook's logs reuses (learned again with a new plan)."""
        self._stashed = GradientStash()
        """The schedule's gradients of the last ``training_step``, put back in ``backward``."""
        self._training_prepared = False
        self._manual: ManualOptimization | None = None  # set with the plan for modules that optimise by hand

    # -- what the user can inspect ---------------------------------------------------------

    @property
    def inventory(self) -> ClusterInventory | None:
        """The cluster this strategy trains on (None until given or detected)."""
        if self._inventory is None and self._cluster_source is not None:
            self._inventory = load_cluster(self._cluster_source)
        return self._inventory

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            raise RuntimeError(
                "ZorseStrategy.plan exists once the Trainer has set up the strategy (inside fit/validate/"
                "test/predict); pass plan=... to fix it in advance"
            )
        return self._plan

    @property
    def startup(self) -> StartupResult | None:
        """What start-up measured and planned from (profile and cluster as measured on rank 0); None when a
        plan was given or before the first dataloader."""
        return self._startup

    @property
    def precision_choice(self) -> PrecisionChoice:
        """The precision every rank trains in, and why (also in the plan's notes)."""
        if self._precision_choice is None:
            raise RuntimeError("ZorseStrategy.precision_choice is made at setup, once the ranks' devices are known")
        return self._precision_choice

    @property
    def emulation(self) -> StageEmulation | None:
        """This rank's emulation of its GPU type (None when off or before the first step)."""
        return self._emulation

    @property
    def engine(self) -> PipelineEngine:
        if self._engine is None:
            raise RuntimeError("the zorse engine is built at setup, once the plan is known")
        return self._engine

    @override
    def setup(self, trainer: Any) -> None:
        if self._cluster_source is None and self._inventory is None and self._plan_source is None:
            self._inventory = detect_cluster(self.root_device, self.world_size)
        self.accelerator.setup(trainer)
        quiet_merged_metric_advice()
        self._set_precision()
        self.precision_plugin.convert_module(self.model)
        emulation = self._rank_emulation()
        if emulation is not None and has_meta_tensors(self.lightning_module):
            # Its memory counts from here: none, then what start-up and the stage materialize. A module built on
            # the host is host memory until its stage is placed (on a CPU rank the two cannot be told apart).
            emulation.meter.track((self.lightning_module,))
            emulation.meter.measure()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._patch_clipping()
        # A world of one rank keeps no survivor state: no survivor can exist.
        if self._recovery.enabled and self.world_size > 1 and not any(
            isinstance(c, SurvivorSnapshots) for c in trainer.callbacks
        ):
            trainer.callbacks.insert(0, SurvivorSnapshots(self._snapshot_for_recovery, self._keeper, self._recovery))
        if self._engine is None:
            if self.world_size > 1:
                self._host_group = host_group()
            if self.world_size > 1 and not has_meta_tensors(self.lightning_module):  # meta: values per stage
                broadcast_module(self.lightning_module, self._host_group)
            if self._plan_source is not None:
                plan = resolve_plan(self._plan_source, self.inventory, self.world_size)
                check_schedule(plan, self._planner_options)
                self._set_plan(plan)

    def _set_precision(self) -> None:
        if self.inventory is not None:
            check_detected_devices(self.inventory, checkpoint_io.all_gather(local_device_report(self.root_device)))
            gpu_types = [gpu.gpu_type for gpu in self.inventory.gpus]
        else:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, self.accelerator.describe_rank(self.global_rank, self.local_rank, self.root_device).gpu_type)
            gpu_types = [t for t in gathered if t is not None]
        plugin, self._precision_choice = resolve_precision(
            self._precision, self.precision_plugin, gpu_types, self.root_device.type
        )
        plugin.parameters = lambda: self.engine.local_parameters()
        plugin.device = self.root_device
        self.precision_plugin = plugin

    def _set_plan(self, plan: Plan) -> None:
        if self.inventory is not None:
            check_plan_against(plan, self.inventory)
        check_manual_plan(plan, self.lightning_module, self.precision_plugin)
        check_plan_for_module(plan, self.lightning_module, self.block_path, self.inventory)
        if self._precision_choice is not None and self._precision_choice.note not in plan.notes:
            plan = Plan.from_dict({**plan.to_dict(), "notes": [*plan.notes, self._precision_choice.note]})
        self._plan = plan
        groups = build_groups(plan, self.global_rank, self._timeout)
        self._log_mergers = {}
        self._watchdog = start_watchdog(
            self.cluster_environment, plan, self.inventory, self.global_rank, self._faults, self._keep_survivor_state
        )
        self._engine = PipelineEngine(
            self.lightning_module, groups, self.root_device, self.block_path,
            initial=self._initial_values(), host_group=self._host_group,
        )
        self.precision_plugin.cache_weights = groups.is_idle or not groups.stage.gather_per_microbatch
        if not self.lightning_module.automatic_optimization:
            self._manual = ManualOptimization(self._engine, self.lightning_module, self.precision_plugin, self._host_group)

    def _initial_values(self) -> InitialValues:
        """A resumed checkpoint's weights (names as the module's own), else the pretrained ``weights`` given."""
        if self._resume.pending_module_state is not None:
            return InitialValues(self.seed, self._resume.pending_module_state, weights_prefix="")
        return InitialValues(self.seed, self._weights, self._weights_prefix)

    @override
    def model_to_device(self) -> None:
        """Nothing moves before the cut: the engine puts this rank's stage on the device and nothing else."""

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``Trainer.init_module()``: on the host (the engine moves only the stage to the device); with
        ``empty_init=True`` on the meta device: no rank ever holds the whole model, and each materializes its
        stage after planning (values: ``zorse_lightning.module.materialize``; or a checkpoint's, on resume)."""
        with torch.device("meta" if empty_init else "cpu"), self.precision_plugin.tensor_init_context():
            yield

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model()`` builds on the meta device, as under ``init_module(empty_init=True)``."""
        with torch.device("meta"):
            yield

    # -- start-up and data -----------------------------------------------------------------

    def _rank_emulation(self) -> RankEmulation | None:
        """This rank's emulation, made once: its memory meter counts from setup to the end of the run."""
        if self._rank_emu is None:
            self._rank_emu = rank_emulation(
                self.inventory, self._emulate, self.root_device, self.global_rank, self.emulation_slowdown
            )
        return self._rank_emu

    def _plan_at_start(self, loader: DataLoader) -> Plan:
        """Start-up on the training loader (its batch size makes the global batch), with gradients on.

        Lightning's sanity check processes the validation loader first, inside
        ``torch.inference_mode``: planning there once took the validation batch size
        for the global batch and timed every block's backward as nothing.
        """
        trainer = self.lightning_module.trainer
        if trainer.sanity_checking:
            loader = training_loader(trainer, loader)
        inputs = startup_inputs(
            self.lightning_module, self.inventory, loader, self.global_rank, self.world_size, self.root_device,
            self._resume.checkpoint_global_batch_size, self._planner_options, self.block_path, self._rank_emulation(),
            self.seed,
        )
        with torch.inference_mode(False), torch.enable_grad():
            batch = self.batch_to_device(next(iter(loader)))
            self._startup = run_startup(inputs, batch, quiet_training_step(self.lightning_module))
        return self._startup.plan

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if not isinstance(dataloader, DataLoader):
            return dataloader
        if self._plan is None:
            self._set_plan(self._plan_at_start(dataloader))
        loader = plan_dataloader(dataloader, self.plan, self.global_rank, self.seed)
        if self.lightning_module.trainer.training:
            self._resume.train_loader(loader.batch_sampler)
        return loader

    @override
    def teardown(self) -> None:
        """As Lightning's, except that other stages' weights stay on the meta device (they have no data)."""
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._emulation is not None:
            self._emulation.stop()
        self.cluster_environment.teardown()
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        if self.lightning_module is not None:
            self.lightning_module._apply(lambda t: t.cpu() if holds_values(t) else t)
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="zorse: plans and trains on mixed GPU types"
        )
        strategy_registry.register(
            "zorse_gpipe", cls, description="zorse, planned and run with the GPipe schedule", schedule="gpipe"
        )
        strategy_registry.register(
            "zorse_spawn", cls, description="zorse, processes started with multiprocessing spawn", start_method="spawn"
        )
