"""The start-up pass's pure parts, in one process: which microbatch sizes it plans with, and that one
emulation (with the strategy's slowdown) times the blocks and the step's edges alike."""

from __future__ import annotations

import pytest
import torch

from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.emulation.rank import RankEmulation
from zorse_lightning.errors import PlanningError
from zorse_lightning.models.gpt import GPT
from zorse_lightning.module.blocks import CutError, find_block_list
from zorse_lightning.module.capture import first_block_call
from zorse_lightning.module.first_block import first_block_view
from zorse_lightning.module.microbatch import microbatch_slice
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.startup import type_profile
from zorse_lightning.startup.device_profile import block_calls
from zorse_lightning.startup.profiled_sizes import sizes_to_profile, within_profiled_sizes
from zorse_lightning.strategy.trainer_inputs import quiet_training_step


def test_start_up_profiles_every_size_the_batch_allows_and_the_whole_local_batch():
    options = PlannerOptions(microbatch_sizes=(1, 2, 4, 8, 16, 32))
    assert sizes_to_profile(options, 8) == (1, 2, 4, 8)
    assert sizes_to_profile(options, 6) == (1, 2, 4, 6)  # one microbatch of the whole local batch
    assert sizes_to_profile(PlannerOptions(microbatch_sizes=(3,)), 4) == (1, 2, 3, 4)
    assert sizes_to_profile(PlannerOptions(microbatch_size=3), 8) == (1, 2, 3, 4, 8)


def test_sizes_beyond_the_measured_ones_are_dropped_with_a_note_saying_why():
    options, note = within_profiled_sizes(PlannerOptions(microbatch_sizes=(1, 2, 4, 8)), (1, 2, 4), "4 samples per rank")
    assert options.microbatch_sizes == (1, 2, 4)
    assert note is not None and "[8]" in note and "measured sizes [1, 2, 4]" in note and "4 samples per rank" in note


def test_the_largest_measured_size_is_a_candidate_even_off_the_list():
    options, _ = within_profiled_sizes(PlannerOptions(microbatch_sizes=(1, 2, 4)), (1, 2, 4, 6))
    assert options.microbatch_sizes == (1, 2, 4, 6)


def test_a_pinned_size_is_kept_when_measured_and_refused_when_not():
    options = PlannerOptions(microbatch_size=8)
    assert within_profiled_sizes(options, (1, 2, 4, 8)) == (options, None)
    with pytest.raises(PlanningError, match=r"microbatch_size=8 was not measured.*\[1, 2, 4\].*8 did not fit on t4"):
        within_profiled_sizes(options, (1, 2, 4), "8 did not fit on t4")


def test_blocks_and_edges_are_timed_through_the_one_emulation_given(monkeypatch):
    """The step-edge probe once built its own emulator at the default slowdown (3) whatever the strategy's."""
    built: list[RankEmulation] = []
    original = RankEmulation.instrumented

    def recording(self, root, costs=None, named=None):
        built.append(self)
        return original(self, root, costs, named)

    monkeypatch.setattr(RankEmulation, "instrumented", recording)
    torch.manual_seed(0)
    model = GPT(vocab_size=16, seq_len=4, width=8, layers=2, heads=2)
    blocks = find_block_list(model)
    batch = (torch.randint(0, 16, (2, 4)), torch.randint(0, 16, (2, 4)))
    step = quiet_training_step(model)
    calls = {size: first_block_call(blocks.blocks[0], lambda: step(microbatch_slice(batch, 0, size))) for size in (1, 2)}
    emulation = RankEmulation(load_cluster("cpu_sim2"), rank=1, fastest_slowdown=5.0)
    measured = type_profile.measure_type_profile(
        model, blocks, calls, batch, step, torch.device("cpu"),
        "v100x16", emulation, costs=None, optimizer=lambda params: torch.optim.AdamW(params),
    )
    assert built == [emulation, emulation]
    assert measured.sizes == (1, 2)
    assert measured.blocks.times.head.forward.at(1) > 0 and measured.blocks.times.optimizer_ms_per_million_parameters > 0


def test_blocks_that_cannot_run_with_one_real_block_are_a_cut_error_naming_block_path():
    """Start-up runs the step with block 0 the only real block: a list whose blocks change the activation's
    shape fails there, and the user gets the block list and what to pass, not a traceback from the model."""

    class Widening(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)])
            self.head = torch.nn.Linear(4, 2)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    model = Widening()
    blocks = find_block_list(model)
    batch = torch.randn(2, 4)
    with first_block_view(model, blocks, torch.device("cpu")):
        with pytest.raises(CutError, match=r"layers\[0\] the only real block.*block_path="):
            block_calls(blocks, lambda size: lambda: model(batch[:size]), (1, 2))
