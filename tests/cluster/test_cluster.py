"""The cluster inventory: catalog lookups, link resolution, shipped configs, bad input."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from zorse_lightning.apps.hydra_support import CONF_DIR
from zorse_lightning.cluster import DEFAULT_CATALOG, LinkKind
from zorse_lightning.cluster.config import load_cluster
from zorse_lightning.cluster.detection import DeviceReport, MachineReport, inventory_from_reports, match_device
from zorse_lightning.errors import InventoryError

SHIPPED = sorted(p.stem for p in (CONF_DIR / "cluster").glob("*.yaml"))
GIB = 1024**3


@pytest.mark.parametrize(
    "spelling, expected",
    [
        ("NVIDIA A100-SXM4-40GB", "a100x40"),
        ("A100", "a100x40"),
        ("Tesla V100-SXM2-16GB", "v100x16"),
        ("v100", "v100x16"),
        ("Tesla V100-SXM2-32GB", "v100x32"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm80"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("Tesla T4", "t4"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA RTX A6000", "a6000"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("Tesla P40", "p40"),
        ("rtx_3090", "rtx3090"),
    ],
)
def test_catalog_resolves_usual_spellings(spelling, expected):
    assert DEFAULT_CATALOG.get(spelling).name == expected


def test_catalog_has_every_reference_type():
    reference_types = {
        "a100x40", "a100x80", "h100-nvl", "a10g", "a6000", "l40s", "l4", "t4",
        "p100", "p40", "v100x16", "v100x32", "v100-pciex16", "rtx3090",
    }
    assert reference_types | {"h100-sxm", "a100-sxm80", "rtx4090"} <= set(DEFAULT_CATALOG.names)
    assert DEFAULT_CATALOG.get("v100x16").supports_bf16 is False
    assert DEFAULT_CATALOG.get("a100x40").supports_bf16 is True


def test_unknown_gpu_type_suggests_close_names():
    with pytest.raises(InventoryError, match=r"unknown GPU type 'a100x4'.*closest: 'a100x40'"):
        DEFAULT_CATALOG.get("a100x4")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_inventory_loads(name):
    inventory = load_cluster(name)
    assert inventory.name == name
    assert inventory.world_size == sum(len(m.gpu_types) for m in inventory.machines)


def test_required_inventories_are_shipped():
    required = {"lab4_l4_a6000_p40", "a100x4_v100x4", "dc2_a100x8_v100x8", "a10g_l4_t4", "mix32_4types", "cpu_sim2", "cpu_sim4"}
    assert required <= set(SHIPPED)
    assert load_cluster("mix32_4types").world_size == 32
    assert {g.gpu_type.name for g in load_cluster("mix32_4types").gpus} == {"a100x40", "v100x16", "a10g", "t4"}


def test_links_resolve_by_kind_and_override():
    dc2 = load_cluster("dc2_a100x8_v100x8")
    assert dc2.link_kind(0, 1) is LinkKind.INTRA_MACHINE and dc2.bandwidth_gbps(0, 1) == 4800
    assert dc2.link_kind(0, 8) is LinkKind.INTER_DATACENTER and dc2.bandwidth_gbps(0, 8) == 5
    assert dc2.latency_us(0, 8) == 15000
    mix = load_cluster("mix32_4types")
    assert mix.bandwidth_gbps(0, 4) == 200  # a100-0 <-> a100-1 override
    assert mix.bandwidth_gbps(4, 28) == 10  # a100-1 <-> t4-1 override
    assert mix.bandwidth_gbps(8, 16) == 25  # default
    sim = load_cluster("cpu_sim4")
    assert sim.emulated and [g.memory_gib for g in sim.gpus] == [0.4, 0.16, 0.16, 0.16]


def _cluster(**overrides):
    base = {
        "name": "t",
        "machines": [
            {"name": "m0", "gpus": [{"type": "a100x40", "count": 2}]},
            {"name": "m1", "gpus": [{"type": "t4", "count": 1}]},
        ],
    }
    base.update(overrides)
    return base


BAD_INPUTS = {
    "unknown type": (_cluster(machines=[{"name": "m0", "gpus": [{"type": "a100x4"}]}]), r"unknown GPU type 'a100x4'"),
    "memory not positive": (
        _cluster(machines=[{"name": "m0", "gpus": [{"type": "t4", "memory_gib": -1.0}]}]),
        r"memory_gib=-1.0 must be a positive",
    ),
    "bandwidth not positive": (_cluster(inter_machine_bandwidth_gbps=0), r"inter_machine_bandwidth_gbps=0.0 must be a positive"),
    "machine without GPUs": (_cluster(machines=[{"name": "empty", "gpus": []}]), r"machine 'empty' has no GPUs"),
    "duplicate machine": (
        _cluster(machines=[{"name": "m", "gpus": [{"type": "t4"}]}, {"name": "m", "gpus": [{"type": "t4"}]}]),
        r"machine name 'm' is used 2 times",
    ),
    "link to unknown machine": (
        _cluster(machine_links=[{"machine_a": "m0", "machine_b": "ghost", "bandwidth_gbps": 10}]),
        r"names machine 'ghost', which does not exist",
    ),
    "datacenters without link": (
        _cluster(
            machines=[
                {"name": "m0", "datacenter": "east", "gpus": [{"type": "t4"}]},
                {"name": "m1", "datacenter": "west", "gpus": [{"type": "t4"}]},
            ]
        ),
        r"datacenters 'east' and 'west' have no link",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_named_with_its_fix(case):
    config, message = BAD_INPUTS[case]
    with pytest.raises(InventoryError, match=message):
        load_cluster(config)


def test_config_can_add_a_gpu_type():
    inventory = load_cluster(
        _cluster(
            gpu_types=[{"name": "mi250", "memory_gib": 64, "fp16_tflops": 362, "bf16_tflops": 362}],
            machines=[{"name": "amd", "gpus": [{"type": "MI250", "count": 2}]}],
        )
    )
    assert [g.gpu_type.name for g in inventory.gpus] == ["mi250", "mi250"]


def test_detection_matches_catalog_and_assembles_unequal_machines():
    reports = [
        MachineReport("a", (DeviceReport("NVIDIA A100-SXM4-40GB", 40 * GIB),) * 3),
        MachineReport("b", (DeviceReport("Tesla T4", 15 * GIB), DeviceReport("Tesla V100-SXM2-16GB", 16 * GIB))),
    ]
    inventory = inventory_from_reports(reports)
    assert [g.gpu_type.name for g in inventory.gpus] == ["a100x40"] * 3 + ["t4", "v100x16"]
    assert [len(m.gpu_types) for m in inventory.machines] == [3, 2]
    assert inventory.gpus[3].memory_gib == 15


def test_detection_of_unknown_gpu_warns_and_uses_reported_memory():
    with pytest.warns(UserWarning, match="not in the catalog"):
        gpu_type = match_device(DeviceReport("Fancy Accelerator X", 48 * GIB))
    assert gpu_type.memory_gib == 48 and not gpu_type.from_datasheet


# -- the Hydra app, in process -----------------------------------------------------------


def _run_cluster_app(run_app, *args):
    from zorse_lightning.apps.cluster_app import main

    return run_app(main, *args)


def test_app_prints_inventory_with_totals(run_app):
    code, out, _ = _run_cluster_app(run_app, "cluster=a10g_l4_t4")
    assert code == 0
    assert "4x a10g" in out and "links between machines" in out
    assert "total" in out and "12" in out


def test_app_reports_bad_user_config_without_traceback(run_app, tmp_path: Path):
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "mine.yaml").write_text(
        "defaults:\n  - cluster_schema\n  - _self_\nname: mine\nmachines:\n  - name: m\n    gpus: [{type: h9000}]\n"
    )
    code, _, err = _run_cluster_app(run_app, "--config-dir", str(tmp_path), "cluster=mine")
    assert code == 2
    assert "unknown GPU type 'h9000'" in err and "Traceback" not in err


def test_app_warns_when_a_user_file_is_shadowed(run_app, tmp_path: Path):
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "cpu_sim2.yaml").write_text("name: mine\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out, _ = _run_cluster_app(run_app, "--config-dir", str(tmp_path), "cluster=cpu_sim2")
    assert code == 0 and "cluster cpu_sim2" in out
    assert any("has the name of a shipped config" in str(w.message) for w in caught)


@pytest.mark.multiprocess
def test_import_registers_strategy_without_side_effects():
    import subprocess
    import sys

    probe = (
        "import sys, zorse_lightning\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "import torch.distributed as dist\n"
        "print('zorse' in StrategyRegistry, dist.is_initialized())\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["True", "False"]


@pytest.mark.multiprocess
def test_the_package_planner_and_plan_app_do_not_import_torch_or_lightning():
    """Planning needs neither: the package loads its names lazily (seconds saved on every plan app run)."""
    import subprocess
    import sys

    probe = (
        "import sys, zorse_lightning\n"
        "import zorse_lightning.cluster.config, zorse_lightning.cluster.detection, zorse_lightning.cluster.report\n"
        "import zorse_lightning.planner.search, zorse_lightning.planner.baselines, zorse_lightning.planner.cost.simulate\n"
        "import zorse_lightning.profiling.reference, zorse_lightning.profiling.estimate\n"
        "import zorse_lightning.apps.plan_app\n"
        "print('torch' in sys.modules, 'lightning' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
