"""Profiles: the shipped reference data, hole filling, estimates, and measuring a real module."""

from __future__ import annotations

import json
import statistics
import warnings
from pathlib import Path

import pytest

from zorse_lightning.cluster import DEFAULT_CATALOG
from zorse_lightning.errors import PlanningError
from zorse_lightning.profiling import (
    REFERENCE_MODELS,
    MixedProfileSourcesWarning,
    ProfileSource,
    TransformerShape,
    calibrated_efficiency,
    estimated_profile,
    reference_profile,
    warn_if_mixed_sources,
)
from tools.convert_reference import DATA_DIR, convert
from zorse_lightning.profiling.reference_data import DATA_FILE, entry_kind, load_reference_data

RAW_DIR = Path(__file__).resolve().parents[3] / "shared" / "reference"
needs_raw = pytest.mark.skipif(not RAW_DIR.is_dir(), reason="raw reference data not present")
REL = 1e-6  # the shipped copy rounds to 7 significant digits


@pytest.fixture(scope="module")
def raw():
    return json.loads((RAW_DIR / "layer_latencies.json").read_text())


def _raw_total_slope(entry):
    kind = entry_kind(entry)
    if kind == "slope":
        return entry
    return entry[0] if kind == "combined" else entry[0][0] + entry[1][0]


# --- the loader -----------------------------------------------------------------------------


@needs_raw
def test_shipped_copy_is_the_conversion_of_the_raw_data():
    shipped = json.loads((DATA_DIR / DATA_FILE).read_text())
    assert shipped == json.loads(json.dumps(convert(RAW_DIR)))
    assert (DATA_DIR / "LICENSE-layer-data").read_text() == (RAW_DIR / "LICENSE-layer-data").read_text()


@needs_raw
def test_loader_reads_every_entry_shape_as_the_raw_numbers(raw):
    data = load_reference_data()
    seen = set()
    for key in {k for m in REFERENCE_MODELS.values() for k in m.latency_keys}:
        for raw_gpu, by_seq in raw[key].items():
            gpu = DEFAULT_CATALOG.get(raw_gpu).name
            for seq, by_dtype in by_seq.items():
                for dtype, entry in by_dtype.items():
                    kind = entry_kind(entry)
                    seen.add(kind)
                    times = data.layer_times(key, gpu, int(seq), dtype)
                    fwd, bwd = times.forward, times.backward
                    if kind.startswith("fits"):
                        got = [fwd.slope_ms, fwd.intercept_ms, bwd.slope_ms, bwd.intercept_ms]
                        assert got == pytest.approx([*entry[0], *entry[1]], rel=REL)
                    else:
                        assert fwd.slope_ms + bwd.slope_ms == pytest.approx(_raw_total_slope(entry), rel=REL)
                    if kind == "fits+measured":
                        assert fwd.measured_ms == pytest.approx(entry[2], rel=REL)
                        assert bwd.measured_ms == pytest.approx(entry[3], rel=REL)
                        assert fwd.at(1) == pytest.approx(entry[2][0], rel=REL)
                        beyond = len(entry[2]) + 1
                        assert fwd.at(beyond) == pytest.approx(max(entry[0][0] * beyond + entry[0][1], 1e-3), rel=REL)
    assert seen == {"fits", "fits+measured", "combined", "slope"}


@needs_raw
def test_combined_line_is_split_by_the_models_backward_share(raw):
    entry = raw["gpt_1.3b"]["v100"]["512"]["float16"]  # [slope, intercept] of forward + backward
    shares = [
        e[1][0] / (e[0][0] + e[1][0])
        for by_seq in raw["gpt_1.3b"].values()
        for by_dtype in by_seq.values()
        for e in by_dtype.values()
        if isinstance(e[0], list)
    ] or [2 / 3]
    share = statistics.median(shares)
    times = load_reference_data().layer_times("gpt_1.3b", "v100x16", 512, "float16")
    assert times.backward.slope_ms == pytest.approx(entry[0] * share, rel=REL)
    assert times.forward.intercept_ms == pytest.approx(entry[1] * (1 - share), rel=REL)


