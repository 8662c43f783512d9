"""ctypes binding of the fused one-pass host optimizer kernel (host/l2l_host_kernel.c).

    found = step(optimizer, scalars, grad, param, m, v, working_out=w)   # in place
    found = step(..., param_out=p2, m_out=m2, v_out=v2)                    # double buffer
    found = step(..., m, v, state="8bit", m_scale=ms, v_scale=vs)          # compressed m, v

One pass reads the gradient (fp32, bf16 or fp16), unscales it, flags non-finite values,
updates fp32 param, m and v by `golden.apply_rule` bit for bit, and writes the bf16/fp16
working copy. LAMB and LARS take a pass before it (`l2l_host_norms`: the tensor's sums of
squares, golden.sum_of_squares' order, nothing written), whose sums make the tensor's trust
scalar by golden.with_trust. m and v may be kept compressed (`state=`, golden.STATE_FORMATS): "bf16"
(torch.bfloat16 tensors) or "8bit" (torch.uint8 codes, golden.M_CODE / V_CODE, plus one
float32 scale per golden.QUANT_BLOCK elements in m_scale / v_scale, the last block
possibly short: `golden.stored_pieces` gives the shapes); the update is then
`golden.apply_rule_stored`, bit for bit, still one pass. Tensors go to C by pointer
(`data_ptr()`), so building the library needs neither torch nor Python headers; ctypes
releases the GIL for the call.

Buffers: CPU, contiguous, aligned to their element size (4 bytes for fp32, 2 for
bf16/fp16; the SIMD paths use unaligned loads, so nothing more is needed). A destination
may be exactly its own source (in place) but must not otherwise overlap any other
buffer. ISA: `isa=` or the environment variable L2L_HOST_ISA (scalar, avx2, avx512);
by default the widest the CPU has. Threads: `threads=` or every core this process may
run on (os.sched_getaffinity).
"""
from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
from pathlib import Path

import torch

from l2l_hw.eps import golden
from l2l_hw.eps.base import LAYERWISE, MOMENTUM_OPTIMIZERS
from l2l_hw.eps.golden import StepScalars

ISAS = ("scalar", "avx2", "avx512")  # codes 0, 1, 2 in C
ISA_ENV = "L2L_HOST_ISA"
OPTIMIZER_CODES = {"adamw": 0, "adam": 1, "sgd": 2, "lamb": 3, "lars": 4}
GRAD_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
WORKING_CODES = {torch.bfloat16: 1, torch.float16: 2}
STATE_CODES = {"fp32": 0, "bf16": 1, "8bit": 2}  # golden.STATE_FORMATS, in C's order
BUILD_HINT = ("build it with `pip install -e .` in the repository (or `make test`, which does that); "
              "it needs a C compiler (gcc)")


class HostKernelMissing(ImportError):
    """The native library l2l_hw/_host_kernel*.so is not built."""


class _Scalars(ctypes.Structure):
    """Mirror of l2l_scalars in host/l2l_host_kernel.c."""

    _fields_ = [("optimizer", ctypes.c_int32), ("nesterov", ctypes.c_int32)] + [
        (name, ctypes.c_float) for name in (
            "inv_scale", "lr", "weight_decay", "decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2",
            "step_size", "bias_correction2_sqrt", "eps", "momentum", "dampening_complement", "bias_correction1",
            "trust")]


