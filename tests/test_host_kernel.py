"""The fused host kernel: bit-identical to golden.apply_rule on every ISA path, and strict about its buffers."""
import numpy as np
import pytest
import torch

import l2l_hw
from l2l_hw.eps import golden, host_kernel
from l2l_hw.eps.base import STATE_SLOTS, OptimConfig

ISAS = host_kernel.ISAS
AVAILABLE = host_kernel.available_isas()
TILE = host_kernel.tile()
SMALL_SIZES = (0, 1, 7, TILE - 1, TILE + 1)
BIG = 2**20 + 3
OPTIMIZERS = {
    "adamw": dict(optimizer="adamw", lr=3e-3, weight_decay=0.1),
    "adam": dict(optimizer="adam", lr=2e-3, weight_decay=0.05, betas=(0.8, 0.95)),
    "sgd-momentum": dict(optimizer="sgd", lr=0.1, momentum=0.9, dampening=0.3, weight_decay=1e-2),
    "sgd-nesterov": dict(optimizer="sgd", lr=0.1, momentum=0.8, nesterov=True),
    "sgd-plain": dict(optimizer="sgd", lr=0.1),
    "lamb": dict(optimizer="lamb", lr=5e-3, weight_decay=0.01, betas=(0.85, 0.99)),
    "lars": dict(optimizer="lars", lr=0.5, momentum=0.9, weight_decay=1e-3, trust_coefficient=2e-3),
}
GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WORKING = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def isa_param(isa):
    return pytest.param(isa, marks=pytest.mark.skipif(isa not in AVAILABLE, reason=f"this CPU lacks {isa}"))


ISA_PARAMS = [isa_param(isa) for isa in ISAS]


