"""The relay's options: one frozen dataclass, declared once (l2l_hw/options.py), taken by
`Relay(..., options=RelayOptions(...))` or as keyword arguments, composed by the trainer's
config and turned into `l2l train` / `l2l finetune` flags."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from l2l_hw.options import check_options, fail, option
from l2l_hw.relay.precision import COMPUTE_DTYPES
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
class RelayOptions:
    """How the relay runs a step. The defaults are plain fp32 training, equal to PyTorch."""

    device: str = option("cpu", "where layers run: cpu, cuda, cuda:N; under torchrun, cuda means each rank's "
                         "own GPU (LOCAL_RANK)", kind="text", check=device_problem)
    micro_batches: int = option(1, "micro-batches per minibatch", kind="int", low=1)
    recompute: bool = option(True, "recompute each layer's forward in the backward (off: keep the forward graphs, "
                             "one forward less per step, memory grows with depth)", kind="bool",
                             flag="--no-recompute")
    activations: str = option("device", "where stashed layer inputs live; host = constant device memory",
                              kind="choice", choices=POLICIES)
    precision: str = option("fp32", "compute dtype; fp16 uses dynamic loss scaling", kind="choice",
                            choices=tuple(COMPUTE_DTYPES))
    pipedream_2bw: bool = option(False, "PipeDream-2BW: compute on the weights one step back, never wait for an "
                                 "update", kind="bool")
    layer_drop: float | Callable[[int], float] = option(
        0.0, "probability of skipping each block per step (Python: also a function of the step)", kind="float",
        low=0.0, high=1.0, high_open=True, function_ok=True)
    clip_grad_norm: float | None = option(None, "clip gradients to this norm (default: no clipping)", kind="float",
                                          low=0.0, low_open=True)
    clip_mode: str = option("layer", "per-layer norms, or one global norm with updates deferred to the step's end",
                            kind="choice", choices=CLIP_MODES)
    skip_nonfinite: bool = option(False, "discard a step whose gradients are not finite and go on (default: a "
                                  "non-finite loss stops l2l train, keeping the last checkpoint)", kind="bool")

    def __post_init__(self):
        check_options(self)
        if self.activations == "host" and not self.recompute:
            fail("activations", self.activations, "needs recompute (without it the forward graphs keep every layer's "
                 "intermediates on the device)")
        if self.clip_mode == "global" and self.clip_grad_norm is None:
            fail("clip_mode", self.clip_mode, "clips the gradients to a norm: give clip_grad_norm (the norm) too")
