"""The plan says tensor parallelism: TP groups listed replica by replica, validated, saved and read back; older
plans still read; unknown keys refused by name; the schedule pairs TP ranks of neighbouring stages."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from zorse_lightning.errors import PlanningError
from zorse_lightning.schedule.actions import Action, ActionKind, messages_of
from zorse_lightning.schedule.plan import PLAN_FORMAT_VERSION, Plan, StagePlan
from zorse_lightning.schedule.programs import build_schedule

FIRST = StagePlan(
    ranks=(0, 1, 2, 3), gpu_types=("a100x40",) * 2 + ("v100x16",) * 2, machines=("m0", "m0", "m1", "m1"),
    layers=(0, 2), microbatches_per_rank=(3, 3, 1, 1), tensor_parallel=2,
)
SECOND = StagePlan(
    ranks=(4, 5, 6, 7), gpu_types=("t4",) * 4, machines=("m2",) * 4, layers=(2, 4), microbatches_per_rank=(1, 1, 3, 3),
    tensor_parallel=2,
)


def _plan(*stages: StagePlan, schedule: str = "1f1b") -> Plan:
    world = sum(len(s.ranks) for s in stages)
    return Plan("tiny", "hand", stages[-1].layers[1], world, 8, 2, schedule, stages)


def test_replicas_share_their_microbatches():
    assert FIRST.replicas == ((0, 1), (2, 3))
    assert FIRST.num_microbatches == 4
    assert FIRST.microbatch_ranges() == {0: range(0, 3), 1: range(0, 3), 2: range(3, 4), 3: range(3, 4)}
    assert FIRST.tensor_group(3) == (2, 3) and FIRST.tensor_index(3) == 1
    assert FIRST.data_ranks(1) == (1, 3)
    assert FIRST.peer_of_microbatch(3, 1) == 3 and FIRST.rank_of_microbatch(3) == 2


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"machines": ("m0", "m1", "m1", "m1")}, ["TP group [0, 1]", "machines ['m0', 'm1']", "one machine"]),
        ({"gpu_types": ("a100x40", "t4", "v100x16", "v100x16")}, ["gpu_types ['a100x40', 't4']", "one GPU type"]),
        ({"microbatches_per_rank": (3, 2, 1, 2)}, ["microbatches_per_rank [3, 2]", "replica's microbatches"]),
        ({"tensor_parallel": 3}, ["tensor_parallel=3 does not divide its 4 ranks", "choose a degree dividing 4"]),
        ({"tensor_parallel": 0}, ["tensor_parallel=0 must be a whole number >= 1"]),
    ],
)
def test_bad_tensor_parallel_groups_are_named(change, words):
    with pytest.raises(PlanningError) as error:
        _plan(replace(FIRST, **change))
    for word in words:
        assert word in str(error.value)
    assert "layers cover" not in str(error.value)


def test_round_trip_and_format_version(tmp_path):
    plan = _plan(FIRST, SECOND)
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["format_version"] == PLAN_FORMAT_VERSION == 2
    assert data["stages"][0]["tensor_parallel"] == 2
    assert Plan.load(tmp_path / "plan.json") == plan


def test_version_one_plans_read_without_tensor_parallelism():
    data = _plan(replace(FIRST, tensor_parallel=1, microbatches_per_rank=(1, 1, 1, 1))).to_dict()
    data["format_version"] = 1
    del data["stages"][0]["tensor_parallel"]
    assert Plan.from_dict(data).stages[0].tensor_parallel == 1


def test_unknown_key_names_key_file_and_version(tmp_path):
    data = _plan(FIRST, SECOND).to_dict()
    data["stages"][1]["tensor_paralel"] = 2
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanningError) as error:
        Plan.load(path)
    for word in ("stages[1].tensor_paralel", str(path), "format_version=2", "plan format 2 does not know"):
        assert word in str(error.value)


def test_unreadable_version_names_the_file(tmp_path):
    data = _plan(FIRST).to_dict()
    data["format_version"] = 9
    path = tmp_path / "new.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanningError, match=r"new.json.*format_version=9.*reads \[1, 2\]"):
        Plan.load(path)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_tensor_ranks_exchange_with_their_index(schedule):
    plan = _plan(FIRST, SECOND, schedule=schedule)
    built = build_schedule(plan)
    for rank in range(8):
        stage = plan.stages[plan.stage_of_rank(rank)]
        group = stage.tensor_group(rank)
        assert built.for_rank(rank) == built.for_rank(group[0]), "a TP group runs one program"
        for action in built.for_rank(rank):
            receives, sends = messages_of(plan, rank, action)
            for message in (*receives, *sends):
                other = message.dst if message.src == rank else message.src
                assert plan.stages[plan.stage_of_rank(other)].tensor_index(other) == stage.tensor_index(rank)
    assert messages_of(plan, 1, Action(0, ActionKind.FORWARD, 0))[1][0].dst == 5
    assert messages_of(plan, 1, Action(0, ActionKind.FORWARD, 1))[1][0].dst == 7


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_stages_of_different_degrees_pair_index_modulo_degree(schedule):
    """TP 2 then TP 1 (two replicas): TP rank 0 sends the activation, TP rank 1 sends none; each receiving
    rank sends the gradient back to both; every rank receives one message per action."""
    second = replace(SECOND, tensor_parallel=1, microbatches_per_rank=(1, 1, 1, 1))
    plan = _plan(FIRST, second, schedule=schedule)
    built = build_schedule(plan)
    assert built.for_rank(0) == built.for_rank(1)
    forward, backward = Action(0, ActionKind.FORWARD, 0), Action(0, ActionKind.BACKWARD, 0)
    assert [m.dst for m in messages_of(plan, 0, forward)[1]] == [4]
    assert messages_of(plan, 1, forward)[1] == []
    assert [m.src for m in messages_of(plan, 1, backward)[0]] == [4]
    assert [m.dst for m in messages_of(plan, 4, Action(1, ActionKind.BACKWARD, 0))[1]] == [0, 1]
    for rank in range(8):
        for action in built.for_rank(rank):
            fed = (action.stage == 1) == (action.kind is ActionKind.FORWARD)  # an activation or a gradient comes in
            assert len(messages_of(plan, rank, action)[0]) == int(fed), (rank, action)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("interleave", [1, 2])
def test_a_tp_plan_is_played_once_per_replica_as_on_every_rank(schedule, interleave):
    """played_programs records a TP plan on one rank per TP group and gives its program and steps to the group:
    the same programs and unit-step grid as recording and playing every rank (stages of degrees 2 and 1 and 2,
    uneven replica shares, plain and interleaved; forward-only too)."""
    from zorse_lightning.schedule.programs import check_coverage, play_in_steps, played_programs, rank_programs

    middle = StagePlan((8, 9), ("t4",) * 2, ("m3",) * 2, (2, 4), (3, 1))
    third = replace(SECOND, layers=(4, 6))
    plan = _plan(FIRST, middle, third, schedule=schedule)
    if interleave > 1:
        chunks = [replace(s, layers=(i, i + 1)) for i, s in enumerate(plan.stages * 2)]
        plan = replace(plan, stages=tuple(chunks), num_layers=len(chunks), interleave=2)
    for forward_only in (False, True):
        programs = rank_programs(plan, forward_only)
        check_coverage(plan, programs, forward_only)
        assert played_programs(plan, forward_only) == (programs, play_in_steps(plan, programs))


def test_a_tp_group_across_machines_of_the_cluster_is_refused():
    """The plan's own machine names agree, but the cluster puts the ranks on two machines."""
    from zorse_lightning.cluster.config import load_cluster
    from zorse_lightning.planner.plan_check import check_plan

    inventory = load_cluster({
        "name": "two_t4_machines", "emulated": True,
        "machines": [{"name": name, "gpus": [{"type": "t4", "count": 2}]} for name in ("m0", "m1")],
    })
    stage = StagePlan(
        ranks=(0, 1, 2, 3), gpu_types=("t4",) * 4, machines=("m0",) * 4, layers=(0, 4), microbatches_per_rank=(4, 4, 4, 4),
        tensor_parallel=2,
    )
    check_plan(Plan("tiny", inventory.name, 4, 4, 16, 2, "1f1b", (stage,)), inventory)  # (0, 1) and (2, 3): fine
    across = replace(stage, ranks=(0, 2, 1, 3))
    with pytest.raises(PlanningError, match=r"ranks \[0, 2\] one TP group .* on machines \['m0', 'm1'\].*lives on one machine"):
        check_plan(Plan("tiny", inventory.name, 4, 4, 16, 2, "1f1b", (across,)), inventory)


