"""The update rule: CPU EPS bit-identical to golden; golden within 2 ulp of torch.optim."""

import numpy as np
import pytest
import torch

import l2l_hw
from l2l_hw.eps.base import OptimConfig
from l2l_hw.eps.engine import Engine

SIZES = {"scalar": (1,), "odd": (7,), "matrix": (33, 17), "empty": (0,)}
CONFIGS = {
    "adamw": dict(optimizer="adamw", lr=3e-3, weight_decay=0.1),
    "adam": dict(optimizer="adam", lr=2e-3, weight_decay=0.05, betas=(0.8, 0.95)),
    "sgd-momentum-dampening": dict(optimizer="sgd", lr=0.1, momentum=0.9, dampening=0.3, weight_decay=1e-2),
    "sgd-nesterov": dict(optimizer="sgd", lr=0.1, momentum=0.8, nesterov=True),
    "sgd-plain": dict(optimizer="sgd", lr=0.1),
    "adamw-cosine": dict(optimizer="adamw", lr=1e-2, schedule="cosine", warmup_steps=2, total_steps=6,
                         min_lr=1e-4),
    "lamb": dict(optimizer="lamb", lr=1e-2, weight_decay=0.01),
    "lars-cosine": dict(optimizer="lars", lr=0.5, momentum=0.9, weight_decay=1e-4, schedule="cosine",
                        warmup_steps=2, total_steps=6),
}


def random_group(seed):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SIZES.items()}


def random_grads(seed, dtype, scale):
    g = torch.Generator().manual_seed(1000 + seed)
    return {name: (torch.randn(shape, generator=g) * scale).to(dtype) for name, shape in SIZES.items()}


def assert_bit_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) if a[k].dtype == torch.float32 \
            else torch.equal(a[k], b[k]), f"{k} differs"


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_cpu_eps_bit_identical_to_golden_after_every_step(config, grad_dtype):
    epss = [l2l_hw.make_eps(name, working_dtype="bf16", **CONFIGS[config]) for name in ("golden", "cpu")]
    for eps in epss:
        eps.register("layer0", random_group(0))
        eps.register("layer1", {"w": random_group(1)["matrix"]})
    for step in range(6):
        inv_scale = 1.0 if step % 2 else 1 / 1024
        for eps in epss:
            grads = random_grads(step, grad_dtype, scale=1024 if inv_scale != 1 else 1)
            eps.push_grads("layer1", {"w": grads["matrix"]}, inv_scale=inv_scale)
            eps.push_grads("layer0", grads, inv_scale=inv_scale)
            eps.commit_step()
        assert_bit_identical(epss[0].state_dict(), epss[1].state_dict())
        for key in ("layer0", "layer1"):
            assert_bit_identical(epss[0].fetch(key), epss[1].fetch(key))


def test_nonfinite_gradient_sets_flag_and_gives_canonical_nan_in_both():
    epss = [l2l_hw.make_eps(name, optimizer="adamw") for name in ("golden", "cpu")]
    grads = random_grads(0, torch.float32, 1.0)
    grads["matrix"][3, 4] = float("inf")
    grads["odd"][2] = float("nan")
    for eps in epss:
        eps.register("layer0", random_group(0))
        eps.push_grads("layer0", grads)
        assert eps.commit_step() is True
    golden, cpu = (e.state_dict() for e in epss)
    assert_bit_identical(golden, cpu)
    nan_bits = golden["layer0/odd/param"].view(torch.int32)[2]
    assert int(nan_bits) == 0x7FC00000
    for eps in epss:  # a finite step afterwards clears the flag
        eps.push_grads("layer0", random_grads(1, torch.float32, 1.0))
        assert eps.commit_step() is False


def test_working_copy_is_round_to_nearest_even_of_master():
    for working in ("bf16", "fp16"):
        for backend in ("golden", "cpu"):
            eps = l2l_hw.make_eps(backend, working_dtype=working)
            group = random_group(0)
            group["matrix"][0, :6] = torch.tensor([float("nan"), float("inf"), 1e-40, 65520.0, -0.0, 3.0e38])
            eps.register("layer0", group)
            dtype = torch.bfloat16 if working == "bf16" else torch.float16
            canonical_nan = 0x7FC0 if working == "bf16" else 0x7E00
            for name, t in eps.fetch("layer0").items():
                # torch's conversion is an independent round-to-nearest-even reference, but it
                # keeps NaN payloads; every NaN must be the canonical quiet NaN.
                expected = group[name].to(dtype).view(torch.int16)
                expected = torch.where(group[name].isnan(), torch.tensor(canonical_nan, dtype=torch.int16), expected)
                assert t.dtype == dtype and torch.equal(t.view(torch.int16), expected), name


