"""Compressed optimizer state (bf16, block-wise 8-bit m and v): the golden rule against an
independent reading of its code books, and the host kernel bit for bit against golden."""
import numpy as np
import pytest
import torch

from l2l_hw.eps import golden, host_kernel
from l2l_hw.eps.base import STATE_SLOTS, OptimConfig

AVAILABLE = host_kernel.available_isas()
ISA_PARAMS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in AVAILABLE, reason=f"this CPU lacks {isa}"))
              for isa in host_kernel.ISAS]
BLOCK = golden.QUANT_BLOCK
TILE = host_kernel.tile()
OPTIMIZERS = {
    "adamw": dict(optimizer="adamw", lr=3e-3, weight_decay=0.1),
    "adam": dict(optimizer="adam", lr=2e-3, weight_decay=0.05, betas=(0.8, 0.95)),
    "sgd-momentum": dict(optimizer="sgd", lr=0.1, momentum=0.9, dampening=0.3, weight_decay=1e-2),
    "lamb": dict(optimizer="lamb", lr=5e-3, weight_decay=0.01),
    "lars": dict(optimizer="lars", lr=0.5, momentum=0.9, weight_decay=1e-3),
}


# ---------------------------------------------------------------------------- the code books

def minifloat_values(exp_bits, man_bits, signed):
    """Every value of the code book from its definition, in float64: normals
    2^(e - bias) (1 + f / 2^man_bits) for e >= 1, subnormals 2^(1 - bias) f / 2^man_bits."""
    bias = 2**exp_bits - 1
    mags = [2.0 ** (1 - bias) * f / 2**man_bits for f in range(2**man_bits)]
    mags += [2.0 ** (e - bias) * (1 + f / 2**man_bits) for e in range(1, 2**exp_bits) for f in range(2**man_bits)]
    return np.array(mags + [-x for x in mags] if signed else mags)


@pytest.mark.parametrize("code", [golden.M_CODE, golden.V_CODE], ids=lambda c: c.name)
def test_code_book_is_the_minifloat_it_claims(code):
    values = code.values().astype(np.float64)
    assert np.array_equal(values, minifloat_values(code.exp_bits, code.man_bits, code.signed))
    mags = values[:128] if code.signed else values
    assert (np.diff(mags) > 0).all(), "magnitude codes must be strictly increasing"
    assert mags[-1] == 2 - 2.0**-code.man_bits


def test_smallest_codes_of_m_and_of_sqrt_v_are_alike():
    m, v = golden.M_CODE.values(), golden.V_CODE.values()
    assert np.min(m[m > 0]) == 2.0**-17 and np.min(v[v > 0]) == 2.0**-33  # sqrt(v): 2^-16.5


def random_block_values(rng, n, signed):
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-9, 3, n)).astype(np.float32)
    return x if signed else np.abs(x)


@pytest.mark.parametrize("code", [golden.M_CODE, golden.V_CODE], ids=lambda c: c.name)
def test_quantize_picks_a_nearest_code_and_the_smallest_power_of_two_scale(code):
    rng = np.random.default_rng(0)
    x = random_block_values(rng, 40 * BLOCK + 77, code.signed)
    x[BLOCK: 2 * BLOCK] *= np.float32(1e-30)  # a block near the float32 floor
    codes, scales = golden.quantize(x, code)
    assert scales.size == 41 and codes.dtype == np.uint8
    back = golden.dequantize(codes, scales, code).astype(np.float64)
    book = np.unique(minifloat_values(code.exp_bits, code.man_bits, code.signed))
    for b in range(scales.size):
        block = x[b * BLOCK: (b + 1) * BLOCK].astype(np.float64)
        s = float(scales[b])
        assert s > 0 and np.log2(s) == np.round(np.log2(s)), f"block {b}: scale {s} is not a power of two"
        grid = book * s
        nearest = np.abs(block[:, None] - grid[None, :]).min(axis=1)
        assert np.array_equal(np.abs(block - back[b * BLOCK: (b + 1) * BLOCK]), nearest), f"block {b}"
        # half the scale would push the largest value past the rounding range of the top code
        top = book.max()
        assert np.abs(block).max() / s <= top + 2.0**-(code.man_bits + 1)
        assert np.abs(block).max() / (s / 2) > top + 2.0**-(code.man_bits + 1)
        # relative error of values in the normal range: at most half a unit in the last place
        normal = np.abs(block) >= 2.0 ** (1 - code.bias) * s
        assert (np.abs(block - back[b * BLOCK: (b + 1) * BLOCK])[normal]
                <= 2.0 ** -(code.man_bits + 1) * np.abs(block[normal])).all()


