"""Muon on the CPU EPS: one matrix's update in torch on the host, golden.muon_update bit for bit.

    found = step(scalars, grad, src, dst, state="8bit", working_dtype="bf16")   # in place or not

Muon (docs/NUMERICS.md, "Muon") is matrix work: the Newton-Schulz iterations multiply whole
matrices, so the fused host kernel, which streams elements, cannot run it. Here the update of
one matrix runs as torch operations on its whole buffers, on torch's intra-op threads: the
gradient unscaled (fp32, bf16 or fp16 widened exactly) and checked for non-finite values, the
momentum buffer decoded from its state format (fp32, bf16, block-wise 8-bit: golden's codes),
torch.optim.Muon's statements with its single roundings of each multiply-add (`fma`, exact, as
golden.fma32), the iterations by golden.orthogonalize (torch's bf16 matrix products, the same
call golden makes), then param, the momentum buffer re-encoded and the working copy written.
The engine hands a Muon EPS's other tensors (biases, norms: not 2-D) to the host kernel's AdamW.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from l2l_hw.eps import golden
from l2l_hw.eps.golden import StepScalars

CANONICAL_NAN = torch.tensor(golden.CANONICAL_NAN32, dtype=torch.int32).view(torch.float32)


def fma(a: torch.Tensor, b, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to float32, for float32 tensors (b may be a float holding a float32
    value): golden.fma32's steps in torch (the float64 product is exact; a float64 sum that lands
    on a float32 tie the exact sum is not moves one float64 step towards it before rounding)."""
    product = a.double() * b
    addend = c.double()
    total = product + addend
    low = total - product
    error = (product - (total - low)) + (addend - low)  # total + error == product + addend, exactly
    near = total.float()
    beside = torch.nextafter(near, torch.where(total > near, math.inf, -math.inf).float())
    tie = (total == (near.double() + beside.double()) / 2) & (error != 0) & torch.isfinite(total)
    total = torch.where(tie, torch.nextafter(total, torch.where(error > 0, math.inf, -math.inf).double()), total)
    return total.float()


def lerp(start: torch.Tensor, end: torch.Tensor, weight: float) -> torch.Tensor:
    """torch.lerp as its CPU kernel computes it (golden.lerp32): one fused multiply-add after the difference."""
    difference = end - start
    if abs(weight) < 0.5:
        return fma(difference, weight, start)
    return fma(difference, float(np.float32(weight) - np.float32(1)), end)


def momentum_buffer(src: dict[str, torch.Tensor], state: str, shape: torch.Size) -> torch.Tensor:
    """The matrix's momentum buffer m as float32 (shape), decoded from its state format exactly as
    golden.decode_state (bf16 widens exactly; 8-bit: codes times their block's scale)."""
    if state == "fp32":
        return src["m"].reshape(shape)
    if state == "bf16":
        return src["m"].reshape(shape).float()
    stored = golden.state_arrays({k: src[k].reshape(-1) for k in ("m", "m_scale")})
    return torch.from_numpy(golden.decode_state(stored, state, "m").reshape(shape))


def step(s: StepScalars, grad: torch.Tensor, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor],
         state: str = "fp32", working_dtype: str = "fp32") -> bool:
    """One Muon step of one matrix; returns whether the gradient times s.inv_scale held a
    non-finite value. `grad` (rows, cols) in fp32, bf16 or fp16; `src` param and the stored pieces
    of m (golden.stored_pieces); `dst` some of param, m's pieces and `working` (its dtype:
    `working_dtype`), each written only once every result is computed (a destination may be
    its own source). s.matrix_lr is the matrix's (golden.tensor_scalars)."""
    if grad.dim() != 2:
        raise ValueError(f"Muon steps matrices (2-D tensors), got a gradient of shape {tuple(grad.shape)}")
    shape = grad.shape
    g = grad.float() * s.inv_scale
    found = not bool(torch.isfinite(g).all())
    m = lerp(momentum_buffer(src, state, shape), g, s.one_minus_momentum)  # buf.lerp_(grad, 1 - momentum)
    u = lerp(g, m, s.momentum) if s.nesterov else m  # grad.lerp(buf, momentum), or buf
    o = golden.orthogonalize(u, s.ns_steps).float()  # bf16 values, exact in float32
    p = src["param"].reshape(shape) * s.decay  # param.mul_(1 - lr * weight_decay)
    p = fma(o, -s.matrix_lr, p)  # param.add_(update, alpha=-adjusted_lr)
    p = torch.where(torch.isnan(p), CANONICAL_NAN, p)
    pieces = golden.state_tensors(golden.encode_state(m.numpy(), state, "m"))
    results = {"param": p, **pieces}
    if "working" in dst:
        results["working"] = golden.working_copy(p.numpy(), working_dtype)
    for slot, t in dst.items():
        t.copy_(results[slot].reshape(t.shape))
    return found