def random_state(n, seed, optimizer):
    """p, m, v spanning many decades (subnormals, fp16 overflow and underflow, bf16 ties) and a gradient."""
    rng = np.random.default_rng(seed)
    def spread(lo, hi):
        return (rng.standard_normal(n) * 10.0 ** rng.uniform(lo, hi, n)).astype(np.float32)
    p = spread(-8, 5)
    p[: n // 50] = rng.choice(np.array([0.0, -0.0, 1e-40, -3e-39, 65520.0, 1.00390625], np.float32), n // 50)
    m = spread(-6, 0)
    v = np.abs(spread(-10, 0)) if "v" in STATE_SLOTS[optimizer] else None
    g = spread(-4, 3) * np.float32(1024)  # the loss scale
    return p, m, v, g


def grad_tensor(g: np.ndarray, dtype) -> torch.Tensor:
    with np.errstate(over="ignore"):
        return torch.from_numpy(g.copy()).to(dtype)


def expected(optimizer, s, p, m, v, grad, working):
    """The golden rule (LAMB and LARS: pass 1 then pass 2), its canonical NaNs, the working copy bits and the flag."""
    g = golden.grad_to_numpy(grad)
    s = golden.layerwise_scalars(optimizer, s, p, m, v, g)
    with np.errstate(all="ignore"):
        found = not np.isfinite(g * np.float32(s.inv_scale)).all()
        ep, em, ev = golden.apply_rule(optimizer, s, p, m, v, g, np.sqrt)
    ep, em = (golden.canonicalize_nan(np.array(x, np.float32)) for x in (ep, em))
    ev = None if ev is None else golden.canonicalize_nan(np.array(ev, np.float32))
    w = None if working is None else (golden.to_bf16_bits(ep) if working == torch.bfloat16 else golden.to_fp16_bits(ep))
    return ep, em, ev, w, found


def run_kernel(optimizer, s, p, m, v, grad, working, isa, in_place, threads=2):
    """The kernel on torch copies of the inputs; returns (p, m, v, working bits, flag) and checks
    the sources were left alone when the destinations are separate."""
    src = [None if x is None else torch.from_numpy(x.copy()) for x in (p, m, v)]
    dst = src if in_place else [None if x is None else torch.full_like(x, float("nan")) for x in src]
    w = None if working is None else torch.empty(p.shape, dtype=working)
    found = host_kernel.step(optimizer, s, grad, src[0], src[1], src[2], param_out=dst[0], m_out=dst[1],
                             v_out=dst[2], working_out=w, isa=isa, threads=threads)
    if not in_place:
        for x, t in zip((p, m, v), src):
            assert t is None or np.array_equal(t.numpy().view(np.uint32), x.view(np.uint32)), "a source was written"
    bits = None if w is None else w.view(torch.int16).numpy().view(np.uint16)
    return (*(None if t is None else t.numpy() for t in dst), bits, found)


def assert_bits(name, ours, theirs):
    if theirs is None:
        return
    a, b = ours.view(np.uint32 if ours.dtype == np.float32 else np.uint16), theirs.view(
        np.uint32 if theirs.dtype == np.float32 else np.uint16)
    bad = np.flatnonzero(a != b)
    assert bad.size == 0, f"{name}: {bad.size} of {a.size} differ, first at {bad[0]}: {a[bad[0]]:#x} != {b[bad[0]]:#x}"


def check(config, grad_dtype, working, isa, in_place, n, step=3, inv_scale=1 / 1024, threads=2, seed=0):
    cfg = OptimConfig(**OPTIMIZERS[config])
    s = golden.step_scalars(cfg, step, inv_scale)
    p, m, v, g = random_state(n, seed, cfg.optimizer)
    grad = grad_tensor(g, grad_dtype)
    want = expected(cfg.optimizer, s, p, m, v, grad, working)
    got = run_kernel(cfg.optimizer, s, p, m, v, grad, working, isa, in_place, threads)
    plain_sgd = cfg.optimizer == "sgd" and cfg.momentum == 0  # m is no state of plain SGD: not written
    for name, ours, theirs in zip(("param", "m", "v", "working copy"), got[:4], want[:4]):
        if not (name == "m" and plain_sgd):
            assert_bits(f"{name} (n={n})", ours, theirs)
    assert got[4] == want[4], f"non-finite flag {got[4]}, golden {want[4]} (n={n})"


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "separate"])
@pytest.mark.parametrize("working", list(WORKING))
@pytest.mark.parametrize("grad_dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("config", list(OPTIMIZERS))
@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_kernel_bit_identical_to_golden_small_sizes(isa, config, grad_dtype, working, in_place):
    for n in SMALL_SIZES:
        check(config, GRAD_DTYPES[grad_dtype], WORKING[working], isa, in_place, n)


@pytest.mark.parametrize("grad_dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_kernel_bit_identical_to_golden_2_pow_20_plus_3_adamw(isa, grad_dtype):
    working = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[grad_dtype]
    check("adamw", GRAD_DTYPES[grad_dtype], working, isa, in_place=grad_dtype != "fp16", n=BIG, threads=3)


@pytest.mark.parametrize("config", ["adam", "sgd-momentum", "sgd-nesterov", "sgd-plain", "lamb", "lars"])
@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_kernel_bit_identical_to_golden_2_pow_20_plus_3_other_optimizers(isa, config):
    check(config, torch.bfloat16, torch.bfloat16, isa, in_place=config != "adam", n=BIG)


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_first_step_and_no_loss_scale_bit_identical(isa):
    for config in OPTIMIZERS:
        check(config, torch.float32, torch.float16, isa, True, TILE + 1, step=1, inv_scale=1.0)


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_nan_and_inf_gradients_set_flag_and_give_canonical_nans(isa):
    n = 3 * TILE + 5
    for grad_dtype in GRAD_DTYPES.values():
        for config, working in (("adamw", torch.bfloat16), ("sgd-momentum", torch.float16),
                                ("lamb", torch.bfloat16), ("lars", torch.float16)):
            cfg = OptimConfig(**OPTIMIZERS[config])
            s = golden.step_scalars(cfg, 2, 1.0)
            p, m, v, g = random_state(n, 1, cfg.optimizer)
            g = g / np.float32(1024)
            grad = grad_tensor(g, grad_dtype)
            grad[5], grad[TILE + 3], grad[n - 1] = float("nan"), float("inf"), -float("inf")
            if grad_dtype == torch.float32:  # a negative quiet NaN and a signalling NaN payload
                grad.view(torch.int32)[17] = np.int32(np.uint32(0xFFC00001).view(np.int32))
                grad.view(torch.int32)[18] = 0x7F800001
            want = expected(cfg.optimizer, s, p, m, v, grad, working)
            got = run_kernel(cfg.optimizer, s, p, m, v, grad, working, isa, in_place=False)
            assert want[4] and got[4], "a NaN or Inf gradient must set the flag"
            for name, ours, theirs in zip(("param", "m", "v", "working copy"), got[:4], want[:4]):
                assert_bits(name, ours, theirs)
            assert got[0].view(np.uint32)[5] == golden.CANONICAL_NAN32
            assert got[3][5] == (golden.CANONICAL_NAN_BF16 if working == torch.bfloat16 else golden.CANONICAL_NAN_FP16)


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_non_finite_state_with_finite_gradients_gives_canonical_nans(isa):
    """NaN (of any sign and payload) and Inf already in p, m or v, every gradient finite: the
    invalid operations they cause (Inf - Inf, 0 x Inf) make the CPU's default NaN, which is
    negative; every NaN written must still be golden's canonical one, in p, m, v and the copy."""
    n = 2 * TILE + 37
    odd = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFC00123, 0x7F800000, 0xFF800000], np.uint32).view(np.float32)
    for config, working in (("adamw", torch.bfloat16), ("adam", torch.float16), ("sgd-nesterov", torch.bfloat16),
                            ("sgd-momentum", None), ("lamb", torch.bfloat16), ("lars", None)):
        cfg = OptimConfig(**OPTIMIZERS[config])
        s = golden.step_scalars(cfg, 2, 1 / 1024)
        p, m, v, g = random_state(n, 3, cfg.optimizer)
        for k, x in enumerate(x for x in (p, m, v) if x is not None):
            x[k * 97 + 11 :: 1201][: odd.size * 3] = np.tile(odd, 3)[: x[k * 97 + 11 :: 1201].size]
        grad = grad_tensor(g, torch.float32)
        want = expected(cfg.optimizer, s, p, m, v, grad, working)
        got = run_kernel(cfg.optimizer, s, p, m, v, grad, working, isa, in_place=True)
        assert not want[4] and not got[4], "finite gradients do not set the flag"
        assert np.isnan(want[0]).any(), "the case must produce NaN weights"
        for name, ours, theirs in zip(("param", "m", "v", "working copy"), got[:4], want[:4]):
            assert_bits(name, ours, theirs)


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_every_rounding_of_the_denominator_shows_at_zero_weights(isa):
    """With p = 0 the new weight is -(m x step size) / denom, so a one-ulp error in
    sqrt(v) / bias_correction2_sqrt shows in p's bits (at |p| ~ 1 it would round away). v spans
    every binade of float32 (subnormals, 0, the largest floats, Inf); the steps give 147
    different bias corrections, for which the AVX-512 loops take the FMA quotient (each is
    checked first: a step this small would not run the check), and one below 2^-20
    (beta2 = 1 - 1e-15), which they must divide."""
    n = 4 * TILE + 5
    rng = np.random.default_rng(7)
    v = np.abs(rng.standard_normal(n).astype(np.float32)) * np.float32(2.0) ** rng.integers(-149, 127, n).astype(np.float32)
    v[:6] = [0.0, 1e-45, 3.4e38, np.inf, 1.0, 2.0**-126]
    m = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 0, n)).astype(np.float32)
    g = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    p = np.zeros(n, np.float32)
    grad = grad_tensor(g, torch.float32)
    cases = [(beta2, step) for beta2 in (0.95, 0.999, 0.99999) for step in range(1, 50)] + [(1 - 1e-15, 1)]
    for beta2, step in cases:
        cfg = OptimConfig(optimizer="adamw", lr=1e-3, weight_decay=0.1, betas=(0.9, beta2))
        s = golden.step_scalars(cfg, step)
        if isa == "avx512":
            assert host_kernel.bias_correction_by_fma(s) == (beta2 < 1 - 1e-9)
        want = expected("adamw", s, p, m, v, grad, torch.bfloat16)
        got = run_kernel("adamw", s, p, m, v, grad, torch.bfloat16, isa, in_place=True)
        for name, ours, theirs in zip(("param", "m", "v", "working copy"), got[:4], want[:4]):
            assert_bits(f"{name} (beta2 {beta2}, step {step}, bias correction {s.bias_correction2_sqrt})", ours, theirs)
    assert golden.step_scalars(OptimConfig(betas=(0.9, 1 - 1e-15)), 1).bias_correction2_sqrt < 2.0**-20


