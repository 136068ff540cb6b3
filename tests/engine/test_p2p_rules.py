"""``ZORSE_P2P_RULES=nccl`` on real gloo ranks: the schedule's batches pass with every message intact, and the
orders that hang a GPU cluster fail with an error that names the ranks and what each waits for: the engine's old
per-message posting of a two-stage 1F1B, the start-up probe's old ring (send to the next, then receive from the
previous) on three ranks, whose first sends each wait inside the connection of their direction, and a group's
first collective issued while a peer waits for this rank's message. One spawn of three processes; the failing
cases run last, each in a world of its own (what a failed batch leaves posted must not meet the next case's
messages)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from testing.launch import free_ports, join_world, spawn_ranks
from testing.plans import hand_plan, per_message_batches

from zorse_lightning.engine.p2p import Transport, post_batches
from zorse_lightning.engine.p2p_rules import LazyCommunicators, P2PRulesError
from zorse_lightning.schedule.actions import ActionKind, Message, messages_of
from zorse_lightning.schedule.p2p_batches import P2PBatch
from zorse_lightning.schedule.programs import build_schedule

pytestmark = pytest.mark.multiprocess

ELEMENTS = 256 * 1024
"""1 MiB of float32 per message: on NCCL the size decides whether a send waits for its receive; the rules
mode makes every send wait, which is the stricter case."""


def _drive(plan, rank: int, program, batches, transport: Transport) -> int:
    """Run ``program`` with stand-in compute: an activation of microbatch ``j`` is filled with ``j``, its
    gradient with ``j + 0.5``; returns how many messages arrived with the value they should carry."""
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    intact = 0
    for ran, action in enumerate(program):
        batches = post_batches(transport, batches, ran, lambda m: outputs[(m.boundary, m.microbatch)])
        receives, sends = messages_of(plan, rank, action)
        for message in receives:
            expected = message.microbatch + (0.5 if message.kind is ActionKind.BACKWARD else 0.0)
            intact += bool(torch.all(transport.take(message) == expected))
        value = action.microbatch + (0.5 if action.kind is ActionKind.BACKWARD else 0.0)
        output = torch.full((ELEMENTS,), value)
        if action.kind is ActionKind.FORWARD:
            outputs[(action.stage, action.microbatch)] = output
        for message in sends:
            transport.stage(message, output)
    post_batches(transport, batches, len(program), lambda m: outputs[(m.boundary, m.microbatch)])
    transport.finish()
    return intact


def _ring(rank: int, world: int, batched: bool) -> None:
    """The probe's exchange: every rank sends to the next and receives from the previous."""
    to, source = (rank + 1) % world, (rank - 1) % world
    outgoing = Message(rank, to, ActionKind.FORWARD, 0, rank)
    incoming = Message(source, rank, ActionKind.FORWARD, 0, source)
    if batched:
        batches = [P2PBatch(0, (outgoing,), (incoming,))]
    else:
        batches = [P2PBatch(0, (outgoing,), ()), P2PBatch(0, (), (incoming,))]
    transport = Transport(torch.device("cpu"))
    transport.stage(outgoing, torch.zeros(ELEMENTS))
    post_batches(transport, batches, 0, lambda m: None)
    transport.take(incoming)
    transport.finish()


def _collective_before_a_send(rank: int) -> str:
    """Rank 0 makes group [0, 1]'s communicator (its first collective) before it sends rank 1 the message
    rank 1 waits for: under NCCL both hosts block."""
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    message = Message(0, 1, ActionKind.BACKWARD, 0, 0)  # a gradient: no header, the receive posts at once
    transport = Transport(torch.device("cpu"))
    if rank == 0:

        def run() -> None:
            LazyCommunicators().call(group, "stage 0's gradient reduction")
            transport.stage(message, torch.zeros(4))
            post_batches(transport, [P2PBatch(0, (message,), ())], 0, lambda m: None)

        return _failure(run)
    if rank == 1:
        batches = [P2PBatch(0, (), (message,))]
        return _failure(lambda: (post_batches(transport, batches, 0, lambda m: torch.zeros(4)), transport.take(message)))
    return ""


