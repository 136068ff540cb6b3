"""Profiles of the reference models by name, from the shipped GPU measurements.

``reference_profile("llama_7b", ["a100x40", "v100x32"])`` gives every GPU type
times from the most trusted source that has them:

1. ``REFERENCE``: the data has this GPU at the requested sequence length and dtype;
2. ``REFERENCE_SCALED``: the same GPU at another length (same dtype first; the
   per-sample slope scaled linearly in the length, the intercept kept) or at
   another dtype (scaled by the dtype speed ratio, see :func:`dtype_ratio`);
   ``bfloat16`` is read from the float16 entries (same tensor-core rate);
3. ``ESTIMATED``: FLOPs over the catalog peak times an efficiency calibrated on
   the GPUs that do have data for this model (:func:`calibrated_efficiency`).

Only the reader :mod:`zorse_lightning.profiling.reference_data` touches the
file. Every layer of a model gets the same times (the data has one layer); the
embedding and head are timed from their FLOPs relative to a layer (see
:func:`zorse_lightning.profiling.estimate.device_times_from_layer`).
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from zorse_lightning.cluster.catalog import DEFAULT_CATALOG, GpuCatalog
from zorse_lightning.errors import PlanningError
from zorse_lightning.profiling.estimate import (
    DEFAULT_EFFICIENCY,
    TransformerShape,
    bytes_per_element,
    device_times_from_layer,
    estimated_block_times,
    peak_flops_per_s,
)
from zorse_lightning.profiling.profile import BlockTimes, ModelProfile, ProfileSource, TensorParallelSupport, TimeCurve
from zorse_lightning.profiling.reference_data import ReferenceData, load_reference_data

LLAMA_VOCAB = 32000
GPT_VOCAB = 50257
GPT_POSITIONS = 2048
"""GPT models learn a position table of 2048 rows (the GPT-3 context length)."""
FLOAT32_TO_FLOAT16 = 0.2
"""Last-resort float32 -> float16 time ratio (tensor-core GPUs in the data run float16 ~5x faster)."""


@dataclass(frozen=True)
class ReferenceModel:
    """One selectable model: where its shape and its times live in the data."""

    name: str
    family: str
    stats_key: str
    """Key of ``model_stats``."""
    latency_keys: tuple[str, ...]
    """Keys of ``layer_latencies``, most preferred first (a GPU type takes the first that has it)."""
    vocab_size: int
    learned_positions: int
    tied_embedding_head: bool
    heads: int
    """Attention heads (and key/value heads: none of these models groups them), which a TP degree must divide."""


LLAMA_HEADS = {"tiny": 32, "3b": 32, "7b": 32, "13b": 40, "33b": 52}
"""Heads of the Llama shapes in the data (their public configs: TinyLlama, OpenLLaMA 3B, LLaMA 7B/13B/33B). The
data's layers hold as many key/value heads: 4 h^2 of attention weights fits their parameter counts (TinyLlama's own
4 grouped key/value heads would not)."""
GPT_HEADS = {"1.3b": 16, "2.7b": 32, "6.7b": 32}
"""Heads of DeepSpeed's Megatron GPT examples of these sizes (hidden 2048, 2560, 4096)."""


def _llama(size: str) -> ReferenceModel:
    key = f"deepspeedllama_{size}"
    return ReferenceModel(f"llama_{size}", "llama", key, (key,), LLAMA_VOCAB, 0, False, LLAMA_HEADS[size])


def _gpt(size: str) -> ReferenceModel:
    # deepspeedgpt_* has separate forward/backward fits; gpt_* (one combined line) adds
    # T4 and V100-16GB at float16 and agrees with it where both exist (RTX 3090: 6.04 ms).
    key = f"deepspeedgpt_{size}"
    return ReferenceModel(f"gpt_{size}", "gpt", key, (key, f"gpt_{size}"), GPT_VOCAB, GPT_POSITIONS, True, GPT_HEADS[size])


REFERENCE_MODELS: Mapping[str, ReferenceModel] = MappingProxyType(
    {m.name: m for m in (*map(_llama, ("tiny", "3b", "7b", "13b", "33b")), *map(_gpt, ("1.3b", "2.7b", "6.7b")))}
)


def reference_tensor_parallel(model: ReferenceModel, shape: TransformerShape) -> TensorParallelSupport:
    """The TP degrees a reference model's layers admit under Megatron's split (q, k, v and the MLP's first
    projections column-wise, the output projections row-wise: Llama's ``base_model_tp_plan``, the project's GPT's
    ``tp_plan``): those dividing its heads and its MLP width, read from its parameters per layer (Llama:
    ``4 h^2 + 3 h f + 2 h``; GPT: ``f = 4 h``). What the split leaves whole: Llama's two norms (``2 h``); GPT's two
    layer norms and its two row-wise biases (``6 h``)."""
    h, per_layer = shape.hidden_size, shape.layer_parameters
    if model.family == "llama":
        mlp_width, replicated = (per_layer - 4 * h * h - 2 * h) // (3 * h), 2 * h
    else:
        mlp_width, replicated = 4 * h, 6 * h
    degrees = tuple(t for t in range(2, model.heads + 1) if model.heads % t == 0 and mlp_width % t == 0)
    reason = (
        f"{model.name}: {model.heads} heads (as many key/value heads) and an MLP width of {mlp_width}; a degree must "
        f"divide both"
    )
    return TensorParallelSupport(degrees, reason, replicated)
