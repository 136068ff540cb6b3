"""What a block returns, and what a block that passes its input on must return in its place.

Most blocks return their activation. Some Hugging Face layers (Falcon's and Bloom's,
and most families' before transformers 5) return a tuple instead: the activation
first, then attention weights (None unless asked for), the key/value cache the call
was given, or values computed in the block (old GPT-2's present keys and values).
The model's loop takes item 0 as the next block's input and collects the rest.

A block that passes its input on (before this rank's stage, or behind start-up's
one-block view) must then return the same form, or the loop would take sample 0
of the activation for the activation. Items the call was given are handed back
from the passing call's own inputs; anything else becomes None. The loss never
depends on those: the cut's analysis refuses a loss that depends on a block other
than through the chain (:mod:`.cut_analysis`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Given = int | str | None
"""Where a returned item comes from: the call's positional argument (int), keyword argument (str), or
nowhere the passing call could give it (None: returned as None)."""


def activation_of(output: Any) -> torch.Tensor | None:
    """The activation in a block's ``output``: the tensor itself, or the first item of a tuple or list
    (None when neither is a tensor)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


@dataclass(frozen=True)
class OutputForm:
    """A block's output: the activation alone (``container`` empty), or first in a tuple or list."""

    container: str = ""
    """``""`` (the tensor alone), ``"tuple"`` or ``"list"``."""
    rest: tuple[Given, ...] = ()
    """The items after the activation, each by where a passing call finds it (:data:`Given`)."""

    @classmethod
    def of(cls, output: Any, args: tuple, kwargs: dict) -> OutputForm | None:
        """The form of ``output``, returned by a call on ``args`` and ``kwargs`` (None: no activation in it)."""
        if activation_of(output) is None:
            return None
        if isinstance(output, torch.Tensor):
            return cls()
        return cls("list" if isinstance(output, list) else "tuple", tuple(_given(item, args, kwargs) for item in output[1:]))

    def passed_on(self, args: tuple, kwargs: dict) -> Any:
        """What a block of this form returns when it passes its input (``args[0]``) on."""
        if not self.container:
            return args[0]
        items = [args[0], *(_from_call(where, args, kwargs) for where in self.rest)]
        return items if self.container == "list" else tuple(items)

    def passing_forward(self) -> Callable[..., Any]:
        """A ``forward`` that passes its input on in this form."""
        return lambda *args, **kwargs: self.passed_on(args, kwargs)


def _given(item: Any, args: tuple, kwargs: dict) -> Given:
    if item is None:
        return None
    for index, arg in enumerate(args):
        if arg is item:
            return index
    return next((key for key, value in kwargs.items() if value is item), None)


def _from_call(where: Given, args: tuple, kwargs: dict) -> Any:
    if isinstance(where, int):
        return args[where] if where < len(args) else None
    if isinstance(where, str):
        return kwargs.get(where)
    return None