def test_negative_fitted_times_are_floored():
    data = load_reference_data()
    times = data.layer_times("deepspeedllama_7b", "l4", 512, "float32")
    assert times.backward.intercept_ms < 0  # the data has it
    assert times.backward.at(10_000) > 0
    assert data.layer_times("deepspeedllama_7b", "a100x40", 8192, "float16") is None


# --- reference profiles ---------------------------------------------------------------------


@needs_raw
def test_llama_7b_on_a100_matches_the_data(raw):
    entry = raw["deepspeedllama_7b"]["a100x40"]["512"]["float16"]
    profile = reference_profile("llama_7b", ["A100"])
    times = profile.times("a100x40")
    assert times.source is ProfileSource.REFERENCE
    assert profile.num_layers == 32 and len(times.layers) == 32
    assert all(layer == times.layers[0] for layer in times.layers)
    assert times.layers[0].forward.slope_ms == pytest.approx(entry[0][0], rel=REL)
    assert times.layers[0].backward.at(2) == pytest.approx(entry[3][1], rel=REL)
    assert profile.layers[0].parameters == 202383360
    # Head: 2 s h V FLOPs against the layer's 2 P s + 4 s^2 h, on this GPU's own layer curve.
    s, h, p, v = 512, 4096, 202383360, 32000
    ratio = (2 * s * h * v) / (2 * p * s + 4 * s * s * h)
    assert times.head.forward.slope_ms == pytest.approx(entry[0][0] * ratio, rel=REL)
    assert profile.head.parameters == v * h and not profile.tied_embedding_head


@needs_raw
def test_holes_are_filled_scaled_or_estimated_and_mixed_sources_warn(raw):
    llama = reference_profile("llama_7b", ["a100x40", "v100x32"])
    assert llama.sources == {"a100x40": ProfileSource.REFERENCE, "v100x32": ProfileSource.REFERENCE_SCALED}
    # v100x32 has only float32 for llama_7b; no other llama model has both dtypes on it, so the
    # float32 -> float16 ratio is the median over the other GPUs of llama_7b that have both.
    by_gpu = raw["deepspeedllama_7b"]
    ratios = [
        _raw_total_slope(d["512"]["float16"]) / _raw_total_slope(d["512"]["float32"])
        for g, d in by_gpu.items()
        if g != "v100x32" and {"float16", "float32"} <= set(d.get("512", {}))
    ]
    expected = by_gpu["v100x32"]["512"]["float32"][0][0] * statistics.median(ratios)
    assert llama.times("v100x32").layers[0].forward.slope_ms == pytest.approx(expected, rel=1e-5)

    for small in ("llama_tiny", "llama_3b"):
        assert reference_profile(small, ["v100x16"]).sources["v100x16"] is ProfileSource.REFERENCE_SCALED

    gpt = reference_profile("gpt_1.3b", ["a6000", "a100x40"])
    assert gpt.sources == {"a6000": ProfileSource.REFERENCE, "a100x40": ProfileSource.ESTIMATED}
    flops = 2 * 50358272 * 512 + 4 * 512**2 * 2048
    efficiency = calibrated_efficiency("gpt_1.3b")
    expected_ms = flops / (312e12 * efficiency) * 1e3
    assert gpt.times("a100x40").layers[0].forward.slope_ms == pytest.approx(expected_ms, rel=1e-9)
    assert gpt.times("a100x40").layers[0].backward.slope_ms == pytest.approx(2 * expected_ms, rel=1e-9)
    assert gpt.tied_embedding_head and gpt.total_parameters == gpt.embedding.parameters + 24 * 50358272

    with pytest.warns(MixedProfileSourcesWarning) as record:
        assert warn_if_mixed_sources(gpt)
    assert len(record) == 1
    assert "reference: a6000" in str(record[0].message) and "estimated: a100x40" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not warn_if_mixed_sources(gpt, ["a6000"])


