"""Reading pretrained weights into one pipeline stage, tensor by tensor.

A rank holds only its stage's weights, so it must not load a whole pretrained
model to fill them: a 70B checkpoint does not fit one rank's host memory, and
reading all of it on every rank multiplies the disk traffic by the world size.
A :class:`WeightSource` therefore lists the names a source holds without
reading any tensor (a safetensors header, a sharded index's ``weight_map``, a
torch file opened with ``mmap=True``) and reads only the tensors asked for,
one at a time; :func:`read_into` copies each straight into the stage's
materialized parameter or buffer, on whatever device it lives, and drops it.

Sources:

- a mapping name -> tensor (a state dict already in memory);
- a ``.safetensors`` file;
- a Hugging Face sharded checkpoint: its ``*.index.json`` (a ``weight_map`` from
  tensor name to shard file) or the directory holding it; only the shards
  that hold a wanted tensor are opened;
- a torch file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``), memory-mapped so that
  untouched tensors are never read from disk; a Lightning checkpoint's
  ``state_dict`` is used.

The module's names may carry a prefix the source lacks (a LightningModule
holding a Hugging Face model as ``self.model`` has ``model.layers.3.mlp.weight``
where the file has ``layers.3.mlp.weight``): module name = prefix + source
name; :func:`detect_prefix` finds it when it is not given.
"""

from __future__ import annotations

import json
import os
import pickle
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from zorse_lightning.errors import ZorseUserError

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
INDEX_SUFFIX = ".index.json"
_SHOWN = 10
"""How many names an error lists before saying how many more there are."""


class WeightsError(ZorseUserError):
    """Pretrained weights that cannot be read into the module (unreadable, missing or misshapen tensors)."""


def _shown(names: list[str]) -> str:
    """Up to ``_SHOWN`` names, then how many were left out."""
    text = ", ".join(repr(name) for name in names[:_SHOWN])
    if len(names) > _SHOWN:
        text += f" (and {len(names) - _SHOWN} more)"
    return text


def _checked_state_dict(value: object, where: str) -> dict[str, torch.Tensor]:
    """``value`` as a state dict (str -> tensor), or an error saying what it holds instead."""
    if not isinstance(value, Mapping):
        raise WeightsError(
            f"{where} holds a {type(value).__name__}, not a state dict (a mapping from tensor name to tensor); "
            f"give a file or mapping that holds the model's tensors by name"
        )
    odd = [str(key) for key, tensor in value.items() if not (isinstance(key, str) and isinstance(tensor, torch.Tensor))]
    if odd:
        raise WeightsError(
            f"{where} is not a state dict: the entries {_shown(odd)} are not a tensor under a string name; "
            f"if it bundles the weights with other things (optimizer state, configuration), load it yourself "
            f"and pass the dict of model tensors (for example torch.load(path, mmap=True)['model'])"
        )
    return dict(value)


def _load_torch_file(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of a torch file, memory-mapped: its tensors are read from disk only when touched."""
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as error:
        raise WeightsError(
            f"{path} holds objects other than tensors and plain containers, which torch.load(weights_only=True) "
            f"refuses to unpickle ({error}); if you trust the file, load it yourself with "
            f"torch.load(path, map_location='cpu', mmap=True, weights_only=False) and pass its state dict"
        ) from error
    except RuntimeError as error:
        raise WeightsError(
            f"{path} cannot be memory-mapped as a torch file ({error}); it must be written by torch.save "
            f"in its zip format (the default since torch 1.6): load and save it again, or convert it to safetensors"
        ) from error
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        return _checked_state_dict(loaded["state_dict"], f"the 'state_dict' of {path}")
    return _checked_state_dict(loaded, str(path))


def _unreadable(path: Path, error: Exception) -> WeightsError:
    return WeightsError(f"{path} is not a readable safetensors file ({error}); check that it was fully written")


def _safetensors_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file's header (no tensor is read)."""
    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            return list(handle.keys())
    except SafetensorError as error:
        raise _unreadable(path, error) from error


class _InMemory:
    """Tensors already in (host or mapped) memory: a state dict, or a torch file's."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        self.tensors = tensors
        self.names = frozenset(tensors)
        self.description = where

    def where(self, name: str) -> str:
        return self.description

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            yield name, self.tensors[name]


class _Files:
    """Tensors in files, found through a name -> file map; each file opened only when a wanted tensor is in it."""

    def __init__(self, weight_map: dict[str, Path]) -> None:
        self.weight_map = weight_map
        self.names = frozenset(weight_map)

    def where(self, name: str) -> str:
        return str(self.weight_map[name])

    def read(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.weight_map[name], []).append(name)
        for path, in_file in by_file.items():
            yield from _read_file(path, in_file)


def _check_shard(path: Path, names: list[str], held: Iterable[str]) -> None:
    """Refuse a shard that lacks tensors its index places in it (an index from another download)."""
    lacking = sorted(set(names) - set(held))
    if lacking:
        raise WeightsError(
            f"{path} lacks {_shown(lacking)}, which its index's weight_map places there; "
            f"the index and its shards do not belong together: download the checkpoint again"
        )


def _read_file(path: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors of one file, one at a time (a sharded index may point at torch files too)."""
    if path.name.endswith(".safetensors"):
        try:
            with safe_open(path, framework="pt", device="cpu") as handle:
                _check_shard(path, names, handle.keys())
                for name in names:
                    yield name, handle.get_tensor(name)
        except SafetensorError as error:
            raise _unreadable(path, error) from error
        return
    tensors = _load_torch_file(path)
    _check_shard(path, names, tensors)
    for name in names:
        yield name, tensors[name]


def _index_map(index: Path) -> dict[str, Path]:
    """A sharded checkpoint's ``weight_map`` with shard paths made absolute; every shard must exist."""
    try:
        content = json.loads(index.read_text())
    except (OSError, json.JSONDecodeError) as error:
        message = f"{index} is not a readable JSON index ({error}); check that it was fully written"
        raise WeightsError(message) from error
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and isinstance(file, str) for name, file in weight_map.items()
    ):
        raise WeightsError(
            f"{index} has no 'weight_map' from tensor name to shard file name, as Hugging Face writes "
            f"(model.safetensors.index.json); give the index of a sharded checkpoint, or a single weights file"
        )
    shards = {file: index.parent / file for file in weight_map.values()}
    absent = sorted(file for file, path in shards.items() if not path.is_file())
    if absent:
        raise WeightsError(
            f"{index} names shards that are not beside it: {_shown(absent)}; download every shard into {index.parent}"
        )
    return {name: shards[file] for name, file in weight_map.items()}


