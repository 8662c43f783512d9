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
LAMB and LARS add one per-tensor scalar, the trust ratio's (`layerwise_scalars`: pass 1,
sums of squares in float64 in one fixed order, `sum_of_squares`), before the rule runs.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from l2l_hw.eps.base import LAYERWISE, MOMENTUM_OPTIMIZERS, OptimConfig, tensor_rule
from l2l_hw.hw import regs

CANONICAL_NAN32 = 0x7FC00000
CANONICAL_NAN_BF16 = 0x7FC0
CANONICAL_NAN_FP16 = 0x7E00


def f32(x: float) -> float:
    """Round a float64 to the nearest float32 (ties to even), kept as a Python float."""
    return float(np.float32(x))


@dataclass(frozen=True)
class StepScalars:
    """Host-side scalars of one step, each an exact float32 value (but LAMB's and LARS's float64
    exact_lr, exact_weight_decay and trust_coefficient, inputs of the per-tensor trust scalar)."""

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
    bias_correction1: float = 1.0  # LAMB: 1 - beta1^t (m_hat = m / it, as the paper writes it)
    # LAMB and LARS: the float64 hyper-parameters the per-tensor trust scalar is computed from
    # (layerwise_scalars, on the host, once per tensor and step), and that scalar: LAMB lr x
    # the tensor's trust ratio, LARS the ratio (1 until layerwise_scalars sets it)
    exact_lr: float = 0.0
    exact_weight_decay: float = 0.0
    trust_coefficient: float = 0.0
    trust: float = 1.0
    # Muon (its matrices): the weight of torch's buf.lerp_(grad, 1 - momentum), f32(1 - momentum);
    # the Newton-Schulz iterations; and f32(lr x the matrix's shape adjustment), set per tensor
    # by tensor_scalars (0 until then)
    one_minus_momentum: float = 0.0
    ns_steps: int = 0
    matrix_lr: float = 0.0


# The scalars only LAMB and LARS read (the host kernel's, not the RTL's: its registers are the rest).
LAYERWISE_SCALARS = ("bias_correction1", "exact_lr", "exact_weight_decay", "trust_coefficient", "trust")
MUON_SCALARS = ("one_minus_momentum", "ns_steps", "matrix_lr")  # only Muon's matrices read them


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
        bias_correction1=f32(1.0 - b1 ** step),
        exact_lr=lr,
        exact_weight_decay=cfg.weight_decay,
        trust_coefficient=cfg.trust_coefficient,
        one_minus_momentum=f32(1.0 - cfg.momentum),
        ns_steps=cfg.ns_steps,
    )


def tensor_scalars(cfg: OptimConfig, s: StepScalars, shape) -> StepScalars:
    """The scalars of one tensor of `shape`: a Muon matrix's with its matrix_lr, f32(lr x
    muon_lr_ratio) from the float64 lr as torch.optim.Muon computes it; any other tensor's as they are."""
    if tensor_rule(cfg.optimizer, shape) != "muon":
        return s
    return dataclasses.replace(s, matrix_lr=f32(s.exact_lr * muon_lr_ratio(cfg.adjust_lr_fn, shape)))


def without_weight_decay(s: StepScalars) -> StepScalars:
    """The scalars of a tensor updated without weight decay (EPS.register's no_decay)."""
    return dataclasses.replace(s, weight_decay=f32(0.0), decay=f32(1.0), exact_weight_decay=0.0)


def apply_rule(optimizer: str, s: StepScalars, p, m, v, g, sqrt):
    """One step of the update rule on float32 arrays; returns new (p, m, v).

    `g` is the gradient already converted to float32 (exact from bf16/fp16). Each
    statement is one rounding. `v` is None for SGD and LARS. LAMB and LARS take the
    tensor's trust scalar `s.trust` from layerwise_scalars."""
    g = g * s.inv_scale
    if optimizer in MOMENTUM_OPTIMIZERS:  # SGD and LARS
        if s.weight_decay != 0:
            g = g + p * s.weight_decay
        if optimizer == "lars":
            g = g * s.trust
        if s.momentum != 0:
            m = m * s.momentum + g * s.dampening_complement
            g = g + m * s.momentum if s.nesterov else m
        return p - g * s.lr, m, v
    if optimizer == "lamb":
        u, m, v = lamb_update(s, p, m, v, g, sqrt)
        return p - u * s.trust, m, v
    if optimizer == "muon":  # a matrix: p, m, g 2-D
        p, m = muon_update(s, p, m, g)
        return p, m, v
    if optimizer == "adam" and s.weight_decay != 0:
        g = g + p * s.weight_decay
    if optimizer == "adamw" and s.weight_decay != 0:
        p = p * s.decay
    m, v, denom = adam_moments(s, m, v, g, sqrt)
    return p - (m * s.step_size) / denom, m, v


