"""Where a block's TP plan comes from and whether it applies: the user's module, a Hugging Face model inside it,
a given plan; keys, styles, widths and heads checked; a block that cannot be split runs at TP 1 with the reason."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from zorse_lightning.errors import PlanningError
from zorse_lightning.models.gpt import GPT, CausalSelfAttention
from zorse_lightning.module.blocks import find_block_list
from zorse_lightning.module.tensor_parallel import (
    HF_STYLES,
    find_block_plan,
    require_block_plan,
    tensor_parallel_choice,
)

transformers = pytest.importorskip("transformers")


class Wrapped(nn.Module):
    """A user's module around a Hugging Face model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def _hf(kind: str, heads: int = 4, kv_heads: int = 2) -> Wrapped:
    config = getattr(transformers, kind)(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    return Wrapped(transformers.AutoModelForCausalLM.from_config(config))


def test_the_gpt_splits_by_its_own_plan():
    model = GPT(width=32, heads=4, layers=2)
    choice = tensor_parallel_choice(model, find_block_list(model), 2)
    assert choice.degree == 2 and not choice.reason
    assert choice.plan.source == "GPT.tp_plan at '<root>'"
    assert dict(choice.plan.styles) == {
        "attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.proj": "rowwise",
        "mlp.0": "colwise", "mlp.2": "rowwise",
    }
    assert isinstance(choice.plan.torch_plan()["attn.proj"], RowwiseParallel)


@pytest.mark.parametrize("kind", ["LlamaConfig", "Qwen2Config", "MistralConfig"])
def test_hugging_face_plans_are_read_relative_to_a_block(kind):
    model = _hf(kind)
    blocks = find_block_list(model)
    plan = find_block_plan(model, blocks)
    assert plan.source.endswith(".tp_plan at 'model'")
    assert plan.styles["self_attn.q_proj"] == "colwise" and plan.styles["mlp.down_proj"] == "rowwise"
    assert "lm_head" not in plan.styles and "embed_tokens" not in plan.styles  # outside the blocks: replicated
    assert tensor_parallel_choice(model, blocks, 2).degree == 2


def test_key_value_heads_not_divisible_give_tp_1_with_the_reason():
    model = _hf("LlamaConfig", heads=4, kv_heads=2)
    choice = tensor_parallel_choice(model, find_block_list(model), 4)
    assert choice.degree == 1
    assert "num_key_value_heads=2 is not divisible by tensor_parallel=4" in choice.reason
    assert choice.reason.count("num_key_value_heads") == 1  # a config shared by submodules is named once


def test_gpt_heads_and_widths_not_divisible():
    model = GPT(width=32, heads=4, layers=2)
    reason = tensor_parallel_choice(model, find_block_list(model), 3).reason
    assert "attn.heads=4 is not divisible by tensor_parallel=3" in reason
    assert "'attn.q' splits 32 outputs over tensor_parallel=3" in reason


def test_a_model_without_a_plan_runs_without_tp_and_says_why():
    model = Wrapped(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64)))
    choice = tensor_parallel_choice(model, find_block_list(model), 2)
    assert choice.degree == 1 and "has no tensor-parallel plan for its blocks (GPT2Block)" in choice.reason


def test_a_fused_conv1d_projection_cannot_be_split():
    model = Wrapped(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64)))
    choice = tensor_parallel_choice(model, find_block_list(model), 2, given={"attn.c_attn": "colwise"})
    assert choice.degree == 1 and "'attn.c_attn' is a Conv1D" in choice.reason


def test_given_plans_unknown_styles_and_keys_are_named():
    model = GPT(width=32, heads=4, layers=2)
    blocks = find_block_list(model)
    given = {"blocks.*.attn.q": "packed_colwise", "attn.nothing": "colwise", "mlp.0": ColwiseParallel()}
    plan = find_block_plan(model, blocks, given)
    assert set(plan.styles) == {"attn.q"}  # keys with the block list's path win; the others are not the block's
    choice = tensor_parallel_choice(model, blocks, 2, given={"attn.nothing": "colwise", "mlp.0": "sideways"})
    assert "key 'attn.nothing' of the given tp_plan names no module of the block" in choice.reason
    assert "style 'sideways' of 'mlp.0'" in choice.reason and str(sorted(HF_STYLES)) in choice.reason
    with pytest.raises(PlanningError, match=r"the plan's tensor_parallel=2 cannot run: .*or use tensor_parallel=1"):
        require_block_plan(model, blocks, 2, given={"attn.nothing": "colwise"})


def test_checkpoints_of_the_fused_qkv_still_load():
    attention = CausalSelfAttention(32, 4, 0.0)
    fused = {
        "qkv.weight": torch.randn(96, 32), "qkv.bias": torch.randn(96),
        "proj.weight": torch.randn(32, 32), "proj.bias": torch.randn(32),
    }
    attention.load_state_dict(fused)
    for index, name in enumerate("qkv"):
        assert torch.equal(getattr(attention, name).weight, fused["qkv.weight"][32 * index : 32 * (index + 1)])
        assert torch.equal(getattr(attention, name).bias, fused["qkv.bias"][32 * index : 32 * (index + 1)])


def test_heads_bind_only_where_attention_is_split():
    """A plan that splits the MLP alone runs at a degree the heads do not divide (the attention stays whole)."""
    model = GPT(width=32, heads=1, layers=2)
    blocks = find_block_list(model)
    assert tensor_parallel_choice(model, blocks, 2, given={"mlp.0": "colwise", "mlp.2": "rowwise"}).degree == 2
    assert "attn.heads=1" in tensor_parallel_choice(model, blocks, 2).reason