@pytest.mark.skipif("avx512" not in AVAILABLE, reason="this CPU lacks avx512")
def test_avx512_divides_by_the_bias_correction_with_a_proven_fma_quotient():
    """The exhaustive check accepts the bias corrections of ordinary runs (so the AVX-512
    loops take the quotient without a division) and refuses a divisor outside [2^-20, 2^20],
    where the argument that one binade's check covers every sqrt(v) does not hold."""
    for beta2 in (0.95, 0.999, 0.99999):
        for step in (1, 2, 10, 1000, 10**6):
            s = golden.step_scalars(OptimConfig(betas=(0.9, beta2)), step)
            assert host_kernel.bias_correction_by_fma(s), (beta2, step, s.bias_correction2_sqrt)
    assert not host_kernel.bias_correction_by_fma(golden.step_scalars(OptimConfig(betas=(0.9, 1 - 1e-15)), 1))


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_unscaling_overflow_sets_flag_and_finite_gradients_do_not(isa):
    s = golden.step_scalars(OptimConfig(), 1, inv_scale=4.0)
    p = torch.zeros(40)
    g = torch.ones(40)
    assert host_kernel.step("adamw", s, g, p, torch.zeros(40), torch.zeros(40), isa=isa) is False
    g[33] = 1e38  # finite, but times 4 it is Inf
    assert host_kernel.step("adamw", s, g, p, torch.zeros(40), torch.zeros(40), isa=isa) is True


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_subnormals_kept_when_caller_flushes_denormals(isa):
    """torch.set_flush_denormal(True) sets FTZ|DAZ in the caller's MXCSR; the kernel sets its own."""
    n = 2 * TILE + 3
    cfg = OptimConfig(**OPTIMIZERS["sgd-momentum"])
    s = golden.step_scalars(cfg, 2, 1.0)
    rng = np.random.default_rng(2)
    p = (rng.standard_normal(n) * 1e-39).astype(np.float32)  # subnormal
    m = (rng.standard_normal(n) * 1e-39).astype(np.float32)
    grad = torch.from_numpy((rng.standard_normal(n) * 1e-38).astype(np.float32))
    want = expected(cfg.optimizer, s, p, m, None, grad, torch.bfloat16)
    assert (np.abs(want[0]) < np.finfo(np.float32).tiny).any() and (want[0] != 0).any()
    before = host_kernel.caller_mxcsr()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        flushed = host_kernel.caller_mxcsr()
        assert flushed & 0x8040 == 0x8040, f"MXCSR {flushed:#x}: expected FTZ and DAZ set"
        got = run_kernel(cfg.optimizer, s, p, m, None, grad, torch.bfloat16, isa, in_place=True)
        assert host_kernel.caller_mxcsr() == flushed, "the kernel must restore the caller's MXCSR"
    finally:
        torch.set_flush_denormal(False)
    assert host_kernel.caller_mxcsr() == before
    for name, ours, theirs in zip(("param", "m", "v", "working copy"), got[:4], want[:4]):
        assert_bits(name, ours, theirs)


