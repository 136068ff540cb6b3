"""A layer with state of its own, for the tests of what runs a captured call several times."""

from __future__ import annotations

import torch
from torch import nn


class RecurrentLayer(nn.Module):
    """Keeps its state as a plain tensor attribute that its forward reads and replaces, as RecurrentGemma's
    recurrent block does (its model resets the state before the layers)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x) + (0.0 if self.state is None else self.state)
        self.state = out.mean(0, keepdim=True)
        return out
