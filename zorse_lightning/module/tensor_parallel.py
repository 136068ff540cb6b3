"""Where a block's tensor-parallel (TP) plan comes from, and whether it applies at a degree.

A block's TP plan maps module names inside one block (``"self_attn.q_proj"``) to
torch's ``ParallelStyle``s. It comes, in this order, from a plan given
explicitly, from a ``tp_plan`` attribute of the user's module, or from a Hugging
Face model inside it (``model.tp_plan``, which merges ``config.base_model_tp_plan``:
Llama, Mistral, Qwen2 and others). Keys of the module's or a model's plan are
relative to their owner, with ``*`` for the block index (``"model.layers.*.mlp.up_proj"``);
those that do not fall in the block list (an embedding, the head) are left out:
only blocks are split, the rest is replicated on every rank of a TP group. A
given plan may also name modules of one block directly.

Hugging Face's own TP layers replace ``forward`` and expect weights sharded at
load time (they refuse a materialized layer), so its style names are translated
to torch's styles in one table, :data:`HF_STYLES`; packed, MoE and the other
styles have no translation. ``parallelize_module`` only warns about a key that
matches nothing, so :func:`plan_problems` checks each key against the block, and
the widths a degree must divide: each split projection's, and the heads and
key/value heads the block's attention reads. A block whose plan cannot apply
runs without TP (:func:`tensor_parallel_choice`, whose reason a plan's note can
show); asked for anyway (a hand-written plan), :func:`require_block_plan` refuses
it with the same reason.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from zorse_lightning.errors import PlanningError
from zorse_lightning.module.blocks import BlockList

TP_PLAN_ATTRIBUTE = "tp_plan"
"""The attribute of a user's module (or a Hugging Face model) that holds its TP plan."""

HF_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
}
"""Hugging Face's style names with a torch equivalent: column-wise splits a projection's outputs (its local
output is this rank's slice of the features: its heads), row-wise its inputs (its output is summed over the
group); ``_rep``/``gather_output``/``split_input`` take or give the whole tensor instead of a slice."""

HEAD_ATTRIBUTES = (
    "num_heads", "num_attention_heads", "heads", "n_head", "n_heads",
    "num_key_value_heads", "num_kv_heads", "n_kv_heads",
)
"""Attributes (of a block's submodules or their ``config``) whose counts a TP degree must divide: each rank
computes whole heads (and whole key/value heads, which grouped-query attention shares between them)."""

Style = str | ParallelStyle


@dataclass(frozen=True)
class BlockTensorPlan:
    """A block's TP plan: module name inside the block -> style (a Hugging Face name or a torch style)."""

    styles: Mapping[str, Style]
    source: str
    """Where it came from, for messages (``"LlamaForCausalLM.tp_plan at 'model'"``)."""

    def torch_plan(self) -> dict[str, ParallelStyle]:
        """The plan in torch's styles (unknown names raise: :func:`plan_problems` names them first)."""
        return {key: style if isinstance(style, ParallelStyle) else HF_STYLES[style]() for key, style in self.styles.items()}


@dataclass(frozen=True)
class TensorParallelChoice:
    """The TP degree a block list runs at, and why it is not the one asked for."""

    degree: int
    plan: BlockTensorPlan | None = None
    reason: str = ""
    """Empty where the degree asked for applies; else why the blocks run without TP (a plan note)."""
    problems: tuple[str, ...] = field(default=())


def _block_keys(plan: Mapping[str, Style], owner: str, blocks: BlockList) -> dict[str, Style]:
    """The keys of ``plan`` (relative to the module at ``owner``) that name modules of every block, made
    relative to one block."""
    prefix = f"{owner}." if owner else ""
    pattern = re.compile(rf"^{re.escape(blocks.path)}\.\*\.(.+)$")
    found = {}
    for key, style in plan.items():
        match = pattern.match(prefix + key)
        if match:
            found[match.group(1)] = style
    return found


def _owned_plans(root: nn.Module):
    """(owner path, plan, where) of every TP plan in ``root``, outermost first: a ``tp_plan`` attribute (the
    user's module, a Hugging Face model), else a Hugging Face config's ``base_model_tp_plan``."""
    for path, module in root.named_modules():
        own = getattr(module, TP_PLAN_ATTRIBUTE, None)
        if isinstance(own, Mapping) and own:
            yield path, own, f"{type(module).__name__}.{TP_PLAN_ATTRIBUTE} at {path or '<root>'!r}"
        config_plan = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
        if isinstance(config_plan, Mapping) and config_plan:
            yield path, config_plan, f"{type(module).__name__}.config.base_model_tp_plan at {path or '<root>'!r}"


def find_block_plan(
    root: nn.Module, blocks: BlockList, given: Mapping[str, Style] | None = None
) -> BlockTensorPlan | None:
    """The block's TP plan: ``given`` (keys relative to ``root`` with ``*`` for the block index, or relative to
    one block), else the first plan in ``root`` with keys in the block list; None where there is none."""
    if given:
        relative = _block_keys(given, "", blocks)
        return BlockTensorPlan(relative or dict(given), "the given tp_plan")
    for owner, plan, where in _owned_plans(root):
        relative = _block_keys(plan, owner, blocks)
        if relative:
            return BlockTensorPlan(relative, where)
    return None


def _matched(block: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in block.named_modules() if name and fnmatch.fnmatchcase(name, key)]


