"""The processes, devices and collectives of ``ZorseStrategy`` (one of its bases): Lightning's side of a run
over several processes, answered for a cluster whose machines may run different numbers of them.

Lightning asks a parallel strategy how to start its processes, which rank and device each is, how to
join them, what to build tensors on, and for its own small collectives (barrier, broadcast, reduce). A
zorse run takes ranks from its launcher as they are, joins the process group with the cluster's backend
(NCCL's first communicator measured while the GPU is empty), and moves nothing to a device before the
engine's cut. The attributes these hooks read (``inventory``, ``_state``, ``_start_method``, ``_timeout``,
``_num_nodes``) are set by :class:`~.zorse_strategy.ZorseStrategy`.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from zorse_lightning.engine.groups import backend_for, tear_down_hung_collectives
from zorse_lightning.engine.nccl_memory import measure_first_communicator
from zorse_lightning.strategy.accelerator import cuda_index_for, resolve_accelerator
from zorse_lightning.strategy.environment import HeterogeneousEnvironment


class ProcessHooks(ParallelStrategy):
    """Launch, ranks, devices and Lightning's collectives; where tensors are built."""

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

    # -- where tensors are built -------------------------------------------------------------

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