def test_the_state_a_tp_rank_must_hold_is_its_share():
    """Three blocks of 4.9 M weights need 0.22 GiB of float32 Adam state: over a 0.16 GiB T4 alone, within
    it split over two."""
    from zorse_lightning.cluster.config import load_cluster
    from zorse_lightning.planner.plan_check import ModelBlocks, check_plan

    inventory = load_cluster({
        "name": "t4_pairs", "emulated": True,
        "machines": [{"name": name, "gpus": [{"type": "t4", "count": 2, "memory_gib": 0.16}]} for name in ("m0", "m1")],
    })
    blocks = ModelBlocks("GPT", parameters=(4_923_520,) * 4)

    def plan(degree: int) -> Plan:
        stages = tuple(
            StagePlan(
                ranks=ranks, gpu_types=("t4",) * 2, machines=(machine,) * 2, layers=layers,
                microbatches_per_rank=(4, 4) if degree == 2 else (2, 2), tensor_parallel=degree,
            )
            for ranks, machine, layers in (((0, 1), "m0", (0, 3)), ((2, 3), "m1", (3, 4)))
        )
        return Plan("GPT", inventory.name, 4, 4, 8, 2, "1f1b", stages)

    check_plan(plan(2), inventory, blocks)
    with pytest.raises(PlanningError, match=r"stage 0 \(blocks 0-2\) needs at least 0.22 GiB"):
        check_plan(plan(1), inventory, blocks)
