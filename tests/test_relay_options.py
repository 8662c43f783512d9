"""Relay options: activation offload, memory accounting, layer selection, clipping."""
import copy

import pytest
import torch
from torch import nn

import l2l_hw
from tests.helpers import DEVICES, mlp_layers, rel_diff
from tests.test_relay_equivalence import (OPTIMIZERS, STEPS, assert_same_training, gpt, gpt_batches, mlp_batches,
                                          train_plain)
from l2l_hw.models.gpt import lm_loss


def relay_losses(relay, data):
    return [relay.train_step(x, y) for x, y in data]


@pytest.mark.parametrize("device", DEVICES)
def test_host_activations_bit_identical_to_device(device):
    data = gpt_batches(4)
    results = {}
    for policy in ("device", "host"):
        torch.manual_seed(7)
        relay = l2l_hw.Relay(gpt(dropout=0.1), lm_loss, eps=l2l_hw.make_eps("cpu"), micro_batches=3,
                             activations=policy, device=device)
        results[policy] = (relay_losses(relay, data), relay.eps.state_dict())
    assert results["device"][0] == results["host"][0]
    for k, v in results["device"][1].items():
        assert torch.equal(v, results["host"][1][k]), k


@pytest.mark.parametrize("u", [1, 3])
def test_memory_report_follows_the_arithmetic_of_a_linear_stack(u):
    # L bias-free Linear(W, W) layers, batch B, MSE loss. The peak is at the last
    # layer, right after a micro-batch's backward: its weights and their gradient, the
    # next layer's weights in flight, 3 activations of the whole batch (the last
    # layer's input, the targets, its output and the earlier micro-batches' input
    # gradients) and this micro-batch's input gradient (1 / u of the batch's), plus
    # the stash: every earlier layer's input ("device") or one layer's ("host").
    W, B = 64, 24
    weight, act = W * W * 4, B * W * 4
    for policy in ("device", "host"):
        for L in (4, 5, 8):
            torch.manual_seed(0)
            relay = l2l_hw.Relay([nn.Linear(W, W, bias=False) for _ in range(L)], nn.functional.mse_loss,
                                 eps=l2l_hw.make_eps("cpu"), micro_batches=u, activations=policy, account_memory=True)
            relay.train_step(torch.randn(B, W), torch.randn(B, W))
            stash = (L - 1) * act if policy == "device" else act
            expected = 3 * weight + 3 * act + act // u + stash
            assert relay.memory_report()["peak_bytes"] == expected, (policy, L)


