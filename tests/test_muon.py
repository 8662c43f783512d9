"""Muon in the EPS: golden and the CPU EPS bit for bit as torch.optim.Muon on the same gradients
(fp32 state; bf16 and 8-bit state against torch.optim.Muon whose momentum buffer an independent
quantizer rounds after every step), AdamW on the tensors that are not matrices, the disk tier and
checkpoints bit-exact, the relay equal to plain PyTorch with Muon, the estimate's bytes, and the
refusals (FPGA, sharded state, options of another optimizer), each one line before any weight."""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

import l2l_hw
from l2l_hw.checkpoint import open_checkpoint, save_checkpoint
from l2l_hw.cli import main
from l2l_hw.eps import golden, muon
from l2l_hw.eps.base import OptimConfig, tensor_rule
from l2l_hw.models.gpt import lm_loss
from l2l_hw.options import OptionError
from l2l_hw.train import ConfigError, TrainConfig
from tests.helpers import rel_diff
from tests.test_relay_equivalence import assert_same_training, gpt, gpt_batches, train_relay

# Tall, wide and square matrices (one without weight decay), a vector and a 3-D tensor (AdamW's).
SHAPES = {"tall": (48, 20), "wide": (12, 72), "square": (32, 32), "proj": (24, 40), "bias": (40,),
          "conv": (3, 4, 5)}
NO_DECAY = frozenset({"proj", "bias"})
MATRICES = [n for n, s in SHAPES.items() if len(s) == 2]
STEPS = 5
LR, WD = 2e-2, 0.1


