"""A checkpoint's tensors by name, each file opened only when one of its tensors is first asked for.

Lightning reads a checkpoint before the plan exists, so at that moment no rank
knows which stage it will hold. Reading every file then would put the whole
model and its optimizer state in every process (a 7B model with Adam: about
100 GB per process). The checkpoint's dictionary therefore holds mappings from
name to value that know from the manifest (``contents``) or a survivor's index
which file holds each name, and open a file, memory-mapped, only when one of
its names is read: the stage's placement (:meth:`ByName.weight_source`) and
the optimizers' restriction to the stage read only their own names, so a rank
opens only the files that hold its stage's tensors, and of those touches only
its tensors' pages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from zorse_lightning.engine.checkpoint.files import open_file
from zorse_lightning.module.stage_weights import WeightSource


class OpenedFiles:
    """Files opened on first use, once each (memory-mapped, ``weights_only``), shared by the mappings of one
    checkpoint."""

    def __init__(self) -> None:
        self._opened: dict[Path, Any] = {}
        self._moved: dict[Path, Path] = {}

    def get(self, path: Path) -> Any:
        path = self._moved.get(path, path)
        if path not in self._opened:
            self._opened[path] = open_file(path)
        return self._opened[path]

    def relocate(self, moved: dict[Path, Path]) -> None:
        """Read each file named in ``moved`` from its new place (a local copy of another machine's file)."""
        self._moved.update(moved)

    @property
    def opened(self) -> list[Path]:
        """The files opened so far, in order (what this rank has read)."""
        return list(self._opened)

    def close(self) -> None:
        """Drop the opened files: their mappings end once no tensor read from them is left (the stage's weights
        are copies), so pages read for the weights stop counting in this process's memory. A later read opens
        the file again."""
        self._opened.clear()


Section = Callable[[Any], Mapping[str, Any]]
"""The part of an opened file a mapping reads: its ``state_dict``, or one optimizer's state by name."""


class ByName(Mapping[str, Any]):
    """``name -> value`` over files: ``located[name]`` is the file holding ``name``; ``section(file)`` the
    mapping inside it. Listing names opens nothing; reading one opens its file (once)."""

    def __init__(self, located: Mapping[str, Path], files: OpenedFiles, section: Section, description: str) -> None:
        self.located = dict(located)
        self.files = files
        self.section = section
        self.description = description

    def __getitem__(self, name: str) -> Any:
        return self.section(self.files.get(self.located[name]))[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.located)

    def __len__(self) -> int:
        return len(self.located)

    # What a WeightSource asks of the tensors behind it (the stage's placement reads through it).

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.located)

    def where(self, name: str) -> str:
        return str(self.located[name])

    def read(self, names: Iterable[str]) -> Iterator[tuple[str, Any]]:
        for name in names:
            yield name, self[name]

    def weight_source(self) -> WeightSource:
        """These tensors as pretrained weights are given to a stage: read one at a time, only those placed."""
        return _CheckpointWeights(self)


class _CheckpointWeights(WeightSource):
    """A :class:`WeightSource` over a :class:`ByName` (a plain mapping would be checked value by value on first
    use, which opens every file)."""

    def __init__(self, tensors: ByName) -> None:
        self._by_name = tensors
        self.description = tensors.description

    @cached_property
    def _tensors(self) -> ByName:
        return self._by_name


def state_dict_section(file: Any) -> Mapping[str, Any]:
    return file["state_dict"]


def optimizer_section(index: int) -> Section:
    return lambda file: file["optimizers"][index]


__all__ = ["ByName", "OpenedFiles", "optimizer_section", "state_dict_section"]