@pytest.mark.parametrize("code", [golden.M_CODE, golden.V_CODE], ids=lambda c: c.name)
def test_quantize_is_monotonic_within_a_block(code):
    rng = np.random.default_rng(1)
    x = np.sort(random_block_values(rng, BLOCK, code.signed))
    back = golden.dequantize(*golden.quantize(x, code), code)
    assert (np.diff(back) >= 0).all()


def test_zero_nan_and_inf_blocks_are_defined():
    x = np.zeros(3 * BLOCK + 5, np.float32)
    x[1] = -0.0
    x[BLOCK + 3] = np.nan
    x[2 * BLOCK + 7] = -np.inf
    x[3 * BLOCK:] = 1.5
    codes, scales = golden.quantize(x, golden.M_CODE)
    assert scales[0] == 2.0**-126 and (codes[:BLOCK] == np.where(np.arange(BLOCK) == 1, 0x80, 0)).all()
    assert scales.view(np.uint32)[1] == scales.view(np.uint32)[2] == golden.CANONICAL_NAN32
    assert (codes[BLOCK: 3 * BLOCK] == 0).all()
    back = golden.dequantize(codes, scales, golden.M_CODE)
    assert back.view(np.uint32)[1] == 0x80000000 and (back[:BLOCK] == 0).all()
    assert np.isnan(back[BLOCK: 3 * BLOCK]).all() and (back[3 * BLOCK:] == 1.5).all()


def test_bf16_state_is_round_to_nearest_even():
    x = np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20, np.nan], np.float32)
    stored = golden.encode_state(x, "bf16", "m")["m"]
    assert list(stored) == [0x3F80, 0x3F82, 0x3F81, golden.CANONICAL_NAN_BF16]
    assert np.array_equal(golden.decode_state({"m": stored[:3]}, "bf16", "m"),
                          torch.tensor(x[:3]).to(torch.bfloat16).float().numpy())


def test_unknown_state_format_is_refused():
    with pytest.raises(ValueError, match="unknown optimizer state format 'int4'.*fp32, bf16, 8bit"):
        golden.encode_state(np.zeros(3, np.float32), "int4", "m")
    with pytest.raises(ValueError, match="unknown optimizer state format 'int4'"):
        host_kernel.step("adamw", golden.step_scalars(OptimConfig(), 1), torch.ones(3), torch.zeros(3),
                         torch.zeros(3), torch.zeros(3), state="int4")


# ---------------------------------------------------------------------------- kernel == golden

def initial_state(n, seed, optimizer, state):
    """p (a few subnormal), stored m/v (as golden encodes them from spread fp32 values) and a
    gradient, with a block of all zeros (state and gradient) where the size allows."""
    rng = np.random.default_rng(seed)
    p = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 2, n)).astype(np.float32)
    p[5::97] = np.float32(-3e-39)  # subnormal weights: their working copy is rounded, not read as zero
    g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 2, n) * 1024).astype(np.float32)
    fp32 = {"m": (rng.standard_normal(n) * 10.0 ** rng.uniform(-7, 0, n)).astype(np.float32)}
    if "v" in STATE_SLOTS[optimizer]:
        fp32["v"] = (np.abs(rng.standard_normal(n)) * 10.0 ** rng.uniform(-12, 0, n)).astype(np.float32)
    if n >= 2 * BLOCK:
        g[BLOCK: 2 * BLOCK] = 0
        for x in fp32.values():
            x[BLOCK: 2 * BLOCK] = 0
    stored = {}
    for slot, x in fp32.items():
        stored.update(golden.encode_state(x, state, slot))
    return p, stored, g


