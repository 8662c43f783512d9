"""LAMB and LARS: golden within 2 ulp per step of the papers' algorithms written here in plain
torch, the norms' fixed summation order, the cpu EPS bit for bit as golden (every state format),
and the backends and options that refuse them. The host kernel against golden on every ISA path
is in tests/test_host_kernel.py and tests/test_state_formats.py (their OPTIMIZERS hold lamb, lars)."""
import math

import numpy as np
import pytest
import torch

import l2l_hw
from l2l_hw.eps import golden, host_kernel
from l2l_hw.eps.options import EpsOptions
from l2l_hw.options import OptionError
from tests.test_eps import ulp_at_scale

# One large tensor, one that starts at zero (its trust ratio is 1 at step 1), one without weight decay.
SHAPES = {"w": (64, 64), "b": (64,), "norm": (40,)}
NO_DECAY = frozenset({"norm"})


# ---------------------------------------------------------------------------- the references

def vector_norm64(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x, dtype=torch.float64))


def lamb_reference(x, g, m, v, t, lr, betas, eps, wd):
    """You et al., arXiv 1904.00962, Algorithm 2 (LAMB), one step of one tensor: Adam's moments
    and bias corrections, r = m_hat / (sqrt(v_hat) + eps), u = r + wd x, and the step
    lr phi(||x||) / ||u|| u with phi the identity and ratio 1 where a norm is 0. The norms in
    float64 (the paper leaves their precision open; the EPS takes them so). Adam's lines are
    written as torch.optim.Adam computes them (lerp_, mul_ + addcmul_, sqrt(v) / sqrt(bc2) + eps)
    but without the FMA torch fuses into lerp_ and addcmul_ and with the IEEE square root, which
    torch's float32 sqrt is not on every CPU (docs/NUMERICS.md; golden's AdamW is checked against
    torch.optim.AdamW itself in tests/test_eps.py): a difference of one rounding in m or v moves
    u by many of its ulps where m cancels, and LAMB makes such elements the whole step."""
    b1, b2 = betas
    m = m + (g - m) * (1 - b1)
    v = v * b2 + ((1 - b2) * g) * g
    denom = (v.double().sqrt().float() / math.sqrt(1 - b2**t)) + eps  # sqrt in float64 rounded once: IEEE
    u = (m / (1 - b1**t)) / denom + wd * x
    x_norm, u_norm = vector_norm64(x), vector_norm64(u)
    ratio = x_norm / u_norm if x_norm > 0 and u_norm > 0 else 1.0
    return x - (lr * ratio) * u, {"m": m, "v": v}


def lars_reference(x, g, buf, t, lr, momentum, wd, eta):
    """You, Gitman, Ginsburg, arXiv 1708.03888, Algorithm 1 (LARS), one step of one tensor:
    local lr eta ||x|| / (||g|| + wd ||x||) (1 where a norm is 0) on g + wd x, heavy-ball
    momentum; lr outside the buffer as torch.optim.SGD keeps it (NVIDIA's LARC, timm's Lars)."""
    x_norm, g_norm = vector_norm64(x), vector_norm64(g)
    ratio = eta * x_norm / (g_norm + wd * x_norm) if x_norm > 0 and g_norm > 0 else 1.0
    d = (g + wd * x) * ratio
    buf = d.clone() if t == 1 else momentum * buf + d
    return x - lr * buf, {"m": buf}


def gradients(gen, step):
    """Each tensor's gradient a random normal vector spanning four decades over the steps."""
    return {n: torch.randn(s, generator=gen) * 10 ** float(torch.empty(()).uniform_(-3, 1, generator=gen))
            for n, s in SHAPES.items()}


def within_2_ulp_per_step(optimizer, options, reference):
    """20 steps; each starts golden from the reference's state (as the AdamW test); p and every
    state slot within 2 ulp at the scale of the update. Returns the worst distance."""
    gen = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(SHAPES["w"], generator=gen) * 0.05, "b": torch.zeros(SHAPES["b"]),
             "norm": 1 + 0.1 * torch.randn(SHAPES["norm"], generator=gen)}
    eps = l2l_hw.make_eps("golden", optimizer=optimizer, **options)
    eps.register("layer0", {n: t.clone() for n, t in start.items()}, no_decay=NO_DECAY)
    slots = eps.slots()[1:]
    params = {n: t.clone() for n, t in start.items()}
    state = {n: {slot: torch.zeros(s) for slot in slots} for n, s in SHAPES.items()}
    worst = 0.0
    for step in range(1, 21):
        grads = gradients(gen, step)
        eps.load_state_dict({"step": torch.tensor(step - 1), **{
            f"layer0/{n}/{slot}": t.clone() for n in SHAPES for slot, t in (("param", params[n]), *state[n].items())}})
        eps.push_grads("layer0", grads)
        eps.commit_step()
        ours = eps.state_dict()
        for n in SHAPES:
            new_p, new_state = reference(params[n], grads[n], state[n], step, 0.0 if n in NO_DECAY else None)
            for slot, old, theirs in (("param", params[n], new_p), *((k, state[n][k], new_state[k]) for k in slots)):
                d = float(ulp_at_scale(ours[f"layer0/{n}/{slot}"], theirs, old).max())
                worst = max(worst, d)
                assert d <= 2, f"{optimizer} step {step}: {n}/{slot} is {d} ulp from the paper's algorithm"
            params[n], state[n] = new_p, new_state
    return worst