"""The alias table: selectable name -> data keys."""


def reference_model(name: str) -> ReferenceModel:
    try:
        return REFERENCE_MODELS[name]
    except KeyError:
        raise PlanningError(
            f"unknown reference model {name!r}; known: {', '.join(REFERENCE_MODELS)}. "
            f"For another model give its shape to estimated_profile() or measure it"
        ) from None


def model_shape(model: ReferenceModel, seq_len: int, data: ReferenceData | None = None) -> TransformerShape:
    stats = (data or load_reference_data()).model_stats(model.stats_key)
    return TransformerShape(
        hidden_size=stats.hidden_size,
        num_layers=stats.num_layers,
        seq_len=seq_len,
        vocab_size=model.vocab_size,
        parameters_per_layer=stats.parameters_per_layer,
        learned_positions=model.learned_positions,
        tied_embedding_head=model.tied_embedding_head,
    )


def _entry(data: ReferenceData, model: ReferenceModel, gpu: str, seq_len: int, dtype: str) -> BlockTimes | None:
    for key in model.latency_keys:
        found = data.layer_times(key, gpu, seq_len, dtype)
        if found is not None:
            return found
    return None


def _lengths(data: ReferenceData, model: ReferenceModel, gpu: str, dtype: str) -> list[int]:
    return sorted({s for k in model.latency_keys for s, d in data.coverage(k).get(gpu, {}).items() if dtype in d})


def _total_slope(times: BlockTimes) -> float:
    return times.forward.slope_ms + times.backward.slope_ms


def dtype_ratio(
    data: ReferenceData, model: ReferenceModel, gpu: str, seq_len: int, from_dtype: str, to_dtype: str
) -> float:
    """Time at ``to_dtype`` over time at ``from_dtype`` (forward+backward slopes), median of witnesses.

    Witnesses, first non-empty set wins: the same GPU on the other models of the
    family (the ratio is a property of the GPU's units: ~1 on P40, ~10 on A100);
    then the other GPUs of this model; else :data:`FLOAT32_TO_FLOAT16`.
    """
    family = [m for m in REFERENCE_MODELS.values() if m.family == model.family and m is not model]
    candidates = ([(m, gpu) for m in family], [(model, g) for g in _gpus(data, model) if g != gpu])
    for witnesses in candidates:
        ratios = []
        for m, g in witnesses:
            src, dst = _entry(data, m, g, seq_len, from_dtype), _entry(data, m, g, seq_len, to_dtype)
            if src is not None and dst is not None and _total_slope(src) > 0:
                ratios.append(_total_slope(dst) / _total_slope(src))
        if ratios:
            return statistics.median(ratios)
    return FLOAT32_TO_FLOAT16 if from_dtype == "float32" else 1 / FLOAT32_TO_FLOAT16


def _gpus(data: ReferenceData, model: ReferenceModel) -> list[str]:
    return sorted({g for k in model.latency_keys for g in data.coverage(k)})


def _rescale_length(times: BlockTimes, factor: float) -> BlockTimes:
    """Per-sample slope linear in the sequence length; fixed costs (intercept) kept; points dropped."""
    return BlockTimes(
        TimeCurve(times.forward.slope_ms * factor, times.forward.intercept_ms),
        TimeCurve(times.backward.slope_ms * factor, times.backward.intercept_ms),
    )


def reference_layer_times(
    data: ReferenceData, model: ReferenceModel, gpu: str, seq_len: int, dtype: str
) -> tuple[BlockTimes, ProfileSource] | None:
    """One layer's times on ``gpu`` from the data, exact or rescaled; None if the GPU has no data."""
    data_dtype = "float16" if dtype == "bfloat16" else dtype
    exact = _entry(data, model, gpu, seq_len, data_dtype)
    if exact is not None:
        return exact, ProfileSource.REFERENCE if data_dtype == dtype else ProfileSource.REFERENCE_SCALED
    other_dtypes = [d for d in ("float16", "float32") if d != data_dtype]
    for source_dtype in (data_dtype, *other_dtypes):
        lengths = _lengths(data, model, gpu, source_dtype)
        if not lengths:
            continue
        nearest = min(lengths, key=lambda s: (abs(math.log(s / seq_len)), s))
        times = _entry(data, model, gpu, nearest, source_dtype)
        if nearest != seq_len:
            times = _rescale_length(times, seq_len / nearest)
        if source_dtype != data_dtype:
            times = times.scaled(dtype_ratio(data, model, gpu, nearest, source_dtype, data_dtype))
        return times, ProfileSource.REFERENCE_SCALED
    return None