@pytest.mark.parametrize("config", ["adamw", "lamb", "lars"])  # LAMB, LARS: the norms' order is fixed too
def test_every_isa_and_thread_count_gives_the_same_bits(config):
    n = 5 * TILE + 9
    cfg = OptimConfig(**OPTIMIZERS[config])
    s = golden.step_scalars(cfg, 4, 1 / 1024)
    p, m, v, g = random_state(n, 3, cfg.optimizer)
    grad = grad_tensor(g, torch.bfloat16)
    results = [run_kernel(cfg.optimizer, s, p, m, v, grad, torch.bfloat16, isa, True, threads)
               for isa in AVAILABLE for threads in (1, 2, 4)]
    for r in results[1:]:
        for a, b in ((a, b) for a, b in zip(r[:4], results[0][:4]) if b is not None):  # LARS has no v
            assert np.array_equal(a.view(np.uint32 if a.dtype == np.float32 else np.uint16),
                                  b.view(np.uint32 if b.dtype == np.float32 else np.uint16))


def test_isa_forced_by_environment(monkeypatch):
    monkeypatch.setenv(host_kernel.ISA_ENV, "scalar")
    assert host_kernel.resolve_isa() == "scalar"
    assert host_kernel.resolve_isa("avx2" if "avx2" in AVAILABLE else "scalar") in AVAILABLE
    monkeypatch.setenv(host_kernel.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="unknown host kernel ISA 'sse9'"):
        host_kernel.resolve_isa()
    monkeypatch.setenv(host_kernel.ISA_ENV, "scalar")
    assert l2l_hw.make_eps("cpu").kernel.isa == "scalar"


