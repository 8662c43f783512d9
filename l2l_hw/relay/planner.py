"""The pipeline's planner: where to cut the model into stages, and how many micro-batches.

    profile   each layer's forward and backward time, its weights' bytes, what its forward
              saves for the backward and what it hands the next layer, measured on the device
              in a short run (the fastest of `repeats`) at two micro-batch sizes, so a layer's
              time is a line in the micro-batch size: fixed + per_sample * size
    cost      a stage [a, b) on stage s of S in 1F1B: time per micro-batch = sum of its layers'
              forward + backward; memory = weights and their gradients + the saved activations
              of the S - s micro-batches in flight + the receive buffers of the step
    plan      for each micro-batch count M: the boundaries minimising the slowest stage under
              the per-stage memory limit, by dynamic programming over contiguous splits
              (PipeDream-2BW's planner, Narayanan et al. arXiv 2006.09503, section 4), exact;
              then the M with the smallest predicted step, (M + S - 1) * slowest stage
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from l2l_hw.relay.interpreter import backprop
from l2l_hw.relay.stage import flatten, to_float, unflatten


@dataclass(frozen=True)
class LayerCost:
    """One layer, measured. Times in seconds per micro-batch of `size` samples: fixed + per_sample * size."""

    forward_fixed_s: float
    forward_per_sample_s: float
    backward_fixed_s: float
    backward_per_sample_s: float
    param_bytes: int
    saved_bytes_per_sample: float  # what the forward keeps for the backward
    output_bytes_per_sample: float  # what goes to the next layer (a stage boundary's transfer)

    def time_s(self, size: float) -> float:
        return (self.forward_fixed_s + self.backward_fixed_s
                + (self.forward_per_sample_s + self.backward_per_sample_s) * size)


@dataclass
class Plan:
    """Stage boundaries [0, b_1, ..., L], the micro-batch count, and what the cost model predicts."""

    bounds: list[int]
    micro_batches: int
    stage_s: list[float]  # predicted time per step of each stage's compute (all micro-batches)
    stage_bytes: list[float]  # predicted peak memory of each stage
    step_s: float  # predicted step time, (M + S - 1) * slowest stage per micro-batch
    measured_s: list[float] | None = field(default=None)  # per stage, from a run (fill in, then describe())

    @property
    def boundaries(self) -> str:
        """The explicit boundaries for PipelineConfig / --pipeline-boundaries."""
        return ",".join(str(b) for b in self.bounds[1:-1])

    def describe(self) -> str:
        lines = [f"pipeline plan: {len(self.bounds) - 1} stages, {self.micro_batches} micro-batches, "
                 f"boundaries {self.boundaries}, predicted step {self.step_s * 1e3:.1f} ms"]
        for s, (a, b) in enumerate(zip(self.bounds, self.bounds[1:])):
            measured = (f"   measured {self.measured_s[s] * 1e3:8.1f} ms ({self.measured_s[s] / self.stage_s[s] - 1:+.0%})"
                        if self.measured_s else "")
            lines.append(f"  stage {s}: layers {a}..{b - 1}  predicted {self.stage_s[s] * 1e3:8.1f} ms "
                         f" memory {self.stage_bytes[s] / 2**20:8.1f} MiB{measured}")
        return "\n".join(lines)


# -- profiling --------------------------------------------------------------------------------
def _saved_bytes(fn: Callable) -> tuple[object, int]:
    """Run fn(), counting the bytes autograd saves for the backward (each storage once)."""
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def _measure(layer: nn.Module, x, loss_fn, target, repeats: int):
    """Median forward and backward seconds of `layer` on x; saved and output bytes; its output."""
    fwd, bwd = [], []
    for _ in range(repeats + 1):  # the first run warms up
        leaf = unflatten(x, [t.detach().requires_grad_(t.is_floating_point()) for t in flatten(x)])
        t0 = time.perf_counter()
        out, saved = _saved_bytes(lambda: layer(leaf))
        out = out if isinstance(out, torch.Tensor) else tuple(out)
        t1 = time.perf_counter()
        if loss_fn is not None:
            loss = loss_fn(to_float(out), target)
            backprop([loss], [torch.ones_like(loss)])
        else:
            backprop(flatten(out), [torch.ones_like(o) for o in flatten(out)])
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    layer.zero_grad(set_to_none=True)
    detached = unflatten(out, [t.detach() for t in flatten(out)])
    out_bytes = sum(t.numel() * t.element_size() for t in flatten(detached))
    return min(fwd[1:]), min(bwd[1:]), saved, out_bytes, detached  # min: least disturbed by other work


def profile_layers(layers: Sequence[nn.Module], loss_fn: Callable, inputs, targets, sizes: tuple[int, int],
                   repeats: int = 3, threads: int | None = None) -> list[LayerCost]:
    """Measure every layer at micro-batches of sizes[0] and sizes[1] samples (the first samples
    of inputs / targets); each layer's time is then a line through the two points. `threads`:
    torch's intra-op threads while measuring (a stage's own count; on a shared CPU, 1 is the
    measurement least disturbed by other processes)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _profile(layers, loss_fn, inputs, targets, sizes, repeats)
    finally:
        torch.set_num_threads(before)


