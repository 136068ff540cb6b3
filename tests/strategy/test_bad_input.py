"""Bad input, each refused before any step with a message that says what is wrong and what to do.

A corrupt or truncated checkpoint is in test_checkpoint_files.py (and through
the Trainer in test_checkpoint_resume.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from testing.plans import hand_plan

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.cluster.detection import DeviceReport, match_machines
from zorse_lightning.errors import InventoryError, PlanningError
from zorse_lightning.planner.plan_check import check_plan, resolve_plan
from zorse_lightning.strategy.zorse_strategy import model_blocks
from zorse_lightning.models.gpt import GPT
from zorse_lightning.schedule.plan import Plan, Prediction

GIB = 1 << 30


def _plan4() -> Plan:
    inventory = load_cluster("cpu_sim4")
    return hand_plan([((0, 1), (4, 4), (0, 2)), ((2, 3), (4, 4), (2, 4))], inventory=inventory)


def _plan2(layers: int = 4) -> Plan:
    inventory = load_cluster("cpu_sim2")
    return hand_plan([((0,), (4,), (0, layers // 2)), ((1,), (4,), (layers // 2, layers))], inventory=inventory)


def test_plan_for_another_rank_count():
    with pytest.raises(PlanningError, match=r"plan is for 4 ranks but cluster 'cpu_sim2' has 2; re-plan"):
        check_plan(_plan4(), load_cluster("cpu_sim2"))


def test_plan_for_other_gpu_types():
    with pytest.raises(PlanningError, match=r"stage 0 .* puts a a100x40 at rank 0, but cluster 'lab4_l4_a6000_p40' "
                                            r"has a l4 there; .*re-plan for this one"):
        check_plan(_plan4(), load_cluster("lab4_l4_a6000_p40"))


@pytest.mark.parametrize("launched, word", [(2, "fewer"), (6, "more")])
def test_more_or_fewer_processes_than_the_plan_has_ranks(launched, word):
    with pytest.raises(PlanningError, match=rf"plan is for 4 ranks but {launched} processes were launched \({word} "
                                            r"than the plan has\); launch 4"):
        resolve_plan(_plan4(), launched)


def test_predicted_memory_beyond_a_gpu():
    # cpu_sim2's V100 (rank 1) has a 0.16 GiB budget; the plan predicts 0.3 GiB there.
    plan = replace(_plan2(), predicted=Prediction(1.0, 1.0, (0.1, 0.3), {}))
    with pytest.raises(PlanningError, match=r"predicts 0.30 GiB on rank 1, but that v100x16 has 0.16 GiB; re-plan"):
        check_plan(plan, load_cluster("cpu_sim2"))
    check_plan(replace(plan, predicted=Prediction(1.0, 1.0, (0.1, 0.15), {})), load_cluster("cpu_sim2"))


def test_stage_state_beyond_a_gpu():
    # Width 640: a block has 12 * 640^2 + 13 * 640 = 4,923,520 weights; float32 training state (weights,
    # gradients, two Adam moments) is 16 bytes each: 2 blocks = 0.147 GiB fit the V100's 0.16 GiB, 3 = 0.220 do not.
    model = GPT(vocab_size=16, seq_len=8, width=640, layers=4, heads=2)
    inventory = load_cluster("cpu_sim2")
    check_plan(_plan2(), inventory, model_blocks(model, None))
    too_much = hand_plan([((0,), (4,), (0, 1)), ((1,), (4,), (1, 4))], inventory=inventory)
    with pytest.raises(PlanningError, match=r"stage 1 \(blocks 1-3\) needs at least 0.22 GiB .* rank 1, but that "
                                            r"v100x16 has 0.16 GiB; re-plan .*shard the optimizer state"):
        check_plan(too_much, inventory, model_blocks(model, None))


def test_plan_made_for_another_model():
    plan = replace(_plan2(layers=8), model="llama_7b")
    model = GPT(vocab_size=16, seq_len=8, width=16, layers=4, heads=2)
    with pytest.raises(PlanningError, match=r"plan \(made for model 'llama_7b'\) splits 8 blocks, but GPT has 4; "
                                            r"it was made for another model: re-plan"):
        check_plan(plan, None, model_blocks(model, None))


def test_inventory_disagrees_with_detected_devices():
    inventory = load_cluster("a100x4_v100x4")
    right = [("h0", DeviceReport("NVIDIA A100-SXM4-40GB", 40 * GIB))] * 4 + [("h1", DeviceReport("Tesla V100-SXM2-32GB", 32 * GIB))] * 4
    assert match_machines(inventory, right) == inventory
    wrong = [*right[:6], ("h1", DeviceReport("NVIDIA L4", 24 * GIB)), right[7]]
    with pytest.raises(InventoryError, match=r"host 'h1' runs 4 processes on GPUs \['v100x32', 'v100x32', 'l4', "
                                             r"'v100x32'\], and no machine of cluster 'a100x4_v100x4' left unmatched"
                                             r".*or omit cluster=\.\.\. to use the detected devices"):
        match_machines(inventory, wrong)


def test_emulation_slowdown_below_one():
    from zorse_lightning.errors import ZorseUserError
    from zorse_lightning.strategy.zorse_strategy import ZorseStrategy

    with pytest.raises(ZorseUserError, match=r"emulation_slowdown=0.5 must be >= 1 .* the default is 3"):
        ZorseStrategy(cluster="cpu_sim2", emulation_slowdown=0.5)
