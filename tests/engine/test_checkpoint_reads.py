"""Reading a checkpoint at scale, in one process (ranks are threads sharing a gather): a rank opens only the
files holding the tensors it asks for, memory-mapped; every file is unpickled with ``weights_only=True`` and
one that is not so is refused naming the file, the rule and the fix; each file's checksum is computed by one
rank; a checkpoint listing a shard that is not there is never published."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from zorse_lightning.engine.checkpoint import files as checkpoint_files
from zorse_lightning.engine.checkpoint import shards
from zorse_lightning.engine.checkpoint.files import (
    COMMON, CheckpointError, FileRecord, NotWeightsOnlyError, open_file, read_manifest, shard_name, verify_files,
)
from zorse_lightning.engine.checkpoint.shards import NAMED_STATE_KEY
from zorse_lightning.module.stage_weights import read_into


class Settings:
    """A user's hyper-parameters as an object: not a plain container."""

    lr = 0.1


class _Threads:
    """``world`` ranks as threads: ``gather(rank)`` is an all-gather among them."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world)
        self._slots: list = [None] * world

    def gather(self, rank: int):
        def gather(obj):
            self._slots[rank] = obj
            self._barrier.wait()
            gathered = list(self._slots)
            self._barrier.wait()  # nobody overwrites a slot before everyone has read it
            return gathered

        return gather

    def run(self, work) -> list:
        results: list = [None] * self.world
        errors: list = []

        def one(rank: int) -> None:
            try:
                results[rank] = work(rank, self.gather(rank))
            except BaseException as error:  # noqa: BLE001 - handed to the test thread
                errors.append(error)
                self._barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


def _two_stage_checkpoint(path: Path) -> None:
    """Rank r held stage r: ``blocks.r.weight`` and its Adam state."""

    def write(rank: int, gather) -> None:
        name = f"blocks.{rank}.weight"
        shard = {
            "state_dict": {name: torch.full((256,), float(rank))},
            "optimizers": [{name: {"step": torch.tensor(3.0), "exp_avg": torch.full((256,), 10.0 + rank)}}],
            "rng": shards.rng_state(),
        }
        common = {"global_step": 3, "optimizer_states": [{"param_groups": [{"lr": 0.1}]}]}
        contents = {shard_name(r): {"state_dict": [f"blocks.{r}.weight"], "optimizers": [[f"blocks.{r}.weight"]]}
                    for r in range(2)}
        checkpoint_files.write_checkpoint(path, rank, shard, common, {"world_size": 2, "contents": contents}, gather)

    _Threads(2).run(write)


def test_a_rank_opens_only_the_shards_holding_the_tensors_it_reads(tmp_path):
    """Would catch every rank reading every shard (issue 29: about 100 GB per process for the 7B recipe)."""
    path = tmp_path / "step.ckpt"
    _two_stage_checkpoint(path)
    checkpoint = shards.load(path, rank=1, world_size=3, gather=lambda obj: [obj])  # another cluster: no RNG read
    state_dict = checkpoint["state_dict"]
    assert sorted(state_dict) == ["blocks.0.weight", "blocks.1.weight"]  # listed from the manifest
    assert state_dict.files.opened == [path / COMMON]
    module = torch.nn.Module()
    module.blocks = torch.nn.ModuleList([torch.nn.Linear(256, 1, bias=False) for _ in range(2)])
    for block in module.blocks:
        block.weight = torch.nn.Parameter(torch.empty(256))
    read_into(module, state_dict.weight_source(), ["blocks.1.weight"], prefix="")  # stage 1's placement
    assert torch.equal(module.blocks[1].weight, torch.full((256,), 1.0))
    by_name = checkpoint["optimizer_states"][0][NAMED_STATE_KEY]
    assert by_name.get("blocks.1.weight")["exp_avg"][0].item() == 11.0 and by_name.get("not.mine") is None
    assert state_dict.files.opened == [path / COMMON, path / shard_name(1)]  # shard 0 never opened


def test_checkpoint_files_are_memory_mapped_and_read_weights_only(tmp_path, monkeypatch):
    """Would catch files read whole into memory (a mapped tensor's pages are read only when touched) or
    unpickled with ``weights_only=False``."""
    file = tmp_path / "shard.pt"
    torch.save({"state_dict": {"w": torch.zeros(1 << 10)}}, file)
    calls = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: calls.append(kwargs) or load(*args, **kwargs))
    assert torch.equal(open_file(file)["state_dict"]["w"], torch.zeros(1 << 10))
    assert calls == [{"map_location": "cpu", "mmap": True, "weights_only": True}]


def test_a_file_not_loadable_weights_only_is_refused_naming_the_file_the_rule_and_the_fix(tmp_path):
    """Would catch ``weights_only=False`` (a checkpoint file could run code when read) or a refusal that does
    not say which file, why, or what to do."""
    path = tmp_path / "step.ckpt"
    with pytest.raises(CheckpointError, match=r"common\.pt would hold objects of .*Settings.*weights_only=True.*dataclasses\.asdict"):
        checkpoint_files.write_checkpoint(path, 0, {"w": torch.ones(2)}, {"hparams": Settings()}, {"world_size": 1},
                                          lambda obj: [obj])
    assert not path.exists() and not list(tmp_path.iterdir())  # nothing published, the staging removed
    foreign = tmp_path / "foreign.pt"
    torch.save({"hparams": Settings()}, foreign)
    with pytest.raises(NotWeightsOnlyError, match=rf"{foreign} is refused: .*plain containers.*weights_only=False\) "
                                                  r"and save its tensors again"):
        open_file(foreign)


def test_each_file_is_checksummed_by_one_rank_and_a_bad_one_is_refused_on_every_rank(tmp_path, monkeypatch):
    """Would catch every rank checksumming every file (the whole checkpoint read once per rank)."""
    path = tmp_path / "step.ckpt"
    _two_stage_checkpoint(path)
    directory, manifest = read_manifest(path)
    summed: list[str] = []
    sha256 = checkpoint_files._sha256
    monkeypatch.setattr(checkpoint_files, "_sha256", lambda file: summed.append(file.name) or sha256(file))
    names = [COMMON, shard_name(0), shard_name(1)]
    _Threads(2).run(lambda rank, gather: verify_files(directory, manifest, names, rank, 2, gather))
    assert sorted(summed) == sorted(names)  # each once, over both ranks

    with (directory / shard_name(1)).open("r+b") as handle:  # same size, other bytes
        handle.seek(200)
        handle.write(b"\xff")
    refused = []

    def verify(rank, gather):
        try:
            verify_files(directory, manifest, names, rank, 2, gather)
        except CheckpointError as error:
            refused.append(str(error))

    _Threads(2).run(verify)
    assert len(refused) == 2 and all(f"{shard_name(1)} does not match its SHA-256" in e for e in refused)


def test_publish_refuses_a_checkpoint_listing_a_shard_that_is_not_there(tmp_path):
    """Would catch a manifest listing a rank's shard that never reached the shared file system (another rank's
    directory on local disk): the checkpoint would look whole and fail at the resume."""
    path = tmp_path / "step.ckpt"

    def gather(obj):  # a second rank that says it wrote its shard, which rank 0 cannot see
        if isinstance(obj, tuple):
            return [obj, ([FileRecord(shard_name(1), 1024, "0" * 64)], None)]
        return [obj, obj]

    with pytest.raises(CheckpointError, match=rf"{shard_name(1)} \(missing\).*shared file system"):
        checkpoint_files.write_checkpoint(path, 0, {"w": torch.ones(2)}, {"step": 1}, {"world_size": 2}, gather)
    assert not path.exists()