def torch_fuses_lerp() -> bool:
    """Whether this torch's CPU lerp rounds its multiply-add once (an FMA): start + w (end - start)
    with the difference rounded, then the rest in float64 (exact but for a 2^-29 chance of a
    double rounding) rounded once. True wherever torch vectorizes (AVX2, AVX-512, NEON); the
    bit-exact comparisons with torch.optim.Muon need it."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4096, generator=gen), torch.randn(4096, generator=gen)
    w = np.float32(0.05)
    once = (a.double() + float(w) * (b - a).double()).float()
    return torch.equal(torch.lerp(a, b, 0.05), once)


FUSED = torch_fuses_lerp()
needs_fused_torch = pytest.mark.skipif(not FUSED, reason="this torch's CPU lerp does not fuse its multiply-add")


# ---------------------------------------------------------------------------- the fused multiply-add

def round_to_float32(x: Fraction) -> float:
    """An exact rational rounded once to float32 (nearest, ties to even), from the definition."""
    if x == 0:
        return 0.0
    e = max(math.floor(math.log2(abs(x))) - 23, -149)  # the float32 grid's spacing near x (subnormals: 2^-149)
    while abs(x) >= Fraction(2) ** (e + 24):  # log2 of a huge rational may be off by one
        e += 1
    while e > -149 and abs(x) < Fraction(2) ** (e + 23):
        e -= 1
    return float(np.float32(round(x / Fraction(2) ** e) * 2.0**e))  # round(): ties to even


def test_fma32_rounds_once_where_float64_would_round_twice():
    # 1 + 2^-23 + 2^-24 - 2^-70: float64 rounds it onto the float32 tie 1 + 2^-23 + 2^-24, which
    # ties-to-even would round up; the exact sum is below the tie, so the answer is 1 + 2^-23
    a, b, c = np.float32(1 + 2**-23), np.float32(2**-24 - 2**-47), np.float32(1 + 2**-23)
    naive = np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    assert naive == np.float32(1 + 2**-22)  # the double rounding this guards against
    assert golden.fma32(a, b, c) == np.float32(1 + 2**-23)
    assert golden.fma32(-a, b, -c) == np.float32(-(1 + 2**-23))
    assert muon.fma(torch.tensor([a]), float(b), torch.tensor([c])).item() == np.float32(1 + 2**-23)


def test_fma32_and_its_torch_twin_equal_the_exactly_rounded_sum():
    rng = np.random.default_rng(0)
    n = 3000
    a = (rng.standard_normal(n) * 10.0 ** rng.uniform(-15, 15, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 10.0 ** rng.uniform(-15, 15, n)).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(n) * 1e-7)).astype(np.float32)  # cancellation
    c[::3] = rng.standard_normal(n)[::3].astype(np.float32)
    c[1::7] = np.float32(1e-45)  # subnormal addends and results
    want = np.array([round_to_float32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                     for x, y, z in zip(a, b, c)], np.float32)
    assert np.array_equal(golden.fma32(a, b, c).view(np.uint32), want.view(np.uint32))
    ours = muon.fma(torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c))
    assert np.array_equal(ours.numpy().view(np.uint32), want.view(np.uint32))


@needs_fused_torch
@pytest.mark.parametrize("weight", [0.05, 0.3, 0.5, 0.95])
def test_lerp32_is_torch_lerp_bit_for_bit(weight):
    gen = torch.Generator().manual_seed(1)
    start, end = torch.randn(1037, generator=gen), torch.randn(1037, generator=gen) * 30
    want = torch.lerp(start, end, weight)
    w = float(np.float32(weight))
    assert torch.equal(torch.from_numpy(golden.lerp32(start.numpy(), end.numpy(), w)), want)
    assert torch.equal(muon.lerp(start, end, w), want)


# ---------------------------------------------------------------------------- the references

def independent_8bit(x: torch.Tensor) -> torch.Tensor:
    """x rounded to golden's block-wise 8-bit m format, from its definition (docs/NUMERICS.md):
    per block of QUANT_BLOCK elements, the smallest power-of-two scale 2^k (|k| <= 126) under
    which the block's largest magnitude is below the top code 1.875 plus half its last step;
    each value the nearest sign-magnitude minifloat (4 exponent bits, 3 mantissa bits,
    subnormals) times the scale, ties to the even code."""
    code = golden.M_CODE
    bias = 2**code.exp_bits - 1
    mags = [2.0 ** (1 - bias) * f / 2**code.man_bits for f in range(2**code.man_bits)]
    mags += [2.0 ** (e - bias) * (1 + f / 2**code.man_bits) for e in range(1, 2**code.exp_bits)
             for f in range(2**code.man_bits)]
    mags = np.array(mags)
    limit = mags[-1] + 2.0 ** -(code.man_bits + 1)
    flat = x.reshape(-1).double().numpy()
    out = np.zeros_like(flat)
    for start in range(0, flat.size, golden.QUANT_BLOCK):
        block = flat[start:start + golden.QUANT_BLOCK]
        top = np.abs(block).max()
        if top == 0:
            continue
        k = math.floor(math.log2(top)) - 2
        while top / 2.0**k >= limit:
            k += 1
        k = min(max(k, -126), 126)
        y = np.minimum(np.abs(block) / 2.0**k, mags[-1])
        hi = np.clip(np.searchsorted(mags, y), 1, mags.size - 1)
        lo = hi - 1
        d_lo, d_hi = y - mags[lo], mags[hi] - y
        pick = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
        out[start:start + block.size] = np.sign(block) * mags[pick] * 2.0**k
    return torch.from_numpy(out.astype(np.float32)).reshape(x.shape)


ROUND_MOMENTUM = {"fp32": None, "bf16": lambda b: b.bfloat16().float(), "8bit": independent_8bit}


def start_values():
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen) * 0.05 for n, s in SHAPES.items()}


def step_gradients(step: int) -> dict[str, torch.Tensor]:
    """Each tensor's gradient of a step: normal, spanning three decades over the steps."""
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=gen) * 10.0 ** (step % 3 - 1) for n, s in SHAPES.items()}