def _in_directory(directory: Path) -> Path:
    """The one safetensors index, or else the one safetensors file, in ``directory``."""
    indexes = sorted(directory.glob(f"*.safetensors{INDEX_SUFFIX}"))
    if len(indexes) == 1:
        return indexes[0]
    files = sorted(directory.glob("*.safetensors"))
    if not indexes and len(files) == 1:
        return files[0]
    found = [path.name for path in indexes or files]
    raise WeightsError(
        f"{directory} holds {len(indexes)} safetensors indexes and {len(files)} safetensors files "
        f"({_shown(found)}); a directory must hold one *.safetensors.index.json or one *.safetensors file: "
        f"give the path of the index or file to read instead"
    )


class WeightSource:
    """Pretrained weights that list their names without reading tensors, and read only the tensors asked for.

    ``source`` is a mapping name -> tensor, or the path of a ``.safetensors``
    file, a sharded checkpoint's ``*.index.json`` or its directory, or a torch
    file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``). Nothing is opened until
    :attr:`names` or :meth:`read` needs it.
    """

    def __init__(self, source: Mapping[str, torch.Tensor] | str | os.PathLike[str]) -> None:
        self._source: Mapping[str, torch.Tensor] | Path
        if isinstance(source, Mapping):
            self._source = source
            self.description = "the given state dict"
            return
        path = Path(source)
        if not path.exists():
            raise WeightsError(f"pretrained weights {path} do not exist; give the path of a weights file or directory")
        if path.is_dir():
            path = _in_directory(path)
        elif not (path.name.endswith((".safetensors", INDEX_SUFFIX)) or path.suffix in TORCH_SUFFIXES):
            raise WeightsError(
                f"pretrained weights {path} are of no known kind (by their name); give a .safetensors file, a "
                f"sharded checkpoint's *{INDEX_SUFFIX} or its directory, or a torch file ({', '.join(TORCH_SUFFIXES)})"
            )
        self._source = path
        self.description = str(path)

    @cached_property
    def _tensors(self) -> _InMemory | _Files:
        source = self._source
        if isinstance(source, Mapping):
            return _InMemory(_checked_state_dict(source, self.description), self.description)
        if source.name.endswith(INDEX_SUFFIX):
            return _Files(_index_map(source))
        if source.name.endswith(".safetensors"):
            return _Files(dict.fromkeys(_safetensors_names(source), source))
        return _InMemory(_load_torch_file(source), self.description)

    @property
    def names(self) -> frozenset[str]:
        """The names of the tensors the source holds (no tensor is read to list them)."""
        return self._tensors.names

    def where(self, name: str) -> str:
        """The file (or in-memory state dict) holding tensor ``name``, for messages."""
        return self._tensors.where(name)

    def read(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, CPU tensor) for each of ``names``, one at a time, opening each file once and only if needed."""
        wanted = list(dict.fromkeys(names))
        absent = sorted(set(wanted) - self.names)
        if absent:
            raise WeightsError(f"{self.description} has no tensors {_shown(absent)}; read only names in its .names")
        return self._tensors.read(wanted)


def detect_prefix(module_names: Iterable[str], source_names: Iterable[str]) -> str:
    """The prefix ``p`` (``""`` or ``"<attribute path>."``) under which most source names ``n`` are module names ``p + n``.

    Why: a LightningModule usually holds the pretrained model as an attribute
    (``self.model``), so its names carry that attribute path while the file's
    do not. A tie between two prefixes is refused: guessing would read
    weights into the wrong submodule.
    """
    sources = set(source_names)
    matches: Counter[str] = Counter()
    for name in set(module_names):
        cuts = [0] + [at + 1 for at, char in enumerate(name) if char == "."]
        for cut in cuts:
            if name[cut:] in sources:
                matches[name[:cut]] += 1
    ranked = matches.most_common()
    if not ranked:
        raise WeightsError(
            f"no pretrained tensor name is a module name, with or without a prefix (source names such as "
            f"{_shown(sorted(sources)[:3])}); the weights were saved from a different model, or its names were "
            f"renamed: rename the state dict's keys to the module's before reading"
        )
    best, count = ranked[0]
    tied = [prefix for prefix, other in ranked if other == count]
    if len(tied) > 1:
        raise WeightsError(
            f"the module prefixes {_shown(sorted(tied))} each make {count} pretrained tensor names module names; "
            f"which submodule the weights belong to is ambiguous: pass prefix= explicitly "
            f"(module name = prefix + source name)"
        )
    return best


def read_into(
    module: nn.Module,
    source: WeightSource | Mapping[str, torch.Tensor] | str | os.PathLike[str],
    names: Iterable[str] | None = None,
    *,
    prefix: str | None = None,
) -> str:
    """Copy the pretrained tensors for the module's ``names`` (default: all its state) into it; returns the prefix used.

    ``names`` are the module's ``state_dict()`` names (a stage's own); each is
    read from the source under ``name`` without ``prefix`` (detected when
    None), cast to the target's dtype and copied onto the target's device in
    place, one tensor at a time, so no copy of the whole model is ever made.
    Tied weights (two names, one tensor object) are read once, from whichever
    of the names the source holds; ``to_empty`` from the meta device unties
    them, so tie them again before reading. Everything but shapes is checked
    before any tensor is read; shapes are checked tensor by tensor.
    """
    weights = source if isinstance(source, WeightSource) else WeightSource(source)
    targets = module.state_dict(keep_vars=True)
    wanted = list(targets) if names is None else list(dict.fromkeys(names))
    unknown = [name for name in wanted if name not in targets]
    if unknown:
        raise WeightsError(
            f"{_shown(unknown)} are not parameters or persistent buffers of the module; "
            f"ask only for names of its state_dict() (such as {_shown(list(targets)[:3])})"
        )
    source_names = weights.names
    if prefix is None:
        prefix = detect_prefix(targets, source_names)
    aliases: dict[int, list[str]] = {}
    for name, tensor in targets.items():
        aliases.setdefault(id(tensor), []).append(name)

    plan: dict[str, str] = {}
    """Source name -> the module name it fills (one per distinct target tensor)."""
    filled: set[int] = set()
    missing: list[str] = []
    for name in wanted:
        target = targets[name]
        if id(target) in filled:
            continue
        filled.add(id(target))
        if target.is_meta:
            raise WeightsError(
                f"the module's {name!r} is on the meta device, which holds no data to copy into; "
                f"materialize the stage first (module.to_empty(device=...)) and then read its weights"
            )
        candidates = [name] + [alias for alias in aliases[id(target)] if alias != name]
        held = [
            alias[len(prefix) :]
            for alias in candidates
            if alias.startswith(prefix) and alias[len(prefix) :] in source_names
        ]
        if held:
            plan[held[0]] = name
        else:
            missing.append(name)
    if missing:
        raise WeightsError(
            f"{len(missing)} of the {len(wanted)} module tensors asked for are not in {weights.description} "
            f"under the prefix {prefix!r} (module name = prefix + source name): {_shown(missing)}; "
            f"the source holds names such as {_shown(sorted(source_names)[:3])}: check the prefix (pass prefix=), "
            f"that the weights were saved from this model's architecture, and that weights tied in the model "
            f"(an output head sharing the embedding's) are tied again after module.to_empty(), which unties them"
        )

    with torch.no_grad():
        for source_name, tensor in weights.read(plan):
            name = plan[source_name]
            target = targets[name]
            if tensor.shape != target.shape:
                raise WeightsError(
                    f"pretrained tensor {source_name!r} in {weights.where(source_name)} has shape "
                    f"{tuple(tensor.shape)} but the module's {name!r} has shape {tuple(target.shape)}; "
                    f"build the model with the configuration the weights were saved with"
                )
            target.copy_(tensor)
    return prefix
