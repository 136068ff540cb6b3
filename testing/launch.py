"""Starting a few local ranks for multi-process tests, as torchrun would, and collecting their results.

Each rank writes one JSON file; the test reads them all. Processes start once per
test module and run several cases, because each start costs seconds here. Under
the tests (``use_forkserver``, called by tests/conftest.py) ranks are forked from
one server process that imported torch, Lightning and the strategy once for the
whole session: 4 spawned ranks took 26-30 s to start on this machine, forked ones 0.2 s.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _ephemeral_low_port() -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux; 32768 where unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port below the kernel's ephemeral range.

    A port from ``bind(0)`` lies inside that range, so when it is chosen early and
    used later (a test joining a second process group), a gloo connection opened in
    between can take it (EADDRINUSE). Ports below the range are only taken by
    listeners, so a port free now stays free.
    """
    low = _ephemeral_low_port()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found below {low} after 200 tries; free some listening ports")


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (for a test that joins several process groups in turn)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def torchrun_variables(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun gives a rank of a one-machine job (read by HeterogeneousEnvironment)."""
    return {
        "TORCHELASTIC_RUN_ID": "test", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }


def join_world(world_size: int, port: int) -> None:
    """Leave the current process group (if any) so that the next Trainer forms one of ``world_size`` ranks on
    ``port``: a spawned run tries several cluster sizes in turn (ranks beyond the new size sit out)."""
    import os

    leave_world()
    os.environ.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), MASTER_PORT=str(port))


_START_METHOD = "spawn"
PRELOADED = ("torch", "torch.distributed", "lightning.pytorch", "zorse_lightning.strategy.zorse_strategy",
             "zorse_lightning.emulation.callback", "testing.gpt_reference")
"""What the forkserver imports before it forks any rank: the seconds every spawned rank would pay again."""


def use_forkserver() -> None:
    """Start :func:`spawn_ranks`' ranks by forking a server process that imported :data:`PRELOADED` once (it
    starts at the first launch and lives as long as this process). Each rank is still a process of its own
    with nothing of a previous launch: forked from the server, which never runs a rank's code, it gets this
    process's environment, working directory and ``sys.path`` at launch, as a spawned rank does."""
    global _START_METHOD
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOADED))
    _START_METHOD = "forkserver"


def start_method() -> str:
    """How :func:`spawn_ranks` starts ranks (``"forkserver"`` after :func:`use_forkserver`), for a test that
    starts its own."""
    return _START_METHOD


def _run_rank(rank: int, worker: Callable[..., Any], port: int, out_dir: str, world_size: int,
              environ: dict[str, str], forked: bool, *args: Any) -> None:
    """One spawned rank: the launching process's environment (a forked rank has the server's), one thread (two
    cores are shared by all ranks), torchrun's variables, result to JSON. A forked rank's output goes to a file
    that :func:`spawn_ranks` passes on (its standard streams are the server's, not the test's)."""
    import os
    import sys

    import torch

    os.environ.clear()
    os.environ.update(environ)
    if forked:
        with open(_output_path(out_dir, rank), "wb") as output:
            os.dup2(output.fileno(), 1)
            os.dup2(output.fileno(), 2)
    try:
        torch.set_num_threads(1)
        os.environ.update(torchrun_variables(rank, world_size, port))
        result = worker(rank, Path(out_dir), *args)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        leave_world()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _output_path(out_dir: str | Path, rank: int) -> Path:
    return Path(out_dir, f"rank{rank}.output")


def leave_world() -> None:
    """Destroy this process's process group, if any, before the process exits.

    A process that exits with a live gloo group can abort in its destructor
    ("terminate called without an active exception", SIGABRT), failing the
    whole launch although every rank finished its work.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def spawn_ranks(worker: Callable[..., Any], world_size: int, out_dir: str | Path, *args: Any) -> list[Any]:
    """Run ``worker(rank, out_dir, *args) -> result`` on ``world_size`` torchrun-like processes;
    the results (JSON-serialisable) in rank order."""
    import torch.multiprocessing as mp

    forked = _START_METHOD == "forkserver"
    try:
        mp.start_processes(_run_rank, args=(worker, free_port(), str(out_dir), world_size, dict(os.environ), forked,
                                            *args), nprocs=world_size, join=True, start_method=_START_METHOD)
    finally:
        for rank in range(world_size):  # a forked rank's output, where the test's capture (or terminal) shows it
            output = _output_path(out_dir, rank)
            if forked and output.exists() and output.stat().st_size:
                sys.stderr.write(f"--- rank {rank} of {world_size} ---\n{output.read_text(errors='replace')}")
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]


def start_script_ranks(script: str, world_size: int, out_dir: str | Path) -> list[subprocess.Popen]:
    """``world_size`` processes of ``python script RANK PORT OUT_DIR`` on a free port, each with this
    repository on its path, standard error captured as text: for tests whose ranks must be whole processes
    (a rank that exits or is signalled on its own)."""
    port = free_port()
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return [
        subprocess.Popen([sys.executable, script, str(rank), str(port), str(out_dir)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for rank in range(world_size)
    ]
