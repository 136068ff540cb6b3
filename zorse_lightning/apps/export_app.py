"""A plain state dict of the whole model from a zorse checkpoint: no zorse_lightning needed to use it.

The checkpoint's per-rank files are verified and merged (every stage's weights,
each written once); weights the model ties (an input embedding used as the
output head) stay one tensor under both names, so the file holds them once and
``load_state_dict`` ties them again. ``python -m zorse_lightning.apps.export_app
CHECKPOINT OUT.pt`` writes the file; ``torch.load(OUT.pt)`` reads it back.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from zorse_lightning.engine.checkpoint.files import CheckpointError
from zorse_lightning.engine.checkpoint.shards import merged_state_dict, read_shards


def export_state_dict(checkpoint: str | Path, module: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The whole model's state dict; checked against ``module``'s keys when given."""
    _, _, shards = read_shards(checkpoint)
    state_dict = merged_state_dict(shards)
    if module is not None:
        expected = set(module.state_dict())
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint {checkpoint} is not of {type(module).__name__}: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}; export it against the module it was trained with"
            )
        state_dict = {key: state_dict[key] for key in module.state_dict()}
    return state_dict


def export(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the whole model's state dict to ``out`` (``torch.save``; tied weights stored once)."""
    out = Path(out)
    torch.save(export_state_dict(checkpoint), out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    print(f"wrote {export(args.checkpoint, args.out)}")


if __name__ == "__main__":
    main()
