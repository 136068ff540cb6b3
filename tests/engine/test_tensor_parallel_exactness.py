"""Tensor parallelism runs exactly: after N steps every rank's slice of every weight equals single-process training.

Four gloo processes start once and run every case (under the rules mode the tests set, NCCL's lazy
communicators included): the project's GPT, Hugging Face Llama and Qwen2 from tiny configs (never downloaded),
at TP 2 alone, TP 2 x 2 pipeline stages (also interleaved, recomputing, built on the meta device, and stages of
TP 2 and TP 1 either way round), and TP 2 x data parallel 2 with uneven microbatch shares, with global-norm clipping and optimizer-state sharding in uneven shares; and a degree that does not divide the heads, refused on every
rank. Each rank trains the single-process reference itself and
compares its local slice of each split weight (and each weight it holds whole) with it, and the losses.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from testing.launch import spawn_ranks
from zorse_lightning.capabilities import Schedule, Sharding
from zorse_lightning.engine.executor import PipelineEngine
from zorse_lightning.engine.groups import build_groups
from zorse_lightning.engine.host_group import broadcast_module
from zorse_lightning.errors import PlanningError
from zorse_lightning.models.gpt import GPT
from zorse_lightning.engine import tensor_parallel as engine_tensor_parallel
from zorse_lightning.module.materialize import InitialValues, holds_values, materialize
from zorse_lightning.module.tensor_parallel import local as local_part
from zorse_lightning.schedule.plan import Plan, StagePlan

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.multiprocess

WORLD = 4
STEPS = 3
MICROBATCH = 2
SEQ, VOCAB = 8, 64
BUCKET_BYTES = 8 * 1024


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    stages: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, int]], ...]
    """(ranks replica by replica, microbatches per rank, layers) per stage."""
    degrees: tuple[int, ...] = ()
    """Each stage's TP degree (empty: 2 everywhere)."""
    idle: tuple[int, ...] = ()
    schedule: Schedule = Schedule.ONE_F_ONE_B
    sharding: Sharding = Sharding.NONE
    clip: float | None = None
    fractions: tuple[float, ...] = ()
    """Each rank's share of the optimizer state (its replica's, repeated on its TP ranks)."""
    interleave: int = 1
    recompute: bool = False
    meta: bool = False
    """Built on the meta device: each rank places one block, splits it, then places the next."""


CASES = [
    Case("gpt_tp2_alone", "gpt", (((0, 1), (4, 4), (0, 4)),), idle=(2, 3), clip=0.05),
    Case("gpt_tp2_two_stages", "gpt", (((0, 1), (4, 4), (0, 2)), ((2, 3), (4, 4), (2, 4))), clip=0.05),
    Case("gpt_tp2_dp2_uneven", "gpt", (((0, 1, 2, 3), (3, 3, 1, 1), (0, 4)),), clip=0.05),
    Case(
        "gpt_tp2_dp2_uneven_optimizer_sharded", "gpt", (((0, 1, 2, 3), (1, 1, 3, 3), (0, 4)),),
        sharding=Sharding.OPTIMIZER, clip=0.05, fractions=(0.7, 0.7, 0.3, 0.3),
    ),
    Case(
        "gpt_tp2_interleaved_two_groups", "gpt",
        tuple(((0, 1) if i % 2 == 0 else (2, 3), (4, 4), (i, i + 1)) for i in range(4)), interleave=2, clip=0.05,
    ),
    Case("llama_tp2_two_stages_gpipe", "llama", (((0, 1), (4, 4), (0, 2)), ((2, 3), (4, 4), (2, 4))), schedule=Schedule.GPIPE),
    Case("qwen2_tp2_dp2_uneven", "qwen2", (((0, 1, 2, 3), (3, 3, 1, 1), (0, 4)),), clip=0.05),
    Case("llama_tp2_alone", "llama", (((2, 3), (4, 4), (0, 4)),), idle=(0, 1)),
    # built on the meta device, the optimizer made after prepare (an id of a replaced parameter is reused)
    Case("gpt_meta_tp2_two_stages", "gpt", (((0, 1), (4, 4), (0, 2)), ((2, 3), (4, 4), (2, 4))), meta=True),
    Case("gpt_tp2_two_stages_recompute", "gpt", (((0, 1), (4, 4), (0, 2)), ((2, 3), (4, 4), (2, 4))), recompute=True),
    # degrees differ: the GPT's tied embedding sums over all ranks of both stages, each part over its degree
    Case("gpt_tp2_then_two_replicas_3_5", "gpt", (((0, 1), (8, 8), (0, 2)), ((2, 3), (3, 5), (2, 4))), degrees=(2, 1), clip=0.05),
    Case(
        "llama_two_replicas_5_3_then_tp2", "llama", (((0, 1), (5, 3), (0, 2)), ((2, 3), (8, 8), (2, 4))), degrees=(1, 2),
        schedule=Schedule.GPIPE,
    ),
]


