"""Lost ranks and failed ranks: every survivor stops, within a bounded time, naming who and which stage.

Process-group timeouts alone do not suffice: a point-to-point receive from a
live rank that itself waits on a dead one can block for the whole timeout
(minutes by default), and the error then names a socket, not a rank. So each
rank runs a :class:`Watchdog` thread that beats a counter in a key-value store
(the rendezvous ``TCPStore``) and watches everyone else's:

- a rank whose counter has not moved for ``timeout_s`` is declared lost;
- a rank whose step raised posts its error (:meth:`Watchdog.report`);
- the store itself unreachable means rank 0, which hosts it, is gone.

The first verdict is written to the store and everyone reads the same one. A
rank whose main thread meets a communication error waits for the verdict and
raises :class:`RankLostError` with it (:meth:`Watchdog.explain`); a rank stuck
inside a collective that never returns is ended by the watchdog itself (the
message on stderr, exit status :data:`LOST_EXIT_STATUS`): a blocked C++ wait
cannot be interrupted from Python.

The watchdog decides without touching a device: beats and verdicts go through
the store (host sockets), silence is measured on the host clock, and a stuck
rank ends by ``os._exit``. Under NCCL a collective
that the dead peer never joins blocks the CUDA stream, and anything queued
behind it (a device-to-host copy, a synchronize) would never return; so what
runs on its verdict must not touch the device either (survivors write host
copies taken after optimizer steps: :mod:`zorse_lightning.engine.checkpoint.survivors`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from zorse_lightning.cluster.inventory import ClusterInventory
from zorse_lightning.engine.checkpoint.shards import all_gather
from zorse_lightning.schedule.plan import Plan

LOST_EXIT_STATUS = 75
SIGTERM_EXIT_STATUS = 128 + signal.SIGTERM
"""A shell's status for a process ended by SIGTERM: what torchrun's agent expects of the workers it stops."""
_COMMUNICATION_WORDS = ("gloo", "nccl", "connection", "broken pipe", "timed out", "timeout", "socket", "peer")
_FIRST_POLL_S = 0.001
"""A meeting's first poll of the store (:meth:`Watchdog.meet`): ranks that arrive together part at once."""


@dataclass(frozen=True)
class FaultPolicy:
    timeout_s: float = 60.0
    """A rank silent this long is lost (keep it above the longest pause of a healthy rank: a checkpoint save)."""
    heartbeat_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval_s < self.timeout_s:
            raise ValueError(
                f"heartbeat_interval_s={self.heartbeat_interval_s} must be positive and below "
                f"timeout_s={self.timeout_s}; a rank must beat several times within the timeout"
            )


class RankLostError(RuntimeError):
    """Another rank died or failed: this rank cannot go on (relaunch, resume from the last checkpoint)."""


def is_communication_error(error: BaseException) -> bool:
    """Errors a rank meets because a peer went away, rather than errors of its own."""
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(w in str(error).lower() for w in _COMMUNICATION_WORDS)
    )