# ---------------------------------------------------------------------------- bad buffers

def adamw_buffers(n=64):
    return dict(grad=torch.randn(n), param=torch.randn(n), m=torch.zeros(n), v=torch.zeros(n))


def call(**overrides):
    s = golden.step_scalars(OptimConfig(), 1)
    b = {**adamw_buffers(), **overrides}
    return host_kernel.step("adamw", s, b.pop("grad"), b.pop("param"), b.pop("m"), b.pop("v"), **b)


def test_misaligned_buffer_is_refused_with_the_alignment_needed():
    misaligned = torch.frombuffer(bytearray(4 * 64 + 1), dtype=torch.float32, offset=1, count=64)
    with pytest.raises(ValueError, match="param .* not aligned to its 4-byte elements"):
        call(param=misaligned)
    misaligned16 = torch.frombuffer(bytearray(2 * 64 + 1), dtype=torch.bfloat16, offset=1, count=64)
    with pytest.raises(ValueError, match="working_out .* not aligned to its 2-byte elements"):
        call(working_out=misaligned16)


def test_overlapping_buffers_are_refused_but_exact_in_place_is_allowed():
    storage = torch.randn(65)
    b = adamw_buffers()
    with pytest.raises(ValueError, match="param_out overlaps param"):
        call(param=storage[:64], param_out=storage[1:])
    with pytest.raises(ValueError, match="(m_out overlaps param|param_out overlaps m_out)"):
        call(param=b["param"], m_out=b["param"])
    with pytest.raises(ValueError, match="working_out overlaps grad"):
        g = torch.randn(64)
        call(grad=g, working_out=g.view(torch.bfloat16)[:64])
    with pytest.raises(ValueError, match="(v_out overlaps param_out|param_out overlaps v_out)"):
        out = torch.empty(64)
        call(param_out=out, v_out=out)
    assert call(param=b["param"], param_out=b["param"], m=b["m"], m_out=b["m"]) is False


def test_wrong_dtype_length_layout_and_device_are_refused():
    with pytest.raises(TypeError, match="grad has dtype torch.int32"):
        call(grad=torch.ones(64, dtype=torch.int32))
    with pytest.raises(TypeError, match="param has dtype torch.float64"):
        call(param=torch.randn(64, dtype=torch.float64))
    with pytest.raises(TypeError, match="working_out has dtype torch.float32"):
        call(working_out=torch.empty(64))
    with pytest.raises(ValueError, match="v has 63 elements; param has 64"):
        call(v=torch.zeros(63))
    with pytest.raises(ValueError, match="m is not contiguous"):
        call(m=torch.zeros(128)[::2])
    with pytest.raises(ValueError, match="grad is on meta"):
        call(grad=torch.empty(64, device="meta"))
    with pytest.raises(ValueError, match="adamw needs the state tensor v"):
        call(v=None)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        call(threads=0)


def test_missing_library_says_how_to_build(monkeypatch):
    monkeypatch.setattr(host_kernel, "_lib", None)
    monkeypatch.setattr(host_kernel.importlib.machinery, "EXTENSION_SUFFIXES", [".not-built.so"])
    with pytest.raises(host_kernel.HostKernelMissing, match=r"not built.*pip install -e \."):
        host_kernel.library()
    with pytest.raises(host_kernel.HostKernelMissing, match="make test"):
        l2l_hw.make_eps("cpu")