def test_on_the_cpu_memory_report_names_the_option_that_counts_it():
    relay = l2l_hw.Relay([nn.Linear(8, 8)], nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu"))
    relay.train_step(torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match=r"account_memory=True \(l2l train --account-memory\)"):
        relay.memory_report()


def test_evaluation_holds_two_layers_of_weights_whatever_the_depth():
    """evaluate() drops each layer's weights after their last use and prefetches the next
    layer's: the layer running, the layer arriving and the activations (CUDA_REVIEW item 1)."""
    W, B = 64, 24
    weight, act = W * W * 4, B * W * 4
    for L in (4, 8):
        torch.manual_seed(0)
        relay = l2l_hw.Relay([nn.Linear(W, W, bias=False) for _ in range(L)], nn.functional.mse_loss,
                             eps=l2l_hw.make_eps("cpu"), account_memory=True)
        relay.reset_memory()
        relay.evaluate(torch.randn(B, W), torch.randn(B, W))
        assert relay.memory_report()["peak_bytes"] == 2 * weight + act, L


def test_skipped_layer_costs_nothing_and_training_equals_the_model_without_it():
    data = mlp_batches(STEPS)
    relay_model = mlp_layers()
    skipped = 2
    eps = l2l_hw.make_eps("cpu", **OPTIMIZERS["adamw"][0])
    relay = l2l_hw.Relay(relay_model, nn.functional.mse_loss, eps=eps, micro_batches=3)
    before = {k: v.clone() for k, v in eps.state_dict().items() if k.startswith(f"layer{skipped}/")}
    fetched = []
    fetch = eps.fetch
    eps.fetch = lambda key, **kw: fetched.append(key) or fetch(key, **kw)
    active = [i for i in range(len(relay_model)) if i != skipped]
    losses = [relay.train_step(x, y, layers=active) for x, y in data]
    assert f"layer{skipped}" not in fetched  # no transfer
    after = eps.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # no update, state untouched
    # The hand-written reference: the same network without the skipped layer.
    plain = mlp_layers()
    reference = nn.Sequential(*[m for i, m in enumerate(plain) if i != skipped])
    plain_losses = train_plain(reference, OPTIMIZERS["adamw"][1], nn.functional.mse_loss, data)
    for a, b in zip(losses, plain_losses):
        assert abs(a - b) <= 1e-5 * abs(b)
    trained = relay.materialize()
    for i, (m, r) in enumerate(zip([m for i, m in enumerate(trained) if i != skipped], reference)):
        for p, q in zip(m.parameters(), r.parameters()):
            assert rel_diff(p, q) <= 1e-5, i


def test_layer_drop_schedule_draws_reproducibly_and_trains():
    def run():
        relay = l2l_hw.Relay(gpt(), lm_loss, eps=l2l_hw.make_eps("cpu"), micro_batches=2,
                             layer_drop=lambda step: 0.5 if step > 1 else 0.0, layer_drop_seed=3)
        drawn = [relay.active_layers(None)]
        losses = []
        for x, y in gpt_batches(6):
            drawn.append(relay.active_layers(None))
            losses.append(relay.train_step(x, y))
        return drawn, losses

    drawn, losses = run()
    assert drawn == run()[0]
    assert drawn[0] == [0, 1, 2, 3]  # step 1: nothing dropped
    assert any(len(d) < 4 for d in drawn[1:]), "with p = 0.5 some step drops a block"
    assert all(d[0] == 0 and d[-1] == 3 for d in drawn)  # embedding and head always run
    assert all(torch.isfinite(torch.tensor(losses)))


def test_bad_layer_selection_is_refused():
    relay = l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu"))
    x, y = mlp_batches(1)[0]
    with pytest.raises(ValueError, match="must be indices in \\[0, 5\\) and include the last layer 4"):
        relay.train_step(x, y, layers=[0, 1])


@pytest.mark.parametrize("mode, activations", [("layer", "device"), ("global", "device"), ("global", "host")])
@pytest.mark.parametrize("device", DEVICES)
def test_gradient_clipping_matches_torch_clip_grad_norm(mode, activations, device):
    # Global clipping defers every update to the commit, so with the host stash nothing waits
    # for a copy down during the backward: the stash's copy up must wait for its copy down.
    data = mlp_batches(STEPS)
    max_norm = 0.05  # small enough that every step clips
    plain = mlp_layers()
    opt = OPTIMIZERS["adamw"][1](plain.parameters())
    plain_losses = []
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.mse_loss(plain(x), y)
        loss.backward()
        groups = [list(layer.parameters()) for layer in plain] if mode == "layer" else [list(plain.parameters())]
        for params in groups:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        plain_losses.append(loss.item())
    relay = l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu", **OPTIMIZERS["adamw"][0]),
                         micro_batches=3, clip_grad_norm=max_norm, clip_mode=mode, activations=activations,
                         device=device)
    assert_same_training(plain_losses, plain, relay_losses(relay, data), relay)


# Active layers per step: block 2 skipped at steps 2 and 4, block 1 at step 3 (None: all).
SKIPS = [None, [0, 1, 3, 4], [0, 2, 3, 4], [0, 1, 3, 4], None, None]


