"""The planning app: compose cluster + model + planner options, plan, print, save.

A LightningModule config is profiled as start-up profiles it, and planned, as
start-up plans, only at the microbatch sizes that profile measured (the plan's
notes name those left out). Writes ``plan.json`` and ``timeline.png`` into the
Hydra run directory.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from zorse_lightning.apps.hydra_support import report_user_errors, run_app
from zorse_lightning.apps.model_source import profile_from_config
from zorse_lightning.apps.planner_options import planner_options_from_config
from zorse_lightning.cluster.config import inventory_from_config
from zorse_lightning.planner import all_baselines
from zorse_lightning.planner.cost.context import CostContext
from zorse_lightning.planner.search import make_plan
from zorse_lightning.profiling import warn_if_mixed_sources
from zorse_lightning.reporting.plan_table import print_plan
from zorse_lightning.reporting.timeline import draw_plan_timeline
from zorse_lightning.startup.profiled_sizes import unsaid, within_profiled_sizes


@report_user_errors
def _run(cfg: DictConfig) -> None:
    inventory = inventory_from_config(cfg.cluster)
    options = planner_options_from_config(cfg.planner)
    profiled = profile_from_config(cfg.model, inventory, options, cfg.get("data"))
    profile = profiled.profile
    options, size_note = within_profiled_sizes(options, profiled.sizes, profiled.why_not)
    batch = cfg.global_batch_size  # as given: the planner refuses what is not a positive integer, with the fix
    plan = make_plan(inventory, profile, batch, options)
    notes = ([size_note] if size_note else []) + list(
        unsaid(profiled.tensor_parallel_note, profile.tensor_parallel.reason, plan.notes)
    )
    if notes:
        plan = replace(plan, notes=(*plan.notes, *notes))
    warn_if_mixed_sources(profile, {t for stage in plan.stages for t in stage.gpu_types})
    ctx = CostContext.build(inventory, profile, options.memory_reserve_gib, options.p2p_rules)
    baselines = all_baselines(inventory, profile, batch, options)
    print_plan(plan, ctx, baselines)
    out = Path(HydraConfig.get().runtime.output_dir)
    plan.save(out / "plan.json")
    draw_plan_timeline(plan, ctx, out / "timeline.png")
    print(f"wrote {out / 'plan.json'} and {out / 'timeline.png'}")


def main() -> None:
    run_app(_run, "plan")