@pytest.mark.parametrize("double_buffer", [False, True])
def test_cpu_eps_update_that_fails_its_checks_leaves_the_group_bit_identical(double_buffer):
    """In place by default: every gradient of the group reaches the host before any buffer is
    written, so one that cannot (here a meta-device tensor) leaves every tensor as it was."""
    eps = l2l_hw.make_eps("cpu", working_dtype="bf16", double_buffer=double_buffer)
    eps.register("layer0", {"a": torch.randn(10), "b": torch.randn(3)})
    before, working = eps.state_dict(), {k: t.clone() for k, t in eps.fetch("layer0").items()}
    eps.push_grads("layer0", {"a": torch.ones(10), "b": torch.ones(3, device="meta")})
    with pytest.raises(RuntimeError, match="EPS update of group 'layer0' failed"):
        eps.commit_step()
    after = eps.state_dict()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    for k, t in eps.fetch("layer0").items():
        assert torch.equal(t.view(torch.int16), working[k].view(torch.int16)), k


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_every_16_bit_gradient_pattern_widens_exactly(isa):
    """SGD with lr = 1 from p = 0 gives p = -g: every bf16 and fp16 bit pattern, NaNs included."""
    s = golden.step_scalars(OptimConfig(optimizer="sgd", lr=1.0), 1)
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        grad = bits.view(dtype)
        p = np.zeros(grad.numel(), np.float32)
        want = expected("sgd", s, p, p, None, grad, None)
        got = run_kernel("sgd", s, p, p, None, grad, None, isa, in_place=False)
        assert_bits(f"param from {dtype} gradients", got[0], want[0])
        assert got[4] and want[4]


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_random_float32_patterns_round_to_bf16_and_fp16_as_golden(isa):
    """A zero SGD step leaves p as it is (NaN made canonical); the working copy is then the
    conversion alone, over uniformly random bit patterns (subnormals, Inf, NaN, overflow)."""
    s = golden.step_scalars(OptimConfig(optimizer="sgd", lr=0.0), 1)
    rng = np.random.default_rng(4)
    p = rng.integers(0, 2**32, 2**18 + 5, dtype=np.uint32).view(np.float32)
    p[:8] = np.array([65504.0, 65519.996, 65520.0, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-24 * 1.5, -0.0, 1e-40],
                     np.float32)
    grad = torch.zeros(p.size)
    for working in (torch.bfloat16, torch.float16):
        want = expected("sgd", s, p, p, None, grad, working)
        got = run_kernel("sgd", s, p, p, None, grad, working, isa, in_place=False)
        assert_bits("param", got[0], want[0])
        assert_bits(f"{working} working copy", got[3], want[3])


def test_cpu_eps_double_buffered_matches_golden_with_previous_versions_and_discarded_steps():
    epss = [l2l_hw.make_eps(name, working_dtype="bf16", double_buffer=True, optimizer="adamw", lr=1e-2)
            for name in ("golden", "cpu")]
    g = torch.Generator().manual_seed(5)
    params = {"a": torch.randn(TILE + 3, generator=g), "b": torch.randn(7, generator=g)}
    for eps in epss:
        eps.register("layer0", params)
    for step in range(5):
        grads = {k: torch.randn(t.shape, generator=g) for k, t in params.items()}
        if step == 2:
            grads["b"][3] = float("inf")  # this step is discarded whole
        for eps in epss:
            eps.push_grads("layer0", grads)
            assert eps.commit_step(skip_nonfinite=True) == (step == 2)
        golden_eps, cpu_eps = epss
        for k, t in golden_eps.state_dict().items():
            assert torch.equal(t, cpu_eps.state_dict()[k]), (step, k)
        for previous in (False, True):
            for k, t in golden_eps.fetch("layer0", previous=previous).items():
                assert torch.equal(t.view(torch.int16), cpu_eps.fetch("layer0", previous=previous)[k].view(torch.int16))
