"""Mixed precision: low-precision compute, fp32 masters, overflow discards the whole step."""
import pytest
import torch

import l2l_hw
from l2l_hw.models.gpt import lm_loss
from tests.helpers import DEVICES
from tests.test_relay_equivalence import gpt, gpt_batches

BACKENDS = ["golden", "cpu"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
def test_low_precision_training_tracks_fp32(backend, precision, device):
    data = gpt_batches(8)
    losses = {}
    for p in ("fp32", precision):
        relay = l2l_hw.Relay(gpt(), lm_loss, eps=l2l_hw.make_eps(backend, lr=3e-3), micro_batches=2, precision=p, device=device)
        losses[p] = [relay.train_step(x, y) for x, y in data]
        state = relay.eps.state_dict()
        assert all(t.dtype == torch.float32 for k, t in state.items() if k != "step")  # fp32 masters
        working = relay.eps.fetch("layer1")
        assert all(t.dtype == relay.compute_dtype for t in working.values())
    assert losses[precision][-1] < losses[precision][0]  # it learns
    assert max(abs(a - b) for a, b in zip(losses["fp32"], losses[precision])) < 0.05 * losses["fp32"][0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
def test_inf_gradient_mid_backward_leaves_every_layer_at_its_pre_step_state(backend, device):
    eps = l2l_hw.make_eps(backend, lr=1e-3)
    relay = l2l_hw.Relay(gpt(), lm_loss, eps=eps, micro_batches=2, precision="fp16", device=device)
    data = gpt_batches(3)
    relay.train_step(*data[0])
    before = {k: v.clone() for k, v in eps.state_dict().items()}
    scale = relay.loss_scale
    push = eps.push_grads
    pushed = []

    def inject(key, grads, inv_scale=1.0):
        pushed.append(key)
        if key == "layer1":  # a middle layer: the head and block 2 were updated already
            grads = dict(grads)
            name = next(iter(grads))
            grads[name] = grads[name].clone()
            grads[name].view(-1)[0] = float("inf")
        push(key, grads, inv_scale)

    eps.push_grads = inject
    relay.train_step(*data[1])
    assert pushed.index("layer1") > 0, "later layers must have been updated before the overflow"
    after = eps.state_dict()
    for k, v in before.items():
        assert torch.equal(v, after[k]), f"{k} changed in a discarded step"
    assert relay.loss_scale == scale / 2
    eps.push_grads = push
    relay.train_step(*data[2])  # the next step trains normally
    assert eps.step == 2


def test_loss_scale_grows_after_clean_steps():
    relay = l2l_hw.Relay(gpt(), lm_loss, eps=l2l_hw.make_eps("golden"), micro_batches=1, precision="fp16")
    relay.scaler.growth_interval = 2
    scale = relay.loss_scale
    for x, y in gpt_batches(2):
        relay.train_step(x, y)
    assert relay.loss_scale == 2 * scale


def test_precision_must_match_an_eps_already_in_use():
    eps = l2l_hw.make_eps("cpu")
    l2l_hw.Relay(gpt(), lm_loss, eps=eps)
    with pytest.raises(ValueError, match="precision='bf16' needs an EPS whose working copy is bf16"):
        l2l_hw.Relay(gpt(), lm_loss, eps=eps, precision="bf16")
    with pytest.raises(ValueError, match="precision='fp8': must be one of fp32, bf16, fp16"):
        l2l_hw.Relay(gpt(), lm_loss, eps=l2l_hw.make_eps("cpu"), precision="fp8")