def as_numpy_bits(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy().view(np.uint32) if t.dtype == torch.float32 else t.numpy()


def check(config, state, isa, n, grad_dtype=torch.bfloat16, in_place=True, threads=2, seed=0, poison=(),
          scales=None):
    cfg = OptimConfig(**OPTIMIZERS[config])
    s = golden.step_scalars(cfg, 3, 1 / 1024)
    p, stored, g = initial_state(n, seed, cfg.optimizer, state)
    for name, values in (scales or {}).items():  # block scales replaced, as a loaded state may hold them
        if name in stored:
            stored[name][: len(values)] = values
    grad = torch.from_numpy(g).to(grad_dtype)
    for i, value in poison:
        grad[i] = value
    want_p, want = golden.apply_rule_stored(cfg.optimizer, s, p, stored, golden.grad_to_numpy(grad), state)
    want_found = not np.isfinite(golden.grad_to_numpy(grad) * np.float32(s.inv_scale)).all()

    src = {k: t.clone() for k, t in golden.state_tensors(stored).items()}
    dst = src if in_place else {k: torch.full_like(t, 0x55 if t.dtype == torch.uint8 else float("nan"))
                                for k, t in src.items()}
    param = torch.from_numpy(p.copy())
    param_out = param if in_place else torch.full_like(param, float("nan"))
    working = torch.empty(n, dtype=torch.bfloat16)
    found = host_kernel.step(
        cfg.optimizer, s, grad, param, src["m"], src.get("v"), param_out=param_out, m_out=dst["m"],
        v_out=dst.get("v"), m_scale=src.get("m_scale"), v_scale=src.get("v_scale"),
        m_scale_out=dst.get("m_scale"), v_scale_out=dst.get("v_scale"), working_out=working, state=state,
        isa=isa, threads=threads)
    assert found == want_found
    pairs = [("param", param_out, want_p), ("working copy", working, golden.to_bf16_bits(want_p))]
    pairs += [(k, dst[k], want[k]) for k in want]
    for name, ours, theirs in pairs:
        a = as_numpy_bits(ours)
        b = theirs.view(np.uint32) if theirs.dtype == np.float32 else theirs
        bad = np.flatnonzero(a != b)
        assert bad.size == 0, f"{state} {name} (n={n}): {bad.size} of {a.size} differ, first at {bad[0]}: " \
                              f"{a[bad[0]]:#x} != {b[bad[0]]:#x}"
    if not in_place:
        for k, t in src.items():
            assert np.array_equal(as_numpy_bits(t), stored[k].view(np.uint32) if stored[k].dtype == np.float32
                                  else stored[k]), f"source {k} was written"


SIZES = (1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17, TILE + 300)


@pytest.mark.parametrize("state", ["bf16", "8bit"])
@pytest.mark.parametrize("config", list(OPTIMIZERS))
@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_kernel_bit_identical_to_golden_compressed_state(isa, config, state):
    for n in SIZES:
        check(config, state, isa, n)
    check(config, state, isa, 2 * BLOCK + 3, grad_dtype=torch.float32, in_place=False)


@pytest.mark.parametrize("state", ["bf16", "8bit"])
@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_kernel_bit_identical_to_golden_compressed_state_many_tiles_and_threads(isa, state):
    check("adamw", state, isa, 3 * TILE + 1000, grad_dtype=torch.float16, threads=3, seed=4)


@pytest.mark.parametrize("state", ["bf16", "8bit"])
@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_nan_and_inf_gradients_with_compressed_state(isa, state):
    n = 5 * BLOCK + 9
    poison = ((3, float("nan")), (2 * BLOCK + 8, float("inf")), (n - 1, -float("inf")))
    for config in ("adamw", "sgd-momentum", "lamb", "lars"):
        check(config, state, isa, n, grad_dtype=torch.float32, poison=poison, seed=2)


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_8bit_blocks_of_any_scale_decode_as_golden(isa):
    # 2^20 and 2^40 lie above each code's bias (no single-multiply decode), 3 is not a power
    # of two, then a subnormal scale and zero: none comes from the encoder, a checkpoint may hold them.
    # 2^127: the updated block's maximum needs a scale above 2^126, so its codes saturate;
    # -2 and -0: negative state (v too), encoded by its magnitude
    odd = np.array([2.0**20, 2.0**40, 3.0, 2.0**-140, 0.0, 2.0**-126, 2.0**127, -2.0, -0.0], np.float32)
    for config in ("adamw", "sgd-momentum", "lamb"):
        check(config, "8bit", isa, 10 * BLOCK + 5, scales={"m_scale": odd, "v_scale": odd[::-1].copy()})
        check(config, "8bit", isa, 10 * BLOCK + 5, scales={"m_scale": odd[::-1].copy(), "v_scale": odd})


def test_compressed_state_buffers_are_checked():
    n = BLOCK + 1
    s = golden.step_scalars(OptimConfig(), 1)
    codes = torch.zeros(n, dtype=torch.uint8)
    scale = torch.ones(2)
    args = ("adamw", s, torch.ones(n), torch.zeros(n))
    with pytest.raises(ValueError, match="adamw needs the state tensor m_scale"):
        host_kernel.step(*args, codes, codes.clone(), state="8bit")
    with pytest.raises(ValueError, match="v_scale has 1 elements; 257 params need 2"):
        host_kernel.step(*args, codes, codes.clone(), m_scale=scale, v_scale=torch.ones(1), state="8bit")
    with pytest.raises(TypeError, match="m has dtype torch.float32; with 8bit state it is torch.uint8"):
        host_kernel.step(*args, torch.zeros(n), codes, m_scale=scale, v_scale=scale.clone(), state="8bit")
    with pytest.raises(TypeError, match="v has dtype torch.float32; with bf16 state it is torch.bfloat16"):
        host_kernel.step(*args, torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n), state="bf16")
    with pytest.raises(ValueError, match="(m_scale_out overlaps v_scale|v_scale_out overlaps m_scale)"):
        host_kernel.step(*args, codes, codes.clone(), m_scale=scale, v_scale=scale, state="8bit")