def calibrated_efficiency(
    model: str, seq_len: int = 512, dtype: str = "float16", catalog: GpuCatalog = DEFAULT_CATALOG
) -> float:
    """Median achieved / peak over the GPUs with exact data for this model (else :data:`DEFAULT_EFFICIENCY`).

    Achieved = 3 x layer forward FLOPs per sample / (forward + backward slope).
    """
    spec, data = reference_model(model), load_reference_data()
    shape = model_shape(spec, seq_len, data)
    data_dtype = "float16" if dtype == "bfloat16" else dtype
    achieved = []
    for gpu in _gpus(data, spec):
        times = _entry(data, spec, gpu, seq_len, data_dtype)
        gpu_type = catalog.find(gpu)
        if times is not None and gpu_type is not None and _total_slope(times) > 0:
            flops_per_s = 3 * shape.layer_forward_flops_per_sample / (_total_slope(times) * 1e-3)
            achieved.append(flops_per_s / peak_flops_per_s(gpu_type, dtype))
    return min(statistics.median(achieved), 1.0) if achieved else DEFAULT_EFFICIENCY[data_dtype]


def reference_profile(
    model: str,
    gpu_types: Iterable[str],
    seq_len: int = 512,
    dtype: str = "float16",
    *,
    catalog: GpuCatalog = DEFAULT_CATALOG,
) -> ModelProfile:
    """The profile of a named reference model on the given GPU types (catalog names or spellings).

    Embedding and head: vocabularies of 32000 (Llama) and 50257 (GPT, whose head
    is tied to the embedding and which learns 2048 positions); their times come
    from their FLOPs relative to a layer on the same GPU. Which source each GPU
    type got is in ``profile.sources``; call :func:`warn_if_mixed_sources` where
    a plan uses several types.
    """
    spec = reference_model(model)
    bytes_per_element(dtype)
    if seq_len < 1:
        raise PlanningError(f"seq_len={seq_len!r} must be a positive number of tokens (the data has 512 to 4096)")
    data = load_reference_data()
    shape = model_shape(spec, seq_len, data)
    embedding, layers, head = shape.block_shapes(dtype)
    efficiency: float | None = None
    devices = {}
    for requested in gpu_types:
        gpu = catalog.get(requested)
        found = reference_layer_times(data, spec, gpu.name, seq_len, dtype)
        if found is None:
            if efficiency is None:
                efficiency = calibrated_efficiency(model, seq_len, dtype, catalog)
            estimate = estimated_block_times(shape.layer_forward_flops_per_sample, gpu, dtype, efficiency)
            found = estimate, ProfileSource.ESTIMATED
        devices[gpu.name] = device_times_from_layer(shape, gpu.name, found[1], found[0])
    return ModelProfile(
        model=spec.name,
        seq_len=seq_len,
        dtype=dtype,
        embedding=embedding,
        layers=layers,
        head=head,
        devices=devices,
        tied_embedding_head=spec.tied_embedding_head,
        tensor_parallel=reference_tensor_parallel(spec, shape),
    )


def sources_by_kind(
    profile: ModelProfile, gpu_types: Iterable[str] | None = None
) -> dict[ProfileSource, tuple[str, ...]]:
    """GPU types grouped by where their times came from (restricted to ``gpu_types`` if given)."""
    wanted = set(profile.devices if gpu_types is None else gpu_types)
    grouped: dict[ProfileSource, list[str]] = {}
    for name, source in sorted(profile.sources.items()):
        if name in wanted:
            grouped.setdefault(source, []).append(name)
    return {source: tuple(grouped[source]) for source in ProfileSource if source in grouped}


class MixedProfileSourcesWarning(UserWarning):
    """A plan compares GPU types whose times are not equally trustworthy."""


def warn_if_mixed_sources(profile: ModelProfile, gpu_types: Iterable[str] | None = None) -> bool:
    """Warn once (one message naming the types per source) if the types' times come from several sources.

    Returns whether it warned. Mixed sources bias a plan toward the types whose
    times are optimistic; measuring every type removes the bias.
    """
    grouped = sources_by_kind(profile, gpu_types)
    if len(grouped) < 2:
        return False
    detail = "; ".join(f"{source.value}: {', '.join(names)}" for source, names in grouped.items())
    warnings.warn(
        f"profile of {profile.model!r} mixes sources ({detail}); the plan's balance between these GPU types "
        f"is only as good as the least trusted source. Measure the profile on each type to remove the doubt",
        MixedProfileSourcesWarning,
        stacklevel=2,
    )
    return True