class Watchdog:
    def __init__(
        self, store: dist.Store, rank: int, world_size: int, describe: Callable[[int], str], policy: FaultPolicy,
        exit_process: Callable[[str], None] | None = None,
    ) -> None:
        """``describe(rank)`` names a rank for messages ("rank 3 (stage 1, t4 on node-b)"); ``exit_process``
        ends a process stuck in a wait (default: message to stderr, ``os._exit``)."""
        self.store, self.rank, self.world_size = store, rank, world_size
        self.describe, self.policy = describe, policy
        self._exit_process = exit_process or _exit_with
        self._stop = threading.Event()
        self._handling = threading.Event()
        self._verdict: str | None = None
        self._thread = threading.Thread(target=self._watch, name=f"zorse-watchdog-{rank}", daemon=True)

    @classmethod
    def connect(cls, host: str, port: int, token: str, **kwargs) -> Watchdog:
        """A watchdog on its own client of the rendezvous store at ``host:port`` (keys under ``token``)."""
        timeout = timedelta(seconds=kwargs["policy"].timeout_s)
        client = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        return cls(dist.PrefixStore(f"zorse-faults/{token}", client), **kwargs)

    def start(self) -> Watchdog:
        self.store.add(f"beat/{self.rank}", 1)
        self._thread.start()
        return self

    def stop(self) -> None:
        """A clean end: others no longer watch this rank."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self.store.set(f"exited/{self.rank}", "done")
        except (RuntimeError, dist.DistError):
            pass  # the store's host already ended its run: nobody is left to watch us

    # -- what the main thread calls ---------------------------------------------------------

    def report(self, error: BaseException) -> None:
        """This rank's step failed: let every rank know why (first report wins)."""
        self._post(f"{self.describe(self.rank)} failed with {type(error).__name__}: {error}")

    def meet(self, name: str) -> None:
        """Return once every rank has called ``meet(name)``, however long that takes; a rank lost or failed
        meanwhile ends the wait with the verdict (:class:`RankLostError`).

        Start-up's waits go here rather than into a collective: while the first rank of each GPU type profiles
        (for as long as its model takes), the others would sit in a gather whose timeout may fire first (NCCL's,
        the group's). A rank that profiles still beats, so only a lost or failed one ends the wait. Arrivals
        are counted in the store; the wait polls that count, every millisecond at first, then at most every
        quarter of a heartbeat."""
        key = f"meet/{name}"
        arrived, poll_s = self.store.add(key, 1), _FIRST_POLL_S
        while arrived < self.world_size:
            if self._verdict is not None:
                self._handling.set()  # this thread raises the verdict: the watchdog need not end the process
                raise RankLostError(f"{self._verdict}; {self.describe(self.rank)} stops too")
            time.sleep(poll_s)
            poll_s = min(2 * poll_s, self.policy.heartbeat_interval_s / 4)
            arrived = self.store.add(key, 0)

    def explain(self, error: BaseException) -> RankLostError | None:
        """The lost or failed rank behind ``error`` (waiting for the verdict up to the timeout), or None if
        ``error`` is this rank's own (it is then reported to the others) or the verdict already (:meth:`meet`)."""
        self._handling.set()
        if isinstance(error, RankLostError):
            self.stop()
            return None
        if not is_communication_error(error):
            self.report(error)
            self.stop()
            return None
        deadline = time.monotonic() + self.policy.timeout_s + 3 * self.policy.heartbeat_interval_s
        while self._verdict is None and time.monotonic() < deadline:
            time.sleep(self.policy.heartbeat_interval_s / 4)
        self.stop()
        verdict = self._verdict or (
            f"a peer of {self.describe(self.rank)} closed its connection, but no rank was found silent within "
            f"{self.policy.timeout_s:g} s"
        )
        return RankLostError(f"{verdict}; this rank stops too: relaunch and resume from the last checkpoint")

    # -- the thread -------------------------------------------------------------------------

    def _post(self, verdict: str) -> None:
        try:
            self.store.compare_set("verdict", "", verdict)
            self._verdict = self.store.get("verdict").decode()
        except (RuntimeError, dist.DistError):
            self._verdict = self._verdict or verdict

    def _watch(self) -> None:
        interval, timeout = self.policy.heartbeat_interval_s, self.policy.timeout_s
        others = [r for r in range(self.world_size) if r != self.rank]
        counts = {r: -1 for r in others}
        changed = {r: time.monotonic() for r in others}
        while not self._stop.wait(interval):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                if self.store.check(["verdict"]):
                    self._verdict = self.store.get("verdict").decode()
                    break
                now = time.monotonic()
                for r in list(others):
                    if self.store.check([f"exited/{r}"]):
                        others.remove(r)
                        continue
                    count = self.store.add(f"beat/{r}", 0)
                    if count != counts[r]:
                        counts[r], changed[r] = count, now
                    elif now - changed[r] > timeout:
                        self._post(f"{self.describe(r)} was lost: no heartbeat for {now - changed[r]:.1f} s")
                        break
            except (RuntimeError, dist.DistError) as error:
                self._verdict = self._verdict or (
                    f"{self.describe(0)} was lost: the store it hosts is unreachable ({error})"
                )
            if self._verdict is not None:
                break
        if self._verdict is not None and not self._stop.is_set():
            self._stop.wait(2 * interval)  # the main thread may be meeting the error itself: let it explain
            if not self._handling.is_set():
                self._exit_process(
                    f"zorse: {self._verdict}; {self.describe(self.rank)} stops too: relaunch and resume from the "
                    f"last checkpoint"
                )


