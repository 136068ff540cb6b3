"""Survivors keep state on a device from host copies taken at step end (#13, faults under NCCL).

Under NCCL a collective that a dead peer never joins blocks the CUDA stream, so keeping must not read a device
tensor. On the CPU, ``SurvivorKeeper(host_copies=True)`` takes the path a GPU rank takes; the live tensors are
then made unreadable (meta) or moved on, and what is kept must be the snapshot's values exactly.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from zorse_lightning.engine.groups import NCCL_ERROR_HANDLING, tear_down_hung_collectives
from zorse_lightning.engine.checkpoint.host_copies import CopyDone
from zorse_lightning.engine.checkpoint import survivors as fast_recovery
from zorse_lightning.engine.checkpoint.shards import held_module_state, held_optimizer_state
from zorse_lightning.engine.checkpoint.survivors import SurvivorKeeper


def _trained(device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    """A module with parameters and buffers (batch norm's running statistics), after one Adam step."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(device)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    _step(module, optimizer)
    return module, optimizer


def _step(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    device = next(module.parameters()).device
    optimizer.zero_grad()
    module(torch.randn(5, 3, device=device)).square().sum().backward()
    optimizer.step()


def _held_now(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"state_dict": held_module_state(module), "optimizers": [held_optimizer_state(optimizer, module)]}


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def _assert_same(kept: Any, expected: Any) -> None:
    """Same structure, same leaf types, tensors equal bit for bit with the same dtype."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(kept, torch.Tensor) and kept.dtype == expected.dtype and torch.equal(kept, expected)
    elif isinstance(expected, dict):
        assert list(kept) == list(expected)
        for key in expected:
            _assert_same(kept[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(kept) is type(expected) and len(kept) == len(expected)
        for k, e in zip(kept, expected):
            _assert_same(k, e)
    else:
        assert kept == expected


def _make_unreadable(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Swap every live tensor's contents for a meta tensor (same Python objects, so the optimizer still finds
    its parameters by identity): reading one fails, and the module's state dict no longer holds them."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point():
            stand_in = torch.empty_like(tensor, device="meta")
            torch.utils.swap_tensors(tensor, nn.Parameter(stand_in) if isinstance(tensor, nn.Parameter) else stand_in)
    for state in optimizer.state.values():
        for key, value in state.items():
            state[key] = torch.empty_like(value, device="meta")


def test_keep_writes_the_snapshot_copies_without_reading_a_live_tensor(tmp_path):
    """Would catch keep() reading the module or optimizer at loss time (a device-to-host copy behind a hung
    collective under NCCL): every live tensor is unreadable by then, yet the snapshot's values are kept."""
    module, optimizer = _trained()
    score = torch.tensor(0.5)
    keeper = SurvivorKeeper(host_copies=True)
    keeper.snapshot(1, {"global_step": 1, "best_score": score}, module, [optimizer])
    expected = _held_now(module, optimizer)
    score.fill_(9.0)  # a later change to the checkpoint's own part must not reach it either
    _make_unreadable(module, optimizer)

    path = keeper.keep(tmp_path, 0, module, [optimizer])

    assert path == tmp_path / "step-1" / "rank-0.pt"
    kept = _load(path)
    assert kept["step"] == 1 and kept["common"]["best_score"].item() == 0.5
    _assert_same({"state_dict": kept["state_dict"], "optimizers": kept["optimizers"]}, expected)


def test_more_optimizer_steps_after_the_snapshot_still_keep_the_snapshot_step(tmp_path):
    """Would catch the host-copy path refusing, or mixing in, state moved on by steps the snapshot did not see
    (the main thread keeps training until it meets the lost peer)."""
    module, optimizer = _trained()
    keeper = SurvivorKeeper(host_copies=True)
    keeper.snapshot(1, {"global_step": 1}, module, [optimizer])
    expected = _held_now(module, optimizer)
    _step(module, optimizer)
    _step(module, optimizer)

    path = keeper.keep(tmp_path, 0, module, [optimizer])

    kept = _load(path)
    assert kept["step"] == 1 and kept["common"] == {"global_step": 1}
    _assert_same({"state_dict": kept["state_dict"], "optimizers": kept["optimizers"]}, expected)
    assert json.loads((tmp_path / "step-1" / "rank-0.json").read_text())["step"] == 1
    assert not torch.equal(kept["state_dict"]["0.weight"], module[0].weight.detach())


def test_on_the_host_tensors_moved_since_the_snapshot_are_not_kept(tmp_path):
    """Would catch the default losing its host-side choice: state on the CPU is snapshotted by version counters
    (no copy), so tensors that moved on belong to no completed step and nothing is kept."""
    module, optimizer = _trained()
    keeper = SurvivorKeeper()
    keeper.snapshot(1, {"global_step": 1}, module, [optimizer])
    _step(module, optimizer)

    assert keeper.keep(tmp_path, 0, module, [optimizer]) is None
    assert not (tmp_path / "step-1").exists()


def test_host_copies_write_the_same_files_as_reading_at_keep_time(tmp_path):
    """Would catch the on-disk format drifting (``load`` and ``_read_kept`` read these files): both ways of
    keeping the same state write the same keys, structure, dtypes, values and index."""
    module, optimizer = _trained()
    for host_copies in (True, False):
        keeper = SurvivorKeeper(host_copies=host_copies)
        keeper.snapshot(1, {"global_step": 1, "loops": {"epoch": 0}}, module, [optimizer])
        keeper.keep(tmp_path / str(host_copies), 0, module, [optimizer])

    copied, read = (tmp_path / "True" / "step-1", tmp_path / "False" / "step-1")
    _assert_same(_load(copied / "rank-0.pt"), _load(read / "rank-0.pt"))
    assert (copied / "rank-0.json").read_text() == (read / "rank-0.json").read_text()


def test_a_snapshot_cut_short_leaves_the_previous_step_whole(tmp_path, monkeypatch):
    """Would catch host copies refilled in one buffer set, or a snapshot counted before its copy completed: a
    copy that never completes (its stream waits behind a hung collective) must not have overwritten the step
    that keeping then writes, and no later snapshot may start into the buffers being kept."""
    module, optimizer = _trained()
    keeper = SurvivorKeeper(host_copies=True)
    keeper.snapshot(1, {"global_step": 1}, module, [optimizer])
    _step(module, optimizer)
    keeper.snapshot(2, {"global_step": 2}, module, [optimizer])
    expected = _held_now(module, optimizer)
    _step(module, optimizer)

    monkeypatch.setattr(CopyDone, "query", lambda self: False)  # the copies never complete
    monkeypatch.setattr(fast_recovery, "KEEP_WAITS_FOR_COPY_S", 0.05)
    assert keeper.snapshot(3, {"global_step": 3}, module, [optimizer]) is True  # queued, not yet counted
    assert keeper.newest_step == 2

    kept = _load(keeper.keep(tmp_path, 0, module, [optimizer]))
    assert kept["step"] == 2
    _assert_same({"state_dict": kept["state_dict"], "optimizers": kept["optimizers"]}, expected)
    assert keeper.snapshot(4, {"global_step": 4}, module, [optimizer]) is False  # keeping began: none more


def test_a_snapshot_due_while_the_previous_copy_runs_waits_for_it(tmp_path, monkeypatch):
    """Would catch a rank skipping a snapshot while its previous copy runs (issue 29): ranks would then keep
    different steps, and after a loss the survivors might share none."""
    module, optimizer = _trained()
    keeper = SurvivorKeeper(host_copies=True)
    waited: list[int] = []
    monkeypatch.setattr(CopyDone, "query", lambda self: False)  # each copy is still running when asked
    monkeypatch.setattr(CopyDone, "wait", lambda self: waited.append(1))
    monkeypatch.setattr(fast_recovery, "KEEP_WAITS_FOR_COPY_S", 0.05)
    assert keeper.snapshot(1, {"global_step": 1}, module, [optimizer]) is True
    _step(module, optimizer)
    expected = _held_now(module, optimizer)
    assert keeper.snapshot(2, {"global_step": 2}, module, [optimizer]) is True  # waited for step 1's copy
    assert waited == [1] and keeper.newest_step == 1
    _step(module, optimizer)
    assert keeper.snapshot(3, {"global_step": 3}, module, [optimizer]) is True
    assert waited == [1, 1] and keeper.newest_step == 2
    kept = _load(keeper.keep(tmp_path, 0, module, [optimizer]))  # step 3's copy never completes: step 2 kept
    assert kept["step"] == 2
    _assert_same({"state_dict": kept["state_dict"], "optimizers": kept["optimizers"]}, expected)


def test_the_runs_unchanging_entries_are_given_once_and_written_with_every_file(tmp_path):
    """Would catch the plan and inventory dropped from survivors' files now that snapshots no longer carry them."""
    module, optimizer = _trained()
    keeper = SurvivorKeeper(host_copies=True)
    keeper.static = {"zorse": {"plan": {"world_size": 2}, "inventory": "lab"}}
    keeper.snapshot(1, {"global_step": 1, "zorse": {"sampler": {"epoch": 3}}}, module, [optimizer])
    kept = _load(keeper.keep(tmp_path, 0, module, [optimizer]))
    assert kept["common"]["zorse"] == {"plan": {"world_size": 2}, "inventory": "lab", "sampler": {"epoch": 3}}


def test_snapshots_stop_once_keeping_has_started(tmp_path, monkeypatch):
    """Would catch the main thread's step-end snapshots refilling the buffers the watchdog's thread is writing
    (two more snapshots come back round to the set being kept)."""
    module, optimizer = _trained()
    keeper = SurvivorKeeper(host_copies=True)
    keeper.snapshot(1, {"global_step": 1}, module, [optimizer])
    expected = _held_now(module, optimizer)
    writing, release = threading.Event(), threading.Event()
    write = fast_recovery._write_atomically

    def held_up(path: Path, content: Any, mode: str) -> None:
        writing.set()
        release.wait()
        write(path, content, mode)

    monkeypatch.setattr(fast_recovery, "_write_atomically", held_up)
    kept: list[Path | None] = []
    watchdog = threading.Thread(target=lambda: kept.append(keeper.keep(tmp_path, 0, module, [optimizer])))
    watchdog.start()
    writing.wait()
    for step in (2, 3):
        _step(module, optimizer)
        keeper.snapshot(step, {"global_step": step}, module, [optimizer])
    release.set()
    watchdog.join()

    loaded = _load(kept[0])
    assert loaded["step"] == 1
    _assert_same({"state_dict": loaded["state_dict"], "optimizers": loaded["optimizers"]}, expected)


def test_snapshots_refill_two_host_buffer_sets_in_turn():
    """Would catch a new host allocation at every step end (the held state's size, each step)."""
    module, optimizer = _trained()
    keeper = SurvivorKeeper(host_copies=True)
    pointers = []
    for step in (1, 2, 3):
        keeper.snapshot(step, {"global_step": step}, module, [optimizer])
        pointers.append([t.data_ptr() for t in keeper._snapshot.host.leaves if isinstance(t, torch.Tensor)])
        _step(module, optimizer)

    assert pointers[2] == pointers[0]
    assert not set(pointers[1]) & set(pointers[0])


def test_nccl_groups_end_a_hung_collective_unless_the_user_chose_otherwise(monkeypatch):
    """Would catch the setting missing (a collective hung by a dead peer could block forever), overriding the
    user's or launcher's value, or leaking into gloo runs."""
    monkeypatch.delenv(NCCL_ERROR_HANDLING, raising=False)
    tear_down_hung_collectives("gloo")
    assert NCCL_ERROR_HANDLING not in os.environ
    tear_down_hung_collectives("nccl")
    assert os.environ[NCCL_ERROR_HANDLING] == "3"
    monkeypatch.setenv(NCCL_ERROR_HANDLING, "1")
    tear_down_hung_collectives("nccl")
    assert os.environ[NCCL_ERROR_HANDLING] == "1"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_keep_finishes_while_the_stream_is_blocked(tmp_path):
    """Would catch keep() waiting on the CUDA stream: a long kernel stands for a collective the lost peer never
    joins, and keeping, from another thread as the watchdog does, must finish long before it."""
    module, optimizer = _trained("cuda")
    keeper = SurvivorKeeper()  # decides by itself: the state lives on the GPU
    keeper.snapshot(1, {"global_step": 1}, module, [optimizer])
    expected = _held_now(module, optimizer)
    torch.cuda.synchronize()  # the copy ran on its side stream; it counts once complete
    assert keeper.newest_step == 1 and keeper.last_copy_ms is not None
    assert all(t.is_pinned() for t in keeper._snapshot.host.leaves if isinstance(t, torch.Tensor))

    torch.cuda._sleep(20_000_000_000)  # some 10 s of clock cycles on the stream, before anything keep could queue
    kept: list[Path | None] = []
    thread = threading.Thread(target=lambda: kept.append(keeper.keep(tmp_path, 0, module, [optimizer])))
    thread.start()
    thread.join(timeout=60)
    stream_was_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()

    assert kept and stream_was_busy
    loaded = _load(kept[0])
    _assert_same({"state_dict": loaded["state_dict"], "optimizers": loaded["optimizers"]}, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_copy_overlaps_and_the_next_optimizer_step_waits_for_it(tmp_path):
    """Would catch a snapshot that makes the host wait for its copy, or an optimizer step that changes the weights
    while the copy still reads them: the stream is kept busy, the snapshot returns at once, and what it holds
    is the weights of its step although the step after it ran before the copy could."""
    module, optimizer = _trained("cuda")
    keeper = SurvivorKeeper()
    expected = _held_now(module, optimizer)
    torch.cuda._sleep(2_000_000_000)  # about a second of clock cycles queued before the copy
    keeper.snapshot(1, {"global_step": 1}, module, [optimizer])
    assert keeper.newest_step is None  # queued behind the sleep: not counted yet, and the host did not wait
    keeper.before_optimizer_step()
    _step(module, optimizer)  # queued on the compute stream after a wait on the copy
    torch.cuda.synchronize()
    assert keeper.newest_step == 1
    kept = _load(keeper.keep(tmp_path, 0, module, [optimizer]))
    _assert_same({"state_dict": kept["state_dict"], "optimizers": kept["optimizers"]}, expected)


class _Settings:
    """A callback's state as an object: not loadable with ``weights_only=True``."""


def test_a_snapshot_a_relaunch_could_not_read_is_refused_at_the_first_snapshot():
    """Would catch a survivor's file that the relaunch (``weights_only=True``) refuses, found only after a loss."""
    from zorse_lightning.engine.checkpoint.files import NotWeightsOnlyError

    module, optimizer = _trained()
    with pytest.raises(NotWeightsOnlyError, match=r"survivor snapshot .*plain containers.*RecoveryPolicy\(enabled=False\)"):
        SurvivorKeeper().snapshot(1, {"callbacks": {"mine": _Settings()}}, module, [optimizer])