def ulp_at_scale(ours, theirs, old):
    """|ours - theirs| in ulps of the update's scale: the largest of |old|, |new| and |new - old|.

    An update x <- x + d computed with rounding errors of k ulp in d is off by k ulp of
    max(|x|, |d|); counting ulps of the result alone blows up where x + d cancels."""
    scale = torch.maximum(torch.maximum(old.abs(), theirs.abs()), (theirs - old).abs())
    ulp = (torch.nextafter(scale, torch.tensor(float("inf"))) - scale).double()
    return ((ours.double() - theirs.double()).abs() / ulp).numpy()


def test_golden_adamw_within_2_ulp_of_torch_per_step():
    g = torch.Generator().manual_seed(0)
    shape = (4096,)
    # torch 2.13's first AdamW step in a process sometimes computes other bits (1 process in
    # 5: 1691 of 4096 weights, hundreds of ulp, on that first step only; every later step of
    # the same inputs agrees with golden): one throwaway step first, so the reference is the
    # kernel torch then keeps using.
    warm = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(1)))
    warm.grad = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    torch.optim.AdamW([warm], lr=1e-3, weight_decay=0.01, foreach=False).step()
    param = torch.nn.Parameter(torch.randn(shape, generator=g))
    opt = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, foreach=False)
    golden = l2l_hw.make_eps("golden", optimizer="adamw", lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                             weight_decay=0.01)
    golden.register("layer0", {"w": param.detach().clone()})
    worst = 0
    for step in range(1, 21):
        grad = torch.randn(shape, generator=g) * 10 ** float(torch.empty(()).uniform_(-3, 1, generator=g))
        # Both start the step from torch's state.
        state = opt.state.get(param, {})
        start = {"param": param.detach().clone(), "m": state.get("exp_avg", torch.zeros(shape)).clone(),
                 "v": state.get("exp_avg_sq", torch.zeros(shape)).clone()}
        golden.load_state_dict({"step": torch.tensor(step - 1),
                                **{f"layer0/w/{slot}": t.clone() for slot, t in start.items()}})
        param.grad = grad.clone()
        opt.step()
        golden.push_grads("layer0", {"w": grad})
        golden.commit_step()
        ours = golden.state_dict()
        for slot, old, theirs in (("param", start["param"], param), ("m", start["m"], opt.state[param]["exp_avg"]),
                                  ("v", start["v"], opt.state[param]["exp_avg_sq"])):
            d = ulp_at_scale(ours[f"layer0/w/{slot}"], theirs.detach(), old)
            worst = max(worst, float(d.max()))
            assert d.max() <= 2, f"step {step}: {slot} differs from torch.optim.AdamW by {d.max()} ulp"
    assert worst <= 2