@pytest.mark.parametrize("schedule", [[None] * 6, SKIPS], ids=["every-layer", "with-skipped-layers"])
def test_pipedream_2bw_applies_each_gradient_one_step_late(schedule):
    # Hand-written reference with plain SGD: the gradient of step t+1 is taken at
    # W(t-1) (the version without step t's update) and applied to W(t):
    #   W(t+1) = W(t) - lr * grad f_{t+1}(W(t-1)),   W(-1) = W(0).
    # A layer skipped at step t is not updated, so W(t) = W(t-1) for it: at step t+1 it
    # computes on the version it has had since its last update.
    lr, data = 0.1, mlp_batches(6)
    reference = mlp_layers()
    stale = [p.detach().clone() for p in reference.parameters()]
    for (x, y), active in zip(data, schedule):
        active = active or range(len(reference))
        newest = [p.detach().clone() for p in reference.parameters()]
        with torch.no_grad():  # compute at the stale version
            for p, w in zip(reference.parameters(), stale):
                p.copy_(w)
        reference.zero_grad()
        nn.functional.mse_loss(nn.Sequential(*[reference[i] for i in active])(x), y).backward()
        with torch.no_grad():
            for p, w in zip(reference.parameters(), newest):
                p.copy_(w - lr * p.grad if p.grad is not None else w)
        stale = newest
    for backend in ("golden", "cpu"):
        relay = l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, eps=l2l_hw.make_eps(backend, optimizer="sgd", lr=lr),
                             micro_batches=2, pipedream_2bw=True)
        for (x, y), active in zip(data, schedule):
            relay.train_step(x, y, layers=active)
        for p, q in zip(relay.materialize().parameters(), reference.parameters()):
            assert rel_diff(p, q) <= 1e-5, backend