def adam_moments(s: StepScalars, m, v, g, sqrt):
    """Adam's (and LAMB's) moments and the denominator of its step: new (m, v, denom)."""
    m = m + (g - m) * s.one_minus_beta1  # torch's lerp_, unfused
    v = v * s.beta2 + (g * s.one_minus_beta2) * g  # torch's mul_ then addcmul_, unfused
    denom = sqrt(v) / s.bias_correction2_sqrt + s.eps
    return m, v, denom


def lamb_update(s: StepScalars, p, m, v, g, sqrt):
    """LAMB's update direction before the trust ratio, u = m_hat / (sqrt(v_hat) + eps) + wd p,
    with Adam's moments and denominator; returns (u, m, v). g is unscaled already."""
    m, v, denom = adam_moments(s, m, v, g, sqrt)
    u = (m / s.bias_correction1) / denom
    if s.weight_decay != 0:
        u = u + p * s.weight_decay
    return u, m, v


# ---------------------------------------------------------------------------- delay compensation
# PipeDream-2BW computes step t+1's gradient on the weights one commit back. "predict" (weight
# prediction: SpecTrain, Chen et al., arXiv 1809.02839; PipeMare, Yang et al., arXiv 1910.05124;
# for Adam, XPipe, Guan et al., arXiv 1911.04610) makes the working copy an update writes the
# weights the next step is predicted to reach, so the stale step computes about where a
# synchronous one would. Those papers predict from the moments alone; here the prediction is the
# optimizer's own next step with this step's gradient taken again (its moments move as they
# will), which in the one-dimensional model of a one-step delay (AdamW as momentum 0.9 on a
# quadratic) keeps the update stable up to lr x curvature 5.0, the moments-only prediction 2.7,
# no prediction 1.0 (a synchronous step: 38); on the reference GPT at lr 1e-3 (seed 1337) it
# recovered 66% of 2BW's loss gap (`l2l bench convergence`) where the moments-only one recovered
# 39% (a plain-PyTorch run of the same recipe, 2026-12-07); over 3 seeds, docs/BENCHMARKS.md.
# The master weights, the moments and the rule are untouched: only what the device reads.
DELAY_COMPENSATIONS = ("none", "predict")
PREDICTED = ("adamw", "adam", "sgd")  # the element-wise rules: a prediction of one element needs only its own state


def prediction_problem(cfg: OptimConfig) -> str | None:
    """Why `cfg`'s updates cannot be predicted (None: they can)."""
    if cfg.optimizer not in PREDICTED:
        whole = "its matrices' Newton-Schulz iterations" if cfg.optimizer == "muon" else "a trust ratio of its norms"
        return (f"predicts the next step element by element, for {', '.join(PREDICTED)}; {cfg.optimizer}'s step "
                f"reads whole tensors ({whole}) and is not predicted")
    return None


def predict_rule(optimizer: str, s: StepScalars, p, m, v, g, sqrt):
    """The weights predicted after the next step: apply_rule with the NEXT step's scalars `s` on
    param and the moments this step wrote, and this step's gradient `g` (raw, as pushed) again.
    The same statements and roundings as the rule; the new moments are dropped."""
    return apply_rule(optimizer, s, p, m, v, g, sqrt)[0]


