"""NCCL's own device memory, measured on a real GPU as the first communicator is made.

NCCL allocates outside torch's caching allocator, so no torch statistic shows it,
and how much it takes depends on the machine far more than on ``NCCL_BUFFSIZE``:
measured on one H200 (NCCL 2.28.9, torch 2.11, a world of one, so no peer and no
buffer toward one), the first communicator took 558 MiB and each later one 388-390
MiB whatever ``NCCL_BUFFSIZE``; 16-18 MiB under ``NCCL_MAX_NCHANNELS=2``; 900 MiB
each under ``NCCL_RUNTIME_CONNECT=0``. So at setup the strategy makes the default
group's communicator on purpose, with the device's free memory read before and after
(``cudaMemGetInfo``, which sees every allocation); the figure goes into the rank's
device report (:mod:`zorse_lightning.startup.detection`), and the memory model prices
each of the rank's communicators by it (NCCL's one-time setup included: a little
over, never under).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def measure_first_communicator(device: torch.device) -> int:
    """Make the default group's communicator (its first collective: collective, every rank calls it once the
    group exists and before anything else runs on it) and return the bytes it took on ``device`` (CUDA): the
    free memory it took, less what torch's caching allocator reserved for the collective's tensor meanwhile."""
    torch.cuda.synchronize(device)
    free_before, reserved_before = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
    dist.all_reduce(torch.zeros(1, device=device))
    torch.cuda.synchronize(device)
    free_after, reserved_after = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
    return max((free_before - free_after) - (reserved_after - reserved_before), 0)
