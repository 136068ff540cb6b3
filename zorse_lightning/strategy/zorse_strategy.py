"""``ZorseStrategy``: Lightning's view of a zorse plan, the adapter and nothing else.

The strategy owns the step: Lightning's ``training_step`` runs the plan's
schedule, which calls the user's own step per microbatch
(:class:`~.steps.StepHooks`). Start-up is one call:
:func:`~zorse_lightning.startup.plan_at_start.run_startup` takes the first batch
and the user's step and returns the plan. No rank holds more than its stage:
nothing moves to the device before the engine's cut, and a module built on the
meta device (``configure_model``, ``init_module(empty_init=True)``) is
materialized per stage.

One class; Lightning's hooks of one concern each are in its bases: the steps
(:class:`~.steps.StepHooks`), the checkpoint, snapshot and failure hooks
(:class:`~.checkpoint_hooks.CheckpointHooks`), the processes, devices and
collectives (:class:`~.processes.ProcessHooks`). Here: its arguments, which are the
user's, the setup that turns a plan into groups and an engine, start-up and the
data. Everything the run learns or builds is one record
(:class:`~.run_state.RunState`); what needs no Lightning API lives below
(engine, its checkpoint package, start-up, the planner's plan check).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
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
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.emulation.spec import DEFAULT_FASTEST_SLOWDOWN
from zorse_lightning.emulation.rank import RankEmulation
from zorse_lightning.emulation.stage import StageEmulation
from zorse_lightning.engine.checkpoint import relaunch
from zorse_lightning.engine.checkpoint.survivors import RecoveryPolicy, RecoveryReport
from zorse_lightning.engine.executor import PipelineEngine
from zorse_lightning.engine.host_group import broadcast_module, host_group
from zorse_lightning.engine.checkpoint.by_name import ByName
from zorse_lightning.engine.faults import FaultPolicy, SigtermKeeper, start_watchdog, watch_startup
from zorse_lightning.engine.groups import DEFAULT_TIMEOUT, build_groups
from zorse_lightning.module.blocks import CutError, find_block_list, find_block_list_or_none
from zorse_lightning.module.materialize import InitialValues, has_meta_tensors, holds_values
from zorse_lightning.module.stage_weights import WeightSource
from zorse_lightning.module.tensor_parallel import Style
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.planner.plan_check import ModelBlocks, check_plan, check_schedule, resolve_plan, with_schedule
from zorse_lightning.startup.detection import detect_cluster, placed_inventory
from zorse_lightning.startup.plan_at_start import StartupResult, run_startup
from zorse_lightning.strategy.checkpoint_hooks import CheckpointHooks
from zorse_lightning.strategy.environment import HeterogeneousEnvironment
from zorse_lightning.strategy.log_capture import quiet_merged_metric_advice
from zorse_lightning.strategy.manual_optimization import ManualOptimization, check_manual_plan
from zorse_lightning.strategy.precision import PrecisionChoice, resolve_precision
from zorse_lightning.strategy.processes import ProcessHooks
from zorse_lightning.strategy.run_state import RunState
from zorse_lightning.strategy.sampler import plan_dataloader
from zorse_lightning.strategy.snapshots import SurvivorSnapshots
from zorse_lightning.strategy.steps import StepHooks
from zorse_lightning.strategy.trainer_inputs import quiet_training_step, rank_emulation, startup_inputs, training_loader

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
ClusterSource = str | Path | Mapping[str, Any] | ClusterInventory
PrecisionName = Literal["auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"]


class ZorseStrategy(CheckpointHooks, StepHooks, ProcessHooks):
    """Trains one LightningModule over the mixed GPUs of ``cluster`` by a planned pipeline.

    Args:
        cluster: the inventory: a name in ``conf/cluster/`` (``"cpu_sim4"``), a YAML path, a mapping or a
            :class:`~zorse_lightning.cluster.inventory.ClusterInventory`. None: detected from the ranks' devices.
        plan: a :class:`~zorse_lightning.schedule.plan.Plan` or a ``plan.json`` to run as it is; None: profiled
            and planned at start on the cluster.
        planner_options: the planner's knobs and pins (:class:`~zorse_lightning.planner.options.PlannerOptions`);
            only used when planning at start.
        schedule: pins the pipeline schedule (``"1f1b"``, ``"gpipe"``) for planning at start, so the planner
            prices what runs; with a given ``plan`` it must match the plan's schedule.
        block_path: attribute path of the block list (``"model.layers"``); None: the longest list of
            same-class modules.
        tp_plan: how a block splits over a tensor-parallel group where the plan asks for one, in Hugging Face's
            notation (``{"model.layers.*.mlp.up_proj": "colwise", ...}``, or module names inside one block; torch
            ``ParallelStyle``s also); None: the module's ``tp_plan`` attribute, else its Hugging Face model's
            (:mod:`zorse_lightning.module.tensor_parallel`).
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

    # -- construction -------------------------------------------------------------------------

    def __init__(
        self,
        cluster: ClusterSource | None = None,
        plan: Plan | str | Path | None = None,
        *,
        planner_options: PlannerOptions | None = None,
        schedule: str | None = None,
        block_path: str | None = None,
        tp_plan: Mapping[str, Style] | None = None,
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
        self._plan_source = plan
        self._planner_options = with_schedule(planner_options or PlannerOptions(), schedule)
        RankEmulation.check_slowdown(emulation_slowdown)
        self.emulation_slowdown = emulation_slowdown
        self._precision = precision
        self.block_path = block_path
        self._tp_plan = dict(tp_plan) if tp_plan is not None else None
        self._weights = WeightSource(weights) if weights is not None else None
        self._weights_prefix = weights_prefix
        self.seed = seed
        self._emulate = emulate
        self._timeout = timeout
        self._faults = faults
        self._recovery = recovery
        self._start_method = start_method
        self._num_nodes = 1
        self._state = RunState()
        """Everything the run learns or builds (the arguments above are the user's and stay as given)."""

    # -- what the user can inspect ------------------------------------------------------------

    @property
    def inventory(self) -> ClusterInventory | None:
        """The cluster this strategy trains on (None until given or detected)."""
        if self._state.inventory is None and self._cluster_source is not None:
            self._state.inventory = load_cluster(self._cluster_source)
        return self._state.inventory

    @property
    def recovery_report(self) -> RecoveryReport | None:
        """Where the last ``fit(ckpt_path=...)`` resumed from and what it read (None before one)."""
        return self._state.recovery_report

    @property
    def plan(self) -> Plan:
        if self._state.plan is None:
            raise RuntimeError(
                "ZorseStrategy.plan exists once the Trainer has set up the strategy (inside fit/validate/"
                "test/predict); pass plan=... to fix it in advance"
            )
        return self._state.plan

    @property
    def startup(self) -> StartupResult | None:
        """What start-up measured and planned from (profile and cluster as measured on rank 0); None when a
        plan was given or before the first dataloader."""
        return self._state.startup

    @property
    def precision_choice(self) -> PrecisionChoice:
        """The precision every rank trains in, and why (also in the plan's notes)."""
        if self._state.precision_choice is None:
            raise RuntimeError("ZorseStrategy.precision_choice is made at setup, once the ranks' devices are known")
        return self._state.precision_choice

    @property
    def emulation(self) -> StageEmulation | None:
        """This rank's emulation of its GPU type (None when off or before the first step)."""
        return self._state.emulation

    @property
    def engine(self) -> PipelineEngine:
        if self._state.engine is None:
            raise RuntimeError("the zorse engine is built at setup, once the plan is known")
        return self._state.engine

    # -- setup and the plan -------------------------------------------------------------------

    @override
    def setup(self, trainer: Any) -> None:
        if self._cluster_source is None and self._state.inventory is None and self._plan_source is None:
            self._state.inventory = detect_cluster(self.root_device, self.world_size, self._state.nccl_communicator_bytes)
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
            trainer.callbacks.insert(0, SurvivorSnapshots(
                self._snapshot_for_recovery, self._state.keeper, self._recovery, self._host_gather
            ))
            if self._state.sigterm is None:
                self._state.sigterm = SigtermKeeper(self._keep_survivor_state, f"rank {self.global_rank}")
                self._state.sigterm.install()
        if self._state.engine is None:
            if self.world_size > 1 and self._state.host_group is None:  # a resume may have made it already
                self._state.host_group = host_group(self._timeout, self.cluster_environment.main_address)
            if self.world_size > 1 and not has_meta_tensors(self.lightning_module):  # meta: values per stage
                broadcast_module(self.lightning_module, self._state.host_group)
            if self._plan_source is not None:
                plan = resolve_plan(self._plan_source, self.world_size)
                check_schedule(plan, self._planner_options)
                self._set_plan(plan)

    def _set_precision(self) -> None:
        if self.inventory is not None:
            self._state.inventory = placed_inventory(
                self.inventory, self.root_device, self.world_size, self._state.nccl_communicator_bytes
            )
            gpu_types = [gpu.gpu_type for gpu in self.inventory.gpus]
        else:
            gathered: list[Any] = [None] * self.world_size
            mine = self.accelerator.describe_rank(self.global_rank, self.local_rank, self.root_device)
            dist.all_gather_object(gathered, mine.gpu_type)
            gpu_types = [t for t in gathered if t is not None]
        plugin, self._state.precision_choice = resolve_precision(
            self._precision, self.precision_plugin, gpu_types, self.root_device.type
        )
        plugin.parameters = lambda: self.engine.local_parameters()
        plugin.device = self.root_device
        self.precision_plugin = plugin

    def _set_plan(self, plan: Plan) -> None:
        check_manual_plan(plan, self.lightning_module, self.precision_plugin)  # its own reason comes first
        blocks = model_blocks(self.lightning_module, self.block_path) if len(plan.stages) > 1 else None
        check_plan(plan, self.inventory, blocks)
        if self._state.precision_choice is not None and self._state.precision_choice.note not in plan.notes:
            plan = Plan.from_dict({**plan.to_dict(), "notes": [*plan.notes, self._state.precision_choice.note]})
        self._state.plan = plan
        remote = self._state.resume.remote_files
        if remote is not None:  # survivors' files kept on other machines: only to the ranks whose stage needs them
            blocks = find_block_list_or_none(self.lightning_module, self.block_path)
            relaunch.fetch(remote, relaunch.stage_may_hold(plan, self.global_rank, blocks), self.global_rank,
                           self._host_gather, self._state.host_group)
            self._state.resume.remote_files = None
        groups = build_groups(plan, self.global_rank, self._timeout)
        self._state.log_mergers = {}
        environment = self.cluster_environment
        self._state.watchdog = start_watchdog(
            environment.main_address, environment.main_port, plan, self.inventory, self.global_rank, self._faults,
            self._keep_survivor_state,
        )
        self._state.engine = PipelineEngine(
            self.lightning_module, groups, self.root_device, self.block_path,
            initial=self._initial_values(), host_group=self._state.host_group, tp_plan=self._tp_plan,
        )
        self.precision_plugin.cache_weights = groups.is_idle or not groups.stage.gather_per_microbatch
        if not self.lightning_module.automatic_optimization:
            self._state.manual = ManualOptimization(
                self._state.engine, self.lightning_module, self.precision_plugin, self._state.host_group
            )

    def _initial_values(self) -> InitialValues:
        """A resumed checkpoint's weights (names as the module's own), else the pretrained ``weights`` given."""
        pending = self._state.resume.pending_module_state
        if pending is not None:
            weights = pending.weight_source() if isinstance(pending, ByName) else pending  # read per placed tensor
            return InitialValues(self.seed, weights, weights_prefix="")
        return InitialValues(self.seed, self._weights, self._weights_prefix)

    # -- start-up and data --------------------------------------------------------------------

    def _rank_emulation(self) -> RankEmulation | None:
        """This rank's emulation, made once: its memory meter counts from setup to the end of the run."""
        if self._state.rank_emulation is None:
            self._state.rank_emulation = rank_emulation(
                self.inventory, self._emulate, self.root_device, self.global_rank, self.emulation_slowdown
            )
        return self._state.rank_emulation

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
            self._state.resume.checkpoint_global_batch_size, self._planner_options, self.block_path, self._rank_emulation(),
            self.seed,
        )
        environment = self.cluster_environment
        watchdog = watch_startup(environment.main_address, environment.main_port, self.inventory, self.global_rank,
                                 self.world_size, self._faults)
        inputs = replace(inputs, host_group=self._state.host_group, meet=watchdog.meet)
        try:
            with torch.inference_mode(False), torch.enable_grad():
                batch = self.batch_to_device(next(iter(loader)))
                self._state.startup = run_startup(inputs, batch, quiet_training_step(self.lightning_module))
        except BaseException as error:  # every rank ends with the failing rank's error, not NCCL's timeout
            lost = watchdog.explain(error)
            if lost is not None:
                raise lost from error
            raise
        watchdog.stop()
        return self._state.startup.plan

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if not isinstance(dataloader, DataLoader):
            return dataloader
        if self._state.plan is None:
            self._set_plan(self._plan_at_start(dataloader))
        loader = plan_dataloader(dataloader, self.plan, self.global_rank, self.seed)
        if self.lightning_module.trainer.training:
            self._state.resume.train_loader(loader.batch_sampler)
        return loader

    # -- teardown and registration ------------------------------------------------------------

    @override
    def teardown(self) -> None:
        """As Lightning's, except that other stages' weights stay on the meta device (they have no data)."""
        if self._state.watchdog is not None:
            self._state.watchdog.stop()
        if self._state.sigterm is not None:
            self._state.sigterm.remove()
            self._state.sigterm = None
        if self._state.emulation is not None:
            self._state.emulation.stop()
        self.cluster_environment.teardown()
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        if self.lightning_module is not None:
            self.lightning_module._apply(lambda t: t.cpu() if holds_values(t) else t)
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()


def model_blocks(module: torch.nn.Module, block_path: str | None) -> ModelBlocks:
    """What the plan check needs of the module: its blocks' sizes, or why it has no block list."""
    try:
        blocks = find_block_list(module, block_path).blocks
    except CutError as error:
        return ModelBlocks(type(module).__name__, problem=str(error))
    dtype = str(next(blocks[0].parameters()).dtype).removeprefix("torch.")
    return ModelBlocks(type(module).__name__, tuple(sum(p.numel() for p in b.parameters()) for b in blocks), dtype)
