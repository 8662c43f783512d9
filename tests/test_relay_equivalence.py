"""The relay is ordinary minibatch training: equal to plain PyTorch to fp32 rounding."""
import copy

import pytest
import torch
from torch import nn

import l2l_hw
from l2l_hw.models.gpt import GPTConfig, build_gpt, lm_loss
from tests.helpers import DEVICES, mlp_layers, rel_diff

TOL = 1e-5
STEPS = 10
BATCH = 12
OPTIMIZERS = {
    "adamw": (dict(optimizer="adamw", lr=1e-3, weight_decay=0.01),
              lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=False)),
    "sgd-momentum": (dict(optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=1e-3),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3, foreach=False)),
}


def gpt(seed=0, **kw):
    # bias=False: the key part of an attention input bias has an exactly zero gradient
    # (softmax is invariant to a shift of every key score), so its computed gradient is
    # rounding noise that Adam normalizes into full-size steps; no two fp32
    # implementations agree on such a parameter, plain PyTorch run twice included.
    torch.manual_seed(seed)
    return build_gpt(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, bias=False, **kw))


def gpt_batches(steps, batch=BATCH, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (batch, 16), generator=g), torch.randint(0, 256, (batch, 16), generator=g))
            for _ in range(steps)]


def mlp_batches(steps, batch=BATCH, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 11, generator=g), torch.randn(batch, 7, generator=g)) for _ in range(steps)]


MODELS = {
    "gpt": (gpt, gpt_batches, lm_loss),
    "mlp": (mlp_layers, mlp_batches, nn.functional.mse_loss),
}


def reference_device(device):
    """Where plain PyTorch runs beside a relay on `device`: the twin's device is the CPU."""
    return "cuda" if device == "cuda" else "cpu"


def train_plain(model, make_opt, loss_fn, batches, device="cpu"):
    """Plain PyTorch on `device` (the model comes back to the CPU): where dropout draws, on
    the device whose generator the relay draws from."""
    model.to(device)
    opt = make_opt(model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.to("cpu")
    return losses


def train_relay(model, eps_options, loss_fn, batches, u, backend="cpu", recompute="full", device="cpu"):
    relay = l2l_hw.Relay(model, loss_fn, eps=l2l_hw.make_eps(backend, **eps_options), micro_batches=u,
                         recompute=recompute, device=device)
    return [relay.train_step(x, y) for x, y in batches], relay


def assert_same_training(plain_losses, plain_model, relay_losses, relay, tol=TOL):
    for step, (a, b) in enumerate(zip(relay_losses, plain_losses)):
        assert abs(a - b) <= tol * abs(b), f"step {step}: relay loss {a} vs PyTorch {b}"
    trained = relay.materialize()
    for (name, p), q in zip(plain_model.named_parameters(), trained.parameters()):
        assert rel_diff(q, p) <= tol, f"{name}: relative difference {rel_diff(q, p):.2e}"


@pytest.mark.parametrize("u", [1, 3, 4])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("device", DEVICES)
def test_relay_matches_pytorch_loss_and_parameters(model, opt, u, device):
    build, batches, loss_fn = MODELS[model]
    eps_options, make_opt = OPTIMIZERS[opt]
    data = batches(STEPS)
    plain = build()
    plain_losses = train_plain(plain, make_opt, loss_fn, data)
    relay_losses, relay = train_relay(build(), eps_options, loss_fn, data, u, device=device)
    assert_same_training(plain_losses, plain, relay_losses, relay)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("device", DEVICES)
def test_relay_without_recompute_matches_pytorch(model, device):
    build, batches, loss_fn = MODELS[model]
    eps_options, make_opt = OPTIMIZERS["adamw"]
    data = batches(STEPS)
    plain = build()
    plain_losses = train_plain(plain, make_opt, loss_fn, data)
    relay_losses, relay = train_relay(build(), eps_options, loss_fn, data, u=4, recompute="none", device=device)
    assert_same_training(plain_losses, plain, relay_losses, relay)


@pytest.mark.parametrize("device", DEVICES)
def test_tied_embedding_and_head_accumulate_over_both_uses(device):
    data = gpt_batches(STEPS)
    plain = gpt(tie_weights=True)
    assert plain[0].wte.weight is plain[-1].lm_head.weight
    plain_losses = train_plain(plain, OPTIMIZERS["adamw"][1], lm_loss, data)
    relay_losses, relay = train_relay(gpt(tie_weights=True), OPTIMIZERS["adamw"][0], lm_loss, data, u=3, device=device)
    assert_same_training(plain_losses, plain, relay_losses, relay)
    trained = relay.materialize()
    assert trained[0].wte.weight is trained[-1].lm_head.weight


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_parameters_stay_frozen_and_the_rest_trains_as_pytorch(device):
    def build():
        model = mlp_layers()
        for p in model[1].parameters():
            p.requires_grad_(False)
        return model

    data = mlp_batches(STEPS)
    plain = build()
    frozen_before = copy.deepcopy(plain[1].state_dict())
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01,
                            foreach=False)
    plain_losses = []
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.mse_loss(plain(x), y)
        loss.backward()
        opt.step()
        plain_losses.append(loss.item())
    relay_losses, relay = train_relay(build(), OPTIMIZERS["adamw"][0], nn.functional.mse_loss, data, u=4, device=device)
    assert_same_training(plain_losses, plain, relay_losses, relay)
    for name, t in relay.materialize()[1].state_dict().items():
        assert torch.equal(t, frozen_before[name]), name


