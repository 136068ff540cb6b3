"""Compute time of a stage on one GPU type, and the iteration time of the pipeline.

The pipeline formula (used by the search, checked against hand calculations and
against the event simulation in :mod:`.simulate`):

A plan is a chain of *elements*: stage 0, boundary 0-1, stage 1, ..., stage S-1.
Each element ``e`` has

* a latency ``l_e``: the time one microbatch spends in it, forward plus backward
  (stage: the slowest rank that processes microbatches, ``max_r f_r + b_r``;
  boundary: one activation transfer forward plus one gradient transfer back);
* a busy time ``T_e`` per iteration (stage: ``max_r n_r (f_r + b_r)`` over its ranks
  with ``n_r`` microbatches each, or more when its in-flight limit makes it wait for
  gradients, see :func:`round_trip_busy_ms`, or when it waits for its transfers
  between microbatches, see :func:`receiving_busy_ms`; boundary: its busiest
  link's total transfer time).

Then::

    iteration_ms = sum_e l_e + max_e (T_e - l_e) + max_s (sync_s + update_s - d_s)

The bottleneck element is busy ``T_e`` back to back; before its first microbatch
and after its last, one microbatch must pass every other element (fill and drain).
Each stage synchronises and steps from its own last backward, ``d_s`` before the
pipeline's end (the last microbatch's backward through the stages before it:
:attr:`.evaluate.PlanCost.drain_ms`), so a later stage's step overlaps that drain.
For ``S`` equal single-GPU stages with per-microbatch time ``t = f + b`` and ``M``
microbatches this is the familiar ``(M + S - 1) t``; for one stage (data
parallel) it is ``max_r n_r t_r`` plus the all-reduce and the optimizer step
(:mod:`.update`; a stage's next forward waits for both). 1F1B and GPipe have the
same fill and drain here (both run every forward of a microbatch before its
backward through the whole pipe); they differ in memory (see :mod:`.memory`), so
GPipe never beats 1F1B in this model and the search tries it only when pinned.

Interleaved plans (V chunks per group of ranks, :mod:`.chain`) keep the chain of groups
but count each group's latency once per chunk: ``l_e / V``, the textbook ``(M + (S -
1) / V) t`` of Megatron's interleaved schedule, while each boundary's busy time and
each rank's waits for its transfers grow V-fold (every microbatch crosses every chunk
boundary), which is what makes interleaving lose across slow links.
"""

from __future__ import annotations

from dataclasses import dataclass

from zorse_lightning.profiling.profile import BlockTimes, DeviceTimes


@dataclass(frozen=True)
class MicrobatchTimes:
    """Forward and backward time of one microbatch through a stage's blocks on one GPU."""

    forward_ms: float
    backward_ms: float
    """Includes the recomputed forward when recomputation is on."""

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_ms


def _blocks(device: DeviceTimes, layers: tuple[int, int], first: bool, last: bool) -> list[BlockTimes]:
    blocks = list(device.layers[layers[0] : layers[1]])
    if first:
        blocks.insert(0, device.embedding)
    if last:
        blocks.append(device.head)
    return blocks


def stage_microbatch_times(
    device: DeviceTimes, layers: tuple[int, int], microbatch_size: int, *, first: bool, last: bool, recompute: bool,
    action_ms: float = 0.0, overlaps: bool = False,
) -> MicrobatchTimes:
    """Time of one microbatch of ``microbatch_size`` samples through the stage's blocks, and
    ``action_ms`` for the engine's own work around its forward and around its backward (measured at
    start-up on every rank: the user's step called with every block passing its input on; on
    emulated CPU ranks 3.2 to 4.7 ms an action were seen with 4 gloo ranks on 2 cores, and
    unpriced, an interleaved x4 plan was predicted 6 % faster than plain and measured 19 % slower).

    Recomputation reruns the forward of the layers (not embedding or head) during
    the backward. ``overlaps`` (a device that computes asynchronously from the host):
    the engine's host time hides under the compute, each action takes the longer of the two.
    """
    forward = backward = 0.0
    for block in _blocks(device, layers, first, last):
        forward += block.forward.at(microbatch_size)
        backward += block.backward.at(microbatch_size)
    if recompute:
        backward += sum(b.forward.at(microbatch_size) for b in device.layers[layers[0] : layers[1]])
    if overlaps:
        return MicrobatchTimes(max(forward, action_ms), max(backward, action_ms))
    return MicrobatchTimes(forward + action_ms, backward + action_ms)


def with_offload_copies(times: MicrobatchTimes, copy_ms: float) -> MicrobatchTimes:
    """``times`` of a stage that offloads activations, whose copies take ``copy_ms`` each way per microbatch
    (out during the forward, back during the backward, on a side stream): a copy hides under the compute
    it runs beside and adds only what it lasts longer (torchtune keeps the last projection on the GPU for
    that reason; a pipeline draft that did not hide its copies lost 34 % of its throughput)."""
    return MicrobatchTimes(max(times.forward_ms, copy_ms), max(times.backward_ms, copy_ms))


