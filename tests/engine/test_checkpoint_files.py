"""Atomic checkpoint files in one process: a save that dies or fails leaves the last good one loadable,
and a corrupt, truncated or incomplete checkpoint is refused with a message that says what to do."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from zorse_lightning.engine.checkpoint import files as checkpoint_files
from zorse_lightning.engine.checkpoint.files import COMMON, CheckpointError, read_file, read_manifest, shard_name


def _alone(obj):
    return [obj]


def _save(path: Path, value: float, **kwargs) -> None:
    shard = {"weight": torch.full((64,), value)}
    checkpoint_files.write_checkpoint(path, 0, shard, {"step": value}, {"world_size": 1}, _alone, **kwargs)


def _load(path: Path) -> tuple[dict, dict]:
    directory, manifest = read_manifest(path)
    return read_file(directory, manifest, COMMON), read_file(directory, manifest, shard_name(0))


def test_round_trip_and_overwrite(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, 1.0)
    _save(path, 2.0)  # replaces the first
    common, shard = _load(path)
    assert common == {"step": 2.0} and torch.equal(shard["weight"], torch.full((64,), 2.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # nothing left beside it
    _, manifest = read_manifest(path)
    assert set(manifest["files"]) == {COMMON, shard_name(0)} and manifest["world_size"] == 1


@pytest.mark.multiprocess
def test_process_killed_during_save_leaves_the_last_good_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, 1.0)
    script = textwrap.dedent(f"""
        import os, signal, torch
        from zorse_lightning.engine.checkpoint import files as checkpoint_files
        kill = lambda: os.kill(os.getpid(), signal.SIGKILL)
        checkpoint_files.write_checkpoint({str(path)!r}, 0, {{"weight": torch.zeros(64)}}, {{"step": 2.0}},
                                          {{"world_size": 1}}, lambda o: [o], before_publish=kill)
    """)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert killed.returncode == -9
    common, shard = _load(path)
    assert common == {"step": 1.0} and torch.equal(shard["weight"], torch.full((64,), 1.0))
    assert any(p.name.startswith(".last.ckpt.partial-") for p in tmp_path.iterdir())  # the dead save's files


def test_death_between_the_two_renames_loads_the_replaced_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, 1.0)
    path.rename(tmp_path / ".last.ckpt.replaced-abc")  # the first rename done, the second never happened
    assert checkpoint_files.is_checkpoint_directory(path)
    with pytest.warns(UserWarning, match="save was interrupted"):
        common, _ = _load(path)
    assert common == {"step": 1.0}


def test_failed_write_raises_and_keeps_the_previous(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    _save(path, 1.0)
    original = checkpoint_files._write

    def full_disk(obj, file):
        if file.name == COMMON:
            raise OSError(28, "No space left on device")
        return original(obj, file)

    monkeypatch.setattr(checkpoint_files, "_write", full_disk)
    with pytest.raises(CheckpointError, match="rank 0 could not write.*No space left.*previous checkpoint.*untouched"):
        _save(path, 2.0)
    assert _load(path)[0] == {"step": 1.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: f.write_bytes(f.read_bytes()[:-10]), "truncated"),
        (lambda f: f.write_bytes(f.read_bytes()[:-10] + bytes(10)), "checksum"),
        (lambda f: f.unlink(), "is missing"),
    ],
    ids=["truncated", "corrupt", "missing"],
)
def test_damaged_file_is_refused_and_the_earlier_checkpoint_still_loads(tmp_path, damage, message):
    earlier, later = tmp_path / "step1.ckpt", tmp_path / "step2.ckpt"
    _save(earlier, 1.0)
    _save(later, 2.0)
    damage(later / shard_name(0))
    with pytest.raises(CheckpointError, match=f"{shard_name(0)} .*{message}.*resume from an earlier one"):
        _load(later)
    assert _load(earlier)[0] == {"step": 1.0}


def test_incomplete_or_foreign_directory_is_refused(tmp_path):
    (tmp_path / "half.ckpt").mkdir()
    with pytest.raises(CheckpointError, match="no manifest.json: it is not a complete zorse checkpoint"):
        read_manifest(tmp_path / "half.ckpt")
    with pytest.raises(CheckpointError, match="no checkpoint at .*gone.ckpt"):
        read_manifest(tmp_path / "gone.ckpt")
    _save(tmp_path / "bad.ckpt", 1.0)
    (tmp_path / "bad.ckpt" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is corrupt"):
        read_manifest(tmp_path / "bad.ckpt")
