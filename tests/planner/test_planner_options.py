"""PlannerOptions and the ``planner`` config group: one set of defaults, and refusals that say what to fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig

from zorse_lightning.apps.hydra_support import CONF_DIR, USER_ERROR_EXIT_CODE, register_schemas
from zorse_lightning.apps.planner_options import planner_options_from_config
from zorse_lightning.capabilities import P2PRules, Schedule
from zorse_lightning.errors import PlanningError
from zorse_lightning.planner.options import PlannerOptions


def _plan_config(*overrides: str) -> DictConfig:
    """The ``plan`` app's config as Hydra composes it from the shipped files."""
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("plan", overrides=list(overrides))


def test_shipped_defaults_are_the_dataclass_defaults() -> None:
    planner = _plan_config().planner
    defaults = PlannerOptions()
    assert sorted(planner) == sorted(f.name for f in dataclasses.fields(PlannerOptions))
    composed = planner_options_from_config(planner)
    for field in dataclasses.fields(PlannerOptions):
        assert getattr(composed, field.name) == getattr(defaults, field.name), field.name
    assert composed == defaults


def test_command_line_values_arrive_typed() -> None:
    cfg = _plan_config(
        "planner.schedule=gpipe", "planner.microbatch_size=4", "planner.layer_counts=[20,12]",
        "planner.stage_layout=[[0,1,2,3],[4,5,6,7]]", "planner.solver_time_limit_s=5", "planner.p2p_rules=nccl",
    )
    options = planner_options_from_config(cfg.planner)
    assert options.schedule is Schedule.GPIPE and options.microbatch_size == 4 and options.p2p_rules is P2PRules.NCCL
    assert options.layer_counts == (20, 12) and options.stage_layout == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert options.solver_time_limit_s == 5.0


@pytest.mark.parametrize(
    "override, named",
    [
        ("planner.microbatch_sise=4", "microbatch_sise"),  # misspelt
        ("planner.microbatch_size=four", "microbatch_size"),  # not an integer
        ("planner.max_stages=2.5", "max_stages"),
        ("planner.allow_pipeline=maybe", "allow_pipeline"),
        ("planner.layer_counts=[20,x]", "layer_counts"),
    ],
)
def test_hydra_refuses_unknown_options_and_wrong_types(override: str, named: str) -> None:
    with pytest.raises(ConfigCompositionException) as refused:
        _plan_config(override)
    assert named in f"{refused.value} {refused.value.__cause__}"


def test_an_option_added_with_plus_is_refused_with_a_suggestion() -> None:
    """Hydra's refusal of a misspelt option suggests ``+``, which gets the key past the schema."""
    cfg = _plan_config("+planner.microbatch_sise=4")
    with pytest.raises(PlanningError, match=r"'microbatch_sise' is not a planner option; did you mean 'microbatch_size'"):
        planner_options_from_config(cfg.planner)


@pytest.mark.parametrize("override", ["planner.microbatch_sise=4", "+planner.microbatch_sise=4"])
def test_plan_app_refuses_a_misspelt_option_with_exit_2(run_app, tmp_path: Path, override: str) -> None:
    from zorse_lightning.apps.plan_app import main

    code, _, err = run_app(main, "cluster=a100x4_v100x4", "model=llama_7b", override, f"hydra.run.dir={tmp_path}")
    assert code == USER_ERROR_EXIT_CODE
    assert "microbatch_sise" in err and "Traceback" not in err
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize(
    "values, value, rule, fix",
    [
        (dict(solver_time_limit_s=0), "solver_time_limit_s=0", "must be a positive number of seconds", "give e.g. 1.0"),
        (dict(solver_time_limit_s=True), "solver_time_limit_s=True", "must be a positive number", "give e.g. 1.0"),
        (dict(microbatch_sizes=[]), "microbatch_sizes=[]", "leaves the planner no candidate", "give at least one size"),
        (dict(microbatch_sizes=[2, 0, 1.5]), "microbatch_sizes holds [0, 1.5]", "integers of at least 1", "fix or remove"),
        (dict(microbatch_size=0), "microbatch_size=0", "an integer of at least 1", "give e.g. 4, or null"),
        (dict(memory_reserve_gib=-1.0), "memory_reserve_gib=-1.0", "a number of GiB, 0 or more", "give e.g. 0.5, or null"),
        (dict(max_stages=0), "max_stages=0", "an integer of at least 1", "give e.g. 16"),
        (dict(max_programs=-1), "max_programs=-1", "an integer of at least 0", "give e.g. 8"),
        (dict(stage_layout=[[0, 1], []]), "stage_layout=[[0, 1], []]", "has an empty stage", "give every stage at least one rank"),
        (dict(stage_layout=[[0, -1]]), "stage_layout holds [-1]", "integers of at least 0", "fix or remove"),
        (dict(layer_counts=[20, 0]), "layer_counts holds [0]", "integers of at least 1", "fix or remove"),
        (dict(schedule="interleaved"), "schedule='interleaved'", "not a schedule the engine runs", "use one of ['1f1b', 'gpipe']"),
        (dict(p2p_rules="mpi"), "p2p_rules='mpi'", "not a set of point-to-point rules", "use one of ['gloo', 'nccl']"),
    ],
)
def test_bad_values_are_refused_with_the_rule_and_the_fix(values: dict, value: str, rule: str, fix: str) -> None:
    with pytest.raises(PlanningError) as refused:
        PlannerOptions(**values)
    message = str(refused.value)
    assert message.startswith(value) and rule in message and fix in message, message


def test_lists_are_stored_as_tuples() -> None:
    options = PlannerOptions(microbatch_sizes=[4, 8], stage_layout=[[1, 0], [2]], layer_counts=[3, 4], schedule="1f1b")
    assert options.microbatch_sizes == (4, 8) and options.stage_layout == ((1, 0), (2,))
    assert options.layer_counts == (3, 4) and options.schedule is Schedule.ONE_F_ONE_B
    assert dataclasses.replace(options, microbatch_size=2) == PlannerOptions(
        microbatch_sizes=(4, 8), stage_layout=((1, 0), (2,)), layer_counts=(3, 4), schedule=Schedule.ONE_F_ONE_B, microbatch_size=2
    )
