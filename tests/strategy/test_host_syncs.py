"""The host never waits inside a step: a one-stage plan adds no device-to-host synchronisation to Lightning's.

On a GPU, ``tensor.item()``, ``float(tensor)``, ``.cpu()``, ``.tolist()`` and
``torch.cuda.synchronize()`` make the host wait until the device has run
everything queued; a step that does so stops the host from queuing the next
kernels ahead. A CPU rank cannot show the wait, so the calls are counted: the
same module, data and Trainer flags are trained by plain Lightning and by
``ZorseStrategy`` on one non-emulated CPU rank, and the calls made between the
start and the end of each training batch (after start-up) are compared.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from testing.gpt_reference import gpt, tokens
from testing.launch import spawn_ranks

pytestmark = pytest.mark.multiprocess

CPU_ONE = {
    "name": "cpu_one",
    "description": "this CPU as one real device, nothing emulated",
    "emulated": False,
    "machines": [{"name": "localhost", "intra_bandwidth_gbps": 10, "gpus": [{"type": "a100x40", "count": 1}]}],
}
STEPS = 6
COUNTED_FROM_STEP = 2
"""Start-up (profiling, planning, the cut) runs inside the first step: counted from the third."""

_WAITS = {
    "Tensor.item": (torch.Tensor, "item"),
    "Tensor.tolist": (torch.Tensor, "tolist"),
    "Tensor.cpu": (torch.Tensor, "cpu"),
    "Tensor.numpy": (torch.Tensor, "numpy"),
    "Tensor.__float__": (torch.Tensor, "__float__"),
    "Tensor.__int__": (torch.Tensor, "__int__"),
    "Tensor.__bool__": (torch.Tensor, "__bool__"),
    "torch.cuda.synchronize": (torch.cuda, "synchronize"),
}


class HostWaits(pl.Callback):
    """Counts, by name, the calls that wait for the device, made inside training batches from
    :data:`COUNTED_FROM_STEP` on; outside them the originals run uncounted."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._counting = False
        self._originals = {name: getattr(owner, attr) for name, (owner, attr) in _WAITS.items()}

    def install(self) -> None:
        for name, (owner, attr) in _WAITS.items():
            setattr(owner, attr, self._recording(name, self._originals[name]))

    def uninstall(self) -> None:
        for name, (owner, attr) in _WAITS.items():
            setattr(owner, attr, self._originals[name])

    def _recording(self, name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._counting:
                self.counts[name] += 1
            return original(*args, **kwargs)

        return call

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._counting = trainer.global_step >= COUNTED_FROM_STEP

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._counting = False


def _fit(strategy: Any, tmp: Path, precision: str) -> dict[str, int]:
    torch.manual_seed(0)
    waits = HostWaits()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, precision=precision, gradient_clip_val=1.0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[waits], default_root_dir=tmp,
    )
    loader = DataLoader(tokens(8 * STEPS), batch_size=8, shuffle=False)
    waits.install()
    try:
        trainer.fit(gpt(), train_dataloaders=loader)
    finally:
        waits.uninstall()
    return dict(waits.counts)


def _worker(rank: int, tmp: Path) -> dict[str, dict[str, int]]:
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

    counts = {}
    for precision in ("32-true", "bf16-mixed"):
        counts[f"plain/{precision}"] = _fit("auto", tmp, precision)
        counts[f"zorse/{precision}"] = _fit(ZorseStrategy(cluster=CPU_ONE, emulate=False), tmp, precision)
    return counts


@pytest.fixture(scope="module")
def waits(tmp_path_factory) -> dict[str, dict[str, int]]:
    return spawn_ranks(_worker, 1, tmp_path_factory.mktemp("host_syncs"))[0]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_one_stage_plan_adds_no_host_wait_to_lightnings_step(waits, precision):
    """Would catch ``float(value)`` per ``self.log``, the log merge read back with ``.cpu().tolist()``, a
    snapshot waiting for its copy, or a collective's result read on the host, each once per step or more."""
    plain, zorse = waits[f"plain/{precision}"], waits[f"zorse/{precision}"]
    added = {name: zorse.get(name, 0) - plain.get(name, 0) for name in set(plain) | set(zorse)}
    assert all(count <= 0 for count in added.values()), (plain, zorse)


def test_the_count_sees_host_waits(waits):
    """The recording stand-ins are live: Lightning's own loop reads the loss it logs (``self.log`` of the
    module's ``train_loss``) only when it shows or writes it, so plain runs may count none; a forced read
    is counted."""
    waits_now = HostWaits()
    waits_now.install()
    try:
        waits_now._counting = True
        torch.ones(()).item()
        float(torch.ones(()))
    finally:
        waits_now.uninstall()
    assert waits_now.counts == {"Tensor.item": 1, "Tensor.__float__": 1}