def torch_training(start, muon_options: dict, state: str = "fp32", steps: int = STEPS):
    """torch.optim.Muon on the matrices and torch.optim.AdamW on the rest, as the EPS splits
    them, weight decay off for NO_DECAY; after each step the momentum buffer is rounded to the
    EPS's state format (ROUND_MOMENTUM). Returns the parameters."""
    params = {n: nn.Parameter(t.clone()) for n, t in start.items()}

    def groups(names):
        return [{"params": [params[n] for n in names if n not in NO_DECAY]},
                {"params": [params[n] for n in names if n in NO_DECAY], "weight_decay": 0.0}]
    matrices = torch.optim.Muon(groups(MATRICES), lr=LR, weight_decay=WD, **muon_options)
    others = torch.optim.AdamW(groups([n for n in SHAPES if n not in MATRICES]), lr=LR, weight_decay=WD,
                               foreach=False)
    for step in range(1, steps + 1):
        for n, g in step_gradients(step).items():
            params[n].grad = g
        matrices.step()
        others.step()
        if ROUND_MOMENTUM[state] is not None:
            for n in MATRICES:
                buf = matrices.state[params[n]]["momentum_buffer"]
                buf.copy_(ROUND_MOMENTUM[state](buf))
    return {n: p.detach() for n, p in params.items()}


def eps_training(backend: str, muon_options: dict, state: str = "fp32", working_dtype: str = "fp32",
                 steps: int = STEPS, **options):
    eps = l2l_hw.make_eps(backend, optimizer="muon", lr=LR, weight_decay=WD, state=state,
                          working_dtype=working_dtype, **muon_options, **options)
    eps.register("layer0", start_values(), no_decay=NO_DECAY)
    for step in range(1, steps + 1):
        eps.push_grads("layer0", step_gradients(step))
        eps.commit_step()
    return eps


def assert_same_bits(a: dict, b: dict, what: str):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), f"{what}: {k}"


MUON_OPTIONS = {
    "defaults": {},  # torch's: momentum 0.95, Nesterov, 5 steps, the original lr adjustment
    "plain-momentum-moonshot": dict(momentum=0.9, nesterov=False, ns_steps=3, adjust_lr_fn="match_rms_adamw"),
    "low-momentum": dict(momentum=0.3, ns_steps=6),  # lerp's other branch (weight 1 - 0.3 >= 0.5)
}


# ---------------------------------------------------------------------------- EPS == torch.optim.Muon

def test_muon_takes_the_matrices_and_adamw_every_other_tensor():
    assert [tensor_rule("muon", s) for s in SHAPES.values()] == ["muon"] * 4 + ["adamw"] * 2
    assert tensor_rule("adamw", (4, 4)) == "adamw"
    eps = l2l_hw.make_eps("cpu", optimizer="muon")
    eps.register("layer0", start_values())
    keys = eps.state_dict().keys()
    assert {k for k in keys if k.startswith("layer0/tall/")} == {"layer0/tall/param", "layer0/tall/m"}
    assert {k for k in keys if k.startswith("layer0/bias/")} == {f"layer0/bias/{s}" for s in ("param", "m", "v")}
    cfg = eps.config
    assert (cfg.momentum, cfg.nesterov, cfg.ns_steps, cfg.weight_decay) == (0.95, True, 5, 0.1)  # torch's defaults
    eps.close()


@needs_fused_torch
@pytest.mark.parametrize("options", list(MUON_OPTIONS))
@pytest.mark.parametrize("backend", ["golden", "cpu"])
def test_eps_muon_equals_torch_muon_bit_for_bit_and_adamw_to_rounding(backend, options):
    eps = eps_training(backend, MUON_OPTIONS[options])
    ours, want = eps.master("layer0"), torch_training(start_values(), MUON_OPTIONS[options])
    eps.close()
    for n in MATRICES:
        assert torch.equal(ours[n], want[n]), f"{n}: {rel_diff(ours[n], want[n]):.2e} from torch.optim.Muon"
    for n in set(SHAPES) - set(MATRICES):  # AdamW: golden's unfused rule, a few ulp from torch's fused one
        assert rel_diff(ours[n], want[n]) <= 1e-6, n
    assert ours["tall"].ne(start_values()["tall"]).all()  # it trained