def stage_busy_ms(microbatch_ms: list[float], microbatches: list[int]) -> float:
    """Busy time of a stage per iteration: its slowest rank's total work."""
    return max((n * t for n, t in zip(microbatches, microbatch_ms)), default=0.0)


def lockstep_busy_ms(microbatch_ms: list[float], microbatches: list[int]) -> float:
    """Busy time of a stage whose ranks meet in collectives inside every microbatch (full sharding
    gathered per microbatch: each block's gathers): the ``i``-th round lasts as long as the
    slowest rank that has an ``i``-th microbatch, and the others wait for it in the gathers."""
    total, previous = 0.0, 0
    for level in sorted({n for n in microbatches if n > 0}):
        slowest = max(t for t, n in zip(microbatch_ms, microbatches) if n >= level)
        total += (level - previous) * slowest
        previous = level
    return total


def stage_latency_ms(microbatch_ms: list[float], microbatches: list[int]) -> float:
    """One microbatch through the stage on the slowest rank that processes any."""
    return max((t for n, t in zip(microbatches, microbatch_ms) if n > 0), default=0.0)


def round_trip_busy_ms(
    microbatch_ms: list[float], microbatches: list[int], in_flight: list[int], downstream_ms: float, counted_ms: float | None = None
) -> float:
    """Busy time a stage needs because of its in-flight limit (1F1B).

    A rank that may hold ``w`` microbatches starts a forward only once the backward
    of the microbatch ``w`` earlier is back, a round trip ``t + d`` through itself and
    the later elements (latency ``d``). Its span is then at least ``n (t + d) / w``,
    of which the pipeline formula already counts ``counted_ms`` (default ``d``) as
    latency of those elements. Without transfers this never exceeds ``n t`` for the
    ``w = S - i`` of 1F1B; with transfers it adds the stalls of a gradient's round trip.

    Interleaved, ``w`` counts chunk-forwards and ``d`` sums, over the rank's chunks,
    the latency from each chunk to the end of the virtual pipeline and back: each of
    the ``n V`` chunk-forwards waits ``t / V`` plus its own chunk's round trip.
    """
    counted_ms = downstream_ms if counted_ms is None else counted_ms
    spans = [n * (t + downstream_ms) / w for t, n, w in zip(microbatch_ms, microbatches, in_flight) if n > 0]
    return max(spans, default=0.0) - counted_ms


def receiving_busy_ms(microbatch_ms: list[float], microbatches: list[int], receive_ms: list[float], chunks: int = 1) -> float:
    """Busy time of a stage whose ranks wait for their transfers between microbatches.

    The engine's receives block, and its transport (gloo) moves a message only once
    its receiver has posted the receive, which the receiver does when it reaches the
    action that needs it: a message sent early waits at the sender. So a rank that
    waits ``x`` ms for its messages per microbatch (the activation from the previous
    stage, the gradient from the next: see :func:`.boundaries.receive_ms_per_microbatch`)
    is busy ``t + x`` per microbatch, not ``t`` with the transfers hidden under compute (under NCCL's
    rules, whose receives are posted ahead, ``x`` is the messages alone). Its first receive lies in the fill the
    boundaries' latencies already count, hence ``n t + (n - 1) x``. A rank holding
    ``chunks`` chunks (interleaved) receives per chunk: ``x`` sums its chunks' waits, and
    only the first of its ``n chunks`` receives is in the fill: ``n t + (n chunks - 1) x / chunks``.
    """
    spans = [n * t + (n * chunks - 1) * x / chunks for t, n, x in zip(microbatch_ms, microbatches, receive_ms) if n > 0]
    return max(spans, default=0.0)


def pipeline_ms(latencies_ms: list[float], busy_ms: list[float]) -> float:
    """``sum_e l_e + max_e (T_e - l_e)`` over the chain of stages and boundaries."""
    return sum(latencies_ms) + max(t - l for t, l in zip(busy_ms, latencies_ms))


def per_sample_layer_ms(device: DeviceTimes) -> float:
    """Forward plus backward cost of one sample through an average layer: the type's speed, inverted.

    The slope of the fitted line where it is positive; where it is not (tiny
    blocks whose per-call overhead dominates can time faster at two samples
    than at one), the time of a one-sample microbatch, which is positive by
    construction (``TimeCurve.at`` floors it). Speeds are ratios of these, and
    the grouping takes their logarithm: a zero or negative cost has no speed.
    """
    layers = device.layers
    slope = sum(b.forward.slope_ms + b.backward.slope_ms for b in layers) / len(layers)
    if slope > 0:
        return slope
    return sum(b.forward.at(1) + b.backward.at(1) for b in layers) / len(layers)
