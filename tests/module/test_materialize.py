"""Materializing a meta-built module by parts, the first-block view, and moving a stage to its device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zorse_lightning.errors import ZorseUserError
from zorse_lightning.models.gpt import GPT
from zorse_lightning.module.blocks import find_block_list
from zorse_lightning.module.first_block import first_block_view
from zorse_lightning.module.materialize import InitialValues, materialize, move_to_device, place_on_device, undo

SHAPE = dict(vocab_size=32, seq_len=8, width=16, layers=4, heads=2)


def meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(**SHAPE)


def whole(seed: int = 0) -> GPT:
    model = meta_gpt()
    materialize(model, "cpu", seed)
    return model


def test_a_part_gets_the_values_the_whole_model_gets():
    reference = whole()
    part = meta_gpt()
    keep = {id(t) for t in (*part.blocks[2].parameters(), part.ln_f.weight)}
    materialize(part, "cpu", 0, wanted=lambda name, tensor: id(tensor) in keep)
    state = part.state_dict()
    for name, tensor in reference.state_dict().items():
        if name.startswith("blocks.2.") or name == "ln_f.weight":
            assert torch.equal(state[name], tensor), name
        else:
            assert state[name].is_meta, name
    assert not torch.equal(whole(seed=1).blocks[2].mlp[0].weight, reference.blocks[2].mlp[0].weight)


def test_the_model_s_own_initialisation_is_applied_per_submodule():
    model = whole()
    assert model.head.weight is model.tok_emb.weight  # tied: one tensor, initialised once (by the embedding)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)
    depth_scaled = 0.02 / (2 * SHAPE["layers"]) ** 0.5
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(depth_scaled, rel=0.2)
    assert torch.equal(model.blocks[0].ln1.weight, torch.ones(SHAPE["width"]))  # reset_parameters' defaults
    assert torch.equal(model.blocks[0].attn.q.bias, torch.zeros(SHAPE["width"]))


def test_a_submodule_with_no_initialisation_is_refused_by_name():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(ZorseUserError, match=r"module 1 \(Scale\).*no reset_parameters\(\).*initialize_submodule"):
        materialize(model, "cpu")


def test_undo_puts_the_meta_tensors_back():
    model = meta_gpt()
    swaps = materialize(model, "cpu")
    assert not any(p.is_meta for p in model.parameters())
    undo(swaps)
    assert all(p.is_meta for p in model.parameters())
    assert model.head.weight is model.tok_emb.weight


def test_the_first_block_view_runs_the_step_on_one_real_block_and_leaves_nothing_behind():
    model = meta_gpt()
    blocks = find_block_list(model)
    idx = torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["seq_len"]))
    with first_block_view(model, blocks, torch.device("cpu")):
        held = {n for n, p in model.named_parameters() if not p.is_meta}
        logits = model(idx)
        # blocks 1.. passed block 0's output through: the same as a model of block 0 alone
        x = model.tok_emb(idx) + model.pos_emb(torch.arange(SHAPE["seq_len"]))
        expected = model.head(model.ln_f(model.blocks[0](x)))
    assert torch.equal(logits, expected)
    assert held == {n for n, _ in model.named_parameters() if not n.startswith(("blocks.1", "blocks.2", "blocks.3"))}
    assert all(p.is_meta for p in model.parameters())
    assert all("forward" not in b.__dict__ for b in blocks.blocks)


def test_placing_reads_the_weights_given_for_exactly_the_tensors_placed():
    source = whole(seed=5)
    model = meta_gpt()
    keep = {id(t) for t in model.blocks[1].parameters()}
    placed = place_on_device(
        model, torch.device("cpu"), lambda name, tensor: id(tensor) in keep,
        InitialValues(seed=0, weights=source.state_dict(), weights_prefix=""),
    )
    assert len(placed) == len(keep)
    for name, tensor in model.blocks[1].state_dict().items():
        assert torch.equal(tensor, source.blocks[1].state_dict()[name])


def test_moving_to_a_device_keeps_a_tied_weight_one_tensor():
    model = GPT(**SHAPE)
    swaps = move_to_device(model, torch.device("meta"))
    assert model.head.weight is model.tok_emb.weight and model.head.weight.is_meta
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    undo(swaps)
    assert not any(p.is_meta for p in model.parameters())