@pytest.mark.parametrize("state", ["fp32", "bf16", "8bit"])
def test_cpu_eps_is_golden_bit_for_bit_in_every_state_format_with_a_bf16_working_copy(state):
    cpu = eps_training("cpu", MUON_OPTIONS["defaults"], state, working_dtype="bf16")
    gold = eps_training("golden", MUON_OPTIONS["defaults"], state, working_dtype="bf16")
    assert_same_bits(cpu.state_dict(), gold.state_dict(), f"{state} state")
    master, fetched = cpu.master("layer0"), cpu.fetch("layer0")
    for n in SHAPES:  # the working copy is the master rounded to nearest even
        assert fetched[n].dtype == torch.bfloat16 and torch.equal(fetched[n], master[n].bfloat16()), n
    cpu.close(), gold.close()


@needs_fused_torch
@pytest.mark.parametrize("state", ["bf16", "8bit"])
def test_compressed_momentum_equals_torch_muon_with_its_buffer_rounded_to_the_format(state):
    eps = eps_training("cpu", MUON_OPTIONS["defaults"], state)
    ours, want = eps.master("layer0"), torch_training(start_values(), {}, state)
    buffers = {n: eps.read_state("layer0", n)["m"] for n in MATRICES}
    eps.close()
    for n in MATRICES:
        assert torch.equal(ours[n], want[n]), f"{n}: {rel_diff(ours[n], want[n]):.2e} from the reference"
    exact = torch_training(start_values(), {}, "fp32")
    # the rounded buffer moves the weights, by about the format's rounding: the comparison can fail
    assert any(not torch.equal(ours[n], exact[n]) for n in MATRICES)
    assert all(rel_diff(ours[n], exact[n]) < 0.05 for n in MATRICES)
    assert all(b.abs().max() > 0 for b in buffers.values())


def test_independent_8bit_rounding_agrees_with_golden_encoding():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3 * golden.QUANT_BLOCK + 17, generator=gen) * torch.logspace(-6, 2, 3 * golden.QUANT_BLOCK + 17)
    stored = golden.encode_state(x.numpy(), "8bit", "m")
    assert torch.equal(torch.from_numpy(golden.decode_state(stored, "8bit", "m")), independent_8bit(x))


# ---------------------------------------------------------------------------- disk tier, checkpoints

def test_disk_tier_equals_memory_bit_for_bit(tmp_path):
    """Three groups, two of them in memory at a time: each update reads its group back from disk."""
    def run(**options):
        eps = l2l_hw.make_eps("cpu", optimizer="muon", lr=LR, state="8bit", working_dtype="bf16", **options)
        groups = [f"layer{i}" for i in range(3)]
        eps.expect({key: dict(SHAPES) for key in groups})
        for key in groups:
            eps.register(key, start_values(), no_decay=NO_DECAY)
        for step in range(1, 4):
            eps.expect_step(groups, groups[::-1])
            for key in groups[::-1]:
                eps.push_grads(key, step_gradients(step))
            eps.commit_step()
        return eps
    ram, disk = run(), run(state_dir=tmp_path / "state", groups_in_flight=2)
    assert len(list((tmp_path / "state").iterdir())) >= 3
    assert_same_bits(ram.state_dict(), disk.state_dict(), "state_dir")
    ram.close(), disk.close()


def test_double_buffered_muon_equals_in_place_and_discards_a_step_whole():
    """PipeDream-2BW and fp16's skipped steps: updates write spare buffers, swapped in at commit."""
    in_place = eps_training("cpu", {}, "8bit", working_dtype="bf16")
    spare = eps_training("cpu", {}, "8bit", working_dtype="bf16", double_buffer=True)
    assert_same_bits(in_place.state_dict(), {k: v for k, v in spare.state_dict().items()
                                             if not k.endswith("/previous")}, "double buffered")
    before = spare.state_dict()
    spare.push_grads("layer0", step_gradients(STEPS + 1))
    spare.discard_step()
    assert_same_bits(spare.state_dict(), before, "discarded step")
    in_place.close(), spare.close()


