"""The activation offload's hooks in one process: what they copy, what they leave, and the order they
bring block calls back (multi-process exactness is in test_engine_exactness.py)."""

from __future__ import annotations

import torch
from torch import nn

from zorse_lightning.engine.activation_offload import ActivationOffload
from zorse_lightning.engine.cutting import kept_activations_forward
from zorse_lightning.planner.cost.memory import offload_working_bytes
from zorse_lightning.profiling.profile import BlockShape, ModelProfile


def _blocks() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))


def _gradients(blocks: nn.ModuleList, x: torch.Tensor) -> list[torch.Tensor]:
    for block in blocks:
        x = block(x)
    x.square().sum().backward()
    return [p.grad.clone() for p in blocks.parameters()]


def test_offloaded_blocks_give_the_same_gradients_and_copy_no_weight():
    x = torch.randn(4, 8, requires_grad=True)
    plain = _gradients(_blocks(), x)
    blocks, offload = _blocks(), ActivationOffload(torch.device("cpu"))
    for index, block in enumerate(blocks):
        block.forward = offload.wrap(index, block, block.forward)
    offloaded = _gradients(blocks, x)
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
    # Per block: the linear's input and the tanh's output (4 x 8 float32 each); its weight stays put.
    assert offload.offloaded_bytes == 3 * 2 * 4 * 8 * 4


def test_with_recompute_only_each_block_input_goes_to_host_memory():
    """Recomputed and offloaded: the checkpoint keeps each block's input, and that is all the offload copies
    (the tensors the rerun saves stay inside the checkpoint's own hooks); gradients as without either."""
    x = torch.randn(4, 8, requires_grad=True)
    plain = _gradients(_blocks(), x)
    blocks, offload = _blocks(), ActivationOffload(torch.device("cpu"))
    for index, block in enumerate(blocks):
        block.forward = kept_activations_forward(offload, index, block, block.forward, recompute=True)
    both = _gradients(blocks, x)
    assert all(torch.equal(a, b) for a, b in zip(plain, both))
    assert offload.offloaded_bytes == 3 * 4 * 8 * 4  # one 4 x 8 float32 input per block


def test_the_block_before_is_brought_back_before_the_backward_reaches_it():
    offload, blocks = ActivationOffload(torch.device("cpu")), _blocks()
    events: list[tuple[str, int]] = []
    block_of: dict[int, int] = {}
    load, unpack = offload._load, offload._unpack

    def recorded_load(call):
        if call.loaded is None:
            events.append(("load", block_of[id(call)]))
        load(call)

    def recorded_unpack(packed):
        if isinstance(packed, tuple):  # not a weight, which stays where it is
            events.append(("unpack", block_of[id(packed[0])]))
        return unpack(packed)

    offload._load, offload._unpack = recorded_load, recorded_unpack  # before the forward installs the hooks
    for index, block in enumerate(blocks):
        block.forward = offload.wrap(index, block, block.forward)
    x = torch.randn(2, 8)
    for index, block in enumerate(blocks):
        x = block(x)
        block_of[id(offload._last[1]())] = index
    x.sum().backward()
    for index in (1, 0):
        assert events.index(("load", index)) < events.index(("unpack", index)), events
    assert events[:3] == [("unpack", 2), ("load", 2), ("load", 1)], events


def test_the_device_holds_two_layers_during_a_backward_and_nothing_after_it():
    """1F1B's last stage: each microbatch's backward follows its forward, then the optimizer step. Counted: the
    device copies the hooks hold after each unpack (at most the block whose backward runs and the one
    prefetched: the memory model's two layers), after each backward and after the step (none). Would catch the
    last forward's chain held from the offload object (the whole microbatch, 4 layers, held after its backward)."""
    blocks, offload = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)), None
    offload = ActivationOffload(torch.device("cpu"))
    for index, block in enumerate(blocks):
        block.forward = offload.wrap(index, block, block.forward)
    during: list[int] = []
    unpack = offload._unpack

    def counted_unpack(packed):
        tensor = unpack(packed)
        if isinstance(packed, tuple):  # not a weight, which stays where it is
            during.append(offload.held_device_bytes())
        return tensor

    offload._unpack = counted_unpack  # before the forwards install the hooks
    optimizer = torch.optim.SGD(blocks.parameters(), lr=0.1)
    after_backward = []
    for _ in range(2):
        x = torch.randn(4, 8)
        for block in blocks:
            x = block(x)
        x.square().sum().backward()
        after_backward.append(offload.held_device_bytes())
    optimizer.step()
    # Each block saves the linear's input and the tanh's output: 2 x 4 samples x 8 float32 = 256 bytes.
    layer = BlockShape("layer", 72, activation_bytes_per_sample=2 * 8 * 4, output_bytes_per_sample=8 * 4,
                       forward_flops_per_sample=0.0)
    edge = BlockShape("edge", 0, 0, 8 * 4, 0.0)
    profile = ModelProfile("blocks", 1, "float32", edge, (layer,) * 4, edge, {})
    budget = offload_working_bytes(profile, (0, 4), microbatch_size=4)
    assert budget == 512
    assert max(during) == budget and len(during) == 2 * 2 * 4  # two unpacks per block, per microbatch
    assert after_backward == [0, 0]
    assert offload.held_device_bytes() == 0
