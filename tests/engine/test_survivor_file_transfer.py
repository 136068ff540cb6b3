"""A survivor's file goes, over gloo and chunk by chunk, only to the ranks that cannot see it and whose stage
needs it. Three ranks: rank 0 kept ``blocks.0`` on its "local disk" and sees it; ranks 1 and 2 cannot; the new
plan puts block 0 on rank 1's stage, block 1 on rank 2's."""

from __future__ import annotations

from pathlib import Path

import pytest

from testing.launch import spawn_ranks

pytestmark = pytest.mark.multiprocess


def _worker(rank: int, out: Path) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    from testing.plans import hand_plan
    from zorse_lightning.engine.checkpoint import relaunch
    from zorse_lightning.engine.checkpoint.by_name import OpenedFiles
    from zorse_lightning.engine.checkpoint.survivors import KeptIndex
    from zorse_lightning.module.blocks import find_block_list

    dist.init_process_group("gloo", rank=rank, world_size=3)
    relaunch.CHUNK_BYTES = 1000  # several chunks, the last one short
    kept = out / "machine-a" / "step-3" / "rank-0.pt"
    if rank == 0:
        kept.parent.mkdir(parents=True)
        torch.save({"state_dict": {"blocks.0.weight": torch.arange(1000.0)}}, kept)
    dist.barrier()
    index = KeptIndex(0, 3, ("blocks.0.weight",), (("blocks.0.weight",),), str(kept))
    files = OpenedFiles()
    remote = relaunch._remote_files([index], {str(kept)} if rank == 0 else set(), out / f"received-{rank}", files,
                                    relaunch.all_gather)
    module = nn.Module()
    module.blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])
    plan = hand_plan([((1,), (1,), (0, 1)), ((2,), (1,), (1, 2))], microbatch_size=1, idle_ranks=(0,))
    relaunch.fetch(remote, relaunch.stage_may_hold(plan, rank, find_block_list(module)), rank, relaunch.all_gather)
    received = sorted(str(p.relative_to(out)) for p in out.glob(f"received-{rank}/**/*.pt"))
    read = files.get(kept)["state_dict"]["blocks.0.weight"] if rank != 2 else None
    return {"received": received, "read": read is not None and torch.equal(read, torch.arange(1000.0))}


def test_a_survivors_file_goes_only_to_the_ranks_that_cannot_see_it_and_need_it(tmp_path):
    """Would catch every file sent to every rank (``all_gather_object`` on the default group: under NCCL,
    pickled bytes staged on every GPU), a file sent to a rank whose stage holds none of it, or a file cut short
    between chunks."""
    results = spawn_ranks(_worker, 3, tmp_path)
    assert [r["received"] for r in results] == [[], ["received-1/step-3/rank-0.pt"], []]
    assert results[0]["read"] and results[1]["read"]  # rank 0 where it lies, rank 1 from its copy