def _failure(run) -> str:
    try:
        run()
    except P2PRulesError as error:
        return str(error)
    return ""


def _worker(rank: int, out_dir: Path, ports: list[int]) -> dict:
    import torch.distributed as dist

    os.environ["ZORSE_P2P_RULES"] = "nccl"
    os.environ["ZORSE_P2P_RULES_TIMEOUT_S"] = "4"
    join_world(3, ports[0])
    dist.init_process_group("gloo")
    plan = hand_plan([((0,), (3,), (0, 1)), ((1,), (3,), (1, 2))])
    schedule = build_schedule(plan)
    result = {}
    if rank < 2:
        program = schedule.programs[rank]
        result["intact"] = _drive(plan, rank, program, schedule.batches[rank], Transport(torch.device("cpu")))
    _ring(rank, 3, batched=True)
    dist.barrier()
    if rank < 2:
        old = per_message_batches(plan, schedule.programs)[rank]
        result["old_1f1b"] = _failure(lambda: _drive(plan, rank, schedule.programs[rank], old, Transport(torch.device("cpu"))))
    join_world(3, ports[1])
    dist.init_process_group("gloo")
    result["old_ring"] = _failure(lambda: _ring(rank, 3, batched=False))
    join_world(3, ports[2])
    dist.init_process_group("gloo")
    result["collective_first"] = _collective_before_a_send(rank)
    return result


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_worker, 3, tmp_path_factory.mktemp("p2p_rules"), free_ports(3))


def test_the_schedules_batches_pass_with_every_message_intact(results):
    # 3 microbatches: rank 0 receives 3 gradients, rank 1 3 activations
    assert [r["intact"] for r in results[:2]] == [3, 3]


def test_the_old_1f1b_order_fails_naming_ranks_and_messages(results):
    rank0, rank1 = results[0]["old_1f1b"], results[1]["old_1f1b"]
    assert "under NCCL's point-to-point rules this run would hang" in rank0
    assert (
        "its send of the activation of microbatch 1 (stages 0-1) to rank 1: rank 1 has not posted the matching receive"
        in rank0
    )
    assert (
        "its send of the gradient of microbatch 0 (stages 0-1) to rank 0: rank 0 has not posted the matching receive"
        in rank1
    )


def test_the_old_probe_ring_fails_on_three_ranks(results):
    """Each rank's first batch sends to the next rank alone; NCCL connects that direction on both hosts, and
    the next rank posts its receive only after its own send's connection: a cycle of blocked hosts."""
    for rank, result in enumerate(results):
        following = (rank + 1) % 3
        assert (
            f"under NCCL's lazy rules this run would hang: rank {rank} [send activation of microbatch 0 (stages "
            f"{rank}-{rank + 1}) to rank {following}] is the first batch from rank {rank} to rank {following}, whose "
            f"connection is made inside ncclGroupEnd on both hosts; after 4 s rank {following} had not posted its batch "
            f"holding the activation of microbatch 0 (stages {rank}-{rank + 1})"
        ) in result["old_ring"]


def test_a_first_collective_before_a_send_the_peer_waits_for_fails_naming_the_group_and_the_wait(results):
    rank0, rank1 = results[0]["collective_first"], results[1]["collective_first"]
    assert (
        "under NCCL's lazy rules this run would hang: rank 0's first collective on group" in rank0
        and "(ranks [0, 1]), stage 0's gradient reduction, makes the group's communicator, which blocks the host of "
        "every member until all have called it; after 4 s rank(s) [1] had not" in rank0
    )
    assert "is the first batch from rank 0 to rank 1" in rank1 and "rank 0 had not posted its batch holding the gradient" in rank1
