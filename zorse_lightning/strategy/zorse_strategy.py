"""``ZorseStrategy``: Lightning's view of a zorse plan, the adapter and nothing else.

The strategy owns the step. Lightning calls ``training_step`` once per global
batch; inside it the engine runs the plan's schedule, calling the user's own
``training_step`` per microbatch, with backward included. Lightning's
``backward`` therefore only puts the schedule's gradients back between its
hooks, and ``optimizer_step`` reduces them (weighted by samples, over each
weight's stages) before Lightning's clipping and the optimizer; clipping uses
the global norm over all stages. ``self.log`` inside microbatches is captured
and replayed once per step. A module that optimises by hand owns its step
instead (:mod:`.manual_optimization`).

Start-up is one call: :func:`~zorse_lightning.startup.plan_at_start.run_startup`
takes the first batch and the user's step and returns the plan. No rank holds
more than its stage: nothing moves to the device before the engine's cut, and a
module built on the meta device (``configure_model``,
``init_module(empty_init=True)``) is materialized per stage. One class (its
checkpoint, snapshot and failure hooks in its base, :class:`~.checkpoint_hooks.CheckpointHooks`):
its arguments are the user's, everything the run learns or builds is one record
(:class:`~.run_state.RunState`); what needs no Lightning API lives below
(engine, its checkpoint package, start-up, the planner's plan check).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader
from typing_extensions import override

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.emulation.spec import DEFAULT_FASTEST_SLOWDOWN
from zorse_lightning.emulation.rank import RankEmulation
from zorse_lightning.emulation.stage import StageEmulation
from zorse_lightning.engine.checkpoint import relaunch, shards
from zorse_lightning.engine.checkpoint.survivors import RecoveryPolicy, RecoveryReport
from zorse_lightning.engine.executor import PipelineEngine
from zorse_lightning.engine.host_group import broadcast_module, host_group
from zorse_lightning.engine.checkpoint.by_name import ByName
from zorse_lightning.engine.faults import FaultPolicy, SigtermKeeper, start_watchdog, watch_startup
from zorse_lightning.engine.nccl_memory import measure_first_communicator
from zorse_lightning.engine.groups import DEFAULT_TIMEOUT, backend_for, build_groups, tear_down_hung_collectives
from zorse_lightning.module.blocks import CutError, find_block_list, find_block_list_or_none
from zorse_lightning.module.materialize import InitialValues, has_meta_tensors, holds_values
from zorse_lightning.module.stage_weights import WeightSource
from zorse_lightning.module.tensor_parallel import Style
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.schedule.plan import Plan
from zorse_lightning.planner.plan_check import ModelBlocks, check_plan, check_schedule, resolve_plan, with_schedule
from zorse_lightning.startup.detection import detect_cluster, placed_inventory
from zorse_lightning.startup.plan_at_start import StartupResult, run_startup
from zorse_lightning.strategy.accelerator import cuda_index_for, resolve_accelerator
from zorse_lightning.strategy.checkpoint_hooks import CheckpointHooks
from zorse_lightning.strategy.environment import HeterogeneousEnvironment
from zorse_lightning.strategy.gradient_stash import GradientStash
from zorse_lightning.strategy.log_capture import LogCapture, LogMerger, capturing_logs, quiet_merged_metric_advice, replay
from zorse_lightning.strategy.manual_optimization import ManualOptimization, check_manual_plan
from zorse_lightning.strategy.precision import PrecisionChoice, resolve_precision
from zorse_lightning.strategy.run_state import RunState
from zorse_lightning.strategy.sampler import plan_dataloader
from zorse_lightning.strategy.snapshots import SurvivorSnapshots
from zorse_lightning.strategy.trainer_inputs import quiet_training_step, rank_emulation, startup_inputs, training_loader

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
ClusterSource = str | Path | Mapping[str, Any] | ClusterInventory
PrecisionName = Literal["auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"]


class ZorseStrategy(CheckpointHooks):
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

    # -- processes, devices, collectives ------------------------------------------------------

    @property
    @override
    def accelerator(self):
        return self._accelerator

    @accelerator.setter
    def accelerator(self, value: Any) -> None:
        # Lightning hands its accelerator choice to the strategy here: keep its device kind, add the cluster.
        self._accelerator = None if value is None else resolve_accelerator(None, value, self.inventory)

    @property
    @override
    def root_device(self) -> torch.device:
        """The device Lightning gave this local rank (``Trainer(devices=[1])``: ``cuda:1``); a process that
        sees only its own GPU (one Lightning device per process under torchrun or srun) takes the one it sees."""
        devices = self.parallel_devices
        if self.local_rank < len(devices):
            return devices[self.local_rank]
        if devices[0].type != "cuda":
            return devices[0]
        return torch.device("cuda", cuda_index_for(self.local_rank, torch.cuda.device_count()))

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        """Ranks from the launcher as they are; Lightning's own launcher runs one machine (rank = local rank)."""
        environment = self.cluster_environment
        # Lightning's children see LOCAL_RANK and report creates_processes_externally, yet still need
        # their ranks set; only HeterogeneousEnvironment (torchrun, SLURM) knows them on its own.
        if environment is not None and not isinstance(environment, HeterogeneousEnvironment):
            if self.num_nodes > 1:
                raise ValueError(
                    f"num_nodes={self.num_nodes}: launch each machine with torchrun or srun, which give every "
                    f"process its global rank (machines may run different numbers of processes)"
                )
            environment.set_global_rank(self.local_rank)
            environment.set_world_size(self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        backend = backend_for(self.root_device)
        tear_down_hung_collectives(backend)  # read by each NCCL group as it is created: before the first
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        # NCCL's memory, measured while nothing else is on the GPU (once: a second fit finds the communicator made)
        if backend == "nccl" and self.world_size > 1 and self._state.nccl_communicator_bytes is None:
            self._state.nccl_communicator_bytes = measure_first_communicator(self.root_device)

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

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

    # -- steps --------------------------------------------------------------------------------

    def _microbatch_step(self, hook: str, batch_idx: int, *rest: Any):
        method = getattr(self.lightning_module, hook)
        return lambda micro, j: method(micro, batch_idx, *rest)

    def _prepare_engine(self, batch: Any, batch_idx: int) -> None:
        """Cut the module (unless a validation before training did), then what training alone needs:
        optimizers restricted to this rank's weights or shard, their restored state, the emulation."""
        if not self.engine.prepared:
            silent = LogCapture(self.plan.microbatch_size)
            with capturing_logs(self.lightning_module, silent):
                self.engine.prepare(batch, self._microbatch_step("training_step", batch_idx))
        pending = self._state.resume.pending_module_state
        if isinstance(pending, ByName):  # the stage holds copies: the files' pages need not stay mapped
            pending.files.close()
        self._state.training_prepared = True
        for optimizer in self.optimizers:
            self.engine.setup_optimizer(optimizer)
        for optimizer, state in zip(self.optimizers, self._state.resume.pending_optimizer_states):
            shards.load_optimizer_state(optimizer, self.lightning_module, state)
        self._state.resume.pending_optimizer_states = []
        emulation = self._rank_emulation()
        if emulation is not None:
            costs = self._state.startup.calibrated_costs if self._state.startup is not None else None
            self._state.emulation = StageEmulation.start(
                emulation, costs, self.lightning_module, self.engine.cut, self.optimizers, self.plan.microbatch_size,
                offload=self.engine.offload, recompute=self.engine.recomputes,
            )

    def _captured(self, run, hook: str, batch_idx: int, *rest: Any):
        capture = LogCapture(self.plan.microbatch_size)
        with capturing_logs(self.lightning_module, capture):
            result = run(self._microbatch_step(hook, batch_idx, *rest))
        merger = self._state.log_mergers.setdefault(hook, LogMerger(self.root_device, self._state.host_group))
        replay(self.lightning_module, capture.merged_over_ranks(merger), self.plan.global_batch_size)
        return result

    @override
    def training_step(self, batch: Any, batch_idx: int, *rest: Any) -> torch.Tensor:
        if not self._state.training_prepared:
            self._prepare_engine(batch, batch_idx)
        if self._state.manual is not None:
            with self.precision_plugin.train_step_context():
                output = self._state.manual.training_step(batch, batch_idx, *rest)
            self._step_done(batch_idx)
            return output
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        scale = self.precision_plugin.loss_scale_value / accumulate
        # Accumulating over several batches adds the set-aside gradients after the run: no overlap then. Without
        # accumulation Lightning zeroes the last step's gradients in this step anyway: they are let go here (they
        # may be views into the reduction's buffer, which this run refills).
        overlap = accumulate == 1
        earlier = GradientStash.take(self.engine.local_parameters()) if not overlap else None
        if overlap:
            for param in self.engine.local_parameters():
                param.grad = None
        with self.precision_plugin.train_step_context():
            loss = self._captured(
                lambda step: self.engine.run(batch, step, scale, reduce_in_backward=overlap), "training_step", batch_idx, *rest
            )
        self._step_done(batch_idx)
        self._state.stashed = GradientStash.take(self.engine.local_parameters())
        if earlier is not None:
            earlier.put_back()
        return loss

    def _step_done(self, batch_idx: int) -> None:
        if self._state.emulation is not None:
            self._state.emulation.after_step()
        self._state.resume.step_done(batch_idx + 1, self.lightning_module.trainer.num_training_batches)

    def _evaluation_step(self, hook: str, batch: Any, batch_idx: int, *rest: Any) -> Any:
        if not self.engine.prepared:
            self._prepare_engine_for_evaluation(batch, batch_idx, hook)
        with self.precision_plugin.val_step_context():
            outputs = self._captured(lambda step: self.engine.evaluate(batch, step), hook, batch_idx, *rest)
        return [outputs[j] for j in sorted(outputs)] if outputs else None

    def _prepare_engine_for_evaluation(self, batch: Any, batch_idx: int, hook: str) -> None:
        """The cut is probed on a loss (its graph shows what crosses the stages): the training step gives
        one, where ``validation_step`` may only log and ``predict_step`` return no gradient."""
        probe = "training_step" if is_overridden("training_step", self.lightning_module) else hook
        silent = LogCapture(self.plan.microbatch_size)
        with capturing_logs(self.lightning_module, silent), torch.enable_grad():
            self.engine.prepare(batch, self._microbatch_step(probe, batch_idx))

    @override
    def validation_step(self, batch: Any, batch_idx: int, *rest: Any) -> Any:
        self._evaluation_step("validation_step", batch, batch_idx, *rest)

    @override
    def test_step(self, batch: Any, batch_idx: int, *rest: Any) -> Any:
        self._evaluation_step("test_step", batch, batch_idx, *rest)

    @override
    def predict_step(self, batch: Any, batch_idx: int, *rest: Any) -> Any:
        outputs = self._evaluation_step("predict_step", batch, batch_idx, *rest)
        if outputs and all(isinstance(o, torch.Tensor) for o in outputs):
            return torch.cat(outputs)
        return outputs

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The schedule already ran backward; its gradients come back here, between Lightning's hooks."""
        if self._state.manual is not None:
            return self._state.manual.backward(closure_loss, *args, **kwargs)  # manual_backward: a real backward
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._state.stashed.put_back()
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        def closure_then_reduce() -> Any:
            result = closure()
            if self._state.manual is None:  # manual_backward reduced its gradients already
                self.engine.reduce_gradients()
            # The step changes the weights: a survivor snapshot's copy still reading them (it overlapped this
            # step's forward and backward) finishes first, a wait on the device, not the host.
            self._state.keeper.before_optimizer_step()
            return result

        output = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        self.engine.after_optimizer_step()
        return output

    def _patch_clipping(self) -> None:
        """Lightning clips by the norm of this rank's parameters; the global norm spans every stage. (By hand:
        one unsharded stage whose gradients are reduced at backward, so Lightning's clipping is right as it is.)"""
        if self._state.clip_patched or not self.lightning_module.automatic_optimization:
            return
        self.precision_plugin.clip_grad_by_norm = lambda optimizer, clip_val: self.engine.clip_grad_norm_(clip_val)
        self._state.clip_patched = True

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