def _profile(layers, loss_fn, inputs, targets, sizes, repeats) -> list[LayerCost]:
    points = []
    for size in sizes:
        x = unflatten(inputs, [t[:size] for t in flatten(inputs)])
        y = unflatten(targets, [t[:size] for t in flatten(targets)])
        row = []
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            f, b, saved, out_bytes, x = _measure(layer, x, loss_fn if last else None, y, repeats)
            row.append((f, b, saved / size, out_bytes / size))
        points.append(row)
    (n1, n2), costs = sizes, []
    for layer, p1, p2 in zip(layers, *points):
        slope = [(b - a) / (n2 - n1) if n2 != n1 else 0.0 for a, b in zip(p1[:2], p2[:2])]
        slope = [max(0.0, s) for s in slope]
        fixed = [max(0.0, a - s * n1) for a, s in zip(p1[:2], slope)]
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        costs.append(LayerCost(fixed[0], slope[0], fixed[1], slope[1], params, max(p1[2], p2[2]), p2[3]))
    return costs


# -- the cost model and the search ---------------------------------------------------------------
def stage_time_s(costs: Sequence[LayerCost], a: int, b: int, size: float) -> float:
    """One micro-batch of `size` samples through layers [a, b), forward and backward."""
    return sum(c.time_s(size) for c in costs[a:b])


def stage_bytes(costs: Sequence[LayerCost], a: int, b: int, stage: int, stages: int, micro_batches: int,
                size: float) -> float:
    in_flight = min(stages - stage, micro_batches)
    weights = 2 * sum(c.param_bytes for c in costs[a:b])  # the working copy and its gradients
    saved = in_flight * size * sum(c.saved_bytes_per_sample for c in costs[a:b])
    received = micro_batches * size * costs[a - 1].output_bytes_per_sample if a > 0 else 0.0
    return weights + saved + received


def best_split(costs: Sequence[LayerCost], stages: int, micro_batches: int, size: float,
               memory_limit: float = math.inf) -> tuple[list[int], float] | None:
    """The boundaries minimising the slowest stage's time per micro-batch under the memory
    limit (dynamic programming over contiguous splits); None if no split fits."""
    L = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c.time_s(size))
    INF = math.inf
    # best[s][i]: the smallest slowest-stage time of layers [0, i) in stages 0..s-1; cut[s][i] its last boundary
    best = [[INF] * (L + 1) for _ in range(stages + 1)]
    cut = [[0] * (L + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, L - (stages - s) + 1):
            for j in range(s - 1, i):
                if best[s - 1][j] == INF:
                    continue
                if stage_bytes(costs, j, i, s - 1, stages, micro_batches, size) > memory_limit:
                    continue
                t = max(best[s - 1][j], prefix[i] - prefix[j])
                if t < best[s][i]:
                    best[s][i], cut[s][i] = t, j
    if best[stages][L] == INF:
        return None
    bounds = [L]
    for s in range(stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1], best[stages][L]


def brute_force_split(costs: Sequence[LayerCost], stages: int, size: float) -> tuple[list[int], float]:
    """Every split of the layers into `stages` contiguous stages, tried (for tests)."""
    L = len(costs)
    best = None
    for inner in itertools.combinations(range(1, L), stages - 1):
        bounds = [0, *inner, L]
        t = max(stage_time_s(costs, a, b, size) for a, b in zip(bounds, bounds[1:]))
        if best is None or t < best[1]:
            best = (bounds, t)
    return best


def plan_pipeline(costs: Sequence[LayerCost], stages: int, batch: int, micro_batches: Sequence[int] | int,
                  memory_limit: float = math.inf) -> Plan:
    """The plan with the smallest predicted step over the micro-batch counts offered."""
    choices = [micro_batches] if isinstance(micro_batches, int) else list(micro_batches)
    plans = []
    for m in choices:
        if not 1 <= m <= batch:
            continue
        size = batch / m
        found = best_split(costs, stages, m, size, memory_limit)
        if found is None:
            continue
        bounds, slowest = found
        per_stage = [stage_time_s(costs, a, b, size) * m for a, b in zip(bounds, bounds[1:])]
        memory = [stage_bytes(costs, a, b, s, stages, m, size) for s, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        plans.append(Plan(bounds, m, per_stage, memory, (m + stages - 1) * slowest))
    if not plans:
        raise ValueError(f"no split of {len(costs)} layers into {stages} stages fits the memory limit of "
                         f"{memory_limit / 2**20:.1f} MiB per stage with micro-batches {choices}")
    return min(plans, key=lambda p: p.step_s)


def plan_on_ranks(layers: Sequence[nn.Module], loss_fn: Callable, inputs, targets, stages: int, micro_batches: int,
                  group=None, threads: int = 1) -> Plan:
    """The plan of a pipeline on the ranks of `group` for minibatches like `inputs`: the group's
    first rank profiles every layer (which it must hold, not on the meta device) and plans at
    `micro_batches`; every rank gets the same plan, or raises the same error."""
    import torch.distributed as dist

    plan = None
    if dist.get_rank(group) == 0:
        try:
            if any(p.is_meta for layer in layers for p in layer.parameters()):
                raise ValueError("the planner profiles every layer, and some are on the meta device (filled stage "
                                 "by stage, as a Hugging Face model is): give the boundaries instead")
            batch = flatten(inputs)[0].shape[0]
            size = max(1, batch // micro_batches)
            with torch.random.fork_rng(devices=[]):  # dropout in the profile must not move the ranks' generators apart
                costs = profile_layers(layers, loss_fn, inputs, targets, sizes=(max(1, size // 2), size),
                                       threads=threads)
            plan = plan_pipeline(costs, stages, batch, micro_batches)
        except ValueError as exc:
            plan = exc
    box = [plan]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    if isinstance(box[0], ValueError):
        raise ValueError(f"boundaries 'auto': {box[0]}")
    return box[0]