def _plan(case: Case) -> Plan:
    stages = tuple(
        StagePlan(
            ranks=ranks, gpu_types=("cpu",) * len(ranks), machines=("localhost",) * len(ranks), layers=layers,
            microbatches_per_rank=counts, sharding=case.sharding, tensor_parallel=degree, shard_fractions=case.fractions,
            recompute=case.recompute,
        )
        for (ranks, counts, layers), degree in zip(case.stages, case.degrees or (2,) * len(case.stages))
    )
    microbatches = stages[0].num_microbatches
    return Plan(
        "test", "test", 4, WORLD, microbatches * MICROBATCH, MICROBATCH, case.schedule, stages, idle_ranks=case.idle,
        interleave=case.interleave,
    )


class HuggingFace(nn.Module):
    """A user's module around a Hugging Face causal LM from a small config."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        config = getattr(transformers, {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}[kind])(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ,
        )
        self.model = transformers.AutoModelForCausalLM.from_config(config)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(input_ids=x).logits.flatten(0, 1), y.flatten())


def _model(case: Case, placed: bool = False) -> nn.Module:
    """The case's model; ``placed``: one built on the meta device materialized whole (the reference)."""
    torch.manual_seed(0)
    with torch.device("meta") if case.meta else nullcontext():
        model = GPT(vocab_size=VOCAB, seq_len=SEQ, width=32, layers=4, heads=2) if case.model == "gpt" else HuggingFace(case.model)
    if case.meta and placed:
        materialize(model, "cpu", seed=0)
    return model


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _batches(count: int, size: int):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (count, size, SEQ + 1), generator=generator)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _reference(case: Case, batches):
    model = _model(case, placed=True)
    optimizer = _optimizer(model)
    losses = []
    for step in range(STEPS):
        loss = model._loss(batches[step])
        loss.backward()
        losses.append(loss.item())
        if case.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        x, y = batches[0]
        evaluated = [model._loss((x[i : i + MICROBATCH], y[i : i + MICROBATCH])).item() for i in range(0, len(x), MICROBATCH)]
    return {n: p.detach() for n, p in model.named_parameters()}, losses, evaluated


