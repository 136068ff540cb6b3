"""HeterogeneousEnvironment: ranks from torchrun and SLURM as they are, machines of different sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zorse_lightning.errors import ZorseUserError
from zorse_lightning.strategy.accelerator import cuda_index_for
from zorse_lightning.strategy.environment import HeterogeneousEnvironment, Launcher, slurm_tasks_on_node
from testing.launch import free_port

TORCHRUN_NODE1 = {  # second machine of two, running 2 of 3 processes: its second process
    "TORCHELASTIC_RUN_ID": "none",
    "RANK": "2",
    "WORLD_SIZE": "3",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}

SLURM_NODE2 = {  # three nodes with 2, 2 and 1 tasks: the last node's only task
    "SLURM_NTASKS": "5",
    "SLURM_PROCID": "4",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "2",
    "SLURM_TASKS_PER_NODE": "2(x2),1",
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NAME": "train",
    "MASTER_ADDR": "node-a",
}


@pytest.mark.multiprocess
def test_torchrun_ranks_are_taken_as_given_and_lightning_arithmetic_is_ignored() -> None:
    env = HeterogeneousEnvironment(TORCHRUN_NODE1)
    # What DDPStrategy.set_world_ranks would compute with devices=2, num_nodes=2: node_rank*2+local = 3, 4.
    env.set_global_rank(1 * 2 + 1)
    env.set_world_size(2 * 2)
    assert (env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()) == (2, 3, 1, 1)
    assert env.local_world_size() == 2
    assert (env.main_address, env.main_port) == ("10.0.0.1", 29500)
    assert env.ranks.launcher is Launcher.TORCHRUN
    env.validate_settings(num_devices=2, num_nodes=2)  # 2 x 2 != 3, which Lightning's own check refuses
    env.validate_settings(num_devices=1, num_nodes=2)  # each process sees its own GPU only
    four = HeterogeneousEnvironment({**TORCHRUN_NODE1, "WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(ZorseUserError, match=r"devices=2\) but torchrun started 4 processes .* devices=4"):
        four.validate_settings(num_devices=2, num_nodes=2)


def test_slurm_ranks_with_uneven_tasks_per_node() -> None:
    env = HeterogeneousEnvironment(SLURM_NODE2)
    assert (env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()) == (4, 5, 0, 2)
    assert env.local_world_size() == 1
    assert (env.main_address, env.main_port) == ("node-a", 15000 + 3456)
    assert [slurm_tasks_on_node("2(x2),1", n) for n in range(3)] == [2, 2, 1]
    assert [slurm_tasks_on_node("3,1(x2)", n) for n in range(3)] == [3, 1, 1]


def test_slurm_with_one_gpu_per_task_is_accepted() -> None:
    """``srun --ntasks-per-node=4 --gpus-per-task=1``: each process sees one GPU, so ``devices='auto'`` is 1
    on a machine of 4 processes; the process uses the GPU it sees."""
    env = HeterogeneousEnvironment({
        **SLURM_NODE2, "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_GPUS_PER_TASK": "1",
    })
    assert (env.global_rank(), env.local_rank(), env.local_world_size()) == (5, 1, 4)
    env.validate_settings(num_devices=1, num_nodes=2)
    assert cuda_index_for(env.local_rank(), visible_devices=1) == 0
    env.validate_settings(num_devices=4, num_nodes=2)  # each sees all four: cuda:LOCAL_RANK
    with pytest.raises(ZorseUserError, match=r"devices=3\) but slurm started 4 processes"):
        env.validate_settings(num_devices=3, num_nodes=2)


@pytest.mark.multiprocess
def test_missing_launcher_is_a_clear_error() -> None:
    with pytest.raises(ZorseUserError, match="torchrun or srun"):
        HeterogeneousEnvironment({"SLURM_JOB_NAME": "bash"})
    with pytest.raises(ZorseUserError, match="RANK='x'"):
        HeterogeneousEnvironment({**TORCHRUN_NODE1, "RANK": "x"})


_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from zorse_lightning.strategy.accelerator import cuda_index_for
    from zorse_lightning.strategy.environment import HeterogeneousEnvironment

    env = HeterogeneousEnvironment()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.main_address, str(env.main_port)
    dist.init_process_group("gloo", rank=env.global_rank(), world_size=env.world_size())
    ranks = torch.tensor([env.global_rank()])
    dist.all_reduce(ranks)
    seen = dict(detect=HeterogeneousEnvironment.detect(), rank=env.global_rank(), world=env.world_size(),
                local=env.local_rank(), local_world=env.local_world_size(), node=env.node_rank(),
                rank_sum=int(ranks))
    dist.destroy_process_group()
    with open(os.path.join(sys.argv[1], f"rank{env.global_rank()}.json"), "w") as f:
        json.dump(seen, f)
    """
)



@pytest.mark.multiprocess
def test_torchrun_two_nodes_with_one_and_two_processes(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--master-addr=127.0.0.1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [*torchrun, f"--nproc-per-node={nproc}", f"--node-rank={node}", f"--master-port={port}", str(script),
             str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
        )
        for node, nproc in ((0, 1), (1, 2))
    ]
    try:
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    expected = [  # (global rank, local rank, processes on its machine, node)
        (0, 0, 1, 0),
        (1, 0, 2, 1),
        (2, 1, 2, 1),
    ]
    assert [(s["rank"], s["local"], s["local_world"], s["node"]) for s in seen] == expected
    assert all(s["world"] == 3 and s["rank_sum"] == 0 + 1 + 2 and s["detect"] for s in seen)
