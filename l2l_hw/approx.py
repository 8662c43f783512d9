"""Approximate-backward drop-in modules: less activation memory saved for backward.

Both forwards are exact; only what the backward keeps, and so the gradient, changes.

FewBitGELU: saves a 3-bit interval index per element instead of the fp32 input
  (3/32 of the bytes) and backpropagates through a piecewise-constant GELU'.
  Novikov et al., "Few-bit backward: quantized gradients of activation functions
  for memory footprint reduction" (ICML 2023, arXiv 2202.00441).
RandomProjectionLinear: saves S^T x, a random sketch of the input along its rows
  (batch * tokens), instead of x; the weight gradient is an unbiased estimate and
  the input and bias gradients stay exact. Bershatsky et al., "Memory-efficient
  backpropagation through large linear layers" (arXiv 2201.13195); Oktay et al.,
  "Randomized automatic differentiation" (ICLR 2021).
"""
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------- few-bit GELU


def gelu_grad(x: torch.Tensor) -> torch.Tensor:
    """GELU'(x) = Phi(x) + x phi(x), the exact derivative of F.gelu(approximate='none')."""
    phi = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return torch.special.ndtr(x) + x * phi


def _interval_means(breakpoints: torch.Tensor) -> torch.Tensor:
    """E[GELU'(x) | x in interval] under x ~ N(0, 1) for the len+1 intervals, in closed form:
    int Phi phi = Phi^2 / 2 and int x phi^2 = -exp(-x^2) / (4 pi)."""
    inf = torch.tensor([math.inf], dtype=torch.float64)
    a, b = torch.cat([-inf, breakpoints]), torch.cat([breakpoints, inf])
    mass = torch.special.ndtr(b) - torch.special.ndtr(a)
    integral = (torch.special.ndtr(b) ** 2 - torch.special.ndtr(a) ** 2) / 2 + \
               (torch.exp(-a * a) - torch.exp(-b * b)) / (4 * math.pi)
    return integral / mass


def optimal_breakpoints(bits: int = 3, grid_step: float = 0.01, span: float = 8.0, tol: float = 1e-13):
    """Breakpoints (2^bits - 1) and values (2^bits) of the piecewise-constant GELU' that
    minimizes E[(GELU'(x) - q(x))^2] for x ~ N(0, 1): LayerNorm makes the MLP's
    pre-activations roughly unit-scale, and N(0, 1) is the weighting Novikov et al. use.

    GELU' is not monotone (it dips to -0.13 at -sqrt 2), so Lloyd-Max alone could stop in a
    poor local optimum. Step 1 finds the global optimum over partitions of a grid
    (step `grid_step` on [-span, span]) by dynamic programming; step 2 refines it with
    Lloyd-Max in the continuum: values = conditional means (closed form), breakpoints =
    where GELU' crosses the midpoint of its neighbours' values (Newton), until nothing
    moves by more than `tol`. Deterministic float64; about a second on a CPU.
    """
    K = 2 ** bits
    x = torch.arange(-span, span + grid_step / 2, grid_step, dtype=torch.float64)  # grid edges
    cell = (x[1:] + x[:-1]) / 2
    w = torch.special.ndtr(x[1:]) - torch.special.ndtr(x[:-1])  # N(0, 1) mass of each cell
    f = gelu_grad(cell)
    W, Fw, Q = (torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(t, 0)]) for t in (w, w * f, w * f * f))
    # cost[a, b]: weighted squared error of cells a..b-1 around their mean
    dW, dF, dQ = (t[None, :] - t[:, None] for t in (W, Fw, Q))  # (G+1, G+1)
    cost = torch.where(dW > 0, dQ - dF * dF / dW.clamp_min(1e-300), torch.inf)
    cost = cost.masked_fill(torch.ones_like(cost, dtype=torch.bool).tril(), torch.inf)
    best, back = cost[0], []  # best[b]: least error of cells 0..b-1 in k+1 segments
    for _ in range(K - 1):
        total = best[:, None] + cost
        arg = total.argmin(0)
        back.append(arg)
        best = total.gather(0, arg[None]).squeeze(0)
    ends = [len(cell)]
    for arg in reversed(back):
        ends.append(int(arg[ends[-1]]))
    bp = x[torch.tensor(ends[1:][::-1])]

    for _ in range(100_000):  # Lloyd-Max in the continuum
        values = _interval_means(bp)
        target = (values[:-1] + values[1:]) / 2
        new = bp.clone()
        for _ in range(20):  # Newton on GELU'(b) = target; GELU'' = phi(b) (2 - b^2)
            phi = torch.exp(-0.5 * new * new) / math.sqrt(2 * math.pi)
            new = new - (gelu_grad(new) - target) / (phi * (2 - new * new))
        moved = float((new - bp).abs().max())
        bp = new
        if moved < tol:
            break
    return bp, _interval_means(bp)


# The output of optimal_breakpoints(3), rounded to 10 digits (float32 needs 9);
# tests/test_approx.py recomputes it. Mean squared error of the derivative under N(0, 1):
# GELU_MSE, 0.42% of E[GELU'^2] = 0.456. Symmetric because GELU' - 1/2 is odd. The worst
# error, 0.09, is in the tails: the outer intervals average in GELU's dip near -sqrt 2.
GELU_BREAKPOINTS = (-0.7793452916, -0.4692450736, -0.2240198070, 0.0, 0.2240198070, 0.4692450736, 0.7793452916)
GELU_VALUES = (-0.0900201873, 0.0668318278, 0.2366913168, 0.4117378970,
               0.5882621030, 0.7633086832, 0.9331681722, 1.0900201873)
