"""Pretrained weights read per stage: every source kind, only the asked tensors, prefixes, and the errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from zorse_lightning.errors import ZorseUserError
from zorse_lightning.module import stage_weights
from zorse_lightning.module.stage_weights import WeightSource, WeightsError, detect_prefix, read_into


class Tiny(nn.Module):
    """A miniature language model: embedding, two layers, a norm with a buffer, a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.norm = nn.LayerNorm(4)
        self.register_buffer("scale", torch.ones(4))
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight


class Holder(nn.Module):
    """A LightningModule-like wrapper: the pretrained model lives under ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Tiny()


def pretrained() -> dict[str, torch.Tensor]:
    """Tiny's state as a file holds it: no ``model.`` prefix, the tied head not stored."""
    generator = torch.Generator().manual_seed(0)
    state = {name: torch.randn(t.shape, generator=generator) for name, t in Tiny().state_dict().items()}
    del state["head.weight"]
    return state


def assert_holds(module: nn.Module, state: dict[str, torch.Tensor], prefix: str = "model.") -> None:
    actual = module.state_dict()
    for name, tensor in state.items():
        assert torch.equal(actual[prefix + name], tensor.to(actual[prefix + name].dtype)), name


def write_shards(directory: Path, state: dict[str, torch.Tensor]) -> Path:
    """A two-shard checkpoint as Hugging Face writes it: embedding and layer 0 in one shard, the rest in the other."""
    first = {name: t for name, t in state.items() if name.startswith(("embed.", "layers.0."))}
    second = {name: t for name, t in state.items() if name not in first}
    save_file(first, directory / "model-00001-of-00002.safetensors")
    save_file(second, directory / "model-00002-of-00002.safetensors")
    weight_map = {name: "model-00001-of-00002.safetensors" for name in first}
    weight_map |= {name: "model-00002-of-00002.safetensors" for name in second}
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


@pytest.fixture
def opened(monkeypatch) -> list[tuple[str, list[str]]]:
    """Spy on the module's safetensors opener: (file name, tensors read from it) per opening."""
    record: list[tuple[str, list[str]]] = []
    real_open = stage_weights.safe_open

    class Spy:
        def __init__(self, path, **options) -> None:
            self.handle = real_open(path, **options)
            self.reads: list[str] = []
            record.append((Path(path).name, self.reads))

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.handle.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, name):
            self.reads.append(name)
            return self.handle.get_tensor(name)

    monkeypatch.setattr(stage_weights, "safe_open", Spy)
    return record


def test_every_source_kind_fills_the_module(tmp_path: Path) -> None:
    state = pretrained()
    save_file(state, tmp_path / "single.safetensors")
    torch.save(state, tmp_path / "plain.pt")
    torch.save({"state_dict": state, "epoch": 3, "global_step": 7}, tmp_path / "lightning.ckpt")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    index = write_shards(sharded, state)
    files = ["single.safetensors", "plain.pt", "lightning.ckpt"]
    for source in [state, *(tmp_path / name for name in files), index, sharded]:
        module = Holder()
        assert read_into(module, source) == "model.", source
        assert_holds(module, state)
        assert torch.equal(module.model.head.weight, state["embed.weight"])


def test_names_are_listed_without_reading_tensors(tmp_path: Path, opened) -> None:
    state = pretrained()
    index = write_shards(tmp_path, state)
    assert WeightSource(index).names == frozenset(state)
    assert opened == []
    save_file(state, tmp_path / "single.safetensors")
    assert WeightSource(tmp_path / "single.safetensors").names == frozenset(state)
    assert opened == [("single.safetensors", [])]


def test_a_shard_without_wanted_tensors_is_never_opened(tmp_path: Path, opened) -> None:
    state = pretrained()
    index = write_shards(tmp_path, state)
    module = Holder()
    read_into(module, index, ["model.layers.1.weight", "model.norm.weight"], prefix="model.")
    assert opened == [("model-00002-of-00002.safetensors", ["layers.1.weight", "norm.weight"])]
    assert torch.equal(module.model.layers[1].weight, state["layers.1.weight"])
    assert torch.equal(module.model.norm.weight, state["norm.weight"])


def test_a_single_safetensors_file_reads_only_the_asked_tensors(tmp_path: Path, opened) -> None:
    state = pretrained()
    save_file(state, tmp_path / "model.safetensors")
    read_into(Holder(), tmp_path / "model.safetensors", ["model.layers.0.bias"], prefix="model.")
    reads = [name for _, names in opened for name in names]
    assert reads == ["layers.0.bias"]


def test_a_torch_file_is_memory_mapped_with_weights_only(tmp_path: Path, monkeypatch) -> None:
    state = pretrained()
    torch.save(state, tmp_path / "model.bin")
    calls: list[dict] = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    module = Holder()
    read_into(module, tmp_path / "model.bin", ["model.norm.bias"])
    assert calls == [{"map_location": "cpu", "mmap": True, "weights_only": True}]
    assert torch.equal(module.model.norm.bias, state["norm.bias"])


def test_prefix_detection_both_ways() -> None:
    state = pretrained()
    module_names = list(Holder().state_dict())
    assert detect_prefix(module_names, state) == "model."
    assert detect_prefix(module_names, {"model." + name: t for name, t in state.items()}) == ""
    bare = Tiny()
    assert read_into(bare, state) == ""
    assert_holds(bare, state, prefix="")


