"""The plan-driven sampler: each rank loads exactly the samples of its microbatches.

Global batch ``g`` of an epoch is positions ``[g B, (g+1) B)`` of the epoch's
order (a seeded permutation when the user's loader shuffles, else the dataset
order); microbatch ``j`` is its samples ``[j m, (j+1) m)``, and a rank loads
the contiguous microbatches the plan gives it. Positions are counted in global
samples, whatever the number of ranks, so a run resumed on another cluster (another
plan) continues with the same samples. The shuffled order of epoch ``e`` is the one
``DistributedSampler.set_epoch(e)`` gives (seed ``seed + e``), so a global batch
holds the samples of DDP's global batch of the same step.

The strategy, not Lightning's epoch counter, moves the sampler on (the
``"zorse"`` section of a checkpoint records where): after each step to the next
global batch, after an epoch's last one to the next epoch's start. Lightning's
``set_epoch`` does not reach a batch sampler, and its counter is not the data's:
a fit stopped by ``max_steps`` mid-epoch counts as a finished epoch, so a resume
would skip the rest of that epoch and shift every later epoch's order by one
from an uninterrupted run's.

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

from zorse_lightning.schedule.plan import Plan


@dataclass(frozen=True)
class SamplerState:
    """Where the training data continues: ``samples_done`` global samples into epoch ``epoch``."""

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
        size = self.plan.global_batch_size
        starts = range(self.skip_samples, self.dataset_size - size + 1, size)
        if self.skip_samples and not starts:
            raise ValueError(
                f"epoch {self.epoch} resumes at global sample {self.skip_samples}, but it has {len(self)} full global "
                f"batches of {size} ({len(self) * size} samples): this rank would train nothing in it. The "
                "checkpoint's data position does not fit this loader; resume with the dataset and global batch size "
                "the checkpoint was taken with"
            )
        order = self.epoch_order()
        for start in starts:
            yield [order[start + row] for row in self.rows]

    def require_batches(self) -> None:
        """A training epoch without one full global batch would end at once, and Lightning only logs that it
        had no batches: refused instead."""
        size = self.plan.global_batch_size
        if len(self) == 0:
            raise ValueError(
                f"the training dataset has {self.dataset_size} samples, fewer than one global batch of {size}: zorse "
                "trains full global batches only (an incomplete one is dropped, as with drop_last=True), so no step "
                f"would run; give the loader at least {size} samples or make its batch size smaller"
            )

    def state(self, batches_done: int, epoch_batches: int) -> SamplerState:
        """The position after ``batches_done`` of the ``epoch_batches`` global batches Lightning runs this epoch
        (``limit_train_batches`` applied): after the last one, the start of the next epoch."""
        if batches_done >= epoch_batches:
            return SamplerState(self.epoch + 1, 0, self.seed, self.shuffle)
        return SamplerState(self.epoch, batches_done * self.plan.global_batch_size, self.seed, self.shuffle)

    def restore(self, state: SamplerState) -> None:
        """Continue at ``state``. A position at the very end of its epoch, as checkpoints recorded an epoch's end
        before the position moved on to the next epoch's start, is the next epoch's start."""
        epoch_end = len(self) * self.plan.global_batch_size
        if 0 < epoch_end == state.samples_done:
            self.epoch, self.skip_samples = state.epoch + 1, 0
        else:
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
