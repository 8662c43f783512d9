"""The update rule, written once, and the golden EPS (numpy float32, op by op).

Every line of `apply_rule` is one IEEE-754 binary32 operation, rounded to nearest
even, with no fused multiply-add and no reassociation. The host kernel and the RTL
implement exactly this sequence; docs/NUMERICS.md explains each choice. The order of
operations mirrors torch.optim's CPU kernels (addcmul computes (value*t1)*t2, addcdiv
computes (value*t1)/t2, lerp computes m + (g - m)*w) so that the rule stays within
2 ulp of torch.optim (torch fuses the last multiply-add of lerp and addcmul; we don't).

Per-step scalars are computed once per step in float64 and rounded to float32; they
are handed to the rule as Python floats holding those exact float32 values, so the
same rule runs on numpy float32 arrays (golden) and torch float32 tensors (CPU EPS).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from l2l_hw.eps.base import OptimConfig

CANONICAL_NAN32 = 0x7FC00000
CANONICAL_NAN_BF16 = 0x7FC0
CANONICAL_NAN_FP16 = 0x7E00


def f32(x: float) -> float:
    """Round a float64 to the nearest float32 (ties to even), kept as a Python float."""
    return float(np.float32(x))


@dataclass(frozen=True)
class StepScalars:
    """Host-side scalars of one step, each an exact float32 value."""

    inv_scale: float
    lr: float
    weight_decay: float  # Adam and SGD: added to the gradient as p * weight_decay
    decay: float  # AdamW: p * (1 - lr * weight_decay)
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float  # lr / (1 - beta1^t)
    bias_correction2_sqrt: float  # sqrt(1 - beta2^t)
    eps: float
    momentum: float
    dampening_complement: float  # SGD: 1 - dampening; 1 at step 1 (torch clones the first gradient)
    nesterov: bool


def step_scalars(cfg: OptimConfig, step: int, inv_scale: float = 1.0) -> StepScalars:
    """Scalars of optimizer step `step` (1-based), in float64 then rounded to float32."""
    lr = cfg.lr_at(step)
    b1, b2 = cfg.betas
    first_or_plain = step == 1 or cfg.momentum == 0
    return StepScalars(
        inv_scale=f32(inv_scale),
        lr=f32(lr),
        weight_decay=f32(cfg.weight_decay),
        decay=f32(1.0 - lr * cfg.weight_decay),
        beta1=f32(b1),
        one_minus_beta1=f32(1.0 - b1),
        beta2=f32(b2),
        one_minus_beta2=f32(1.0 - b2),
        step_size=f32(lr / (1.0 - b1 ** step)),
        bias_correction2_sqrt=f32(math.sqrt(1.0 - b2 ** step)),
        eps=f32(cfg.eps),
        momentum=f32(cfg.momentum),
        dampening_complement=1.0 if first_or_plain else f32(1.0 - cfg.dampening),
        nesterov=cfg.nesterov,
    )


def apply_rule(optimizer: str, s: StepScalars, p, m, v, g, sqrt):
    """One step of the update rule on float32 arrays; returns new (p, m, v).

    `g` is the gradient already converted to float32 (exact from bf16/fp16). Each
    statement is one rounding. `v` is None for SGD."""
    g = g * s.inv_scale
    if optimizer == "sgd":
        if s.weight_decay != 0:
            g = g + p * s.weight_decay
        if s.momentum != 0:
            m = m * s.momentum + g * s.dampening_complement
            g = g + m * s.momentum if s.nesterov else m
        return p - g * s.lr, m, v
    if optimizer == "adam" and s.weight_decay != 0:
        g = g + p * s.weight_decay
    if optimizer == "adamw" and s.weight_decay != 0:
        p = p * s.decay
    m = m + (g - m) * s.one_minus_beta1  # torch's lerp_, unfused
    v = v * s.beta2 + (g * s.one_minus_beta2) * g  # torch's mul_ then addcmul_, unfused
    denom = sqrt(v) / s.bias_correction2_sqrt + s.eps
    return p - (m * s.step_size) / denom, m, v


def canonicalize_nan(x: np.ndarray) -> np.ndarray:
    """Every NaN becomes the canonical quiet NaN 0x7FC00000, as the RTL produces."""
    bits = x.view(np.uint32)
    bits[np.isnan(x)] = CANONICAL_NAN32
    return x


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even, NaN -> 0x7FC0."""
    u = x.view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    bits[np.isnan(x)] = CANONICAL_NAN_BF16
    return bits


def to_fp16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> IEEE half bit patterns, round to nearest even, NaN -> 0x7E00."""
    with np.errstate(over="ignore"):  # overflow to +-Inf is the IEEE result
        bits = x.astype(np.float16).view(np.uint16)
    bits[np.isnan(x)] = CANONICAL_NAN_FP16
    return bits


def working_copy(p: np.ndarray, working_dtype: str) -> torch.Tensor:
    """The low-precision (or fp32) copy the accelerator fetches, as a torch tensor."""
    if working_dtype == "fp32":
        return torch.from_numpy(p)
    bits = to_bf16_bits(p) if working_dtype == "bf16" else to_fp16_bits(p)
    dtype = torch.bfloat16 if working_dtype == "bf16" else torch.float16
    return torch.from_numpy(bits.view(np.int16)).view(dtype)


def grad_to_numpy(g: torch.Tensor) -> np.ndarray:
    """Gradient in fp32, bf16 or fp16 -> float32 numpy (exact widening)."""
    g = g.detach().to("cpu")
    if g.dtype == torch.bfloat16:
        return (g.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return g.numpy().astype(np.float32)