def predicted_working(optimizer: str, s: StepScalars, p: np.ndarray, stored: dict[str, np.ndarray], g: np.ndarray,
                      state: str, working_dtype: str) -> torch.Tensor:
    """The working copy under "predict": predict_rule on param, the decoded state and the
    gradient (numpy float32), canonical NaNs, rounded to the working dtype as working_copy rounds."""
    m, v = (decode_state(stored, state, slot) if slot in stored else None for slot in ("m", "v"))
    with np.errstate(all="ignore"):
        q = predict_rule(optimizer, s, np.asarray(p, np.float32), m, v, g, np.sqrt)
    return working_copy(canonicalize_nan(np.array(q, dtype=np.float32)), working_dtype)


# ---------------------------------------------------------------------------- LAMB and LARS
# The trust ratio of a tensor needs two whole-tensor norms: ||p|| and ||u|| (LAMB's update
# direction) or ||g|| (LARS). Sums of squares are taken in float64 (each square of a float32
# is exact there) in one fixed order that every implementation reproduces bit for bit
# (docs/NUMERICS.md, "LAMB and LARS"): blocks of NORM_BLOCK elements; in a block, 16 lane
# sums (element i goes to lane i % 16, rows added in order), folded by a fixed tree
# (lane l + lane l + 8, then + 4, + 2, + 1); the block sums added in block order.
NORM_BLOCK = regs.QUANT_BLOCK  # the 8-bit state's block: the kernel's tiles hold whole ones
NORM_LANES = 16  # one AVX-512 vector of float32; AVX2 takes two vectors a row, the scalar path 16 steps


