"""The plan-driven sampler: each rank loads exactly the samples of its microbatches.

Global batch ``g`` of an epoch is positions ``[g B, (g+1) B)`` of the epoch's
order (a seeded permutation when the user's loader shuffles, else the dataset
order); microbatch ``j`` is its samples ``[j m, (j+1) m)``, and a rank loads
the contiguous microbatches the plan gives it. Positions are counted in global
samples, whatever the number of ranks, so a run resumed on another cluster (another
plan) continues with the same samples.

An idle rank (``Plan.idle_ranks``) loads no sample, yet its Lightning loop must
run every step, since it joins the world-wide collectives of each step: its
loader yields one :class:`NoSamples` batch per global batch, as many as every
other rank's loader yields.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler
from torch.utils.data.distributed import DistributedSampler

from zorse_lightning.planner.plan import Plan


@dataclass(frozen=True)
class SamplerState:
    epoch: int
    samples_done: int
    """Global samples of this epoch already trained on (a multiple of the global batch size)."""
    seed: int
    shuffle: bool


class NoSamples:
    """The batch of an idle rank: no samples (the strategy's step runs no microbatch on it).

    Not ``None``, which Lightning's loop would skip, taking the rank out of the step's collectives.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "NoSamples()"


def no_samples(samples: list[Any]) -> NoSamples:
    """The collate function of an idle rank's loader (its index lists are empty)."""
    return NoSamples()


class PlanBatchSampler(Sampler[list[int]]):
    """Batches of one rank: its share of each global batch (empty on an idle rank); incomplete global
    batches are dropped."""

    def __init__(self, dataset_size: int, plan: Plan, rank: int, shuffle: bool, seed: int = 0) -> None:
        self.dataset_size = dataset_size
        self.plan = plan
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.skip_samples = 0
        self.rows = self._rows(plan, rank)

    @staticmethod
    def _rows(plan: Plan, rank: int) -> range:
        """Positions inside each global batch that ``rank`` loads."""
        if rank in plan.idle_ranks:
            return range(0)
        share = plan.stages[plan.stage_of_rank(rank)].microbatch_ranges()[rank]
        m = plan.microbatch_size
        # A stage's rank without microbatches still takes part in every step; it gets one microbatch it ignores.
        return range(share.start * m, share.stop * m) if len(share) else range(m)

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this at each epoch start; a new epoch starts at its beginning."""
        if epoch != self.epoch:
            self.skip_samples = 0
        self.epoch = epoch

    def epoch_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def __len__(self) -> int:
        """Global batches of the whole epoch, those trained before a resume included: Lightning counts its
        progress through the epoch from the checkpoint on, and would end a shorter epoch early."""
        return self.dataset_size // self.plan.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        order = self.epoch_order()
        size = self.plan.global_batch_size
        for start in range(self.skip_samples, self.dataset_size - size + 1, size):
            yield [order[start + row] for row in self.rows]

    def state(self, samples_done: int) -> SamplerState:
        return SamplerState(self.epoch, samples_done, self.seed, self.shuffle)

    def restore(self, state: SamplerState) -> None:
        self.epoch, self.skip_samples = state.epoch, state.samples_done


def loader_shuffles(loader: DataLoader) -> bool:
    sampler = loader.sampler
    return isinstance(sampler, RandomSampler) or (isinstance(sampler, DistributedSampler) and sampler.shuffle)


def plan_dataloader(loader: DataLoader, plan: Plan, rank: int, seed: int) -> DataLoader:
    """The user's loader (dataset, collate, workers) with the plan's batches for this rank; on an idle
    rank, batches of :class:`NoSamples` without workers."""
    batch_sampler = PlanBatchSampler(len(loader.dataset), plan, rank, loader_shuffles(loader), seed)
    if rank in plan.idle_ranks:
        return DataLoader(loader.dataset, batch_sampler=batch_sampler, collate_fn=no_samples)
    kwargs: dict[str, Any] = dict(
        batch_sampler=batch_sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn,
    )
    if loader.num_workers > 0:
        kwargs.update(persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor)
    return DataLoader(loader.dataset, **kwargs)
