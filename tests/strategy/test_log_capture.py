"""Merging captured logs over 3 gloo ranks: the cached tensor path gives the object gather's result exactly;
on one rank nothing is merged and tensor values stay tensors."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from zorse_lightning.strategy.log_capture import LogCapture, LoggedValue, LogMerger
from testing.launch import spawn_ranks

pytestmark = pytest.mark.multiprocess

WORLD = 3
LOSS = {"prog_bar": True}
SUM = {"reduce_fx": "sum"}


def _calls(step: int, rank: int) -> list[tuple[str, float, dict[str, Any]]]:
    """What ``rank`` logs at ``step``: rank 2 logs nothing until step 9; values are not dyadic, so a sum
    in another order than the object gather's would differ in the last bits."""
    loss = ("loss", 0.1 * (step + 1) + rank / 3, LOSS)
    count = ("count", 1.0 + rank, SUM)
    extra = ("extra", 0.7 / (step + 1), {})
    acc = ("acc", 0.1 + rank / 4, {})  # totals 0.1 + 0.7 + 1.8 = 2.5999999999999996; reversed: 2.6
    if step in (5, 6):  # nobody logs
        return []
    if rank == 2:
        return [loss, ("loss", 1 / 7, LOSS), acc] if step >= 9 else []
    if rank == 1:
        return [loss, acc] if step >= 9 else [loss, extra] if step in (3, 4, 7) else [loss]
    if step == 8:
        return [("loss", loss[1], {"prog_bar": False}), count]  # same names, other options
    if step >= 9:
        return [count, acc]  # rank 0 stops logging "loss": its order and options now come from rank 1
    return [loss, count, loss]


EXPECTED_OBJECT_GATHERS = [1, 1, 1, 2, 2, 3, 3, 4, 5, 6, 6]
"""After each step: the first; step 3 (rank 1 adds "extra"); 5 (nobody logs); 7 (rank 1's "extra" again after
5-6); 8 (rank 0's options); 9 (rank 0 drops "loss", rank 2 starts); the steps between reuse the layout."""


def _rows(merged: dict[str, LoggedValue]) -> list[list[Any]]:
    """Plain numbers (the tensor path keeps its merged values on the device: tensors)."""
    return [[name, record.kwargs, float(record.total), int(record.samples)] for name, record in merged.items()]


def _worker(rank: int, out_dir: Path) -> list[dict[str, Any]]:
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        merger = LogMerger()
        steps = []
        for step in range(len(EXPECTED_OBJECT_GATHERS)):
            capture = LogCapture(samples_per_call=rank + 1)
            for name, value, kwargs in _calls(step, rank):
                capture.log(name, value, **kwargs)  # a float: a tensor would be rounded to float32 first
            steps.append({
                "cached": _rows(capture.merged_over_ranks(merger)),
                "plain": _rows(capture.merged_over_ranks()),
                "object_gathers": merger.object_gathers,
            })
        return steps
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[list[dict[str, Any]]]:
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("log_capture"))


def test_cached_merge_equals_the_object_gather_bit_for_bit_on_every_rank(results):
    for rank, steps in enumerate(results):
        for step, merged in enumerate(steps):
            assert merged["cached"] == merged["plain"], (rank, step)  # plain: the object gather, as before
            assert merged["cached"] == results[0][step]["cached"], (rank, step)


def test_the_tensor_path_is_taken_while_every_rank_logs_the_same_names(results):
    for steps in results:
        assert [merged["object_gathers"] for merged in steps] == EXPECTED_OBJECT_GATHERS


def test_merged_values_names_order_and_options(results):
    steps = results[0]
    # Step 1, tensor path: loss from rank 0 (2 calls x 1 sample) and rank 1 (1 call x 2 samples); rank 2 idle.
    loss_total = 2 * (0.2 + 0.0) + 1 * 2 * (0.2 + 1 / 3)
    assert steps[1]["cached"] == [["loss", LOSS, loss_total, 4], ["count", SUM, 1.0, 1]]
    assert steps[4]["cached"][2] == ["extra", {}, 2 * 0.7 / 5, 2]  # logged by rank 1 alone
    assert steps[5]["cached"] == steps[6]["cached"] == []  # nobody logs: nothing to replay, no division by zero
    assert steps[8]["cached"][0][1] == {"prog_bar": False}  # options of the first rank that logs the name
    # Step 10: rank 0 logs no "loss", so it comes last; "loss" from ranks 1 (2 samples) and 2 (2 x 3).
    assert [row[:2] for row in steps[10]["cached"]] == [["count", SUM], ["acc", {}], ["loss", LOSS]]
    assert steps[10]["cached"][2][3] == 2 + 2 * 3
    assert steps[10]["cached"][1][2:] == [0.0 + 0.1 + (0.1 + 1 / 4) * 2 + (0.1 + 2 / 4) * 3, 1 + 2 + 3]  # rank order


def test_one_rank_merges_nothing_and_keeps_logged_tensors_on_their_device(monkeypatch):
    """Would catch a collective, or a read of the device (``float(tensor)``), for each ``self.log`` of a
    one-rank run: logged tensors stay tensors and are divided on their device."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_gather_object", lambda *a, **k: pytest.fail("gathered on one rank"))
    capture = LogCapture(samples_per_call=2)
    import torch

    loss = torch.tensor(0.5, requires_grad=True) * 3
    capture.log("loss", loss, prog_bar=True)
    capture.log("loss", torch.tensor(2.5), prog_bar=True)
    merged = capture.merged_over_ranks(LogMerger())
    assert isinstance(merged["loss"].value, torch.Tensor) and not merged["loss"].value.requires_grad
    assert merged["loss"].value.item() == 2.0