@needs_raw
def test_other_sequence_length_scales_the_slope_linearly(raw):
    entry = raw["deepspeedllama_13b"]["a100x80"]["1024"]["float16"]  # no 512 data on a100x80
    times = reference_profile("llama_13b", ["a100x80"], seq_len=512).times("a100x80")
    assert times.source is ProfileSource.REFERENCE_SCALED
    assert times.layers[0].forward.slope_ms == pytest.approx(entry[0][0] / 2, rel=REL)
    assert times.layers[0].forward.intercept_ms == pytest.approx(entry[0][1], rel=REL)


def test_bfloat16_reads_float16_data_as_scaled():
    fp16 = reference_profile("llama_7b", ["a100x40"]).times("a100x40")
    bf16 = reference_profile("llama_7b", ["a100x40"], dtype="bfloat16").times("a100x40")
    assert bf16.source is ProfileSource.REFERENCE_SCALED and bf16.layers == fp16.layers


def test_unknown_model_lists_the_known_names():
    with pytest.raises(PlanningError) as err:
        reference_profile("llama_8b", ["a100x40"])
    message = str(err.value)
    assert "'llama_8b'" in message
    for name in ("llama_tiny", "llama_3b", "llama_7b", "llama_13b", "llama_33b", "gpt_1.3b", "gpt_2.7b", "gpt_6.7b"):
        assert name in message


def test_bad_dtype_is_refused():
    with pytest.raises(PlanningError, match="float8"):
        reference_profile("llama_7b", ["a100x40"], dtype="float8")


# --- estimated profiles ---------------------------------------------------------------------


def test_estimated_profile_against_hand_calculation():
    shape = TransformerShape(hidden_size=1024, num_layers=4, seq_len=256, vocab_size=1000)
    profile = estimated_profile(shape, ["T4", "a100x40"], "float16", efficiency=0.5)
    params = 12 * 1024 * 1024 + 13 * 1024  # 12_596_224
    layer = profile.layers[0]
    assert layer.parameters == params == 12_596_224
    flops = 2 * params * 256 + 4 * 256 * 256 * 1024  # 6_717_702_144
    assert layer.forward_flops_per_sample == flops == 6_717_702_144
    # 8 heads of 128: s h (34 + 5 a s / h) = 256 * 1024 * (34 + 10) bytes at 16-bit
    assert layer.activation_bytes_per_sample == 11_534_336
    assert layer.output_bytes_per_sample == 256 * 1024 * 2
    assert profile.embedding.parameters == profile.head.parameters == 1000 * 1024
    assert profile.total_parameters == 4 * params + 2 * 1000 * 1024
    t4 = profile.times("t4")
    assert t4.source is ProfileSource.ESTIMATED
    assert t4.layers[0].forward.at(3) == pytest.approx(3 * flops / (65e12 * 0.5) * 1e3, rel=1e-12)
    assert t4.layers[0].backward.slope_ms == pytest.approx(2 * flops / (65e12 * 0.5) * 1e3, rel=1e-12)
    head_flops = 2 * 256 * 1024 * 1000
    a100_head = profile.times("a100x40").head.forward.slope_ms
    assert a100_head == pytest.approx(head_flops / (312e12 * 0.5) * 1e3, rel=1e-12)
    fp32 = TransformerShape(1024, 4, 256, 1000).block_shapes("float32")[1][0]
    assert fp32.activation_bytes_per_sample == 2 * 11_534_336


def test_estimated_profile_rejects_bad_shapes():
    with pytest.raises(PlanningError, match="hidden_size=0"):
        TransformerShape(hidden_size=0, num_layers=2, seq_len=8, vocab_size=10)
    with pytest.raises(PlanningError, match="efficiency"):
        estimated_profile(TransformerShape(64, 2, 8, 10), ["t4"], efficiency=1.5)


