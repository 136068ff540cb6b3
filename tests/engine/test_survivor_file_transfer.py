"""A survivor's file goes, over gloo and chunk by chunk, only to the ranks that cannot see it (three ranks:
rank 0 keeps the file on its "local disk", rank 1 sees it too, rank 2 does not)."""

from __future__ import annotations

from pathlib import Path

import pytest

from testing.launch import spawn_ranks

pytestmark = pytest.mark.multiprocess


def _worker(rank: int, out: Path) -> dict:
    import torch
    import torch.distributed as dist

    from zorse_lightning.engine.checkpoint import relaunch
    from zorse_lightning.engine.checkpoint.survivors import KeptIndex

    dist.init_process_group("gloo", rank=rank, world_size=3)
    relaunch.CHUNK_BYTES = 1000  # several chunks, the last one short
    kept = out / "machine-a" / "step-3" / "rank-0.pt"
    if rank == 0:
        kept.parent.mkdir(parents=True)
        torch.save({"state_dict": {"w": torch.arange(1000.0)}}, kept)
    dist.barrier()
    index = KeptIndex(0, 3, ("w",), ((),), str(kept))
    seen = {str(kept)} if rank in (0, 1) else set()
    local = relaunch._local_paths([index], seen, rank, out / f"received-{rank}", relaunch.all_gather, None)
    return {"local": str(local[str(kept)]), "equal": local[str(kept)].read_bytes() == kept.read_bytes(),
            "received": sorted(str(p.relative_to(out)) for p in out.glob(f"received-{rank}/**/*.pt"))}


def test_only_the_rank_that_cannot_see_a_survivors_file_receives_it(tmp_path):
    """Would catch every file sent to every rank (``all_gather_object`` on the default group: under NCCL,
    pickled bytes staged on every GPU) or a file cut short between chunks."""
    results = spawn_ranks(_worker, 3, tmp_path)
    kept = str(tmp_path / "machine-a" / "step-3" / "rank-0.pt")
    assert [r["local"] for r in results[:2]] == [kept, kept]
    assert [r["received"] for r in results] == [[], [], ["received-2/step-3/rank-0.pt"]]
    assert all(r["equal"] for r in results)
