"""Start-up's meeting (``Watchdog.meet``): ranks wait there for one that profiles far longer than any timeout,
and a rank that fails ends the others' wait with its error. Three watchdogs in one process, on threads, over one
store (what start-up's ranks share); the fault timeout is 0.5 s, the store client's too."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from zorse_lightning.engine.faults import FaultPolicy, RankLostError, Watchdog

WORLD = 3
POLICY = FaultPolicy(timeout_s=0.5, heartbeat_interval_s=0.05)


@pytest.fixture
def watchdogs():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ended: list[str] = []
    started = [
        Watchdog.connect("127.0.0.1", store.port, "meet-test", rank=r, world_size=WORLD,
                         describe=lambda r: f"rank {r}", policy=POLICY, exit_process=ended.append).start()
        for r in range(WORLD)
    ]
    yield started
    for watchdog in started:
        watchdog.stop()
    assert ended == []  # no watchdog ended the process: every wait ended by itself


def _meet_on_threads(watchdogs, name: str, before_s: dict[int, float], ranks=range(WORLD)) -> dict[int, tuple[float, str]]:
    """Each of ``ranks`` meets after ``before_s[rank]`` seconds of work: (when its meet returned, what it raised)."""
    start, results = time.monotonic(), {}

    def rank(r: int) -> None:
        time.sleep(before_s.get(r, 0.0))
        try:
            watchdogs[r].meet(name)
            results[r] = (time.monotonic() - start, "")
        except RankLostError as error:
            results[r] = (time.monotonic() - start, str(error))

    threads = [threading.Thread(target=rank, args=(r,)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_ranks_wait_for_one_that_profiles_four_timeouts_long(watchdogs):
    """Would catch a wait bounded by a timeout (a collective's, the store's): rank 0 works 2 s, four fault
    timeouts, while it beats; the others wait for it, and all part together."""
    results = _meet_on_threads(watchdogs, "profiled", {0: 2.0})
    assert sorted(results) == [0, 1, 2] and all(said == "" for _, said in results.values()), results
    assert all(2.0 <= at < 2.0 + 0.5 for at, _ in results.values()), results


def test_a_rank_that_fails_ends_the_others_wait_with_its_error(watchdogs):
    """Rank 1 fails before the meeting (start-up's own error, reported as the strategy does): ranks 0 and 2,
    waiting, stop within a few heartbeats with rank 1's error, not after any timeout."""
    watchdogs[1].report(MemoryError("out of memory at microbatch size 4, on purpose"))
    watchdogs[1].stop()
    results = _meet_on_threads(watchdogs, "profiled", {}, ranks=(0, 2))
    for rank in (0, 2):
        at, said = results[rank]
        assert said == (f"rank 1 failed with MemoryError: out of memory at microbatch size 4, on purpose; "
                        f"rank {rank} stops too"), results
        assert at < 10 * POLICY.heartbeat_interval_s, results