def _exit_with(message: str, status: int = LOST_EXIT_STATUS) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(status)


def rank_describer(plan: Plan, inventory: ClusterInventory | None):
    """``describe(rank)`` for messages: the rank, its stage, and its GPU and machine when known."""

    def describe(rank: int) -> str:
        if rank in plan.idle_ranks:
            return f"rank {rank} (idle)"
        stages = plan.stages_of_rank(rank)
        label = f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"  # interleaved
        where = ""
        if inventory is not None and rank < inventory.world_size:
            gpu = inventory.gpus[rank]
            where = f", {gpu.gpu_type.name} on {gpu.machine}"
        return f"rank {rank} ({label}{where})"

    return describe


def startup_describer(inventory: ClusterInventory | None) -> Callable[[int], str]:
    """``describe(rank)`` before a plan exists: the rank, and its GPU and machine when known."""

    def describe(rank: int) -> str:
        if inventory is None or rank >= inventory.world_size:
            return f"rank {rank} (in start-up)"
        gpu = inventory.gpus[rank]
        return f"rank {rank} ({gpu.gpu_type.name} on {gpu.machine}, in start-up)"

    return describe


def watch_startup(address: str, port: int, inventory: ClusterInventory | None, rank: int, world_size: int,
                  policy: FaultPolicy) -> Watchdog:
    """A watchdog over start-up (collective): a rank that fails there (out of memory at its first profiled size)
    reports its error, and ranks waiting in a collective for it end within the heartbeat interval with that error,
    rather than sit until NCCL's timeout; a rank that dies is declared lost after ``policy.timeout_s``. The
    caller reports its own error with :meth:`Watchdog.explain` and stops the watchdog once start-up is done."""
    token = all_gather(uuid.uuid4().hex if rank == 0 else None)[0]
    watchdog = Watchdog.connect(address, port, f"startup-{token}", rank=rank, world_size=world_size,
                                describe=startup_describer(inventory), policy=policy)
    return watchdog.start()