def adamw_one_step_late(model, data, loss_fn, lr, weight_decay, lr_at=None) -> list[float]:
    """Plain PyTorch PipeDream-2BW reference: W(t+1) = AdamW(W(t), grad at W(t-1)), W(-1) = W(0),
    from a kept copy of W(t-1); trains `model` in place and returns each step's loss (at W(t-1))."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    stale, losses = copy.deepcopy(model), []
    for step, (x, y) in enumerate(data, 1):
        newest = copy.deepcopy(model)
        stale.zero_grad()
        loss = loss_fn(stale(x), y)
        loss.backward()
        losses.append(loss.item())
        for p, q in zip(model.parameters(), stale.parameters()):
            p.grad = q.grad.clone()
        if lr_at is not None:
            opt.param_groups[0]["lr"] = lr_at(step)
        opt.step()
        stale = newest
    return losses


@pytest.mark.parametrize("device", DEVICES)
def test_pipedream_2bw_with_adamw_matches_torch_adamw_on_stale_gradients(device):
    data = mlp_batches(8)
    reference = mlp_layers()
    adamw_one_step_late(reference, data, nn.functional.mse_loss, lr=1e-2, weight_decay=0.01)
    relay = l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, micro_batches=2, pipedream_2bw=True,
                         eps=l2l_hw.make_eps("cpu", lr=1e-2, weight_decay=0.01), device=device)
    for x, y in data:
        relay.train_step(x, y)
    for p, q in zip(relay.materialize().parameters(), reference.parameters()):
        assert rel_diff(p, q) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_pipedream_2bw_gpt_with_tied_weights_and_warmup_cosine_matches_plain_pytorch(device):
    # What `l2l train --pipedream-2bw` runs, small: a GPT whose head shares the token table,
    # micro-batches, AdamW under a warm-up + cosine schedule. Plain PyTorch with a kept copy
    # of W(t-1) must give the same losses (each taken at W(t-1)) and the same W(t): staleness
    # exactly one step for every layer, the first step on W(0), lr and Adam's step count
    # advanced once per step.
    import math
    steps, warmup, lr, min_lr = 8, 2, 3e-3, 3e-4
    data = gpt_batches(steps)

    def lr_at(step):  # 1-based, as nanoGPT's get_lr
        if step <= warmup:
            return lr * step / warmup
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))

    reference = gpt(tie_weights=True)
    losses = adamw_one_step_late(reference, data, lm_loss, lr=lr, weight_decay=0.1, lr_at=lr_at)
    relay = l2l_hw.Relay(gpt(tie_weights=True), lm_loss, micro_batches=3, pipedream_2bw=True,
                         eps=l2l_hw.make_eps("cpu", lr=lr, weight_decay=0.1, schedule="cosine", warmup_steps=warmup,
                                             total_steps=steps, min_lr=min_lr), device=device)
    assert_same_training(losses, reference, relay_losses(relay, data), relay)


def test_pipedream_2bw_evaluates_the_newest_weights():
    # Validation under 2BW is the model the run has reached, W(t) (what materialize()
    # exports), not W(t-1), the version the next step will compute on.
    data = mlp_batches(4)
    reference = mlp_layers()
    adamw_one_step_late(reference, data[:3], nn.functional.mse_loss, lr=1e-2, weight_decay=0.01)
    relay = l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, micro_batches=2, pipedream_2bw=True,
                         eps=l2l_hw.make_eps("cpu", lr=1e-2, weight_decay=0.01))
    for x, y in data[:3]:
        relay.train_step(x, y)
    x, y = data[3]
    with torch.no_grad():
        expected = nn.functional.mse_loss(reference(x), y).item()
    assert relay.evaluate(x, y) == pytest.approx(expected, rel=1e-5)
    assert relay.train_step(x, y) != pytest.approx(expected, rel=1e-3)  # the step itself computes one back


@pytest.mark.parametrize("device", DEVICES)
def test_pipedream_2bw_resumed_from_a_checkpoint_matches_plain_pytorch(device):
    # A 2BW step computes on W(t-1): a checkpoint must carry that version too, or the
    # first step after a resume computes on W(t) and the run leaves the 2BW trajectory.
    data = mlp_batches(6)
    reference = mlp_layers()
    adamw_one_step_late(reference, data, nn.functional.mse_loss, lr=1e-2, weight_decay=0.01)
    for backend in ("golden", "cpu"):
        def relay():
            return l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, micro_batches=2, pipedream_2bw=True,
                                eps=l2l_hw.make_eps(backend, lr=1e-2, weight_decay=0.01), device=device)
        first = relay()
        for x, y in data[:3]:
            first.train_step(x, y)
        resumed = relay()
        resumed.load_state_dict(first.state_dict())
        for x, y in data[3:]:
            resumed.train_step(x, y)
        for p, q in zip(resumed.materialize().parameters(), reference.parameters()):
            assert rel_diff(p, q) <= 1e-5, backend


def test_pipedream_2bw_step_does_not_wait_for_its_last_update():
    # The first layer's update of step 1 is held until released: under 2BW train_step
    # returns anyway (step 2 computes on the version that update replaces); the update
    # is swapped in when step 2 first pushes, and training still equals plain PyTorch.
    # Beside a device (its twin): on the CPU itself updates run between layers, inline.
    import threading
    data = mlp_batches(3)
    reference = mlp_layers()
    adamw_one_step_late(reference, data, nn.functional.mse_loss, lr=1e-2, weight_decay=0.01)
    eps = l2l_hw.make_eps("cpu", lr=1e-2, weight_decay=0.01)
    release, finished = threading.Event(), threading.Event()
    update = eps._update

    def slow_update(key, grads, s):  # an update is a generator the update thread runs
        if key != "layer0" or finished.is_set():
            return (yield from update(key, grads, s))
        assert release.wait(30), "never released"
        try:
            return (yield from update(key, grads, s))
        finally:
            finished.set()

    eps._update = slow_update
    relay = l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, eps=eps, micro_batches=2, pipedream_2bw=True,
                         device="cpu-async")
    relay.train_step(*data[0])
    assert not finished.is_set() and relay.step == 1  # returned before layer0's update could finish
    release.set()
    for x, y in data[1:]:
        relay.train_step(x, y)
    for p, q in zip(relay.materialize().parameters(), reference.parameters()):
        assert rel_diff(p, q) <= 1e-5


def test_pipedream_2bw_failed_background_update_undoes_its_step():
    # An update that fails after its step returned is raised by the next step, and that
    # step is undone whole: every group is back at its state before it, step count too.
    from l2l_hw.eps.worker import UpdateError
    eps = l2l_hw.make_eps("cpu", lr=1e-2, weight_decay=0.01)
    relay = l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, eps=eps, micro_batches=2, pipedream_2bw=True)
    data = mlp_batches(3)
    relay.train_step(*data[0])
    before = {k: v.clone() for k, v in eps.state_dict().items()}
    update = eps._update

    def failing(key, grads, s):
        if key == "layer2":
            raise RuntimeError("injected")
        return (yield from update(key, grads, s))

    eps._update = failing
    relay.train_step(*data[1])  # returns: its updates run in the background
    eps._update = update
    with pytest.raises(UpdateError, match="layer2.*injected"):
        relay.train_step(*data[2])
    after = eps.state_dict()
    assert int(after["step"]) == 1 and before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