@pytest.mark.parametrize("device", DEVICES)
def test_gpt_dropout_replayed_in_recompute_matches_pytorch(device):
    # With one micro-batch the relay draws dropout masks in the same order as plain
    # PyTorch; the backward's recompute must replay them, or gradients differ.
    data = gpt_batches(STEPS)
    torch.manual_seed(123)
    plain = gpt(dropout=0.2)
    torch.manual_seed(123)
    plain_losses = train_plain(plain, OPTIMIZERS["adamw"][1], lm_loss, data, device=reference_device(device))
    model = gpt(dropout=0.2)
    torch.manual_seed(123)
    relay_losses, relay = train_relay(model, OPTIMIZERS["adamw"][0], lm_loss, data, u=1, device=device)
    assert_same_training(plain_losses, plain, relay_losses, relay)


class RecordingDropout(nn.Module):
    """Dropout that records every mask it draws, or applies masks it is given."""

    def __init__(self, p):
        super().__init__()
        self.p, self.drawn, self.given = p, [], []

    def forward(self, x):
        if self.given:
            mask = self.given.pop(0).to(x.device)
        else:
            mask = torch.empty_like(x).bernoulli_(1 - self.p)
            self.drawn.append(mask)
        return x * mask / (1 - self.p)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_masks_of_recompute_equal_forward_and_match_baseline_given_same_masks(device):
    u = 3

    def build():
        model = mlp_layers(dropout=0.0)
        for block in model[1:4]:
            block.drop = RecordingDropout(0.3)
        return model

    data = mlp_batches(STEPS)
    relay_model = build()
    relay_losses, relay = train_relay(relay_model, OPTIMIZERS["adamw"][0], nn.functional.mse_loss, data, u, device=device)
    plain = build()
    for relay_block, plain_block in zip(relay_model[1:4], plain[1:4]):
        drawn = relay_block.drop.drawn
        assert len(drawn) == STEPS * 2 * u  # forward and recompute, each micro-batch
        for step in range(STEPS):
            forward, recompute = drawn[step * 2 * u: step * 2 * u + u], drawn[step * 2 * u + u: (step + 1) * 2 * u]
            for f, r in zip(forward, recompute):
                assert torch.equal(f, r), "recompute drew a different dropout mask than the forward"
            plain_block.drop.given.append(torch.cat(forward))
    plain_losses = train_plain(plain, OPTIMIZERS["adamw"][1], nn.functional.mse_loss, data,
                               device=reference_device(device))
    assert_same_training(plain_losses, plain, relay_losses, relay)


@pytest.mark.parametrize("device", DEVICES)
def test_batchnorm_running_statistics_updated_once_per_micro_batch(device):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(11, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 7))

    u, data = 3, mlp_batches(STEPS)
    plain = build()
    opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3, foreach=False)
    plain_losses = []
    for x, y in data:  # the baseline: gradient accumulation over the same micro-batches
        opt.zero_grad()
        total = 0.0
        for xj, yj in zip(torch.tensor_split(x, u), torch.tensor_split(y, u)):
            loss = nn.functional.mse_loss(plain(xj), yj) / u
            loss.backward()
            total += loss.item()
        opt.step()
        plain_losses.append(total)
    relay_losses, relay = train_relay(build(), OPTIMIZERS["sgd-momentum"][0], nn.functional.mse_loss, data, u, device=device)
    assert_same_training(plain_losses, plain, relay_losses, relay)
    bn, relay_bn = plain[1], relay.materialize()[1]
    assert int(relay_bn.num_batches_tracked) == STEPS * u
    assert rel_diff(relay_bn.running_mean, bn.running_mean) <= TOL
    assert rel_diff(relay_bn.running_var, bn.running_var) <= TOL


@pytest.mark.parametrize("device", DEVICES)
def test_batch_not_divisible_by_micro_batches_is_weighted_exactly(device):
    data = mlp_batches(STEPS, batch=13)
    plain = mlp_layers()
    plain_losses = train_plain(plain, OPTIMIZERS["adamw"][1], nn.functional.mse_loss, data)
    relay_losses, relay = train_relay(mlp_layers(), OPTIMIZERS["adamw"][0], nn.functional.mse_loss, data, u=5, device=device)
    assert_same_training(plain_losses, plain, relay_losses, relay)


def test_evaluate_equals_plain_eval_loss_and_leaves_weights():
    x, y = gpt_batches(1)[0]
    relay = l2l_hw.Relay(gpt(dropout=0.1), lm_loss, eps=l2l_hw.make_eps("cpu"), micro_batches=4)
    reference = gpt(dropout=0.1).eval()
    with torch.no_grad():
        expected = lm_loss(reference(x), y).item()
    assert abs(relay.evaluate(x, y) - expected) <= TOL * expected
    assert relay.step == 0
