"""The TP degrees a real module's profile lists (issue 38 items 1 and 3): read off its blocks' TP plan at start-up
and in the plan app, up to the most GPUs of one type on one machine (at most ``max_tp``), with the plan's note
saying why where the blocks admit none."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zorse_lightning.cluster import DEFAULT_CATALOG, ClusterInventory, Machine
from zorse_lightning.models.gpt import GPT
from zorse_lightning.module.blocks import find_block_list
from zorse_lightning.planner.options import PlannerOptions
from zorse_lightning.startup.profiled_sizes import unsaid
from zorse_lightning.startup.tensor_parallel_support import largest_tensor_parallel_group, module_tensor_parallel
from zorse_lightning.strategy.trainer_inputs import strategy_tp_plan


def _cluster(*machines: dict[str, int]) -> ClusterInventory:
    """Machines of ``{type: count}``."""
    built = tuple(
        Machine(f"m{i}", tuple(DEFAULT_CATALOG.get(t) for t, n in counts.items() for _ in range(n)), 100.0)
        for i, counts in enumerate(machines)
    )
    return ClusterInventory("test", built, emulated=True)


TWO_BY_FOUR = _cluster({"t4": 4}, {"t4": 4}, {"v100x16": 2})


def _gpt(heads: int, width: int) -> GPT:
    return GPT(vocab_size=32, seq_len=8, width=width, layers=2, heads=heads)


def _support(module: nn.Module, inventory: ClusterInventory = TWO_BY_FOUR, options: PlannerOptions = PlannerOptions(), given=None):
    return module_tensor_parallel(module, find_block_list(module), inventory, options, given)


def test_the_gpt_admits_the_degrees_dividing_its_heads_up_to_a_machines_gpus_of_one_type():
    found = _support(_gpt(heads=4, width=32))
    assert found.largest_group_gpus == 4  # four T4 on a machine; the V100s are two
    assert found.support.degrees == (2, 4)
    assert "tensor_parallel=3" in found.support.reason and "heads=4" in found.support.reason
    assert found.support.replicated_parameters_per_layer == 6 * 32  # two layer norms, two row-wise biases
    assert found.note == ""


def test_max_tp_caps_the_degrees_and_one_means_none_without_a_note():
    assert largest_tensor_parallel_group(TWO_BY_FOUR, PlannerOptions(max_tp=2)) == 2
    assert _support(_gpt(4, 32), options=PlannerOptions(max_tp=2)).support.degrees == (2,)
    none = _support(_gpt(4, 32), options=PlannerOptions(max_tp=1))
    assert none.support.degrees == () and "max_tp=1" in none.support.reason and none.note == ""


def test_a_cluster_without_two_gpus_of_a_type_on_a_machine_offers_none_without_a_note():
    found = _support(_gpt(4, 32), inventory=_cluster({"a100x40": 1, "v100x16": 1}, {"t4": 1}))
    assert found.support.degrees == () and "two GPUs of one type" in found.support.reason
    assert found.note == ""  # the cluster's doing, not the module's


def test_blocks_that_admit_no_degree_get_a_note_saying_why():
    found = _support(_gpt(heads=5, width=40))
    assert found.support.degrees == ()
    assert found.note.startswith("no tensor parallelism: tensor_parallel=2:")
    assert "heads=5 is not divisible by tensor_parallel=2" in found.note


def test_the_note_is_added_once_whoever_says_it_first():
    note, reason = "no tensor parallelism: heads=5 ...", "heads=5 ..."
    assert unsaid(note, reason, ("microbatch sizes ...",)) == (note,)
    assert unsaid(note, reason, ("no TP here: heads=5 ...",)) == ()  # the search said it already
    assert unsaid("", reason, ()) == ()


def test_a_module_without_a_plan_gets_a_note_saying_how_to_give_one():
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 16)
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    found = _support(Plain())
    assert found.support.degrees == ()
    assert "no tensor-parallel plan" in found.note and "tp_plan" in found.note


def test_a_given_plan_is_read_instead_of_the_modules():
    # the MLP alone split: the heads (3) no longer bind, only the widths (24 and 96)
    found = _support(_gpt(heads=3, width=24), given={"mlp.0": "colwise", "mlp.2": "rowwise"})
    assert found.support.degrees == (2, 3, 4)
    assert _support(_gpt(heads=3, width=24)).support.degrees == (3,)  # its own plan splits the attention too


def test_a_module_built_on_the_meta_device_answers_alike():
    with torch.device("meta"):
        meta = _gpt(heads=4, width=32)
    assert _support(meta).support == _support(_gpt(heads=4, width=32)).support


def test_a_hugging_face_llama_admits_what_its_key_value_heads_allow():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )
    holder = nn.Module()
    holder.model = transformers.AutoModelForCausalLM.from_config(config)
    found = _support(holder)
    assert found.support.degrees == (2,)  # 3 divides no head count; 4 not the two key/value heads
    assert "tensor_parallel=3" in found.support.reason
    assert found.support.replicated_parameters_per_layer == 2 * 32  # two RMS norms; Llama's projections have no bias
    assert found.note == ""


def test_start_up_reads_the_strategys_tp_plan():
    from zorse_lightning import ZorseStrategy

    plan = {"mlp.0": "colwise", "mlp.2": "rowwise"}
    attached = SimpleNamespace(trainer=SimpleNamespace(strategy=ZorseStrategy(cluster="cpu_sim2", tp_plan=plan)))
    assert strategy_tp_plan(attached) == plan
    assert strategy_tp_plan(SimpleNamespace(trainer=SimpleNamespace(strategy=ZorseStrategy(cluster="cpu_sim2")))) is None
    assert strategy_tp_plan(SimpleNamespace(trainer=SimpleNamespace(strategy=object()))) is None  # another strategy


# --- measured: start-up and the plan app ----------------------------------------------------------------------

_TOKENS = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))
_BATCH = (_TOKENS[:, :-1], _TOKENS[:, 1:])
"""(tokens, next tokens): four samples of eight."""


@pytest.mark.parametrize("heads, width, degrees", [(2, 16, (2,)), (3, 12, ())])
def test_start_up_profiles_the_degrees_and_notes_why_none(monkeypatch: pytest.MonkeyPatch, heads, width, degrees):
    """``run_startup`` on one rank of a cluster of two T4 (the link probe, which needs the other rank, left out)."""
    from contextlib import nullcontext

    from zorse_lightning.startup import plan_at_start
    from zorse_lightning.startup.step_costs import optimizer_factory
    from zorse_lightning.strategy.trainer_inputs import quiet_training_step

    monkeypatch.setattr(plan_at_start, "probe_machines", lambda *args: [])
    module = _gpt(heads=heads, width=width)
    inputs = plan_at_start.StartupInputs(
        module, _cluster({"t4": 2}), rank=0, world_size=1, device=torch.device("cpu"), global_batch_size=8,
        planner_options=PlannerOptions(), optimizer=optimizer_factory(module.configure_optimizers()),
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = plan_at_start.run_startup(inputs, _BATCH, quiet_training_step(module, nullcontext))
    finally:
        dist.destroy_process_group()
    assert result.profile.tensor_parallel.degrees == degrees
    notes = [note for note in result.plan.notes if note.startswith("no tensor parallelism")]
    if degrees:
        assert result.profile.tensor_parallel.replicated_parameters_per_layer == 6 * width
        assert notes == []
    else:
        assert len(notes) == 1 and f"heads={heads} is not divisible by tensor_parallel=2" in notes[0]


def test_the_plan_apps_profile_says_why_blocks_admit_no_degree():
    from omegaconf import OmegaConf

    from zorse_lightning.apps.module_profile import measured_module_profile

    model = {"_target_": "zorse_lightning.models.gpt.GPT", "vocab_size": 256, "seq_len": 8, "width": 12, "layers": 2, "heads": 3}
    data = {
        "_target_": "zorse_lightning.data.datamodule.ByteCorpusDataModule", "seq_len": 8, "batch_size": 2,
        "corpus_bytes": 4_000, "val_fraction": 0.05, "seed": 0,
    }
    profiled = measured_module_profile(OmegaConf.create(model), OmegaConf.create(data), _cluster({"t4": 2}), PlannerOptions())
    assert profiled.profile.tensor_parallel.degrees == ()
    assert "heads=3 is not divisible by tensor_parallel=2" in profiled.tensor_parallel_note
