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


def write_rank_result(out_dir: str | Path, rank: int, result: Any) -> None:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def spawn_ranks(worker: Callable[..., None], world_size: int, out_dir: str | Path, *args: Any) -> list[Any]:
    """Run ``worker(rank, port, out_dir, *args)`` on ``world_size`` processes; each rank's result in rank order."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(free_port(), str(out_dir), *args), nprocs=world_size, join=True)
    return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]
