"""Gathering block by block (one process): which weights are gathered per block, and the empty rounds that
keep a rank with fewer microbatches in step with the stage's busiest."""

from __future__ import annotations

import torch
from torch import nn

from testing.plans import hand_plan
from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.engine.block_gathering import block_units
from zorse_lightning.engine.sharding import refill, free, settle, true_numel, true_shape
from zorse_lightning.module.materialize import holds_values
from zorse_lightning.schedule.gathering_rounds import EMPTY_ROUND
from zorse_lightning.schedule.programs import build_schedule
from zorse_lightning.engine.checkpoint.shards import held_module_entries


def _kinds(program) -> str:
    return "".join(a.kind.value if a.microbatch != EMPTY_ROUND else a.kind.value.lower() for a in program)


def test_a_rank_with_fewer_microbatches_pads_each_schedule_to_the_busiest_rounds():
    for schedule, expected in [(Schedule.ONE_F_ONE_B, "FBfbfb"), (Schedule.GPIPE, "FffBbb")]:
        plan = hand_plan([((0, 1), (3, 1), (0, 2))], schedule=schedule, sharding=Sharding.FULL, gather_per_microbatch=True)
        built = build_schedule(plan)
        padded = built.rounds[1]
        assert _kinds(padded) == expected, (schedule, _kinds(padded))
        assert [a.microbatch for a in padded if a.microbatch != EMPTY_ROUND] == [3, 3]
        assert built.rounds[0] == built.for_rank(0)


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


def test_a_weight_freed_between_steps_is_an_empty_tensor_that_remembers_its_shape():
    """Inside a step a freed weight keeps its shape over an empty storage (autograd may hold it); between
    steps it becomes an empty tensor, safe to read, and refilling it restores shape and values."""
    layer = nn.Linear(3, 2)
    values = layer.weight.detach().clone()
    free([layer.weight])
    assert layer.weight.shape == (2, 3) and not holds_values(layer.weight)
    settle([layer.weight])
    assert layer.weight.numel() == 0 and true_shape(layer.weight) == (2, 3) and true_numel(layer.weight) == 6
    assert not holds_values(layer.weight) and layer.weight.sum().item() == 0.0  # readable, no crash
    assert "weight" not in held_module_entries(layer) and "bias" in held_module_entries(layer)
    refill(layer.weight, values)
    assert holds_values(layer.weight) and torch.equal(layer.weight, values)