def test_golden_lamb_within_2_ulp_of_the_paper_per_step():
    lr, betas, adam_eps, wd = 2e-2, (0.9, 0.999), 1e-6, 0.01

    def reference(x, g, s, t, wd_override):
        return lamb_reference(x, g, s["m"], s["v"], t, lr, betas, adam_eps, wd if wd_override is None else wd_override)
    within_2_ulp_per_step("lamb", dict(lr=lr, betas=betas, eps=adam_eps, weight_decay=wd), reference)


def test_golden_lars_within_2_ulp_of_the_paper_per_step():
    lr, momentum, wd, eta = 0.5, 0.9, 5e-4, 1e-3

    def reference(x, g, s, t, wd_override):
        return lars_reference(x, g, s["m"], t, lr, momentum, wd if wd_override is None else wd_override, eta)
    within_2_ulp_per_step("lars", dict(lr=lr, momentum=momentum, weight_decay=wd, trust_coefficient=eta), reference)


def test_the_reference_check_fails_on_a_wrong_trust_ratio(monkeypatch):
    """The 2-ulp check can fail: a trust ratio off by one part in 10^6 is caught."""
    real = golden.trust_ratio
    monkeypatch.setattr(golden, "trust_ratio", lambda *a: real(*a) * (1 + 1e-6))
    with pytest.raises(AssertionError, match="ulp from the paper"):
        test_golden_lamb_within_2_ulp_of_the_paper_per_step()


# ---------------------------------------------------------------------------- the norms

def sum_of_squares_by_hand(x: np.ndarray) -> float:
    """docs/NUMERICS.md's order read literally, one float64 operation at a time."""
    total = 0.0
    for b0 in range(0, x.size, golden.NORM_BLOCK):
        lanes = [0.0] * 16
        for i in range(b0, min(b0 + golden.NORM_BLOCK, x.size)):
            lanes[(i - b0) % 16] += float(x[i]) * float(x[i])
        for width in (8, 4, 2, 1):
            lanes = [lanes[k] + lanes[k + width] for k in range(width)]
        total += lanes[0]
    return total


def test_sum_of_squares_is_the_documented_order_and_close_to_the_exact_sum():
    rng = np.random.default_rng(3)
    for n in (0, 1, 15, 16, 17, 255, 256, 257, 1000):
        x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-20, 20, n)).astype(np.float32)
        ours = golden.sum_of_squares(x)
        assert ours == sum_of_squares_by_hand(x), f"n={n}"
        exact = math.fsum(float(v) * float(v) for v in x)  # correctly rounded: independent of any order
        assert abs(ours - exact) <= 1e-13 * exact, f"n={n}"


AVAILABLE = host_kernel.available_isas()


