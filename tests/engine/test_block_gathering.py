"""Gathering block by block (one process): which weights are gathered per block, and the empty rounds that
keep a rank with fewer microbatches in step with the stage's busiest."""

from __future__ import annotations

import torch
from torch import nn

from testing.plans import hand_plan
from zorse_lightning.capabilities import Schedule
from zorse_lightning.engine.block_gathering import EMPTY_ROUND, block_units, padded_program
from zorse_lightning.planner.schedule import build_schedule


def _kinds(program) -> str:
    return "".join(a.kind.value if a.microbatch != EMPTY_ROUND else a.kind.value.lower() for a in program)


def test_a_rank_with_fewer_microbatches_pads_each_schedule_to_the_busiest_rounds():
    for schedule, expected in [(Schedule.ONE_F_ONE_B, "FBfbfb"), (Schedule.GPIPE, "FffBbb")]:
        plan = hand_plan([((0, 1), (3, 1), (0, 2))], schedule=schedule)
        built = build_schedule(plan)
        padded = padded_program(built.for_rank(1), built.for_rank(0))
        assert _kinds(padded) == expected, (schedule, _kinds(padded))
        assert [a.microbatch for a in padded if a.microbatch != EMPTY_ROUND] == [3, 3]
        assert padded_program(built.for_rank(0), built.for_rank(0)) == list(built.for_rank(0))


def test_weights_shared_outside_a_block_are_in_no_unit():
    embedding = nn.Embedding(10, 4)
    blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    head = nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight  # tied: stays whole on every rank
    blocks[1].bias = blocks[0].bias  # shared by two blocks: whole too
    root = nn.ModuleDict({"embedding": embedding, "blocks": blocks, "head": head})
    units = block_units(root, list(blocks), list(root.parameters()))
    assert [[id(p) for p in unit] for unit in units] == [[id(blocks[0].weight)], [id(blocks[1].weight)]]
    assert all(isinstance(p, torch.nn.Parameter) for unit in units for p in unit)
