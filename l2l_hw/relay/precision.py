"""Mixed precision: compute dtypes, fp32 gradient sums and dynamic loss scaling.

Layers run in bf16 or fp16 on weights the EPS rounds from its fp32 masters. A layer's
gradient is summed over its micro-batches (and, for a tied parameter, over every layer
that uses it) in fp32 on the device (`GradSums`), as PyTorch autocast and Megatron do:
autograd would accumulate into the low-precision leaf's .grad, a running sum rounded at
every micro-batch (2.8-6.6x the error of one rounding at 32 micro-batches,
docs/NUMERICS.md). The sum is rounded once, to the working dtype, when it leaves for the
EPS (the copy down keeps its width), and the EPS widens it to fp32 exactly.

fp16 needs loss scaling: the loss is multiplied by `scale` before the backward so small
gradients stay representable, and the EPS multiplies every gradient by 1/scale. An
overflow (a non-finite gradient anywhere, or a sum beyond fp16's range at its rounding)
discards the whole step and halves the scale; `growth_interval` clean steps in a row
double it (torch.cuda.amp.GradScaler's policy and defaults).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial

import torch

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_SUMS = ("fp32", "compute")  # RelayOptions.grad_sums: where a low-precision layer's gradient is summed


def compute_dtype(precision: str) -> torch.dtype:
    if precision not in COMPUTE_DTYPES:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[precision]


# elements widened at once where a CPU gradient is added to its fp32 sum (torch's CPU add_ of a bf16
# tensor into an fp32 one first makes an fp32 copy of all of it: 4 B a parameter more, at the peak)
WIDEN_CHUNK = 1 << 22


class _Sum:
    """One leaf's fp32 gradient sum, owned by the leaf's hook: it lives as long as the leaf."""

    __slots__ = ("total", "__weakref__")

    def __init__(self):
        self.total: torch.Tensor | None = None


class GradSums:
    """The relay's gradients summed in fp32 over micro-batches, for leaves of dtype `dtype`.

    `watch(leaf)` (as a layer's device parameters are made) registers a post-accumulate-grad
    hook that adds each backward's gradient into the leaf's fp32 sum and clears the leaf's
    .grad, so autograd never sums in `dtype`; `take(leaves)` hands the sums over when the
    group's gradients leave and forgets them (the accumulator is freed with its last use).
    `rounded(grads)` is the one rounding to `dtype` on the way to the EPS. With fp32 leaves
    autograd already sums in fp32, and with `in_fp32` False (grad_sums="compute") it sums in
    `dtype`: no hook, no copy, `take` gives the leaves' .grad."""

    def __init__(self, dtype: torch.dtype, in_fp32: bool = True):
        self.dtype = dtype
        self.active = in_fp32 and dtype != torch.float32
        self._sums: weakref.WeakValueDictionary[int, _Sum] = weakref.WeakValueDictionary()  # id(leaf) -> its sum

    def watch(self, leaf: torch.Tensor) -> torch.Tensor:
        if self.active and leaf.requires_grad:
            self._sums[id(leaf)] = cell = _Sum()  # dies with the leaf (an abandoned step leaves nothing)
            leaf.register_post_accumulate_grad_hook(partial(self._add, cell))
        return leaf

    @staticmethod
    def _add(cell: _Sum, leaf: torch.Tensor) -> None:
        grad = leaf.grad
        if cell.total is None:
            cell.total = grad.float()
        elif grad.is_cuda or grad.numel() <= WIDEN_CHUNK:
            cell.total.add_(grad)  # bf16/fp16 widened exactly, added in fp32
        else:  # on the CPU a mixed-dtype add_ widens the whole gradient first: a chunk at a time instead
            for total, part in zip(cell.total.view(-1).split(WIDEN_CHUNK), grad.reshape(-1).split(WIDEN_CHUNK)):
                total.add_(part)
        leaf.grad = None

    def take(self, leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gradients of `leaves` (name -> device parameter) that received one: fp32 sums."""
        if not self.active:
            return {n: t.grad for n, t in leaves.items() if t.grad is not None}
        out = {}
        for name, leaf in leaves.items():
            cell = self._sums.pop(id(leaf), None)
            if cell is not None and cell.total is not None:
                out[name], cell.total = cell.total, None
        return out

    def rounded(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`grads` rounded to nearest even in the working dtype: the one rounding of the sums."""
        if not self.active:
            return grads
        return {n: g.to(self.dtype) for n, g in grads.items()}

    def held(self) -> list[torch.Tensor]:
        """The sums on the device now (memory accounting)."""
        return [cell.total for cell in list(self._sums.values()) if cell.total is not None]


@dataclass
class LossScaler:
    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    clean_steps: int = 0  # steps since the last overflow or growth

    def update(self, found_nonfinite: bool) -> None:
        if found_nonfinite:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