@pytest.mark.parametrize("state", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("optimizer", ["lamb", "lars"])
@pytest.mark.parametrize("isa", [pytest.param(i, marks=pytest.mark.skipif(i not in AVAILABLE, reason=f"no {i}"))
                                 for i in host_kernel.ISAS])
def test_kernel_sums_of_squares_are_golden_to_the_last_bit(isa, optimizer, state):
    """The sums themselves, not only the float32 trust scalar they round to (which would hide a
    change of order): many terms of like size make another order give other float64 bits."""
    rng = np.random.default_rng(5)
    cfg = l2l_hw.eps.base.OptimConfig(optimizer=optimizer, lr=1e-2, weight_decay=0.01,
                                      momentum=0.9 if optimizer == "lars" else 0.0)
    s = golden.step_scalars(cfg, 3, 1 / 1024)
    for n in (1, 17, 256, 257, 3 * host_kernel.tile() + 1000):
        spread = lambda lo, hi: (rng.standard_normal(n) * 10.0 ** rng.uniform(lo, hi, n)).astype(np.float32)
        p, g = spread(-2, 2), spread(-10, 10)
        stored = {**golden.encode_state(spread(-8, 0), state, "m"),
                  **golden.encode_state(np.abs(spread(-16, 0)), state, "v")}
        if optimizer == "lars":
            stored = {k: x for k, x in stored.items() if k.startswith("m")}
        want = golden.layerwise_sums(optimizer, s, p, *(golden.decode_state(stored, state, k) if k in stored else None
                                                        for k in ("m", "v")), g)
        t = golden.state_tensors(stored)
        got = host_kernel.sums_of_squares(optimizer, s, torch.from_numpy(g), torch.from_numpy(p), t["m"], t.get("v"),
                                          state=state, m_scale=t.get("m_scale"), v_scale=t.get("v_scale"), isa=isa,
                                          threads=3)
        assert got == want, f"n={n}: {got} != golden {want}"
        if n > host_kernel.tile():  # the data tells orders apart: numpy's pairwise sum gives other bits
            assert float(np.sum(p.astype(np.float64) ** 2)) != want[0]


def test_trust_ratio_is_one_where_a_norm_is_zero_and_never_clamped():
    s = golden.step_scalars(l2l_hw.eps.base.OptimConfig(optimizer="lars", weight_decay=0.5, trust_coefficient=0.01), 1)
    for optimizer in ("lamb", "lars"):
        assert golden.trust_ratio(optimizer, s, 0.0, 4.0) == 1.0
        assert golden.trust_ratio(optimizer, s, 4.0, 0.0) == 1.0
    assert golden.trust_ratio("lamb", s, 1e6, 1e-6) == 1e6  # no upper clamp
    assert golden.trust_ratio("lars", s, 4.0, 9.0) == 0.01 * 2 / (3 + 0.5 * 2)


# ---------------------------------------------------------------------------- the cpu EPS

@pytest.mark.parametrize("state", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("optimizer", ["lamb", "lars"])
def test_cpu_eps_bit_identical_to_golden_with_every_state_format(optimizer, state):
    options = dict(lr=1e-2, weight_decay=0.01) if optimizer == "lamb" else dict(lr=0.3, momentum=0.9,
                                                                                  weight_decay=1e-3)
    shapes = {"big": (3, 70001), "b": (7,), "zero": (300,), "norm": (513,)}  # a tensor of several tiles and threads
    epss = [l2l_hw.make_eps(b, optimizer=optimizer, working_dtype="bf16", state=state, double_buffer=b == "cpu",
                            **options) for b in ("golden", "cpu")]
    gen = torch.Generator().manual_seed(1)
    start = {n: torch.randn(s, generator=gen) * 0.1 for n, s in shapes.items()}
    start["zero"].zero_()
    for eps in epss:
        eps.register("l0", {n: t.clone() for n, t in start.items()}, no_decay=frozenset({"norm"}))
    for step in range(4):
        grads = {n: (torch.randn(s, generator=gen) * 1024).to(torch.bfloat16) for n, s in shapes.items()}
        for eps in epss:
            eps.push_grads("l0", {n: g for n, g in grads.items() if not (step == 1 and n == "b")}, inv_scale=1 / 1024)
            eps.commit_step()
        a, b = (e.state_dict() for e in epss)
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8),
                                                            b[k].reshape(-1).view(torch.uint8)), k
        for n, t in epss[0].fetch("l0").items():
            assert torch.equal(t.view(torch.int16), epss[1].fetch("l0")[n].view(torch.int16)), n


def test_lamb_moves_each_tensor_by_lr_times_its_norm():
    """The layer-wise property itself: a LAMB step moves every tensor by lr x ||p|| (2-norm),
    whatever the scale of its gradient."""
    eps = l2l_hw.make_eps("cpu", optimizer="lamb", lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(2)
    start = {"small": torch.randn(1000, generator=gen) * 1e-3, "large": torch.randn(1000, generator=gen) * 10}
    eps.register("l0", {n: t.clone() for n, t in start.items()})
    eps.push_grads("l0", {"small": torch.randn(1000, generator=gen) * 1e4, "large": torch.randn(1000, generator=gen)})
    eps.commit_step()
    for n, t in eps.master("l0").items():
        moved = float((t - start[n]).double().norm() / start[n].double().norm())
        assert moved == pytest.approx(1e-2, rel=1e-5), n


# ---------------------------------------------------------------------------- what refuses them

@pytest.mark.parametrize("backend", ["fpga-sim", "fpga-pynq"])
@pytest.mark.parametrize("optimizer", ["lamb", "lars"])
def test_fpga_backends_refuse_lamb_and_lars_in_one_line(backend, optimizer):
    with pytest.raises(ValueError) as e:
        l2l_hw.make_eps(backend, optimizer=optimizer)
    message = str(e.value)
    assert "\n" not in message and f"optimizer={optimizer!r}" in message and "adamw, adam, sgd" in message


def test_sharded_state_refuses_layerwise_optimizers():
    with pytest.raises(ValueError, match="whole norms"):
        l2l_hw.make_eps("cpu", optimizer="lamb", shard_state=True)
    with pytest.raises(OptionError, match="whole norms"):
        EpsOptions(optimizer="lars", shard_state=True)


def test_options_take_lamb_and_lars_and_check_the_trust_coefficient():
    args = EpsOptions(optimizer="lars", momentum=0.9, trust_coefficient=2e-3).optimizer_arguments()
    assert args["optimizer"] == "lars" and args["trust_coefficient"] == 2e-3 and args["momentum"] == 0.9
    assert EpsOptions(optimizer="lamb").optimizer_arguments()["optimizer"] == "lamb"
    with pytest.raises(OptionError, match="trust_coefficient"):
        EpsOptions(optimizer="lars", trust_coefficient=-1.0)
    with pytest.raises(OptionError, match="momentum"):
        EpsOptions(optimizer="lamb", momentum=0.9)