def test_schedule_warmup_then_cosine():
    cfg = OptimConfig(lr=1.0, schedule="cosine", warmup_steps=10, total_steps=110, min_lr=0.1)
    assert cfg.lr_at(1) == pytest.approx(0.1)
    assert cfg.lr_at(10) == pytest.approx(1.0)
    assert cfg.lr_at(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert cfg.lr_at(110) == pytest.approx(0.1)
    assert cfg.lr_at(500) == pytest.approx(0.1)
    lrs = [cfg.lr_at(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    # the schedule reaches the update: an SGD step of step t moves p by lr_at(t) * g
    eps = l2l_hw.make_eps("golden", optimizer="sgd", lr=1.0, schedule="cosine", warmup_steps=10, total_steps=110)
    eps.register("layer0", {"w": torch.zeros(3)})
    eps.push_grads("layer0", {"w": torch.ones(3)})
    eps.commit_step()
    assert torch.equal(eps.master("layer0")["w"], torch.full((3,), -np.float32(0.1)))


def test_unknown_backend_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown EPS backend 'tpu'.*cpu.*golden"):
        l2l_hw.make_eps("tpu")


@pytest.mark.parametrize("options, message", [
    (dict(optimizer="adagrad"), "unknown optimizer 'adagrad'"),
    (dict(lr=-1.0), "lr must be >= 0"),
    (dict(betas=(0.9, 1.0)), "betas must be"),
    (dict(optimizer="sgd", nesterov=True), "nesterov needs momentum"),
    (dict(schedule="cosine"), "cosine schedule needs total_steps"),
    (dict(working_dtype="fp8"), "unknown working_dtype"),
    (dict(lr="0.1"), r"lr must be >= 0 \(a finite number\), got '0.1' \(str\)"),
    (dict(lr=float("inf")), r"lr must be >= 0 \(a finite number\), got inf"),
    (dict(eps=float("nan")), "eps must be >= 0"),
    (dict(betas=(0.9,)), "betas must be two numbers"),
    (dict(warmup_steps=2.5), r"warmup_steps must be >= 0 \(an integer\), got 2.5"),
    (dict(total_steps=0), "total_steps must be >= 1"),
    (dict(dampening=2.0), "dampening must be >= 0 and <= 1"),
    (dict(threads=0), "threads must be an integer >= 1"),
    (dict(thread=2), r"unknown option\(s\) thread for the cpu EPS; .*threads"),
    (dict(min_lr=0.1, lr=0.01), r"min_lr must be <= lr \(0.01\), got 0.1"),
    (dict(shard_state="yes"), "shard_state must be True or False, got 'yes'"),
])
def test_bad_optimizer_options_are_refused_with_a_message(options, message):
    with pytest.raises(ValueError, match=message):
        l2l_hw.make_eps("cpu", **options)


def test_bad_gradients_are_refused_before_any_update():
    eps = l2l_hw.make_eps("cpu")
    eps.register("layer0", {"w": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=r"layer0/w has shape \(2, 3\); expected \(3, 2\)"):
        eps.push_grads("layer0", {"w": torch.zeros(2, 3)})
    with pytest.raises(TypeError, match="float64"):
        eps.push_grads("layer0", {"w": torch.zeros(3, 2, dtype=torch.float64)})
    with pytest.raises(KeyError, match="unknown EPS group 'layer9'"):
        eps.push_grads("layer9", {"w": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="unknown tensors"):
        eps.push_grads("layer0", {"b": torch.zeros(3, 2)})
    assert torch.equal(eps.master("layer0")["w"], torch.zeros(3, 2))


def test_update_failure_on_worker_is_raised_from_train_step_without_hanging(monkeypatch):
    from torch import nn

    def broken(self, key, grads, s):  # an update is a generator run by the update thread
        raise MemoryError("simulated allocation failure")
        yield

    eps = l2l_hw.make_eps("cpu")
    monkeypatch.setattr(Engine, "_update", broken)
    relay = l2l_hw.Relay(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), nn.functional.mse_loss, eps=eps)
    before = {k: v.clone() for k, v in eps.state_dict().items()}
    with pytest.raises(RuntimeError, match="EPS update of group 'layer.' failed: simulated allocation failure"):
        relay.train_step(torch.randn(8, 4), torch.randn(8, 2))
    after = eps.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


RSS_PROBE = """
import gc, json, sys
import torch
import l2l_hw
from l2l_hw.estimate import rss_bytes

state, working, group, total = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
eps = l2l_hw.make_eps("cpu", optimizer="adamw", state=state)
eps.configure(working_dtype=working)
grad = torch.randn(group).to(torch.bfloat16 if working == "bf16" else torch.float32)  # the caller's, pushed again
gc.collect()
before = rss_bytes()
keys = [f"g{i}" for i in range(total // group)]
for k in keys:
    eps.register(k, {"w": torch.randn(group)})
for k in reversed(keys):
    eps.push_grads(k, {"w": grad})
eps.commit_step()
for k in keys:
    eps.fetch(k)
gc.collect()
n = len(keys) * group
held = sum(e.shape.numel() * e.dtype.itemsize for e in eps.state_entries().values())
held += 2 * n if working == "bf16" else 0  # the working copy
print(json.dumps({"rss": rss_bytes() - before, "state": held}))
"""


@pytest.mark.parametrize("state,working,group", [
    ("8bit", "bf16", 1 << 20), ("fp32", "bf16", 5 << 19),
    *[pytest.param(*case, marks=pytest.mark.slow) for case in
      [("8bit", "fp32", 1 << 20), ("fp32", "fp32", 10 << 20), ("8bit", "bf16", 10 << 20), ("8bit", "fp32", 50 << 20)]]])
def test_the_eps_holds_its_state_in_resident_memory_and_little_more(state, working, group):
    """Resident memory grown by registering, updating and fetching a model, against the bytes of
    the state the EPS keeps (masters, m and v with their scales, the working copy): within 5%
    (issue 59). The allocator must not keep the freed temporaries of the 8-bit encoding or the
    updates (eps.base.release_freed_memory)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    total = max(32 << 20, 2 * group)
    done = subprocess.run([sys.executable, "-c", RSS_PROBE, state, working, str(group), str(total)],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["rss"] <= 1.05 * figures["state"], figures
