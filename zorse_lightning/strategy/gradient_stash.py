"""Gradients set aside across Lightning's zeroing between ``training_step`` and ``backward``.

Lightning zeroes gradients (at an accumulation window's start) after
``training_step`` returns and before ``backward`` runs. The engine's schedule
runs the whole backward inside ``training_step``, so its gradients wait aside
until ``backward``, and the gradients of earlier batches of the window wait
aside while the schedule runs on empty ones.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class GradientStash:
    """Gradients taken off their parameters, to be put back (added to any there) later."""

    def __init__(self) -> None:
        self._held: list[tuple[nn.Parameter, torch.Tensor | None]] = []

    @staticmethod
    def take(params: Iterable[nn.Parameter]) -> GradientStash:
        """A stash of ``params``' gradients; each parameter is left with none."""
        stash = GradientStash()
        for param in params:
            stash._held.append((param, param.grad))
            param.grad = None
        return stash

    def put_back(self) -> None:
        """Each held gradient onto its parameter, added to the one there if any; the stash is then empty."""
        for param, grad in self._held:
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad + grad
        self._held = []
