"""Starting a few local ranks for multi-process tests, as torchrun would, and collecting their results.

Each rank writes one JSON file; the test reads them all. Processes start once per
test module and run several cases, because each start costs seconds here.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_variables(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun gives a rank of a one-machine job (read by HeterogeneousEnvironment)."""
    return {
        "TORCHELASTIC_RUN_ID": "test", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }


def _run_rank(rank: int, worker: Callable[..., Any], port: int, out_dir: str, world_size: int, *args: Any) -> None:
    """One spawned rank: one thread (two cores are shared by all ranks), torchrun's variables, result to JSON."""
    import os

    import torch

    torch.set_num_threads(1)
    os.environ.update(torchrun_variables(rank, world_size, port))
    result = worker(rank, Path(out_dir), *args)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def spawn_ranks(worker: Callable[..., Any], world_size: int, out_dir: str | Path, *args: Any) -> list[Any]:
    """Run ``worker(rank, out_dir, *args) -> result`` on ``world_size`` torchrun-like processes;
    the results (JSON-serialisable) in rank order."""
    import torch.multiprocessing as mp

    mp.spawn(_run_rank, args=(worker, free_port(), str(out_dir), world_size, *args), nprocs=world_size, join=True)
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]
