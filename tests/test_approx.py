"""Approximate-backward modules (l2l_hw.approx): exact forwards, the promised backwards,
the promised memory, and they train through the relay."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import l2l_hw
from l2l_hw import approx
from l2l_hw.approx import FewBitGELU, RandomProjectionLinear, optimal_breakpoints, pack3, unpack3
from l2l_hw.cli import build_parser, train_config
from l2l_hw.models import GPTConfig, build_gpt, lm_loss

from tests.helpers import rel_diff

TINY = dict(n_layer=2, n_embd=32, n_head=2, block_size=16)


pytestmark = pytest.mark.usefixtures("one_thread")


def saved_activation_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward after module(x): each storage once, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


# ---------------------------------------------------------------------------- few-bit GELU

def test_gelu_constants_are_the_output_of_optimal_breakpoints():
    breakpoints, values = optimal_breakpoints(3)
    assert torch.allclose(breakpoints, torch.tensor(approx.GELU_BREAKPOINTS, dtype=torch.float64), rtol=0, atol=1e-9)
    assert torch.allclose(values, torch.tensor(approx.GELU_VALUES, dtype=torch.float64), rtol=0, atol=1e-9)
    # Lloyd-Max fixed point: each value is its interval's mean, each breakpoint the midpoint crossing.
    mid = (values[:-1] + values[1:]) / 2
    assert torch.allclose(approx.gelu_grad(breakpoints), mid, atol=1e-12)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4099])
def test_pack3_round_trips_and_takes_3_bits_per_code(n):
    codes = torch.randint(0, 8, (n,), generator=torch.Generator().manual_seed(n))
    packed = pack3(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == 3 * math.ceil(n / 8)
    assert torch.equal(unpack3(packed, n).long(), codes)


def test_fewbit_forward_is_exactly_gelu():
    x = torch.randn(4, 33, 65) * 3
    y = FewBitGELU()(x.clone().requires_grad_())
    assert torch.equal(y, F.gelu(x))


def test_fewbit_backward_is_the_piecewise_constant_derivative():
    x = torch.randn(3, 5, 7) * 2  # 105 elements: not a multiple of 8
    x.view(-1)[:7] = torch.tensor(approx.GELU_BREAKPOINTS)  # ties go to the lower interval
    g = torch.randn_like(x)
    x.requires_grad_()
    FewBitGELU()(x).backward(g)
    index = torch.bucketize(x.detach(), torch.tensor(approx.GELU_BREAKPOINTS))  # reference: no packing
    assert torch.equal(x.grad, g * torch.tensor(approx.GELU_VALUES)[index])


def test_fewbit_derivative_error_is_the_optimum_under_a_standard_normal():
    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    xg = x.float().requires_grad_()
    FewBitGELU()(xg).sum().backward()
    err = xg.grad.double() - approx.gelu_grad(x)
    mse = float((err ** 2).mean())
    assert abs(mse - approx.GELU_MSE) < 0.05 * approx.GELU_MSE  # 1e6 samples: ~0.5% noise
    assert float(err.abs().max()) < 0.0901  # the tails: GELU' -> 0 and 1, the outer values -0.090 and 1.090


def test_fewbit_saves_3_bits_per_element():
    x = torch.randn(8, 128, 512, requires_grad=True)
    saved = saved_activation_bytes(FewBitGELU(), x)
    assert saved == 3 * x.numel() // 8 <= 3 / 32 * x.numel() * x.element_size()
    assert saved_activation_bytes(nn.GELU(), x) == x.numel() * 4  # exact GELU keeps the fp32 input


# ---------------------------------------------------------------------------- random projection

def _pair(ratio=0.25, n_in=32, n_out=24):
    torch.manual_seed(0)
    exact = nn.Linear(n_in, n_out)
    torch.manual_seed(0)
    projected = RandomProjectionLinear(n_in, n_out, ratio=ratio)
    return exact, projected


def _grads(layer, x, g, seed=0):
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y, x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


def test_projection_is_a_drop_in_for_linear_with_exact_forward_input_and_bias_gradients():
    exact, projected = _pair()
    assert exact.state_dict().keys() == projected.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(exact.state_dict().values(), projected.state_dict().values()))
    x, g = torch.randn(4, 16, 32), torch.randn(4, 16, 24)
    y0, dx0, _, db0 = _grads(exact, x, g)
    y1, dx1, _, db1 = _grads(projected, x, g)
    assert torch.equal(y0, y1)
    assert rel_diff(dx1, dx0) < 1e-6 and rel_diff(db1, db0) < 1e-6


def test_projection_weight_gradient_is_unbiased():
    exact, projected = _pair(ratio=0.25)
    x, g = torch.randn(64, 32), torch.randn(64, 24)  # N = 64 rows, k = 16
    dw = _grads(exact, x, g)[2]
    samples = []
    for seed in range(1600):
        projected.weight.grad = projected.bias.grad = None
        samples.append(_grads(projected, x, g, seed)[2])
    samples = torch.stack(samples)
    one = float(((samples - dw).norm(dim=(1, 2)) / dw.norm()).pow(2).mean().sqrt())  # rms error of one sample
    for trials in (25, 100, 400, 1600):
        err = float((samples[:trials].mean(0) - dw).norm() / dw.norm())
        assert err < 2.5 * one / math.sqrt(trials), (trials, err, one)  # falls like 1 / sqrt(trials)
    assert float((samples.mean(0) - dw).norm() / dw.norm()) < 0.1


def test_projection_saves_ratio_of_the_input():
    x = torch.randn(4, 64, 32, requires_grad=True)  # N = 256 rows
    for ratio in (0.25, 0.5):
        saved = saved_activation_bytes(RandomProjectionLinear(32, 24, ratio=ratio), x)
        assert saved == ratio * x.numel() * x.element_size()
    assert saved_activation_bytes(nn.Linear(32, 24), x) == x.numel() * x.element_size()


def test_projection_gradients_repeat_under_the_same_seed_and_differ_under_another():
    _, projected = _pair()
    x, g = torch.randn(4, 16, 32), torch.randn(4, 16, 24)
    first = _grads(projected, x, g, seed=7)
    projected.weight.grad = projected.bias.grad = None
    again = _grads(projected, x, g, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    projected.weight.grad = projected.bias.grad = None
    assert not torch.equal(_grads(projected, x, g, seed=8)[2], first[2])


def test_relay_recompute_regenerates_the_same_sketch():
    # The recompute replays the RNG state, so it draws the same seed as the forward:
    # with and without recompute the step is the same to rounding.
    cfg = GPTConfig(**TINY, gelu="fewbit", linear_projection=0.5)
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    models = []
    for recompute in ("full", "none"):
        torch.manual_seed(0)
        relay = l2l_hw.Relay(build_gpt(cfg), lm_loss, eps=l2l_hw.make_eps("cpu", lr=1e-2), micro_batches=2,
                             recompute=recompute)
        torch.manual_seed(5)
        relay.train_step(x, x)
        models.append(relay.materialize())
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert rel_diff(a, b) < 1e-6


# ---------------------------------------------------------------------------- in the reference GPT

def test_gpt_options_keep_parameters_and_init_and_the_default_is_exact():
    torch.manual_seed(0)
    default = build_gpt(GPTConfig(**TINY))
    torch.manual_seed(0)
    approximate = build_gpt(GPTConfig(**TINY, gelu="fewbit", linear_projection=0.5))
    a, b = default.state_dict(), approximate.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    mlp = default[1].mlp  # the default is plain nn.Linear + exact GELU, as before the options
    assert type(mlp.c_fc) is nn.Linear and type(mlp.c_proj) is nn.Linear
    h = torch.randn(2, 16, 32)
    assert torch.equal(mlp(h), mlp.c_proj(F.gelu(mlp.c_fc(h))))
    assert type(approximate[1].mlp.c_fc) is RandomProjectionLinear and type(approximate[1].mlp.gelu) is FewBitGELU


def test_train_flags_reach_the_model_config():
    model_cfg = train_config(build_parser().parse_args(["train", "--gelu", "fewbit", "--linear-projection", "0.5"]))
    assert (model_cfg.model_config().gelu, model_cfg.model_config().linear_projection) == ("fewbit", 0.5)
    default = train_config(build_parser().parse_args(["train"])).model_config()
    assert (default.gelu, default.linear_projection) == ("exact", 0.0)


def test_fewbit_and_projection_train_the_gpt_through_the_relay():
    torch.manual_seed(0)
    relay = l2l_hw.Relay(build_gpt(GPTConfig(**TINY, gelu="fewbit", linear_projection=0.5)), lm_loss,
                         eps=l2l_hw.make_eps("cpu", lr=3e-3), micro_batches=2)
    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 4))
    x = torch.stack([text[i:i + 16] for i in range(0, 64, 8)])  # (8, 16)
    y = torch.stack([text[i + 1:i + 17] for i in range(0, 64, 8)])
    losses = [relay.train_step(x, y) for _ in range(30)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.7 * losses[0], losses
