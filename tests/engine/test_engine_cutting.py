"""Finding the block list and probing where values cross cuts (one process)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.demos import LightningTransformer
from testing.plans import hand_plan
from torch import nn

from zorse_lightning.module.blocks import CutError, find_block_list
from zorse_lightning.engine.cutting import StageCut, holder_stages
from zorse_lightning.module.cut_analysis import probe_cut
from zorse_lightning.models.gpt import GPT


def _gpt() -> GPT:
    return GPT(vocab_size=32, seq_len=6, width=16, layers=4, heads=2)


def _gpt_batch():
    tokens = torch.randint(0, 32, (2, 7))
    return tokens[:, :-1], tokens[:, 1:]


class _Skip(nn.Module):
    """Embedding, blocks, and a head that also reads the embedding output (crosses every cut)."""

    def __init__(self, between: bool = False) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 1)
        self.between = between

    def loss(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        h = e = self.emb(x)
        for block in self.blocks:
            h = block(h) * 2 if self.between else block(h)
        return self.head(h + e if skip else h).pow(2).mean()


def test_gpt_block_list_and_regions():
    model = _gpt()
    blocks = find_block_list(model)
    assert (blocks.path, len(blocks), blocks.block_class) == ("blocks", 4, "Block")
    analysis = probe_cut(model, blocks, lambda: model._loss(_gpt_batch()))
    assert analysis.problem is None
    assert analysis.pre_modules == ("tok_emb", "pos_emb")
    assert analysis.post_modules == ("ln_f", "head")
    plan = hand_plan([((0,), (1,), (0, 1)), ((1,), (1,), (1, 3)), ((2,), (1,), (3, 4))])
    holders = holder_stages(model, blocks, analysis, plan)
    assert holders[id(model.tok_emb.weight)] == {0, 2}  # tied with the head
    assert holders[id(model.pos_emb.weight)] == {0}
    assert holders[id(model.ln_f.weight)] == {2}
    assert holders[id(model.blocks[2].mlp[0].weight)] == {1}


class _TableBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * table.cos()


class _SideTable(nn.Module):
    """A token embedding, and blocks that each receive the rows of a position table besides the chain, as
    RoFormer's layers receive its frozen sinusoidal table (an embedding whose weight is not trained)."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(16, 4)
        self.pos = nn.Embedding(6, 4)
        self.pos.weight.requires_grad_(not frozen)
        self.blocks = nn.ModuleList(_TableBlock() for _ in range(3))
        self.head = nn.Linear(4, 16)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        table, h = self.pos(torch.arange(tokens.shape[1]))[None], self.tok(tokens)
        for block in self.blocks:
            h = block(h, table)
        return self.head(h).logsumexp(-1).mean()


def test_a_frozen_module_feeding_the_blocks_side_inputs_runs_on_every_stage():
    """Given zeros on later stages like an embedding, the table made those stages compute on zeros (RoFormer
    trained 3e-6 off one process); trained, such a table would have to cross the cut and is refused."""
    tokens = torch.randint(0, 16, (2, 6))
    model = _SideTable(frozen=True)
    blocks = find_block_list(model)
    analysis = probe_cut(model, blocks, lambda: model.loss(tokens))
    assert analysis.problem is None and analysis.side_modules == ("pos",)
    assert not model.pos.weight.requires_grad  # frozen again after the probe
    plan = hand_plan([((0,), (1,), (0, 1)), ((1,), (1,), (1, 3))])
    holders = holder_stages(model, blocks, analysis, plan)
    assert holders[id(model.pos.weight)] == {0, 1} and holders[id(model.tok.weight)] == {0}
    table = model.pos(torch.arange(6))
    StageCut(model, blocks, analysis, plan, 1).apply()
    assert torch.equal(model.pos(torch.arange(6)), table)
    assert model.tok.weight.is_meta and not torch.count_nonzero(model.tok(tokens))  # the embedding's stand-in
    trained = _SideTable(frozen=False)
    problem = probe_cut(trained, find_block_list(trained), lambda: trained.loss(tokens)).problem
    assert "receives, besides the chain, a value computed from the embeddings" in problem


def test_encoder_decoder_is_not_cuttable():
    with pytest.raises(CutError, match=r"several block lists of equal length: .*encoder.layers .*decoder.layers"):
        find_block_list(LightningTransformer(vocab_size=16))


def test_module_without_block_list_is_not_cuttable():
    with pytest.raises(CutError, match="no nn.ModuleList or nn.Sequential"):
        find_block_list(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    with pytest.raises(CutError, match="block_path='nope' names no submodule"):
        find_block_list(_gpt(), "nope")


def test_probe_reports_values_crossing_cuts():
    model = _Skip()
    blocks = find_block_list(model)
    x = torch.randn(3, 4)
    assert probe_cut(model, blocks, lambda: model.loss(x, skip=False)).problem is None
    problem = probe_cut(model, blocks, lambda: model.loss(x, skip=True)).problem
    assert "skip connection around the chain" in problem
    between = _Skip(between=True)
    problem = probe_cut(between, find_block_list(between), lambda: between.loss(x, skip=False)).problem
    assert "does not receive block 0's output itself" in problem


def test_probe_reports_encoder_decoder_when_named():
    model = LightningTransformer(vocab_size=16)
    blocks = find_block_list(model, "model.transformer.decoder.layers")
    inputs = torch.randint(0, 16, (2, 5))
    problem = probe_cut(model, blocks, lambda: model.training_step((inputs, inputs), 0)).problem
    assert "receives, besides the chain, a value computed from the embeddings" in problem
