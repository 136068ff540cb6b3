"""Activation offload as a plan choice: in the plan, its JSON and its checks."""

from __future__ import annotations

import json

import pytest

from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.plan import Plan
from testing.plans import hand_plan


def _two_stages(**kwargs) -> Plan:
    return hand_plan([((0,), (4,), (0, 2)), ((1,), (4,), (2, 4))], **kwargs)


def test_offload_survives_json_and_old_plans_read_as_keeping_activations():
    plan = _two_stages(offload_stages=(1,))
    again = Plan.from_json(plan.to_json())
    assert again == plan and [s.activations_label for s in again.stages] == ["keep", "offload"]
    old = json.loads(_two_stages(recompute=True).to_json())
    for stage in old["stages"]:
        del stage["offload_activations"]  # a plan written before offload existed
    assert [s.activations_label for s in Plan.from_dict(old).stages] == ["recompute", "recompute"]


def test_offload_with_recompute_is_refused_with_the_fix():
    with pytest.raises(PlanningError, match="offload_activations with recompute .* choose one"):
        _two_stages(offload_stages=(0,), recompute=True)
