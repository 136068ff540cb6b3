"""Layer 2: per-block profiles of a model on each GPU type (measured, reference or estimated).

Torch-free at import: the measuring functions live in
:mod:`zorse_lightning.profiling.measure`, imported on use.
"""

from zorse_lightning.profiling.estimate import TransformerShape, estimated_profile
from zorse_lightning.profiling.profile import (
    BlockShape,
    BlockTimes,
    DeviceTimes,
    ModelProfile,
    ProfileSource,
    TimeCurve,
)
from zorse_lightning.profiling.reference import (
    REFERENCE_MODELS,
    MixedProfileSourcesWarning,
    calibrated_efficiency,
    reference_profile,
    sources_by_kind,
    warn_if_mixed_sources,
)

__all__ = [
    "REFERENCE_MODELS",
    "BlockShape",
    "BlockTimes",
    "DeviceTimes",
    "MixedProfileSourcesWarning",
    "ModelProfile",
    "ProfileSource",
    "TimeCurve",
    "TransformerShape",
    "calibrated_efficiency",
    "estimated_profile",
    "reference_profile",
    "sources_by_kind",
    "warn_if_mixed_sources",
]
