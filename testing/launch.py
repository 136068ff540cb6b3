"""Starting a few local ranks for multi-process tests, as torchrun would, and collecting their results.

Each rank writes one JSON file; the test reads them all. Processes start once per
test module and run several cases, because each start costs seconds here.
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


def _run_rank(rank: int, worker: Callable[..., Any], port: int, out_dir: str, world_size: int, *args: Any) -> None:
    """One spawned rank: one thread (two cores are shared by all ranks), torchrun's variables, result to JSON."""
    import os

    import torch

    torch.set_num_threads(1)
    os.environ.update(torchrun_variables(rank, world_size, port))
    result = worker(rank, Path(out_dir), *args)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    leave_world()


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

    mp.spawn(_run_rank, args=(worker, free_port(), str(out_dir), world_size, *args), nprocs=world_size, join=True)
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