GELU_MSE = 0.001907  # by quadrature; tests/test_approx.py checks it by sampling


_SLOTS = tuple(range(0, 24, 3))  # bit offset of each of 8 codes in a 24-bit word


@functools.lru_cache(maxsize=None)
def _on(device: torch.device, values: tuple, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """`values` as a tensor on `device`, made once per device and dtype (not copied up per call)."""
    return torch.tensor(values, dtype=dtype, device=device)


def pack3(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..7 (n elements, any shape) -> uint8 (3 * ceil(n / 8),): 8 codes per 3 bytes.
    Few, whole-tensor ops: each op costs a thread-pool round trip on a busy CPU."""
    n = codes.numel()
    m = -(-n // 8)
    c = codes.new_zeros(8 * m, dtype=torch.int32)
    c[:n] = codes.reshape(-1)
    word = (c.view(m, 8) << _on(c.device, _SLOTS)).sum(1, dtype=torch.int32)  # (M,) disjoint bits: sum == or
    return word.view(torch.uint8).view(m, 4)[:, :3].reshape(-1)  # (3M,) the low 3 bytes of each word


def unpack3(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack3: the first n codes, int32 (n,)."""
    m = packed.numel() // 3
    word = packed.new_zeros(m, 4)
    word[:, :3] = packed.view(m, 3)
    word = word.view(torch.int32)  # (M, 1)
    return ((word >> _on(word.device, _SLOTS)) & 7).view(-1)[:n]  # (8M,) -> (n,)


class FewBitGELUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        codes = torch.bucketize(x, _on(x.device, GELU_BREAKPOINTS, x.dtype), out_int32=True)
        ctx.save_for_backward(pack3(codes))  # 3 bits per element instead of 32
        ctx.shape = x.shape
        return F.gelu(x)

    @staticmethod
    def backward(ctx, grad_out):
        (packed,) = ctx.saved_tensors
        codes = unpack3(packed, grad_out.numel()).long()  # (n,) the interval of each element
        slope = _on(grad_out.device, GELU_VALUES, grad_out.dtype).take(codes)
        return grad_out * slope.view(ctx.shape)


class FewBitGELU(nn.Module):
    """Drop-in for nn.GELU(): exact forward, 3-bit piecewise-constant derivative in backward."""

    def forward(self, x):
        if torch.is_grad_enabled() and x.requires_grad:
            return FewBitGELUFunction.apply(x)
        return F.gelu(x)  # nothing to save: no graph


# ---------------------------------------------------------------------------- random projection


def _sketch(rows: int, k: int, seed: int, like: torch.Tensor) -> torch.Tensor:
    """S (rows, k), i.i.d. +-1 from `seed`; S S^T / k has expectation I."""
    gen = torch.Generator(device=like.device).manual_seed(seed)
    s = torch.randint(0, 2, (rows, k), generator=gen, device=like.device, dtype=like.dtype)
    return s.mul_(2).sub_(1)


class RandomProjectionLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, ratio: float, seed: int):
        x2 = x.reshape(-1, x.shape[-1])  # (N, in), N = batch * tokens
        k = max(1, math.ceil(ratio * x2.shape[0]))
        sx = _sketch(x2.shape[0], k, seed, x).T @ x2  # (k, in): the only activation kept
        ctx.save_for_backward(sx, weight)
        ctx.seed, ctx.has_bias = seed, bias is not None  # S is regenerated from the seed
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        sx, weight = ctx.saved_tensors
        dy = grad_out.reshape(-1, grad_out.shape[-1])  # (N, out)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = grad_out @ weight.to(grad_out.dtype)  # exact: needs W, not x
        if ctx.needs_input_grad[1]:
            k = sx.shape[0]
            sdy = _sketch(dy.shape[0], k, ctx.seed, dy).T @ dy  # (k, out)
            dw = (sdy.T @ sx.to(dy.dtype)) / k  # (out, in): E[S S^T] / k = I, so E[dw] = dy^T x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db, None, None


class RandomProjectionLinear(nn.Linear):
    """Drop-in for nn.Linear (same parameters, init and state_dict keys). The backward keeps
    a sketch S^T x of k = ceil(ratio * N) rows instead of the N rows of x: activation memory
    times ratio, weight gradient unbiased with variance ~ 1/k, input and bias gradients exact.

    The sketch's seed is drawn from torch's default generator at each training forward, so
    runs repeat under torch.manual_seed and the relay's RNG replay regenerates the same S in
    its recompute. Drawn with or without grad, so the RNG stream does not depend on it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 ratio: float = 0.25):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if not ratio > 0:
            raise ValueError(f"ratio must be > 0, got {ratio}")
        self.ratio = ratio

    def forward(self, x):
        if not self.training:
            return F.linear(x, self.weight, self.bias)
        seed = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return RandomProjectionLinearFunction.apply(x, self.weight, self.bias, self.ratio, seed)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, ratio={self.ratio}"
