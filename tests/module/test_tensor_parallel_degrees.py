"""The TP degrees a module's blocks admit, for its profile: those its plan applies at, with the first refusal's
reason, and what the plan leaves whole."""

from __future__ import annotations

from torch import nn

from zorse_lightning.models.gpt import GPT
from zorse_lightning.module.blocks import find_block_list
from zorse_lightning.module.tensor_parallel import admitted_degrees


def test_the_projects_gpt_admits_the_divisors_of_its_heads():
    model = GPT(vocab_size=64, seq_len=16, width=48, layers=2, heads=6)
    admitted = admitted_degrees(model, find_block_list(model), 8)
    assert admitted.degrees == (2, 3, 6)
    assert "tensor_parallel=4" in admitted.reason and "heads=6" in admitted.reason
    # two layer norms (weight and bias) and the two row-wise projections' biases: 6 x 48
    assert admitted.replicated_parameters == 6 * 48


def test_blocks_without_a_plan_admit_none():
    model = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))
    admitted = admitted_degrees(model, find_block_list(model), 4)
    assert admitted.degrees == () and "no tensor-parallel plan" in admitted.reason
