"""Integer shares in proportion to weights (largest remainder), used by the heuristic
baselines and by the infeasibility diagnosis."""

from __future__ import annotations

import math


def proportional_counts(total: int, weights: list[float], minimum: int = 0) -> list[int]:
    """``total`` split in proportion to ``weights``, each share at least ``minimum``.

    Largest-remainder rounding: floors first, then the leftover units go to the
    largest fractional parts (ties to the earlier entry), so shares sum to ``total``.
    """
    if minimum * len(weights) > total:
        raise ValueError(f"cannot give {len(weights)} shares at least {minimum} each out of {total}")
    rest = total - minimum * len(weights)
    weight_sum = sum(weights)
    exact = [rest * w / weight_sum for w in weights] if weight_sum > 0 else [rest / len(weights)] * len(weights)
    shares = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[: rest - sum(shares)]:
        shares[i] += 1
    return [s + minimum for s in shares]