def _my_part(param: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's values, the reference's values of the same elements)."""
    if not isinstance(param, DTensor):
        return param.detach(), expected
    index = param.device_mesh.get_local_rank()
    for placement in param.placements:
        if isinstance(placement, Shard):
            expected = expected.chunk(param.device_mesh.size(), dim=placement.dim)[index]
    return param.to_local().detach(), expected


def _run_case(rank: int, case: Case) -> dict:
    plan = _plan(case)
    batches = _batches(STEPS, plan.global_batch_size)
    model = _model(case)
    if not case.meta:
        broadcast_module(model)
    groups = build_groups(plan, rank, timeout=timedelta(seconds=60))
    engine = PipelineEngine(model, groups, torch.device("cpu"), gradient_bucket_bytes=BUCKET_BYTES, initial=InitialValues(seed=0))
    held_at_splits = []
    split_block = engine_tensor_parallel.parallelize_block

    def counted_split(block, *args):
        held_at_splits.append(sum(local_part(p).numel() for p in model.parameters() if holds_values(p)))
        return split_block(block, *args)

    engine_tensor_parallel.parallelize_block = counted_split
    share = groups.stage.microbatch_ranges()[rank] if not groups.is_idle else range(0)
    rows = slice(share.start * MICROBATCH, share.stop * MICROBATCH)
    local = lambda batch: (batch[0][rows], batch[1][rows])
    step_fn = lambda micro, j: model._loss(micro)
    torch.manual_seed(100 + rank)  # as a rank's start-up may leave it: the TP group must agree from setup on
    try:
        engine.prepare(local(batches[0]), step_fn)
    finally:
        engine_tensor_parallel.parallelize_block = split_block
    drawn = torch.rand(1).item()
    blocks = [] if groups.is_idle else [b for s in plan.stages_of_rank(rank) for b in range(*plan.stages[s].layers)]
    stage_blocks = sum(p.numel() for b in blocks for p in _model(case, placed=True).blocks[b].parameters()) if case.meta else 0
    optimizer = _optimizer(model)
    engine.setup_optimizer(optimizer)
    losses = []
    for step in range(STEPS):
        losses.append(engine.run(local(batches[step]), step_fn, reduce_in_backward=True).item())
        engine.reduce_gradients()
        if case.clip:
            engine.clip_grad_norm_(case.clip)
        optimizer.step()
        engine.after_optimizer_step()
        optimizer.zero_grad()
    evaluated = engine.evaluate(local(batches[0]), step_fn)
    expected, expected_losses, expected_evaluated = _reference(case, batches)
    local_ids = {id(p) for p in engine.local_parameters()}
    diffs = {}
    for name, param in model.named_parameters():
        if id(param) in local_ids:
            mine, theirs = _my_part(param, expected[name])
            diffs[name] = (mine - theirs).abs().max().item()
    return {
        "max_param_diff": max(diffs.values(), default=0.0),
        "worst": max(diffs, key=diffs.get, default=""),
        "loss_diff": max(abs(a - b) for a, b in zip(losses, expected_losses)),
        "split": sorted(n for n, p in model.named_parameters() if id(p) in local_ids and isinstance(p, DTensor)),
        "compared": len(diffs),
        "drawn": drawn,
        "most_held_at_a_split": max(held_at_splits, default=0),
        "stage_blocks": stage_blocks,
        "evaluated": len(evaluated),
        "evaluated_diff": max((abs(v.item() - expected_evaluated[j]) for j, v in evaluated.items()), default=0.0),
    }


def _refused(rank: int) -> str:
    """A plan asking for TP 2 of a GPT with one head: every rank (the idle ones too) refuses it at prepare,
    before any collective, so none waits for another."""
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, seq_len=SEQ, width=32, layers=4, heads=1)
    plan = _plan(Case("one_head", "gpt", (((0, 1), (4, 4), (0, 4)),), idle=(2, 3)))
    engine = PipelineEngine(model, build_groups(plan, rank, timeout=timedelta(seconds=60)), torch.device("cpu"))
    batch = _batches(1, plan.global_batch_size)[0]
    try:
        engine.prepare(batch, lambda micro, j: model._loss(micro))
    except PlanningError as error:
        return str(error)
    return "accepted"


def _worker(rank: int, out_dir: Path) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        return {"refused": _refused(rank), **{case.name: _run_case(rank, case) for case in CASES}}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_worker, WORLD, tmp_path_factory.mktemp("tensor_parallel"))


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_slices_and_losses_match_single_process(results, case):
    plan = _plan(next(c for c in CASES if c.name == case))
    for rank, per_rank in enumerate(results):
        run = per_rank[case]
        if rank in plan.idle_ranks:
            assert run["compared"] == 0
            continue
        assert run["compared"] > 0 and bool(run["split"]) == (plan.stages[plan.stage_of_rank(rank)].tensor_parallel > 1), (rank, run)
        assert run["max_param_diff"] < 1e-5, (rank, run)
        assert run["loss_diff"] < 1e-5, (rank, run)
        assert run["evaluated_diff"] < 1e-5, (rank, run)
        last = plan.stages[-1]
        assert run["evaluated"] == (len(last.microbatch_ranges()[rank]) if rank in last.ranks else 0), (rank, run)
        group = plan.stages[plan.stage_of_rank(rank)].tensor_group(rank)
        assert run["drawn"] == results[group[0]][case]["drawn"], "a TP group draws the same numbers"
    if len(plan.stages[0].replicas) > 1:  # replicas keep their own (the agreement above is not a coincidence)
        assert results[0][case]["drawn"] != results[2][case]["drawn"]


def test_heads_the_degree_does_not_divide_are_refused_on_every_rank(results):
    for rank, per_rank in enumerate(results):
        assert "the plan's tensor_parallel=2 cannot run" in per_rank["refused"], (rank, per_rank["refused"])
        assert "attn.heads=1 is not divisible by tensor_parallel=2" in per_rank["refused"]



def test_a_meta_built_stage_is_never_held_whole(results):
    """Each block is placed, then split, before the next: at the last split a rank holds its earlier blocks'
    halves and one whole block (here 3/4 of its stage's blocks' weights), never all of them whole."""
    for case in (c for c in CASES if c.meta):
        for rank, per_rank in enumerate(results):
            run = per_rank[case.name]
            assert 0 < run["most_held_at_a_split"] < 0.8 * run["stage_blocks"], (case.name, rank, run)
