"""Blocks that return a tuple (the activation first, then attention weights, a cache, ...): the form a block
passing its input on returns, and the cut's analysis of such blocks."""

from __future__ import annotations

import torch
from torch import nn

from zorse_lightning.module.block_output import OutputForm, activation_of
from zorse_lightning.module.blocks import find_block_list
from zorse_lightning.module.cut_analysis import probe_cut


def test_the_activation_is_the_tensor_or_the_first_item():
    x = torch.ones(2)
    assert activation_of(x) is x and activation_of((x, None)) is x and activation_of([x]) is x
    assert activation_of((None, x)) is None and activation_of({"h": x}) is None and activation_of(()) is None


def test_a_passing_call_returns_the_form_with_its_own_inputs():
    cache, mask, x = object(), torch.zeros(1), torch.ones(3)
    computed = torch.full((2,), 5.0)
    form = OutputForm.of((x * 2, None, cache, mask, computed), (x, mask), {"past": cache})
    assert form == OutputForm("tuple", (None, "past", 1, None))
    other_cache, other_mask, y = object(), torch.ones(1), torch.zeros(3)
    passed = form.passed_on((y, other_mask), {"past": other_cache})
    assert passed[0] is y and passed[1] is None and passed[2] is other_cache and passed[3] is other_mask
    assert passed[4] is None and type(passed) is tuple  # computed in the block: nothing to pass on
    assert OutputForm.of(x, (x,), {}) == OutputForm() and OutputForm().passed_on((y,), {}) is y
    assert OutputForm.of([x], (x,), {}).passed_on((y,), {}) == [y]
    assert OutputForm.of((None, x), (x,), {}) is None


class _TupleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor, cache: list | None = None) -> tuple:
        out = self.linear(h)
        return out, None, cache, out.sum()  # activation, weights not asked for, the cache given, a computed value


class _TupleModel(nn.Module):
    """As Hugging Face loops over layers that return tuples: item 0 is the next input; the rest collected."""

    def __init__(self, aux_loss: bool = False) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(_TupleBlock() for _ in range(3))
        self.head = nn.Linear(4, 1)
        self.aux_loss = aux_loss

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        h, cache, sums = self.emb(x), [], []
        for block in self.blocks:
            outputs = block(h, cache=cache)
            h = outputs[0]
            sums.append(outputs[3])
        loss = self.head(h).pow(2).mean()
        return loss + sum(sums) if self.aux_loss else loss


def test_blocks_returning_tuples_can_be_cut_and_their_form_is_kept():
    model = _TupleModel()
    analysis = probe_cut(model, find_block_list(model), lambda: model.loss(torch.randn(3, 4)))
    assert analysis.problem is None
    assert analysis.output_form == OutputForm("tuple", (None, "cache", None))


def test_a_loss_that_reads_a_blocks_other_outputs_is_not_cuttable():
    """Each block's computed item becomes None where a block passes its input on: a loss that adds them up
    (a mixture of experts' balancing loss) would change, so the analysis refuses the cut."""
    model = _TupleModel(aux_loss=True)
    problem = probe_cut(model, find_block_list(model), lambda: model.loss(torch.randn(3, 4))).problem
    assert "other than through the last block" in problem
