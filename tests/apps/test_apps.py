"""The Hydra entry points, run in process: outputs, overrides, errors without tracebacks."""

from __future__ import annotations

import json
from pathlib import Path


def test_plan_app_writes_plan_and_timeline_and_prints_baselines(run_app, tmp_path: Path):
    from zorse_lightning.apps.plan_app import main

    code, out, _ = run_app(
        main, "cluster=a100x4_v100x4", "model=llama_7b", "global_batch_size=64", f"hydra.run.dir={tmp_path}"
    )
    assert code == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    for key in ("global_batch_size", "microbatch_size", "schedule", "stages", "predicted", "planner_seconds"):
        assert key in plan
    assert plan["global_batch_size"] == 64
    groups = plan["stages"][: len(plan["stages"]) // plan.get("interleave", 1)]  # each group's first chunk
    assert sorted([r for s in groups for r in s["ranks"]] + plan.get("idle_ranks", [])) == list(range(8))
    for key in ("ranks", "gpu_types", "machines", "layers", "microbatches_per_rank", "sharding"):
        assert key in plan["stages"][0]
    for key in ("iteration_ms", "samples_per_s", "memory_gib", "profile_source"):
        assert key in plan["predicted"]
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    for baseline in ("data_parallel_equal", "fastest_type_alone", "proportional_heuristic", "cephalo"):
        assert baseline in out


def test_plan_app_pins_are_respected(run_app, tmp_path: Path):
    from zorse_lightning.apps.plan_app import main

    code, _, _ = run_app(
        main, "cluster=a100x4_v100x4", "model=llama_7b", "global_batch_size=64",
        "planner.schedule=gpipe", "planner.microbatch_size=4", f"hydra.run.dir={tmp_path}",
    )
    assert code == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["schedule"] == "gpipe" and plan["microbatch_size"] == 4


def test_plan_app_infeasible_is_one_message_and_exit_2(run_app, tmp_path: Path):
    from zorse_lightning.apps.plan_app import main

    code, _, err = run_app(
        main, "cluster=lab4_l4_a6000_p40", "model=llama_33b", "global_batch_size=8", f"hydra.run.dir={tmp_path}"
    )
    assert code == 2
    assert err.startswith("error: ") and "GiB" in err and "Traceback" not in err
    assert not (tmp_path / "plan.json").exists()


def test_plan_app_refuses_a_batch_that_is_no_positive_integer(run_app, tmp_path: Path):
    from zorse_lightning.apps.plan_app import main

    for batch in ("abc", "2.5", "true"):
        code, _, err = run_app(main, "cluster=cpu_sim2", "model=llama_tiny", f"global_batch_size={batch}", f"hydra.run.dir={tmp_path}")
        assert code == 2 and "must be a positive integer" in err and "Traceback" not in err, (batch, err)


def test_plan_app_unknown_model_lists_known_names(run_app, tmp_path: Path):
    from zorse_lightning.apps.plan_app import main

    code, _, err = run_app(main, "cluster=cpu_sim2", "model=llama_7b", "model.name=llama_99b", f"hydra.run.dir={tmp_path}")
    assert code == 2 and "llama_7b" in err and "Traceback" not in err


def test_plan_app_profiles_a_lightning_module_config(run_app, tmp_path: Path, monkeypatch):
    """Profiled as start-up profiles it: at every size a rank's batch allows (8 samples: 1, 2, 4 and 8, not
    only 1 and 2 as the app once did), and planned at a measured size only."""
    from zorse_lightning.apps import plan_app
    from zorse_lightning.apps.plan_app import main

    profiled = []
    original = plan_app.profile_from_config

    def recorded(*args, **kwargs):
        profiled.append(original(*args, **kwargs))
        return profiled[-1]

    monkeypatch.setattr(plan_app, "profile_from_config", recorded)
    code, out, err = run_app(
        main, "cluster=cpu_sim4", "model=gpt_tiny", "model.layers=2", "data.batch_size=8", "global_batch_size=32",
        f"hydra.run.dir={tmp_path}",
    )
    assert code == 0, err
    plan = json.loads((tmp_path / "plan.json").read_text())
    (measured,) = profiled
    assert measured.sizes == (1, 2, 4, 8) and measured.profile.measured_sizes == (1, 2, 4, 8)
    assert plan["microbatch_size"] in measured.sizes
    assert "microbatch sizes [16, 32] not considered" in " ".join(out.split())  # the candidates left out, said
    # measured on this CPU, each type slowed by its emulation: the A100 rank gets the largest share
    assert set(plan["predicted"]["profile_source"].values()) == {"measured"}
    shares = {}
    for stage in plan["stages"]:
        for rank, count in zip(stage["ranks"], stage["microbatches_per_rank"]):
            shares[rank] = shares.get(rank, 0) + count * (stage["layers"][1] - stage["layers"][0])
    assert shares[0] > shares.get(2, 0) and shares[0] > shares.get(3, 0)  # a T4 may be left idle: no share


def test_the_plan_app_times_the_optimizer_configure_optimizers_returns():
    """Read as Lightning reads it (a dict with a scheduler here), and built as the strategy builds its own."""
    from types import SimpleNamespace

    import torch

    from zorse_lightning.apps.module_profile import configured_optimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    sgd = torch.optim.SGD(params, lr=0.25, momentum=0.5)
    module = SimpleNamespace(configure_optimizers=lambda: {
        "optimizer": sgd, "lr_scheduler": torch.optim.lr_scheduler.StepLR(sgd, step_size=1),
    })
    made = configured_optimizer(module)([torch.nn.Parameter(torch.zeros(2))])
    assert type(made) is torch.optim.SGD and made.param_groups[0]["momentum"] == 0.5
    assert configured_optimizer(SimpleNamespace(configure_optimizers=lambda: None)) is None


def test_train_app_refuses_an_unknown_recipe_naming_the_known_ones(run_app, tmp_path: Path):
    """A misspelt recipe is an error listing the recipes, never a silent run of the defaults."""
    from zorse_lightning.apps.train_app import main

    code, out, err = run_app(main, "recipe=gpt_tiny_cpu_sim", f"hydra.run.dir={tmp_path}")
    assert code == 2 and "gpt_tiny_cpu_sim4" in out + err
    assert not (tmp_path / "plan.json").exists()