@pytest.mark.parametrize("state", ["fp32", "8bit"])
def test_resume_from_checkpoint_is_bit_exact(state, tmp_path):
    straight = eps_training("cpu", {}, state, working_dtype="bf16")
    first = eps_training("cpu", {}, state, working_dtype="bf16", steps=3)
    save_checkpoint(tmp_path / "eps.safetensors", first.state_entries(), {})
    resumed = l2l_hw.make_eps("cpu", optimizer="muon", lr=LR, weight_decay=WD, state=state, working_dtype="bf16")
    resumed.register("layer0", {n: torch.zeros(s) for n, s in SHAPES.items()}, no_decay=NO_DECAY)
    resumed.load_state_dict(open_checkpoint(tmp_path / "eps.safetensors"))
    for step in (4, 5):
        resumed.push_grads("layer0", step_gradients(step))
        resumed.commit_step()
    assert_same_bits(resumed.state_dict(), straight.state_dict(), "resumed")
    for eps in (straight, first, resumed):
        eps.close()


TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "16", "--batch-size", "4",
        "--micro-batches", "2", "--seed", "7", "--optimizer", "muon", "--optimizer-state", "8bit",
        "--eval-every", "2", "--steps", "4"]


@pytest.mark.usefixtures("one_thread")
def test_l2l_train_with_muon_resumes_bit_identical_to_a_straight_run(tmp_path, capsys):
    assert main(["train", *TINY, "--out", str(tmp_path / "straight")]) == 0
    assert "orthogonalised by 5 Newton-Schulz steps" in capsys.readouterr().out  # the banner says the rule
    assert main(["train", *TINY, "--out", str(tmp_path / "split"), "--stop-after", "2"]) == 0
    assert main(["train", "--resume", "--out", str(tmp_path / "split")]) == 0
    a = open_checkpoint(tmp_path / "straight" / "checkpoint.safetensors")
    b = open_checkpoint(tmp_path / "split" / "checkpoint.safetensors")
    assert a.keys() == b.keys() and any(k.endswith("/m_scale") for k in a)
    assert_same_bits({k: a[k].read() for k in a if k.startswith("relay.")},
                     {k: b[k].read() for k in b if k.startswith("relay.")}, "resumed run")


# ---------------------------------------------------------------------------- relay == PyTorch
RELAY_LR = 2e-3  # l2l train's default lr; Muon's step, match_rms_adamw: 0.2 sqrt(max(rows, cols)) lr


def train_plain_muon(model, batches, u: int, loss_fn=lm_loss, adjust_lr_fn: str | None = None):
    """Plain PyTorch: torch.optim.Muon on the 2-D parameters, torch.optim.AdamW on the rest (one
    lr and weight decay), each minibatch's gradient accumulated over its u micro-batches by
    autograd (each micro-batch's mean loss weighted by its share of the minibatch), as
    gradient accumulation is written in PyTorch. Returns the minibatch losses."""
    params = list(model.parameters())
    matrices = torch.optim.Muon([p for p in params if p.ndim == 2], lr=RELAY_LR, weight_decay=WD,
                                adjust_lr_fn=adjust_lr_fn)
    others = [p for p in params if p.ndim != 2]
    others = torch.optim.AdamW(others, lr=RELAY_LR, weight_decay=WD, foreach=False) if others else None
    losses = []
    for x, y in batches:
        matrices.zero_grad()
        loss = 0.0
        for xj, yj in zip(x.tensor_split(u), y.tensor_split(u)):
            share = loss_fn(model(xj), yj) * (xj.shape[0] / x.shape[0])
            share.backward()
            loss += share.item()
        matrices.step()
        if others is not None:
            others.step()
            others.zero_grad()
        losses.append(loss)
    return losses