class SigtermKeeper:
    """On SIGTERM, keep this rank's state (``keep``: the newest completed host copy, no device access), then let
    the handler it took SIGTERM from act: Lightning's graceful stop (its loop raises ``SIGTERMException`` at the
    next batch: callbacks' ``on_exception``, loggers finalized, teardown).

    torchrun's agent, once one worker has died, sends SIGTERM to the others within seconds, long before the
    watchdog's silence verdict. The main thread may then be stuck in a collective that a lost peer never
    joins (under NCCL, a wait on the device), where a Python signal handler would never run. So the signal
    also wakes a thread through :func:`signal.set_wakeup_fd`, whose byte the interpreter's C handler writes
    at once; that thread keeps the state. The Python handler, which runs only when the main thread returns
    to the interpreter, holds the main thread still until the state is kept (so it does not move the state
    being kept, and Lightning's handler, whose broadcast fails on a group a lost peer broke, cannot end the
    process mid-write), then calls the handler it replaced. The keeping thread ends the process (status
    :data:`SIGTERM_EXIT_STATUS`) at once where there is no handler to chain to (SIGTERM's default action),
    else when the stop has not reached the strategy's teardown within :attr:`GRACEFUL_STOP_S` (a main thread
    stuck in a wait never runs it)."""

    MAIN_THREAD_WAIT_S = 60.0
    """How long the main thread is held when it sees the signal, waiting for the state to be kept."""
    GRACEFUL_STOP_S = 20.0
    """How long the chained stop may take after the state is kept before the keeping thread ends the process
    (below the 30 s torchrun's agent waits after its SIGTERM before it sends SIGKILL)."""

    def __init__(self, keep: Callable[[], None], who: str) -> None:
        self._keep, self._who = keep, who
        self._kept = threading.Event()
        self._removed = threading.Event()
        self._handling = False
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._previous_handler: Any = None
        self._chained: Any = None
        """The handler SIGTERM goes on to once the state is kept: the one found at install, or one installed
        since and replaced by :meth:`take_over` (Lightning's)."""
        self._previous_fd = -1

    def install(self) -> bool:
        """Take over SIGTERM (main thread only: False elsewhere, nothing changed)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # the C handler must never block
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._chained = self._previous_handler
        self._previous_fd = signal.set_wakeup_fd(self._write_fd)
        threading.Thread(target=self._watch, name="zorse-sigterm", daemon=True).start()
        return True

    def take_over(self) -> None:
        """Be SIGTERM's first Python handler again, chaining to one installed since (Lightning's, which runs
        a broadcast on the default group inside the handler: on a group a lost peer broke, that fails and ends
        the process, which must not happen while the keeping thread still writes)."""
        if self._write_fd is None or threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGTERM)
        if current != self._on_sigterm:
            self._chained = current
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def remove(self) -> None:
        """Give SIGTERM back as it was (a clean end of the run, or the end of the chained stop)."""
        if self._write_fd is None or threading.current_thread() is not threading.main_thread():
            return
        self._removed.set()
        signal.set_wakeup_fd(self._previous_fd)
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)
        os.close(self._write_fd)  # ends the watching thread's read
        self._write_fd = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._write_fd is None:  # reinstalled after removal (Lightning restores the handlers it found): default
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self._handling:  # called again by the handler chained to: Lightning's includes the one it found, this
            return
        self._handling = True
        try:
            self._kept.wait(self.MAIN_THREAD_WAIT_S)
            if callable(self._chained):
                self._chained(signum, frame)
        finally:
            self._handling = False

    def _watch(self) -> None:
        while True:
            try:
                woken = os.read(self._read_fd, 64)
            except OSError:
                return
            if not woken:
                os.close(self._read_fd)
                return
            if signal.SIGTERM in woken:
                break
        said = f"zorse: {self._who} received SIGTERM (its run was stopped); "
        try:
            self._keep()
            said += "it kept its newest snapshot for the relaunch"
        except Exception as error:  # the process must stop even so: torchrun's SIGKILL would follow
            said += f"keeping its newest snapshot failed with {type(error).__name__}: {error}"
        self._kept.set()
        if not callable(self._chained):
            _exit_with(said, SIGTERM_EXIT_STATUS)
        print(f"{said}; it stops as the handler it replaced says", file=sys.stderr, flush=True)
        if not self._removed.wait(self.GRACEFUL_STOP_S):
            _exit_with(f"zorse: {self._who} had not stopped {self.GRACEFUL_STOP_S:g} s after keeping its snapshot "
                       f"on SIGTERM: ended", SIGTERM_EXIT_STATUS)


def start_watchdog(address: str, port: int, plan: Plan, inventory: ClusterInventory | None, rank: int,
                   policy: FaultPolicy, on_lost: Callable[[], None] | None = None) -> Watchdog:
    """Start this rank's watchdog for a run on the job's rendezvous ``address`` and ``port`` (collective: the
    ranks agree on the run's key prefix), named after the plan's stages.

    ``on_lost`` runs before the watchdog ends a rank stuck in a wait (survivors keep their state there)."""
    token = all_gather(uuid.uuid4().hex if rank == 0 else None)[0]

    def exit_process(message: str) -> None:
        try:
            if on_lost is not None:
                on_lost()
        finally:  # the stuck rank must end even if keeping its state failed, or it would hang
            _exit_with(message)

    watchdog = Watchdog.connect(
        address, port, token, rank=rank, world_size=plan.world_size,
        describe=rank_describer(plan, inventory), policy=policy, exit_process=exit_process,
    )
    return watchdog.start()