def _heads(block: nn.Module, split: set[str]) -> dict[str, int]:
    """Head counts read by the submodules around the ``split`` ones (an attention whose projections are split):
    ``{where: count}``."""
    counts, seen = {}, set()
    for name, module in block.named_modules():
        if not any(n == name or n.startswith(f"{name}.") or not name for n in split):
            continue
        for owner, label in ((module, name or "<block>"), (getattr(module, "config", None), f"{name or '<block>'}.config")):
            if owner is None or id(owner) in seen:  # a config shared by several submodules: once
                continue
            seen.add(id(owner))
            for attribute in HEAD_ATTRIBUTES:
                value = getattr(owner, attribute, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    counts[f"{label}.{attribute}"] = value
    return counts


def plan_problems(block: nn.Module, plan: BlockTensorPlan, degree: int) -> list[str]:
    """Why ``plan`` cannot split ``block`` over ``degree`` ranks (empty: it can)."""
    problems, split = [], set()
    for key, style in plan.styles.items():
        if isinstance(style, str) and style not in HF_STYLES:
            problems.append(
                f"style {style!r} of {key!r} ({plan.source}) has no torch equivalent here (known: {sorted(HF_STYLES)}); "
                f"packed and expert styles are not split"
            )
            continue
        matched = _matched(block, key)
        if not matched:
            problems.append(f"key {key!r} of {plan.source} names no module of the block ({type(block).__name__})")
        for name, module in matched:
            split.add(name)
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                problems.append(
                    f"{name!r} is a {type(module).__name__}; torch's column- and row-wise styles split nn.Linear and "
                    f"nn.Embedding only"
                )
                continue
            rowwise = isinstance(style, RowwiseParallel) or (isinstance(style, str) and style.startswith("rowwise"))
            width = module.weight.shape[1 if rowwise and isinstance(module, nn.Linear) else 0]
            if width % degree:
                problems.append(
                    f"{name!r} splits {width} {'inputs' if rowwise else 'outputs'} over tensor_parallel={degree}, which "
                    f"does not divide them"
                )
    for where, count in _heads(block, split).items():
        if count % degree:
            problems.append(f"{where}={count} is not divisible by tensor_parallel={degree}")
    return problems


def tensor_parallel_choice(
    root: nn.Module, blocks: BlockList, degree: int, given: Mapping[str, Style] | None = None
) -> TensorParallelChoice:
    """``degree`` where every block's plan applies at it; else 1, with the reason."""
    if degree == 1:
        return TensorParallelChoice(1)
    plan = find_block_plan(root, blocks, given)
    if plan is None:
        return TensorParallelChoice(
            1, reason=(
                f"{type(root).__name__} has no tensor-parallel plan for its blocks ({blocks.block_class}): no tp_plan "
                f"attribute and no Hugging Face model with one; give one (tp_plan = {{'<module in the block>': "
                f"'colwise' | 'rowwise', ...}}) to split its blocks"
            ),
        )
    problems = []
    for index, block in enumerate(blocks.blocks):
        problems += [f"block {index}: {p}" for p in plan_problems(block, plan, degree)]
        if problems:
            break  # blocks are alike: the first one's problems say it
    if problems:
        return TensorParallelChoice(
            1, plan, f"tensor_parallel={degree} does not apply to {blocks.block_class}: " + "; ".join(problems), tuple(problems)
        )
    return TensorParallelChoice(degree, plan)


@dataclass(frozen=True)
class AdmittedDegrees:
    """The TP degrees a module's blocks admit, for its profile (the planner prices only these)."""

    degrees: tuple[int, ...]
    """Degrees ``2..most`` at which every block's plan applies, increasing."""
    reason: str
    """Why none, or why not the others up to ``most``."""
    replicated_parameters: int
    """Parameters of one block its plan leaves whole on every rank (norms, row-wise biases, unsplit modules)."""


def admitted_degrees(
    root: nn.Module, blocks: BlockList, most: int, given: Mapping[str, Style] | None = None
) -> AdmittedDegrees:
    """The degrees ``2..most`` (``most``: the most GPUs of one type on one machine) at which
    :func:`tensor_parallel_choice` keeps the degree asked, with the first refusal's reason."""
    degrees, reasons, plan = [], [], None
    for degree in range(2, most + 1):
        choice = tensor_parallel_choice(root, blocks, degree, given)
        plan = choice.plan or plan
        if choice.degree == degree:
            degrees.append(degree)
        elif choice.plan is None:
            return AdmittedDegrees((), choice.reason, 0)
        else:
            reasons.append(f"tensor_parallel={degree}: " + "; ".join(choice.problems))
    reason = reasons[0] if reasons else f"every degree up to {most} applies"
    return AdmittedDegrees(tuple(degrees), reason, _replicated_parameters(blocks.blocks[0], plan) if plan else 0)


def _replicated_parameters(block: nn.Module, plan: BlockTensorPlan) -> int:
    """Parameters of ``block`` that ``plan`` does not split: those of modules it names no style for, and the
    biases of row-wise ones (each rank adds the whole bias once its partial sums are reduced)."""
    split = 0
    for key, style in plan.styles.items():
        rowwise = isinstance(style, RowwiseParallel) or (isinstance(style, str) and style.startswith("rowwise"))
        for _, module in _matched(block, key):
            split += sum(p.numel() for name, p in module.named_parameters() if not (rowwise and name == "bias"))
    return sum(p.numel() for p in block.parameters()) - split


def require_block_plan(
    root: nn.Module, blocks: BlockList, degree: int, given: Mapping[str, Style] | None = None
) -> BlockTensorPlan:
    """The blocks' plan at ``degree``, which a plan asks for; refused with the reason where it does not apply."""
    choice = tensor_parallel_choice(root, blocks, degree, given)
    if choice.degree != degree or choice.plan is None:
        raise PlanningError(
            f"the plan's tensor_parallel={degree} cannot run: {choice.reason}; or use tensor_parallel=1 for this stage"
        )
    return choice.plan


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a weight, gradient or saved tensor split over a TP group (the tensor itself when not
    split): what is counted, bucketed, normed and updated outside autograd (a DTensor's own ops communicate)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