def matrices_only_mlp(seed=0):
    """An MLP whose every weight is a matrix (no biases, no norms): Muon updates all of it."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(11, 40, bias=False), nn.Sequential(nn.GELU(), nn.Linear(40, 24, bias=False)),
                         nn.Sequential(nn.GELU(), nn.Linear(24, 7, bias=False)))


def mlp_data(steps=10, batch=12):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 11, generator=gen), torch.randn(batch, 7, generator=gen)) for _ in range(steps)]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("u", [1, 3])
def test_relay_with_muon_is_pytorch_with_the_same_micro_batches_bit_for_bit(u):
    """Every weight a matrix: the relay's gradients are autograd's accumulated over the same
    micro-batches, bit for bit, and its Muon torch.optim.Muon's, so the runs agree exactly."""
    data = mlp_data()
    plain = matrices_only_mlp()
    plain_losses = train_plain_muon(plain, data, u, nn.functional.mse_loss)
    relay_losses, relay = train_relay(matrices_only_mlp(), dict(optimizer="muon", lr=RELAY_LR, weight_decay=WD),
                                      nn.functional.mse_loss, data, u)
    for p, q in zip(plain.parameters(), relay.materialize().parameters()):
        assert torch.equal(p.detach(), q), f"{rel_diff(q, p):.2e}"
    assert_same_training(plain_losses, plain, relay_losses, relay, tol=1e-6)
    relay.eps.close()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_relay_with_muon_matches_pytorch_on_the_reference_gpt(adjust_lr_fn):
    """The reference GPT (its norms' weights AdamW's), 10 steps: the losses agree with PyTorch to
    1e-5, with the relay's micro-batches and with one full batch; the weights as closely as
    PyTorch agrees with itself over those two ways of summing a gradient. Muon's bf16
    Newton-Schulz iterations turn a one-ulp difference of a gradient (or of AdamW's step: golden
    rounds its multiply-adds twice, torch once) into bf16-ulp differences of the update
    (docs/NUMERICS.md, "Muon"); with every weight a matrix the runs agree bit for bit (above)."""
    data, options = gpt_batches(10), dict(optimizer="muon", lr=RELAY_LR, weight_decay=WD, adjust_lr_fn=adjust_lr_fn)
    full, split = gpt(), gpt()
    full_losses = train_plain_muon(full, data, 1, adjust_lr_fn=adjust_lr_fn)
    split_losses = train_plain_muon(split, data, 3, adjust_lr_fn=adjust_lr_fn)
    spread = max(rel_diff(p, q) for p, q in zip(split.parameters(), full.parameters()))  # PyTorch vs itself
    assert spread > 0
    for u, plain_losses, plain in ((1, full_losses, full), (3, split_losses, split)):
        relay_losses, relay = train_relay(gpt(), options, lm_loss, data, u)
        trained = relay.materialize()
        for losses in (plain_losses, full_losses):
            for step, (a, b) in enumerate(zip(relay_losses, losses)):
                assert abs(a - b) <= 1e-5 * abs(b), f"u={u} step {step}: relay loss {a} vs PyTorch {b}"
        for model in (plain, full):
            assert max(rel_diff(q, p) for p, q in zip(model.parameters(), trained.parameters())) <= 2 * spread
        assert min(rel_diff(q, p) for p, q in zip(gpt().parameters(), trained.parameters())) > 1e-3  # it trained
        relay.eps.close()


# ---------------------------------------------------------------------------- the estimate