def test_the_largest_share_of_matching_names_decides_the_prefix() -> None:
    module_names = ["model.a.weight", "model.b.weight", "model.c.weight", "extra.a.weight"]
    assert detect_prefix(module_names, ["a.weight", "b.weight", "c.weight"]) == "model."


def test_an_ambiguous_prefix_is_refused() -> None:
    class EncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Tiny()
            self.decoder = Tiny()

    with pytest.raises(WeightsError, match="ambiguous") as caught:
        read_into(EncoderDecoder(), pretrained())
    assert "'decoder.'" in str(caught.value) and "'encoder.'" in str(caught.value)
    assert "prefix=" in str(caught.value)
    module = EncoderDecoder()
    decoder = [name for name in module.state_dict() if name.startswith("decoder.")]
    read_into(module, pretrained(), decoder, prefix="decoder.")
    assert_holds(module, pretrained(), prefix="decoder.")


def test_no_matching_name_at_all_is_refused() -> None:
    with pytest.raises(WeightsError, match="no pretrained tensor name is a module name"):
        read_into(Holder(), {"unrelated.weight": torch.zeros(2)})


def test_a_shape_mismatch_names_the_tensor_both_shapes_and_the_file(tmp_path: Path) -> None:
    state = pretrained()
    state["layers.1.weight"] = torch.zeros(4, 3)
    path = tmp_path / "model.safetensors"
    save_file(state, path)
    with pytest.raises(WeightsError) as caught:
        read_into(Holder(), path)
    message = str(caught.value)
    assert "'layers.1.weight'" in message and "'model.layers.1.weight'" in message
    assert "(4, 3)" in message and "(4, 4)" in message and str(path) in message
    assert isinstance(caught.value, ZorseUserError)


def test_missing_names_are_listed_up_to_ten_with_the_count() -> None:
    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.ModuleList(nn.Linear(2, 2) for _ in range(8))

    state = {"0.weight": torch.zeros(2, 2), "0.bias": torch.zeros(2)}
    module = Wide()
    with pytest.raises(WeightsError) as caught:
        read_into(module, state)
    message = str(caught.value)
    assert "14 of the 16 module tensors" in message
    assert "'model.1.weight'" in message and "(and 4 more)" in message
    assert "prefix 'model.'" in message and "pass prefix=" in message
    assert torch.count_nonzero(module.model[0].weight) > 0, "nothing is read when names are missing"


def test_names_not_in_the_module_are_refused() -> None:
    with pytest.raises(WeightsError, match="'model.nothing.weight' are not parameters"):
        read_into(Holder(), pretrained(), ["model.nothing.weight"])


def test_a_tied_weight_is_read_once_under_either_name(tmp_path: Path, opened) -> None:
    state = pretrained()
    save_file(state, tmp_path / "model.safetensors")
    module = Holder()
    read_into(module, tmp_path / "model.safetensors", ["model.head.weight", "model.embed.weight"])
    reads = [name for _, names in opened for name in names]
    assert reads == ["embed.weight"]
    assert torch.equal(module.model.head.weight, state["embed.weight"])


def test_dtype_is_cast_to_the_target(tmp_path: Path) -> None:
    state = {name: t.to(torch.bfloat16) for name, t in pretrained().items()}
    save_file(state, tmp_path / "model.safetensors")
    module = Holder()
    read_into(module, tmp_path / "model.safetensors")
    assert module.model.layers[0].weight.dtype == torch.float32
    assert torch.equal(module.model.layers[0].weight, state["layers.0.weight"].float())


def test_a_stage_materialized_from_meta_holds_exactly_the_saved_values(tmp_path: Path) -> None:
    state = pretrained()
    index = write_shards(tmp_path, state)
    with torch.device("meta"):
        module = Holder()
    with pytest.raises(WeightsError, match="meta device"):
        read_into(module, index)
    module.to_empty(device="cpu")
    with pytest.raises(WeightsError, match="'model.head.weight'.*tied again after module.to_empty"):
        read_into(module, index)
    module.model.head.weight = module.model.embed.weight  # to_empty untied them; tie again as the model does
    read_into(module, index)
    assert_holds(module, state)
    assert torch.equal(module.model.head.weight, state["embed.weight"])


def test_bad_sources_are_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="do not exist"):
        WeightSource(tmp_path / "absent.safetensors")
    (tmp_path / "weights.txt").write_text("")
    with pytest.raises(WeightsError, match="no known kind"):
        WeightSource(tmp_path / "weights.txt")
    with pytest.raises(WeightsError, match="one \\*.safetensors.index.json or one \\*.safetensors file"):
        WeightSource(tmp_path)
    torch.save({"model": pretrained(), "optimizer": {"lr": 0.1}}, tmp_path / "bundle.pt")
    with pytest.raises(WeightsError, match="pass the dict of model tensors"):
        _ = WeightSource(tmp_path / "bundle.pt").names
    torch.save({"args": argparse.Namespace(lr=0.1)}, tmp_path / "pickled.ckpt")
    with pytest.raises(WeightsError, match="weights_only=False"):
        _ = WeightSource(tmp_path / "pickled.ckpt").names
    index = write_shards(tmp_path, pretrained())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors"):
        _ = WeightSource(index).names
