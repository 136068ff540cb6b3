"""Fast recovery: the survivors of a lost rank keep what they hold; the relaunch reads that first.

A checkpoint is taken every few steps; a lost rank costs every step since. But
the survivors still hold their stages' parameters and optimizer shards of the
last completed step. Each rank therefore snapshots, after optimizer steps (at
an interval chosen from the snapshot's cost: :func:`snapshot_interval`), the
small part of Lightning's checkpoint (loops, callbacks,
optimizer hyper-parameters, data position: a few kilobytes, serialized with its
tensors moved to the host, so that later changes do not reach it) and its
held tensors, in one of two ways (:class:`SurvivorKeeper`):

- held on the host (CPU ranks): their in-place version counters, not the
  tensors: about 2 ms a step on 2 busy CPU cores (1 % of a 190 ms step), no
  memory, no collective; keeping reads the tensors themselves, unless they moved
  since the snapshot (the lost rank died inside an optimizer step: that state
  belongs to no completed step);
- held on a GPU: host copies into two reused pinned buffer sets, on a side
  stream that overlaps the next step (:mod:`.host_copies`). Under NCCL a
  collective that the dead peer never joins blocks the CUDA stream, so a
  device-to-host copy at loss time would wait forever; keeping touches no
  device tensor. This costs a device-to-host transfer of the held state per
  snapshot and twice its size in pinned host memory (checked:
  :func:`check_host_memory`).

When the watchdog declares a rank lost, or the process gets SIGTERM (torchrun's
agent ends the survivors so within seconds of a loss:
:func:`~zorse_lightning.engine.faults.keep_on_sigterm`), the rank writes its held
state to local disk (``<directory>/step-N/rank-R.pt`` and a small ``rank-R.json``
index, each renamed into place).

On ``fit(ckpt_path=...)`` (:func:`.relaunch.load`) the relaunch, on the cluster as it is
now, takes the newest step whose kept state covers every entry of the model and
every parameter the optimizers step; a step newer than the checkpoint must be
covered by survivors alone, the checkpoint's own step may be completed by its
shards (only those that hold a missing entry are read). Survivors' files are
memory-mapped and opened only for the names a rank's stage asks for, so a rank
reads only its stage's tensors and the optimizer state of the parameters it
steps. Each rank keeps its own random generators (as on elastic resume):
survivors' generators belong to the old rank layout.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zorse_lightning.engine.checkpoint.files import WEIGHTS_ONLY_RULE, NotWeightsOnlyError
from zorse_lightning.engine.checkpoint.shards import held_module_state, held_optimizer_state
from zorse_lightning.engine.checkpoint.host_copies import CopyDone, HostCopy, copy_to_host, held_on_device, lives_off_host
from zorse_lightning.cluster.inventory import PINNED_SHARE_OF_HOST
from zorse_lightning.errors import ZorseUserError
from zorse_lightning.module.materialize import holds_values

SURVIVORS_DIR = ".survivors"
KEEP_WAITS_FOR_COPY_S = 10.0
"""How long keeping waits for a host copy in flight (a step's state over PCIe: seconds at most) before writing the
previous one: the other survivors' copies of that step have most likely completed."""
FORMAT = "zorse-survivor"


@dataclass(frozen=True)
class RecoveryPolicy:
    directory: str | Path | None = None
    """Where survivors keep their state (local disk); None: ``<checkpoint dirpath>/.survivors``, and on resume
    ``<directory of ckpt_path>/.survivors``."""
    enabled: bool = True
    """Snapshot after optimizer steps and keep state on a lost rank; off: resume from checkpoints only. A world
    of one rank keeps nothing either way (no survivor can exist)."""
    snapshot_every_steps: int | None = None
    """Steps between snapshots (a recovery may redo up to this many); None: chosen from the snapshot's measured
    cost, so that it costs at most ``max_snapshot_cost`` of the step time."""
    max_snapshot_cost: float = 0.03
    """The share of step time snapshots may cost when their interval is chosen (CheckFreq's bound is 3.5 %)."""

    def __post_init__(self) -> None:
        if self.snapshot_every_steps is not None and self.snapshot_every_steps < 1:
            raise ZorseUserError(
                f"RecoveryPolicy(snapshot_every_steps={self.snapshot_every_steps!r}): must be at least 1 (1: every "
                f"step), or None to choose it from the snapshot's measured cost"
            )
        if not 0 < self.max_snapshot_cost <= 1:
            raise ZorseUserError(
                f"RecoveryPolicy(max_snapshot_cost={self.max_snapshot_cost!r}): must be a share of step time in "
                f"(0, 1], e.g. 0.03 for 3 %"
            )


@dataclass(frozen=True)
class KeptIndex:
    """What one survivor file holds, readable without loading it."""

    rank: int
    step: int
    entries: tuple[str, ...]
    """Module state-dict names it holds."""
    stepped: tuple[tuple[str, ...], ...]
    """Per optimizer: names of the parameters it steps (its shard), whose optimizer state it holds."""
    path: str


@dataclass(frozen=True)
class RecoveryReport:
    """Where the relaunch resumed from, and what it read (``ZorseStrategy.recovery_report``)."""

    step: int
    checkpoint_step: int
    survivor_files: tuple[str, ...]
    checkpoint_files: tuple[str, ...]
    reason: str
    message: str = ""
    """What the relaunch says about it (the strategy prints it once, as a warning where newer kept state was
    passed over for the checkpoint)."""

    @property
    def passed_over_survivors(self) -> bool:
        return "only in the checkpoint" in self.reason


@dataclass(frozen=True)
class _Snapshot:
    step: int
    common: bytes
    """Lightning's checkpoint of the step without its tensors, by ``torch.save``: reading it back onto the CPU
    touches no device (a monitored score may be a GPU tensor)."""
    versions: dict[int, int]
    """Version counters of the held tensors (state on the host); empty when ``host`` holds copies."""
    host: HostCopy | None
    """Host copies of the held state (state on a device)."""
    done: CopyDone = CopyDone()
    """When ``host`` is complete: a snapshot counts only from then."""


def _serialized(common: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(common, buffer)
    return buffer.getvalue()


def _deserialized(common: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(common), map_location="cpu", weights_only=True)


def _checked_plain(common: bytes) -> None:
    """Refuse ``common`` unless a relaunch can read it with ``weights_only=True``: checked at the first snapshot,
    while the run can still be fixed, not when a rank is lost."""
    try:
        _deserialized(common)
    except pickle.UnpicklingError as error:
        raise NotWeightsOnlyError(
            f"a survivor snapshot of Lightning's checkpoint is refused ({str(error).splitlines()[-1]}): "
            f"{WEIGHTS_ONLY_RULE}: keep hyper-parameters, callback and data-module state plain (convert dataclasses "
            f"with dataclasses.asdict, enums to their values, numpy arrays to tensors), or turn snapshots off with "
            f"RecoveryPolicy(enabled=False)"
        ) from None


def _tensors(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    held = [t for t in module.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor) and holds_values(t)]
    for optimizer in optimizers:
        for state in optimizer.state.values():
            held.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return held


def _versions(tensors: list[torch.Tensor]) -> dict[int, int]:
    return {id(t): t._version for t in tensors}


def _write_atomically(path: Path, write: Callable[[Any], None], mode: str) -> None:
    temporary = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with temporary.open(mode) as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    temporary.replace(path)


def host_bytes_available() -> int:
    """Host memory the system can still give (Linux's MemAvailable, else free pages)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class SurvivorKeeper:
    """One rank's snapshot of its last completed step, and the writing of its state when a rank is lost.

    Keeping may run while the main thread is stuck in a collective a lost peer never joins. Under NCCL
    such a collective blocks the CUDA stream, and a device-to-host copy queued behind it would never
    return: state on a device is therefore copied to pinned host buffers after optimizer steps, on a side
    stream that overlaps the next step (:func:`~.host_copies.copy_to_host`), and keeping writes the newest
    copy known to be complete, never waiting. State on the host cannot be blocked by a hung kernel, so
    there the snapshot records only version counters (no copy, no memory) and keeping reads the tensors
    themselves if they have not moved.

    Host copies alternate between two buffer sets, refilled in place: one holds the newest complete
    snapshot, the other takes the next copy, which starts only once the previous one has completed: a
    snapshot due while the previous copy still runs waits for it rather than being skipped, so every rank
    snapshots the same steps (the interval is agreed across ranks) and survivors share a kept step. Keeping
    likewise gives a copy still in flight a bounded time (:data:`KEEP_WAITS_FOR_COPY_S`) to complete, asking
    the device without blocking on it. Once keeping has started, snapshots stop, so the copies it writes are
    never refilled. ``static`` holds what
    every snapshot shares and never changes (the plan, the inventory): set once, written with each file."""

    def __init__(self, host_copies: bool | None = None) -> None:
        """``host_copies``: whether snapshots copy the held state to host memory; None: exactly when some of it
        lives off the host (on a GPU)."""
        self._host_copies = host_copies
        self._snapshot: _Snapshot | None = None
        self._pending: _Snapshot | None = None
        self._spare: HostCopy | None = None
        self._stream: Any = None
        self._kept = False
        self._keeping = threading.Lock()
        self.static: dict[str, Any] = {}
        """Entries of Lightning's checkpoint dictionary that never change over the run, merged in when writing."""
        self.last_copy_ms: float | None = None
        """How long the newest complete copy took on its stream (0 for version counters; None before one)."""

    def held_bytes(self, module: nn.Module, optimizers: list) -> int:
        """Bytes of the state a snapshot copies (what each of its two host buffer sets holds)."""
        return sum(t.numel() * t.element_size() for t in _tensors(module, optimizers))

    def copies(self, module: nn.Module, optimizers: list) -> bool:
        """Whether snapshots copy the held state (it lives on a device, or copies were asked for)."""
        return self._host_copies if self._host_copies is not None else lives_off_host(_tensors(module, optimizers))

    def snapshot(self, step: int, common: dict[str, Any], module: nn.Module, optimizers: list) -> bool:
        """After optimizer step ``step``: ``common`` is Lightning's checkpoint without the tensors. False when
        no snapshot was started (keeping began). A previous copy still running is waited for (its buffers
        are needed), not skipped: a skipped step on one rank would be a step the survivors do not share."""
        if self._kept:
            return False
        self._settle()
        if self._pending is not None:
            self._pending.done.wait()
            self._publish_pending()
        tensors = _tensors(module, optimizers)
        serialized = _serialized(common)
        if self._snapshot is None and self._pending is None:
            _checked_plain(serialized)
        if not self.copies(module, optimizers):
            self._snapshot = _Snapshot(step, serialized, _versions(tensors), None)
            self.last_copy_ms = 0.0
            return True
        if self._stream is None and any(t.is_cuda for t in tensors):
            self._stream = torch.cuda.Stream()
        host, done = copy_to_host(held_on_device(module, optimizers), self._spare, self._stream)
        self._spare = None
        self._pending = _Snapshot(step, serialized, {}, host, done)
        self._settle()
        return True

    def _settle(self) -> None:
        """Publish the pending copy once complete (asks the device, never waits); its buffers' predecessor
        becomes the spare set."""
        if self._pending is not None and self._pending.done.query():
            self._publish_pending()

    def _publish_pending(self) -> None:
        """The pending copy, known complete, becomes the newest snapshot."""
        pending = self._pending
        self.last_copy_ms = pending.done.elapsed_ms()
        published, self._snapshot, self._pending = self._snapshot, pending, None
        self._spare = published.host if published is not None else None

    def _settle_within(self, seconds: float) -> None:
        """Publish the pending copy if it completes within ``seconds``, polling (a blocking device wait could
        sit behind a collective a lost peer never joins: the copy's own stream is not blocked by it)."""
        deadline = time.monotonic() + seconds
        self._settle()
        while self._pending is not None and time.monotonic() < deadline:
            time.sleep(0.01)
            self._settle()

    def before_optimizer_step(self) -> None:
        """The optimizer step about to be queued changes the weights: it runs after the pending copy (a wait on
        the device, not on the host)."""
        if self._pending is not None:
            self._pending.done.make_current_stream_wait()

    @property
    def newest_step(self) -> int | None:
        """The step of the newest complete snapshot (None before one)."""
        self._settle()
        return self._snapshot.step if self._snapshot is not None else None

    def keep(self, directory: Path, rank: int, module: nn.Module, optimizers: list) -> Path | None:
        """Write this rank's state of the snapshot's step, once, from the main thread or the watchdog's.

        Both may call it when a rank is lost (the watchdog ends a rank stuck in a wait; the main thread,
        unstuck by the lost connection, handles its error); the second waits until the first has written:
        returning at once would let the process end, and the watchdog's daemon thread with it, mid-write."""
        with self._keeping:
            self._settle_within(KEEP_WAITS_FOR_COPY_S)
            if self._kept or self._snapshot is None:
                return None
            self._kept = True
            return self._write(self._snapshot, Path(directory), rank, module, optimizers)

    def _write(self, snap: _Snapshot, directory: Path, rank: int, module: nn.Module, optimizers: list) -> Path | None:
        held = snap.host.held() if snap.host is not None else _read_unmoved(snap, rank, module, optimizers)
        if held is None:
            return None
        state_dict, optimizer_states = held
        state = {
            "format": FORMAT, "rank": rank, "step": snap.step, "common": _with_static(_deserialized(snap.common), self.static),
            "state_dict": state_dict, "optimizers": optimizer_states,
        }
        names = {id(p): n for n, p in module.named_parameters()}  # identities only: no tensor is read
        index = KeptIndex(
            rank, snap.step, tuple(sorted(state_dict)),
            tuple(tuple(sorted(names[id(p)] for g in o.param_groups for p in g["params"])) for o in optimizers),
            path="",
        )
        target = directory / f"step-{snap.step}"
        try:
            target.mkdir(parents=True, exist_ok=True)
            _write_atomically(target / f"rank-{rank}.pt", lambda h: torch.save(state, h), "wb")
            _write_atomically(target / f"rank-{rank}.json", lambda h: json.dump(asdict(index), h), "w")
        except OSError as error:  # the rank must still stop with the lost rank's name, not this
            print(f"zorse: rank {rank} could not keep its state in {target}: {error}", file=sys.stderr, flush=True)
            return None
        return target / f"rank-{rank}.pt"


def _with_static(common: dict[str, Any], static: dict[str, Any]) -> dict[str, Any]:
    """``common`` with the run's unchanging entries merged in (one level deep: ``"zorse"`` has both kinds)."""
    merged = dict(common)
    for key, value in static.items():
        merged[key] = {**value, **merged.get(key, {})} if isinstance(value, dict) else value
    return merged


def _read_unmoved(
    snap: _Snapshot, rank: int, module: nn.Module, optimizers: list
) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The held state on the host, read now, if no tensor moved since the snapshot (else None: the state
    belongs to no completed step)."""
    if _versions(_tensors(module, optimizers)) != snap.versions:
        print(f"zorse: rank {rank} was inside the optimizer step after step {snap.step}: it keeps nothing",
              file=sys.stderr, flush=True)
        return None
    held = held_module_state(module), [held_optimizer_state(o, module) for o in optimizers]
    if _versions(_tensors(module, optimizers)) != snap.versions:  # the main thread moved on while we copied
        return None
    return held


def survivors_directory(policy: RecoveryPolicy, checkpoint_dir: str | Path) -> Path:
    return Path(policy.directory) if policy.directory is not None else Path(checkpoint_dir) / SURVIVORS_DIR


def snapshot_interval(cost_ms: float, step_ms: float, max_cost: float) -> int:
    """Steps between snapshots so that one snapshot's cost, spread over them, is at most ``max_cost`` of a step."""
    if step_ms <= 0:
        return 1
    return max(1, math.ceil(cost_ms / (max_cost * step_ms)))


def check_host_memory(held_bytes: int, processes: int, available_bytes: int | None = None) -> None:
    """Each of this machine's ``processes`` pins two copies of its ``held_bytes`` for snapshots: refuse a run
    that would pin more than :data:`~zorse_lightning.cluster.inventory.PINNED_SHARE_OF_HOST` of the available host memory."""
    available = host_bytes_available() if available_bytes is None else available_bytes
    needed = 2 * held_bytes * processes
    if needed > PINNED_SHARE_OF_HOST * available:
        raise ZorseUserError(
            f"survivor snapshots would pin {needed / 2**30:.1f} GiB of host memory (2 copies of "
            f"{held_bytes / 2**30:.2f} GiB for each of {processes} processes on this machine), more than "
            f"{100 * PINNED_SHARE_OF_HOST:g} % of the {available / 2**30:.1f} GiB available; turn snapshots off with "
            f"ZorseStrategy(recovery=RecoveryPolicy(enabled=False)) (resume from checkpoints only), or run on "
            f"machines with more host memory"
        )


__all__ = ["KeptIndex", "RecoveryPolicy", "RecoveryReport", "SurvivorKeeper", "check_host_memory", "snapshot_interval",
           "survivors_directory"]