def test_estimate_counts_one_momentum_buffer_for_matrices_and_adams_two_for_the_rest():
    from l2l_hw.estimate import eps_bytes, muon_flops

    shapes = {"layer0": {"w": torch.Size([64, 32]), "b": torch.Size([32])}}
    muon_bytes = eps_bytes(TrainConfig(optimizer="muon", out=None), shapes).memory
    adamw_bytes = eps_bytes(TrainConfig(out=None), shapes).memory
    assert muon_bytes == 64 * 32 * (4 + 4) + 32 * (4 + 4 + 4)  # fp32 param + m; param + m + v
    assert adamw_bytes - muon_bytes == 64 * 32 * 4
    q8 = eps_bytes(TrainConfig(optimizer="muon", optimizer_state="8bit", precision="bf16", out=None), shapes).memory
    blocks = lambda n: -(-n // golden.QUANT_BLOCK) * 4  # noqa: E731: one fp32 scale a block
    assert q8 == 64 * 32 * (4 + 1 + 2) + blocks(64 * 32) + 32 * (4 + 1 + 1 + 2) + 2 * blocks(32)
    # Newton-Schulz: per step 2 s^2 l (A = X X^T) + 2 s^3 (A A) + 2 s^2 l ((...) X), s the smaller side
    assert muon_flops((64, 32), 5) == muon_flops((32, 64), 5) == 5 * (4 * 32 * 32 * 64 + 2 * 32**3)


# ---------------------------------------------------------------------------- refusals

def cli_refusal(capsys, tmp_path, *flags) -> str:
    capsys.readouterr()
    out = tmp_path / "run"
    try:
        rc = main(["train", *flags, "--steps", "2", "--out", str(out)])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    assert rc != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not (out / "checkpoint.safetensors").exists() and not (out / "metrics.jsonl").exists()
    return err


@pytest.mark.parametrize("backend", ["fpga-sim", "fpga-pynq"])
def test_muon_on_the_fpga_eps_is_one_line_before_any_weight(backend, tmp_path, capsys):
    with pytest.raises(ConfigError, match=f"optimizer='muon'.*the {backend} EPS's RTL kernel has none: use --eps"):
        TrainConfig(optimizer="muon", eps_backend=backend, overlay="x.bit" if backend == "fpga-pynq" else None)
    err = cli_refusal(capsys, tmp_path, "--optimizer", "muon", "--eps", "fpga-sim")
    assert "--optimizer muon" in err and "matrix work" in err and "--eps cpu" in err
    with pytest.raises(ValueError, match="no matrix unit for Muon's Newton-Schulz iterations"):
        l2l_hw.make_eps(backend, optimizer="muon")  # refused before a transport is built


def test_muon_with_sharded_state_is_refused():
    with pytest.raises(ValueError, match="needs each matrix whole"):
        l2l_hw.make_eps("cpu", optimizer="muon", shard_state=True)
    with pytest.raises(ConfigError, match="needs each matrix whole"):
        TrainConfig(optimizer="muon", shard_state=True)


MISMATCHED = [
    (["--optimizer", "muon", "--momentum", "0.9"], ["--momentum 0.9", "--muon-momentum"]),
    (["--muon-ns-steps", "3"], ["--muon-ns-steps 3", "Muon's", "--optimizer muon"]),
    (["--optimizer", "lamb", "--no-muon-nesterov"], ["--no-muon-nesterov", "Muon's", "lamb"]),
    (["--optimizer", "muon", "--muon-ns-steps", "100"], ["--muon-ns-steps 100", "[1, 99]"]),
    (["--optimizer", "muon", "--muon-adjust-lr", "none"], ["--muon-adjust-lr", "match_rms_adamw"]),
]


@pytest.mark.parametrize("flags,words", MISMATCHED, ids=[" ".join(f) for f, _ in MISMATCHED])
def test_options_that_do_not_go_with_the_optimizer_are_one_line(flags, words, tmp_path, capsys):
    err = cli_refusal(capsys, tmp_path, *flags)
    for word in words:
        assert word in err, err


def test_make_eps_refuses_bad_muon_arguments_naming_them():
    with pytest.raises(OptionError, match="adjust_lr_fn must be one of"):
        OptimConfig(optimizer="muon", adjust_lr_fn="sqrt")
    with pytest.raises(OptionError, match="ns_steps must be >= 1 and <= 99"):
        OptimConfig(optimizer="muon", ns_steps=100)
    with pytest.raises(ValueError, match="Muon steps matrices"):
        muon.step(golden.step_scalars(OptimConfig(optimizer="muon"), 1), torch.zeros(4), {}, {})