class _Buffers(ctypes.Structure):
    """Mirror of l2l_buffers in host/l2l_host_kernel.c."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "g", "p_src", "p_dst", "m_src", "v_src", "m_dst", "v_dst", "m_scale_src", "v_scale_src", "m_scale_dst",
        "v_scale_dst", "w_dst")]


class _Codebook(ctypes.Structure):
    _fields_ = [("exp_bits", ctypes.c_int32), ("man_bits", ctypes.c_int32), ("is_signed", ctypes.c_int32)]


class _Codebooks(ctypes.Structure):
    """Mirror of l2l_codebooks: the 8-bit code books of m and v, from golden."""

    _fields_ = [("m", _Codebook), ("v", _Codebook)]


_STREAMS = 8  # L2L_STREAMS


class _Stream(ctypes.Structure):
    """Mirror of l2l_stream."""

    _fields_ = [("reads", ctypes.c_int32), ("updates", ctypes.c_int32), ("writes", ctypes.c_int32),
                ("nontemporal", ctypes.c_int32), ("size", ctypes.c_int32 * _STREAMS),
                ("ptr", ctypes.c_void_p * _STREAMS)]


_CODEBOOKS = _Codebooks(*(_Codebook(c.exp_bits, c.man_bits, int(c.signed)) for c in (golden.M_CODE, golden.V_CODE)))
_lib = None


def library() -> ctypes.CDLL:
    """The loaded native library; raises HostKernelMissing with the way to build it."""
    global _lib
    if _lib is not None:
        return _lib
    package = Path(__file__).resolve().parent.parent
    found = [package / f"_host_kernel{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES
             if (package / f"_host_kernel{suffix}").exists()]
    if not found:
        raise HostKernelMissing(f"the fused host optimizer kernel is not built (no {package}/_host_kernel*.so); "
                                f"the CPU EPS needs it: {BUILD_HINT}")
    lib = ctypes.CDLL(str(found[0]))
    c_int, c_i64 = ctypes.c_int, ctypes.c_int64
    lib.l2l_host_step.argtypes = [ctypes.POINTER(_Scalars), c_i64, ctypes.POINTER(_Buffers), c_int, c_int,
                                  ctypes.POINTER(_Codebooks), c_int, c_int, c_int]
    lib.l2l_host_step.restype = c_int
    lib.l2l_host_norms.argtypes = [ctypes.POINTER(_Scalars), c_i64, ctypes.POINTER(_Buffers), c_int, c_int,
                                   ctypes.POINTER(_Codebooks), c_int, c_int, ctypes.POINTER(ctypes.c_double)]
    lib.l2l_host_norms.restype = c_int
    lib.l2l_host_stream.argtypes = [c_i64, ctypes.POINTER(_Stream), c_int, c_int]
    lib.l2l_host_stream.restype = c_int
    for name in ("l2l_host_tile", "l2l_host_block", "l2l_host_best_isa"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], c_int
    lib.l2l_host_isa_supported.argtypes, lib.l2l_host_isa_supported.restype = [c_int], c_int
    lib.l2l_host_caller_mxcsr.argtypes, lib.l2l_host_caller_mxcsr.restype = [], ctypes.c_uint
    lib.l2l_host_bc2_by_fma.argtypes, lib.l2l_host_bc2_by_fma.restype = [ctypes.c_float, c_int], c_int
    if lib.l2l_host_block() != golden.QUANT_BLOCK:
        raise HostKernelMissing(f"the host kernel library is stale: its 8-bit block is {lib.l2l_host_block()} "
                                f"elements, golden.QUANT_BLOCK is {golden.QUANT_BLOCK}; rebuild it: {BUILD_HINT}")
    _lib = lib
    return lib


def tile() -> int:
    """Elements per tile, the unit of work of one thread."""
    return library().l2l_host_tile()


@functools.cache
def available_isas() -> tuple[str, ...]:
    lib = library()
    return tuple(name for code, name in enumerate(ISAS) if lib.l2l_host_isa_supported(code))


def resolve_isa(isa: str | None = None) -> str:
    """`isa`, else $L2L_HOST_ISA, else the widest this CPU supports; refuses one it lacks."""
    isa = isa or os.environ.get(ISA_ENV) or available_isas()[-1]
    if isa not in ISAS:
        raise ValueError(f"unknown host kernel ISA {isa!r} (argument or ${ISA_ENV}); choose one of {', '.join(ISAS)}")
    if isa not in available_isas():
        raise RuntimeError(f"this CPU does not support the {isa} path of the host kernel; "
                           f"it supports {', '.join(available_isas())}")
    return isa


def default_threads() -> int:
    return len(os.sched_getaffinity(0))


def bias_correction_by_fma(scalars: StepScalars) -> bool:
    """Whether AVX-512 Adam steps with these scalars divide sqrt(v) by bias_correction2_sqrt
    with an FMA quotient (proved exact for this divisor by an exhaustive check, run now if it
    has not: a step of fewer than 2^20 elements does not run it) instead of a division; the
    bits are the same either way."""
    return bool(library().l2l_host_bc2_by_fma(scalars.bias_correction2_sqrt, default_threads()))


def caller_mxcsr() -> int:
    """MXCSR of the calling thread (0x8000 FTZ, 0x0040 DAZ); the kernel sets its own."""
    return library().l2l_host_caller_mxcsr()


def _check_buffers(buffers: dict[str, torch.Tensor | None], n: int, counts: dict[str, int] | None = None) -> None:
    """Each buffer: a contiguous, element-aligned CPU tensor of `n` elements (or counts[name])."""
    for name, t in buffers.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"host kernel: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"host kernel: {name} is on {t.device}; the kernel reads and writes CPU memory")
        if not t.is_contiguous():
            raise ValueError(f"host kernel: {name} is not contiguous (strides {t.stride()}); pass .contiguous()")
        want = (counts or {}).get(name, n)
        if t.numel() != want:
            raise ValueError(f"host kernel: {name} has {t.numel()} elements; "
                             + (f"param has {n}" if want == n else f"{n} params need {want}"))
        if t.data_ptr() % t.element_size():
            raise ValueError(f"host kernel: {name} at address {t.data_ptr():#x} is not aligned to its "
                             f"{t.element_size()}-byte elements; the kernel needs element alignment")


def _check_overlap(sources: dict[str, torch.Tensor], destinations: dict[str, tuple[torch.Tensor, str | None]]):
    """A destination may be exactly its own source; any other overlap is refused."""
    spans = {name: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for name, t in sources.items()}
    spans.update({name: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                  for name, (t, _) in destinations.items()})
    for dst_name, (_, own_source) in destinations.items():
        lo, hi = spans[dst_name]
        if lo == hi:
            continue
        for name, (a, b) in spans.items():
            if name != dst_name and a < hi and lo < b and not (name == own_source and (a, b) == (lo, hi)):
                raise ValueError(f"host kernel: {dst_name} overlaps {name}; a destination must be exactly its own "
                                 f"source (in place) or disjoint from every other buffer")


def step(optimizer: str, scalars: StepScalars, grad: torch.Tensor, param: torch.Tensor,
         m: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
         param_out: torch.Tensor | None = None, m_out: torch.Tensor | None = None,
         v_out: torch.Tensor | None = None, working_out: torch.Tensor | None = None,
         state: str = "fp32", m_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
         m_scale_out: torch.Tensor | None = None, v_scale_out: torch.Tensor | None = None,
         isa: str | None = None, threads: int | None = None) -> bool:
    """One update of one tensor; returns whether any gradient value times inv_scale is not finite.

    Outputs default to the inputs (in place). `m` is needed by Adam/AdamW/LAMB and by SGD/LARS
    with momentum, `v` by Adam/AdamW/LAMB; `working_out` (bf16 or fp16) receives the working copy.
    LAMB and LARS take two passes: the tensor's sums of squares (`sums_of_squares`, nothing
    written), then the step with the trust scalar golden.with_trust makes of them.
    `state` is the format of m and v (see the module docstring); with "8bit", m_scale and
    v_scale (and their outputs) hold the block scales."""
    call = _Call(optimizer, scalars, grad, param, m, v, param_out=param_out, m_out=m_out, v_out=v_out,
                 working_out=working_out, state=state, m_scale=m_scale, v_scale=v_scale, m_scale_out=m_scale_out,
                 v_scale_out=v_scale_out, isa=isa, threads=threads)
    if optimizer in LAYERWISE:
        scalars = golden.with_trust(optimizer, scalars, *call.sums_of_squares(scalars))
    return call.step(scalars)


def sums_of_squares(optimizer: str, scalars: StepScalars, grad: torch.Tensor, param: torch.Tensor,
                    m: torch.Tensor | None = None, v: torch.Tensor | None = None, *, state: str = "fp32",
                    m_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    isa: str | None = None, threads: int | None = None) -> tuple[float, float]:
    """Pass 1 of a LAMB or LARS step alone (nothing is written): the float64 sums of squares of
    param and of LAMB's update direction or LARS's unscaled gradient, as golden.layerwise_sums."""
    if optimizer not in LAYERWISE:
        raise ValueError(f"host kernel: sums of squares are LAMB's and LARS's pass 1, not {optimizer!r}'s")
    call = _Call(optimizer, scalars, grad, param, m, v, state=state, m_scale=m_scale, v_scale=v_scale, isa=isa,
                 threads=threads)
    return call.sums_of_squares(scalars)


class _Call:
    """One call's buffers, checked (contiguous CPU tensors of the right dtypes and sizes, no
    overlap but a destination on its own source), as the C entry points take them."""

    def __init__(self, optimizer, scalars, grad, param, m, v, *, param_out=None, m_out=None, v_out=None,
                 working_out=None, state="fp32", m_scale=None, v_scale=None, m_scale_out=None, v_scale_out=None,
                 isa=None, threads=None):
        if optimizer not in OPTIMIZER_CODES:
            raise ValueError(f"host kernel: unknown optimizer {optimizer!r}; choose one of "
                             f"{', '.join(OPTIMIZER_CODES)}")
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"host kernel: param must be a torch.Tensor, got {type(param).__name__}")
        n = param.numel()
        pieces = golden.stored_pieces(state, "m", n)
        adam = optimizer not in MOMENTUM_OPTIMIZERS  # Adam, AdamW, LAMB: m and v
        uses_m, uses_v = adam or scalars.momentum != 0, adam
        quantized = state == "8bit"
        for name, t, needed in (("m", m, uses_m), ("v", v, uses_v), ("m_scale", m_scale, uses_m and quantized),
                                ("v_scale", v_scale, uses_v and quantized)):
            if needed and t is None:
                raise ValueError(f"host kernel: {optimizer} needs the state tensor {name} ({state} state)")
        m, v = (m if uses_m else None), (v if uses_v else None)
        m_scale, v_scale = (m_scale if uses_m and quantized else None), (v_scale if uses_v and quantized else None)
        param_out = param if param_out is None else param_out
        m_out = (m if m_out is None else m_out) if uses_m else None
        v_out = (v if v_out is None else v_out) if uses_v else None
        m_scale_out = (m_scale if m_scale_out is None else m_scale_out) if m_scale is not None else None
        v_scale_out = (v_scale if v_scale_out is None else v_scale_out) if v_scale is not None else None
        buffers = {"grad": grad, "param": param, "m": m, "v": v, "m_scale": m_scale, "v_scale": v_scale,
                   "param_out": param_out, "m_out": m_out, "v_out": v_out, "m_scale_out": m_scale_out,
                   "v_scale_out": v_scale_out, "working_out": working_out}
        blocks = pieces.get("m_scale", (None, n))[1]
        _check_buffers(buffers, n, {name: blocks for name in ("m_scale", "v_scale", "m_scale_out", "v_scale_out")})
        if grad.dtype not in GRAD_CODES:
            raise TypeError(f"host kernel: grad has dtype {grad.dtype}; it takes float32, bfloat16 or float16")
        want = {"param": torch.float32, "param_out": torch.float32}
        for name in ("m", "v", "m_out", "v_out"):
            want[name] = golden.STORED_DTYPES[state]
        for name in ("m_scale", "v_scale", "m_scale_out", "v_scale_out"):
            want[name] = torch.float32
        for name, dtype in want.items():
            if buffers[name] is not None and buffers[name].dtype != dtype:
                raise TypeError(f"host kernel: {name} has dtype {buffers[name].dtype}; with {state} state it is "
                                f"{dtype}")
        if working_out is not None and working_out.dtype not in WORKING_CODES:
            raise TypeError(f"host kernel: working_out has dtype {working_out.dtype}; it takes bfloat16 or float16 "
                            f"(an fp32 working copy is param itself)")
        sources = {k: buffers[k] for k in ("grad", "param", "m", "v", "m_scale", "v_scale") if buffers[k] is not None}
        destinations = {k: (buffers[k], src) for k, src in (
            ("param_out", "param"), ("m_out", "m"), ("v_out", "v"), ("m_scale_out", "m_scale"),
            ("v_scale_out", "v_scale"), ("working_out", None)) if buffers[k] is not None}
        _check_overlap(sources, destinations)
        threads = default_threads() if threads is None else threads
        if threads < 1:
            raise ValueError(f"host kernel: threads must be >= 1, got {threads}")
        self.optimizer, self.n, self.threads = optimizer, n, threads
        self.tensors = buffers  # the C side gets their addresses: they live as long as the call
        self.buffers = _Buffers(*(None if buffers[name] is None else buffers[name].data_ptr() for name in (
            "grad", "param", "param_out", "m", "v", "m_out", "v_out", "m_scale", "v_scale", "m_scale_out",
            "v_scale_out", "working_out")))
        self.formats = (GRAD_CODES[grad.dtype], STATE_CODES[state], ctypes.byref(_CODEBOOKS))
        self.working = -1 if working_out is None else WORKING_CODES[working_out.dtype]
        self.isa = ISAS.index(resolve_isa(isa))

    def _scalars(self, scalars: StepScalars):
        return ctypes.byref(_Scalars(OPTIMIZER_CODES[self.optimizer], int(scalars.nesterov), *(
            getattr(scalars, name) for name, _ in _Scalars._fields_[2:])))

    def sums_of_squares(self, scalars: StepScalars) -> tuple[float, float]:
        sums = (ctypes.c_double * 2)()
        rc = library().l2l_host_norms(self._scalars(scalars), self.n, ctypes.byref(self.buffers), *self.formats,
                                      self.isa, self.threads, sums)
        if rc < 0:
            raise RuntimeError(f"host kernel failed with code {rc}")
        return sums[0], sums[1]

    def step(self, scalars: StepScalars) -> bool:
        rc = library().l2l_host_step(self._scalars(scalars), self.n, ctypes.byref(self.buffers), *self.formats,
                                     self.working, self.isa, self.threads)
        if rc < 0:
            raise RuntimeError(f"host kernel failed with code {rc}")
        return bool(rc)


def stream(reads: list[torch.Tensor], updates: list[torch.Tensor], writes: list[torch.Tensor], *,
           nontemporal: bool = False, isa: str | None = None, threads: int | None = None) -> None:
    """The memory reference of `l2l bench eps`: moves the bytes of a step with no arithmetic.
    Every tensor has the same number of elements n; `reads` are only read, `updates` read and
    written in place (one integer add), `writes` only written. `nontemporal` uses streaming
    stores (the tensors must then be 64-byte aligned)."""
    tensors = [*reads, *updates, *writes]
    if not tensors or len(tensors) > _STREAMS:
        raise ValueError(f"host stream: 1 to {_STREAMS} tensors, got {len(tensors)}")
    n = tensors[0].numel()
    _check_buffers({f"stream {k}": t for k, t in enumerate(tensors)}, n)
    if nontemporal and any(t.data_ptr() % 64 for t in tensors):
        raise ValueError("host stream: non-temporal stores need 64-byte aligned tensors")
    job = _Stream(len(reads), len(updates), len(writes), int(nontemporal),
                  (ctypes.c_int32 * _STREAMS)(*(t.element_size() for t in tensors)),
                  (ctypes.c_void_p * _STREAMS)(*(t.data_ptr() for t in tensors)))
    rc = library().l2l_host_stream(n, ctypes.byref(job), ISAS.index(resolve_isa(isa)),
                                   default_threads() if threads is None else threads)
    if rc < 0:
        raise RuntimeError(f"host stream failed with code {rc}")