def sum_of_squares(x: np.ndarray) -> float:
    """The sum of x^2 over a float32 array, in float64, in the order above."""
    x = np.asarray(x, np.float32).reshape(-1)
    blocks = -(-x.size // NORM_BLOCK)
    if blocks == 0:
        return 0.0
    padded = np.zeros(blocks * NORM_BLOCK, np.float64)  # +0 pads: adding +0 changes no sum
    with np.errstate(invalid="ignore"):  # a signalling NaN widens to a NaN: the sum is NaN
        padded[: x.size] = x
    squares = (padded * padded).reshape(blocks, NORM_BLOCK // NORM_LANES, NORM_LANES)
    lanes = np.add.accumulate(squares, axis=1)[:, -1, :]  # accumulate: strictly in order, row by row
    width = NORM_LANES
    while width > 1:
        width //= 2
        lanes = lanes[:, :width] + lanes[:, width: 2 * width]
    return float(np.add.accumulate(lanes[:, 0])[-1])


def trust_ratio(optimizer: str, s: StepScalars, p_squares: float, x_squares: float) -> float:
    """The trust ratio, in float64, from the sums of squares of p and of LAMB's u or LARS's g:
    LAMB ||p|| / ||u||, LARS eta ||p|| / (||g|| + wd ||p||); 1 where either norm is 0 (no
    clamping: phi is the identity)."""
    p_norm, x_norm = math.sqrt(p_squares), math.sqrt(x_squares)
    if p_norm == 0 or x_norm == 0:
        return 1.0
    if optimizer == "lamb":
        return p_norm / x_norm
    return s.trust_coefficient * p_norm / (x_norm + s.exact_weight_decay * p_norm)


def layerwise_scalars(optimizer: str, s: StepScalars, p, m, v, g) -> StepScalars:
    """Pass 1 of a LAMB or LARS step of one whole tensor: the scalars with its trust set, from
    the sums of squares of p and of u (LAMB: the rule's statements, state unchanged) or of the
    unscaled g (LARS), then with_trust. Other optimizers: s as it is."""
    if optimizer not in LAYERWISE:
        return s
    return with_trust(optimizer, s, *layerwise_sums(optimizer, s, p, m, v, g))


def layerwise_sums(optimizer: str, s: StepScalars, p, m, v, g) -> tuple[float, float]:
    """Pass 1's two sums of squares: of p, and of LAMB's u or LARS's unscaled g."""
    with np.errstate(all="ignore"):  # a non-finite gradient makes the ratio NaN: the flag says so
        g = g * np.float32(s.inv_scale)
        x = lamb_update(s, p, m, v, g, np.sqrt)[0] if optimizer == "lamb" else g
    return sum_of_squares(p), sum_of_squares(x)


def with_trust(optimizer: str, s: StepScalars, p_squares: float, x_squares: float) -> StepScalars:
    """s with the tensor's trust scalar: LAMB f32(lr x ratio), LARS f32(ratio), in float64 from the
    float64 lr, weight decay and eta, as every per-step scalar."""
    ratio = trust_ratio(optimizer, s, p_squares, x_squares)
    with np.errstate(over="ignore"):  # a ratio beyond float32 is Inf, as the rule would make it
        return dataclasses.replace(s, trust=f32(s.exact_lr * ratio if optimizer == "lamb" else ratio))


# ---------------------------------------------------------------------------- Muon
# Muon (Keller Jordan, https://kellerjordan.github.io/posts/muon/; torch.optim.Muon) steps a matrix
# by its momentum orthogonalised by Newton-Schulz iterations. Its statements are torch.optim.Muon's
# and so are their roundings: torch's lerp_ and add_(alpha=) round each multiply-add once (its CPU
# kernels fuse them), and the iterations start from the update rounded to bf16, where a momentum
# one ulp off flips a bf16 rounding that the iterations spread over the whole matrix. So Muon's
# multiply-adds are fused here (fma32, exact), unlike every other rule's, and the iterations are
# torch's own bf16 matrix products (`orthogonalize`), which the CPU EPS runs too (docs/NUMERICS.md, "Muon").
MUON_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (a, b, c), from Keller Jordan's post
MUON_NS_EPS = 1e-7  # torch.optim.Muon's eps: the least norm the iterations' first division takes


def muon_lr_ratio(adjust_lr_fn: str | None, shape) -> float:
    """torch.optim.Muon's _adjust_lr factor for a (rows, cols) matrix: None or "original",
    sqrt(max(1, rows / cols)) (Keller Jordan's); "match_rms_adamw", 0.2 sqrt(max(rows, cols))
    (Moonshot's, arXiv 2502.16982: the update's RMS of AdamW's, so AdamW's lr carries over)."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


def orthogonalize(update: torch.Tensor, steps: int) -> torch.Tensor:
    """The Newton-Schulz iterations of torch.optim.Muon (_zeropower_via_newtonschulz), op for op:
    the float32 (rows, cols) update in bf16, as a wide matrix, divided by its norm, then `steps`
    quintic iterations X <- a X + (b A + c A A) X with A = X X^T. Returns a bf16 matrix of the
    update's shape, U S' V^T with S' about 1 where update = U S V^T."""
    a, b, c = MUON_NS_COEFFICIENTS
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T  # (cols, rows): the Gram matrix below is the smaller one
    x.div_(x.norm().clamp(min=MUON_NS_EPS))
    for _ in range(steps):
        gram = x @ x.T  # (small, small)
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def fma32(a, b, c) -> np.ndarray:
    """a * b + c rounded once to float32 (IEEE fusedMultiplyAdd), for float32 arrays or scalars.
    The product of two float32 is exact in float64; the float64 sum is rounded once more, which
    can round twice only where it lands on a float32 tie that the exact sum is not: there it is
    moved one float64 step towards the exact sum (its TwoSum error) before the rounding to float32."""
    product = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    addend = np.asarray(c, np.float64)
    with np.errstate(all="ignore"):  # Inf and NaN flow through as the fused operation gives them
        total = product + addend
        low = total - product
        error = (product - (total - low)) + (addend - low)  # total + error == product + addend, exactly
        near = total.astype(np.float32)
        beside = np.nextafter(near, np.where(total > near, np.float32(np.inf), np.float32(-np.inf)))
        tie = (total == (near.astype(np.float64) + beside.astype(np.float64)) / 2) & (error != 0) & np.isfinite(total)
        total = np.where(tie, np.nextafter(total, np.where(error > 0, np.inf, -np.inf)), total)
        return total.astype(np.float32)


def lerp32(start, end, weight: float) -> np.ndarray:
    """torch.lerp(start, end, weight) for float32 arrays and a float32 weight, as torch's CPU kernel
    computes it: the difference end - start, then one fused multiply-add: start + weight x
    difference where |weight| < 0.5, else end + (weight - 1) x difference."""
    difference = end - start
    if abs(weight) < 0.5:
        return fma32(difference, weight, start)
    return fma32(difference, np.float32(weight) - np.float32(1), end)


def muon_update(s: StepScalars, p, m, g):
    """One Muon step of a matrix (float32 (rows, cols) arrays, g unscaled already): new (p, m),
    statement for statement torch.optim.Muon's (_single_tensor_muon)."""
    m = lerp32(m, g, s.one_minus_momentum)  # buf.lerp_(grad, 1 - momentum)
    u = lerp32(g, m, s.momentum) if s.nesterov else m  # grad.lerp(buf, momentum), or buf
    with np.errstate(all="ignore"):
        o = orthogonalize(torch.from_numpy(np.ascontiguousarray(u, np.float32)), s.ns_steps).float().numpy()
        p = p * s.decay  # param.mul_(1 - lr * weight_decay)
        return fma32(o, -s.matrix_lr, p), m  # param.add_(update, alpha=-adjusted_lr): bf16 widens exactly


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


# ---------------------------------------------------------------------------- state formats
# m and v may be kept compressed; param stays fp32. The update decodes the state of an
# element to float32 (exactly, or with one rounding: see dequantize_block), applies
# `apply_rule` unchanged, and encodes the new state. docs/NUMERICS.md, "Optimizer state
# formats", gives the reasons for each choice below.

STATE_FORMATS = ("fp32", "bf16", "8bit")
# Elements per 8-bit block (one fp32 scale each for m and for v). A divisor of the host
# kernel's tile, so no block straddles two threads; 2 x 4 B of scales per 256 elements
# cost 0.03 B/parameter; Dettmers et al. (arXiv 2110.02861) use 2048: a smaller block
# confines an outlier, which sets its block's scale, to fewer neighbours. Its value lives
# in the register-map source (hdl/l2l_optim_regs.json), which the RTL and the driver read too.
QUANT_BLOCK = regs.QUANT_BLOCK
# Block scales are powers of two 2^k with k in [-SCALE_EXP_LIMIT, SCALE_EXP_LIMIT], so
# that both 2^k and 2^-k are normal float32 numbers and scaling by them is exact.
SCALE_EXP_LIMIT = 126


@dataclass(frozen=True)
class Code8:
    """An 8-bit code book: a minifloat whose top binade is [1, 2) (block values are scaled
    into it), with `exp_bits` exponent and `man_bits` mantissa bits, subnormals, no Inf or
    NaN codes; `signed` puts a sign in bit 7 (sign-magnitude)."""

    name: str
    exp_bits: int
    man_bits: int
    signed: bool

    @property
    def bias(self) -> int:  # magnitude code (e, f), e >= 1: 2^(e - bias) * (1 + f / 2^man_bits)
        return 2**self.exp_bits - 1

    @property
    def max_magnitude(self) -> int:  # the largest magnitude code: (2 - 2^-man_bits)
        return 2 ** (self.exp_bits + self.man_bits) - 1

    @property
    def subnormal_shift(self) -> int:  # magnitude code (0, f): f * 2^-subnormal_shift
        return self.bias - 1 + self.man_bits

    def values(self) -> np.ndarray:
        """The float32 value of every code 0..255 (scale 1)."""
        return decode_codes(np.arange(256, dtype=np.uint8), self)


# m: sign, 4 exponent bits, 3 mantissa bits: codes from 2^-17 to 1.875 (x the block scale).
# v: no sign (v >= 0), 5 exponent bits, 3 mantissa bits: 2^-33 to 1.875, so sqrt(v), which
# divides m in the update, spans 2^-16.5 to 1.37: about the reach of m, at half m's
# relative rounding error.
M_CODE = Code8("m", exp_bits=4, man_bits=3, signed=True)
V_CODE = Code8("v", exp_bits=5, man_bits=3, signed=False)
STATE_CODES = {"m": M_CODE, "v": V_CODE}


def _exp2(k: np.ndarray) -> np.ndarray:
    """2^k as float32 for integer k in [-126, 127] (normal numbers, built from bits)."""
    return ((np.asarray(k, np.int64) + 127) << 23).astype(np.uint32).view(np.float32)


def block_exponent(absmax_bits: np.ndarray, code: Code8) -> np.ndarray:
    """k of each block's scale 2^k: the exponent of the block's largest magnitude rounded
    (to nearest even, on its bits) to the code's mantissa width, clamped to +-SCALE_EXP_LIMIT.
    Rounding first means no value of the block rounds up past the top code."""
    drop = 23 - code.man_bits
    a = absmax_bits.astype(np.int64)
    rounded = a + (1 << (drop - 1)) - 1 + ((a >> drop) & 1)
    return np.clip((rounded >> 23) - 127, -SCALE_EXP_LIMIT, SCALE_EXP_LIMIT)


def encode_codes(y: np.ndarray, code: Code8) -> np.ndarray:
    """float32 values already scaled into the code's range -> codes, round to nearest even
    on the magnitude, saturating at the largest code. NaN is not an input (see quantize)."""
    bits = y.view(np.uint32).astype(np.int64)
    mag = bits & 0x7FFFFFFF
    drop = 23 - code.man_bits
    rebased = mag - ((127 - code.bias) << 23)  # exponent field now e = E - 127 + bias
    normal = (rebased + (1 << (drop - 1)) - 1 + ((rebased >> drop) & 1)) >> drop
    # below 2^(1 - bias): the subnormal grid, step 2^-subnormal_shift; the product is exact
    smallest_normal = np.float32(2.0 ** (1 - code.bias))
    with np.errstate(invalid="ignore"):  # NaN lanes are overwritten by quantize
        sub = np.rint(np.minimum(np.abs(y), smallest_normal) * np.float32(2.0**code.subnormal_shift)).astype(np.int64)
    c = np.minimum(np.where(mag < (128 - code.bias) << 23, sub, normal), code.max_magnitude)
    if code.signed:
        c |= (bits >> 24) & 0x80
    return c.astype(np.uint8)


def decode_codes(c: np.ndarray, code: Code8) -> np.ndarray:
    """codes -> float32 values at scale 1, exactly."""
    c = c.astype(np.int64)
    mag = c & (0x7F if code.signed else 0xFF)
    drop = 23 - code.man_bits
    normal = ((mag << drop) + ((127 - code.bias) << 23)).astype(np.uint32).view(np.float32)
    sub = (mag & (2**code.man_bits - 1)).astype(np.float32) * np.float32(2.0**-code.subnormal_shift)
    out = np.where(mag >> code.man_bits == 0, sub, normal).astype(np.float32)
    if code.signed:
        out = (out.view(np.uint32) | ((c & 0x80) << 24).astype(np.uint32)).view(np.float32)
    return out


def quantize(x: np.ndarray, code: Code8) -> tuple[np.ndarray, np.ndarray]:
    """float32 array -> (uint8 codes, one float32 scale per QUANT_BLOCK elements; the last
    block may be shorter). Per block: k = block_exponent(max |x|), codes = encode(x * 2^-k)
    (the product is exact but for values far below the smallest code), scale = 2^k.
    A block holding Inf or NaN gets scale NaN (0x7FC00000) and codes 0: all of it decodes
    to NaN. A block of zeros gets 2^-126 and codes 0 (+0, or -0 for -0.0 in m)."""
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    n = x.size
    blocks = -(-n // QUANT_BLOCK)
    padded = np.zeros(blocks * QUANT_BLOCK, np.float32)
    padded[:n] = x
    mag = (padded.view(np.uint32) & 0x7FFFFFFF).reshape(blocks, QUANT_BLOCK)
    absmax = mag.max(axis=1)  # integer order of |x| bits = order of |x|; NaN above Inf
    k = block_exponent(absmax, code)
    with np.errstate(all="ignore"):
        y = (padded.reshape(blocks, QUANT_BLOCK) * _exp2(-k)[:, None]).reshape(-1)
    codes = encode_codes(y, code).reshape(blocks, QUANT_BLOCK)
    bad = absmax >= 0x7F800000
    codes[bad] = 0
    scales = _exp2(k)
    scales.view(np.uint32)[bad] = CANONICAL_NAN32
    return codes.reshape(-1)[:n].copy(), scales


def dequantize(codes: np.ndarray, scales: np.ndarray, code: Code8) -> np.ndarray:
    """(codes, block scales) -> flat float32: decode (exact) times the block's scale (one
    rounding, exact unless the product is below 2^-126)."""
    codes = codes.reshape(-1)
    scale = np.repeat(scales.astype(np.float32), QUANT_BLOCK)[: codes.size]
    with np.errstate(all="ignore"):
        return decode_codes(codes, code) * scale


def encode_state(x: np.ndarray, state: str, slot: str) -> dict[str, np.ndarray]:
    """fp32 m or v -> its stored form: {slot: array} (+ {slot_scale: scales} for 8bit)."""
    x = canonicalize_nan(np.array(x, dtype=np.float32))
    if state == "fp32":
        return {slot: x}
    if state == "bf16":
        return {slot: to_bf16_bits(x)}
    if state == "8bit":
        codes, scales = quantize(x, STATE_CODES[slot])
        return {slot: codes, f"{slot}_scale": scales}
    raise ValueError(f"unknown optimizer state format {state!r}; choose one of {', '.join(STATE_FORMATS)}")


STORED_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}


def stored_pieces(state: str, slot: str, numel: int) -> dict[str, tuple[torch.dtype, int]]:
    """What m or v of `numel` elements is stored as: {slot: (dtype, count)}, plus for 8bit
    {slot_scale: (float32, one per QUANT_BLOCK elements)}."""
    if state not in STORED_DTYPES:
        raise ValueError(f"unknown optimizer state format {state!r}; choose one of {', '.join(STATE_FORMATS)}")
    pieces = {slot: (STORED_DTYPES[state], numel)}
    if state == "8bit":
        pieces[f"{slot}_scale"] = (torch.float32, -(-numel // QUANT_BLOCK))
    return pieces


def state_arrays(stored: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Stored state tensors as the numpy arrays of encode_state (bf16 as uint16 bits), sharing memory."""
    return {k: t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
            for k, t in stored.items()}


def state_tensors(stored: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The stored form as torch tensors (bf16 bits as torch.bfloat16), sharing memory."""
    return {k: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == np.uint16
            else torch.from_numpy(a) for k, a in stored.items()}


def decode_state(stored: dict[str, np.ndarray], state: str, slot: str) -> np.ndarray:
    """The stored form of m or v -> float32, as the update reads it."""
    x = stored[slot]
    if state == "fp32":
        return x
    if state == "bf16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return dequantize(x, stored[f"{slot}_scale"], STATE_CODES[slot])


def apply_rule_stored(optimizer: str, s: StepScalars, p: np.ndarray, stored: dict[str, np.ndarray],
                      g: np.ndarray, state: str, shape=None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One step with m and v kept in `state` format: decode, apply_rule, canonicalize NaNs,
    encode. Returns the new fp32 param (canonical NaNs) and the new stored state. Muon's matrices
    need their `shape` (p, g and m may come flat)."""
    slots = [slot for slot in ("m", "v") if slot in stored]
    old = {slot: decode_state(stored, state, slot) for slot in slots}
    if optimizer == "muon":
        p, g, old["m"] = (x.reshape(shape) for x in (p, g, old["m"]))
    s = layerwise_scalars(optimizer, s, p, old.get("m"), old.get("v"), g)
    with np.errstate(all="ignore"):
        p, m, v = apply_rule(optimizer, s, p, old.get("m"), old.get("v"), g, np.sqrt)
    new = {}
    for slot, x in (("m", m), ("v", v)):
        if slot in stored:
            new.update(encode_state(x, state, slot))
    return canonicalize_nan(np.array(p, dtype=np.float32)), new


def grad_to_numpy(g: torch.Tensor) -> np.ndarray:
    """Gradient in fp32, bf16 or fp16 -> float32 numpy (exact widening)."""
    g = g.detach().to("cpu")
    if g.dtype == torch.bfloat16:
        return (g.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return g.numpy().astype(np.float32)
