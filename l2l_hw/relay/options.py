"""The relay's options: one frozen dataclass, declared once (l2l_hw/options.py), taken by
`Relay(..., options=RelayOptions(...))` or as keyword arguments, composed by the trainer's
config and turned into `l2l train` / `l2l finetune` flags."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable

import torch

from l2l_hw.options import check_options, fail, option, prefixed
from l2l_hw.relay.data_parallel import DataParallelOptions
from l2l_hw.relay.precision import COMPUTE_DTYPES, GRAD_SUMS
from l2l_hw.relay.recompute import RECOMPUTE
from l2l_hw.relay.stash import POLICIES

CLIP_MODES = ("layer", "global")


def device_problem(device) -> str | None:
    """What is wrong with `device` for the relay on this machine (None: nothing): cpu, cuda or
    cuda:N, as torch sees them; or cpu-async, the CPU with the asynchronous twin of a device's
    transfers (for tests). The one check, for Relay and TrainConfig alike."""
    name = str(device)
    if not re.fullmatch(r"cpu|cpu-async|cuda(:\d+)?", name):
        return "must be cpu, cuda or cuda:N (or cpu-async: the CPU with asynchronous transfers, for tests)"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            return ("is not available here: CUDA is not available on this machine "
                    "(torch.cuda.is_available() is False); use cpu")
        count = torch.cuda.device_count()
        if int(name.partition(":")[2] or 0) >= count:
            return f"is not available here: this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}"
    return None


@dataclass(frozen=True)
class RelayOptions(DataParallelOptions):
    """How the relay runs a step. The defaults are plain fp32 training, equal to PyTorch."""

    device: str = option("cpu", "where layers run: cpu, cuda, cuda:N; under torchrun, cuda means each rank's "
                         "own GPU (LOCAL_RANK)", kind="text", check=device_problem)
    micro_batches: int = option(1, "micro-batches per minibatch", kind="int", low=1)
    recompute: str | Callable = option(
        "full", "what the backward gets of each layer's forward: full (its inputs; the forward runs again), "
        "selective (also the matmul and attention outputs; only the cheap ops run again), none (the forward graphs: "
        "no recompute, memory grows with depth); Python: also a torch SAC policy function", kind="choice",
        choices=RECOMPUTE, function_ok=True)
    activation_budget: int | None = option(
        None, "bytes of activations the relay may keep on the device for the backward: each layer keeps its "
        "forward graph, its matmul outputs (selective) or its input (full), as the plan that recomputes least "
        "within it picks (planned from the first step, which runs full)", kind="bytes", low=1, metavar="SIZE")
    activations: str = option("device", "where stashed layer inputs live; host = constant device memory",
                              kind="choice", choices=POLICIES)
    precision: str = option("fp32", "compute dtype; fp16 uses dynamic loss scaling", kind="choice",
                            choices=tuple(COMPUTE_DTYPES))
    grad_sums: str = option("fp32", "bf16 / fp16: each layer's gradient summed over its micro-batches in fp32 on the "
                            "device and rounded once on its way to the EPS (fp32), or autograd's running sum in the "
                            "compute dtype (compute: 2 B per parameter less device memory in a layer's backward, "
                            "2.8-6.6x the rounding error at 32 micro-batches; docs/NUMERICS.md)", kind="choice",
                            choices=GRAD_SUMS)
    pipedream_2bw: bool = option(False, "PipeDream-2BW: compute on the weights one step back, never wait for an "
                                 "update", kind="bool")
    layer_drop: float | Callable[[int], float] = option(
        0.0, "probability of skipping each block per step (Python: also a function of the step)", kind="float",
        low=0.0, high=1.0, high_open=True, function_ok=True)
    clip_grad_norm: float | None = option(None, "clip gradients to this norm (default: no clipping)", kind="float",
                                          low=0.0, low_open=True)
    clip_mode: str = option("layer", "per-layer norms, or one global norm with updates deferred to the step's end",
                            kind="choice", choices=CLIP_MODES)
    threads: int | None = option(None, "threads this process computes with: torch's intra-op threads and the "
                                 "host kernel's (default: every core it may use); on the CPU the EPS updates run "
                                 "between layers on them, never beside them", kind="int", low=1)
    skip_nonfinite: bool = option(False, "discard a step whose gradients are not finite and go on (default: a "
                                  "non-finite loss stops the run, keeping the last checkpoint)", kind="bool")
    device_update_layers: int | None = option(
        None, "the first N layers keep their weights and AdamW state on the device and are updated there (they are "
        "pushed last and needed first); 0 keeps every update on the host (default: on CUDA, planned at start-up from "
        "the measured host update and device compute; 0 on the CPU and for a Relay built from Python)", kind="int",
        low=0, optional=True, metavar="N")
    account_memory: bool = option(False, "on the CPU, count the bytes the relay holds as device tensors (weights, "
                                  "stash, graphs, what autograd saves) for memory_report(), at a cost of 1-2% of a "
                                  "CPU step (on CUDA the allocator counts them, always)", kind="bool")

    def __post_init__(self):
        check_options(self)
        if self.threads is not None and self.threads > len(os.sched_getaffinity(0)):  # 10,000 threads ran 100x slower
            fail("threads", self.threads, f"must be at most {len(os.sched_getaffinity(0))}, the cores this process "
                 "may use (more threads than cores only wait for each other)")
        if self.activation_budget is not None and self.recompute != "full":
            fail("recompute", self.recompute, "is planned per layer under activation_budget: leave it at full")
        if self.activations == "host" and self.recompute == "none":
            fail("activations", self.activations, "needs recompute (without it the forward graphs keep every layer's "
                 "intermediates on the device)")
        if self.clip_mode == "global" and self.clip_grad_norm is None:
            fail("clip_mode", self.clip_mode, "clips the gradients to a norm: give clip_grad_norm (the norm) too")


# -- pipeline parallelism (l2l_hw/relay/pipeline.py) ---------------------------------------
PIPELINE_SCHEDULES = ("flush", "2bw")


def _boundaries_problem(value) -> str | None:
    if value is None or value == "auto":
        return None
    parts = value.split(",") if isinstance(value, str) else None
    if not parts or not all(re.fullmatch(r"[0-9]+", p.strip()) for p in parts):  # "²".isdigit(), int("²") fails
        return "must be the first layer of each stage after the first, ascending, e.g. '3,6', or 'auto'"
    numbers_ = [int(p) for p in parts]
    if numbers_[0] < 1 or any(b <= a for a, b in zip(numbers_, numbers_[1:])):
        return "must be ascending layer indices >= 1 (the first layer of stages 1, 2, ...)"
    return None


@dataclass(frozen=True)
class PipelineConfig:
    """The relay as a pipeline: contiguous stages of layers, one per rank of a process group."""

    stages: int = option(1, "pipeline stages, one per rank (torchrun --nproc-per-node S); each rank trains the whole "
                         "minibatch through its stage (1: no pipeline)", kind="int", low=1)
    schedule: str = option("flush", "flush: 1F1B with a flush each minibatch, exact (trains as one process); 2bw: "
                           "PipeDream-2BW, never waits for an update but computes on weights one step stale, which "
                           "costs loss (docs/PIPELINE.md; --delay-compensation)", kind="choice",
                           choices=PIPELINE_SCHEDULES)
    boundaries: str | None = option(None, "first layer of each stage after the first, e.g. '3,6'; 'auto': the "
                                    "planner's split, from a profile of every layer at start-up (default: even by "
                                    "layer count)", kind="text", optional=True, check=_boundaries_problem)
    timeout_s: float = option(300.0, "seconds a stage waits for a neighbour before it stops with an error",
                              kind="float", low=0.0, low_open=True)

    def __post_init__(self):
        check_options(self)
        if self.boundaries not in (None, "auto") and len(self.boundaries.split(",")) != self.stages - 1:
            fail("boundaries", self.boundaries, f"must name {self.stages - 1} layer(s) for {self.stages} stages")

    def split(self) -> list[int] | None:
        """The explicit boundaries as ints (None: not given, or 'auto')."""
        return None if self.boundaries in (None, "auto") else [int(p) for p in self.boundaries.split(",")]

    def bounds(self, n_layers: int, split: list[int] | None = None) -> list[int]:
        """[0, b_1, ..., L]: the layers of each stage of a model of `n_layers` layers (`split`:
        the planner's boundaries, else the given ones, else even by layer count). The one check
        of a pipeline's geometry, made before anything is estimated or started: ValueError naming
        what is wrong and what is allowed."""
        if n_layers < self.stages:
            raise ValueError(f"{self.stages} pipeline stages need at least {self.stages} layers (one a stage); the "
                             f"model is relayed as {n_layers}: give {n_layers} stages or fewer")
        split = split if split is not None else self.split()
        if split is None:
            return even_split(n_layers, self.stages)
        bounds = [0, *split, n_layers] if len(split) == self.stages - 1 else list(split)
        if not (len(bounds) == self.stages + 1 and bounds[0] == 0 and bounds[-1] == n_layers
                and all(a < b for a, b in zip(bounds, bounds[1:]))):
            raise ValueError(f"pipeline boundaries {','.join(map(str, split))} do not split the model's {n_layers} "
                             f"relayed layers into {self.stages} non-empty stages: give the first layer of each stage "
                             f"after the first ({self.stages - 1} of them), ascending, from 1 to {n_layers - 1}")
        return bounds


def even_split(n_layers: int, stages: int) -> list[int]:
    """Boundaries [0, b_1, ..., L] of `stages` contiguous stages with layer counts differing by at most one."""
    return [round(s * n_layers / stages) for s in range(stages + 1)]


# `l2l train --pipeline-stages S` (under torchrun --nproc-per-node S): the same options as TrainConfig
# composes them, prefixed (TrainConfig has a schedule of its own); the run's --dist-timeout is the stages'
# timeout (TrainConfig.pipeline_config).
PipelineOptions = prefixed(PipelineConfig, "pipeline_", "The relay as a pipeline: contiguous stages of layers, one "
                           "per rank (under torchrun --nproc-per-node S)", omit=("timeout_s",), commands=("train",))