# --- measured profiles ----------------------------------------------------------------------

_MODEL = {
    "_target_": "zorse_lightning.models.gpt.GPT", "vocab_size": 256, "seq_len": 8, "width": 16, "layers": 2,
    "heads": 2,
}
_DATA = {
    "_target_": "zorse_lightning.data.datamodule.ByteCorpusDataModule", "seq_len": 8, "batch_size": 4,
    "corpus_bytes": 20_000, "val_fraction": 0.05, "seed": 0,
}


def _start_up_profile(inventory, batch):
    """What start-up measures: ``run_startup`` itself, on one rank (a one-process gloo group)."""
    from contextlib import nullcontext

    import torch
    import torch.distributed as dist
    from hydra.utils import instantiate

    from zorse_lightning.planner.options import PlannerOptions
    from zorse_lightning.startup.plan_at_start import StartupInputs, run_startup
    from zorse_lightning.startup.step_costs import optimizer_factory
    from zorse_lightning.strategy.trainer_inputs import quiet_training_step

    module = instantiate(_MODEL)
    inputs = StartupInputs(
        module, inventory, rank=0, world_size=1, device=torch.device("cpu"), global_batch_size=4,
        planner_options=PlannerOptions(), optimizer=optimizer_factory(module.configure_optimizers()),
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return run_startup(inputs, batch, quiet_training_step(module, nullcontext))
    finally:
        dist.destroy_process_group()


def test_the_plan_apps_profile_of_a_module_is_what_start_up_measures():
    """The plan app once profiled a module its own way (a repeated sample at sizes 1 and 2, no step edges,
    no optimizer, no time per action); now it runs start-up's measurement, so both profiles have one form."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from zorse_lightning.apps.module_profile import measured_module_profile
    from zorse_lightning.cluster import ClusterInventory, Machine
    from zorse_lightning.planner.options import PlannerOptions

    inventory = ClusterInventory("one_t4", (Machine("m0", (DEFAULT_CATALOG.get("t4"),), 100.0),), emulated=True)
    data = instantiate(_DATA)
    data.setup("fit")
    started = _start_up_profile(inventory, next(iter(data.train_dataloader())))
    planned = measured_module_profile(OmegaConf.create(_MODEL), OmegaConf.create(_DATA), inventory, PlannerOptions())

    ours, theirs = planned.profile, started.profile
    assert planned.sizes == ours.measured_sizes == theirs.measured_sizes == (1, 2, 4)  # batch_size 4: all of it
    assert "4 samples per rank" in planned.why_not
    assert (ours.embedding, ours.layers, ours.head) == (theirs.embedding, theirs.layers, theirs.head)
    for edge in (ours.embedding, ours.head):  # the edges: their parameters and what they save for backward
        assert edge.parameters > 0 and edge.activation_bytes_per_sample + edge.activation_bytes_per_microbatch > 0
    assert (ours.seq_len, ours.dtype, ours.weight_dtype, ours.tied_embedding_head) == (
        theirs.seq_len, theirs.dtype, theirs.weight_dtype, theirs.tied_embedding_head)
    assert ours.optimizer is not None and ours.optimizer.name == theirs.optimizer.name == "torch.optim.adamw.AdamW"
    assert ours.optimizer.state_bytes_per_parameter == theirs.optimizer.state_bytes_per_parameter == 8.0
    mine, start = ours.times("t4"), theirs.times("t4")
    assert mine.source is start.source is ProfileSource.MEASURED
    for times in (mine, start):
        assert times.action_overhead_ms > 0 and times.optimizer_ms_per_million_parameters > 0
        for curve in (times.embedding.forward, times.head.backward, times.layers[-1].backward):
            assert curve.measured_sizes == (1, 2, 4) and all(t > 0 for t in curve.measured_ms)
