"""Recompute policies: each trains as plain PyTorch does, and "selective" runs no matmul twice."""
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import l2l_hw
from l2l_hw.models.gpt import lm_loss
from l2l_hw.relay.options import RelayOptions
from l2l_hw.relay.recompute import MATMUL_OPS
from tests.helpers import DEVICES
from tests.test_relay_equivalence import (OPTIMIZERS, STEPS, assert_same_training, gpt, gpt_batches, mlp_batches,
                                          mlp_layers, train_plain, train_relay)

POLICIES = ["none", "full", "selective"]


def keep_nothing(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def keep_linear_outputs(ctx, op, *args, **kwargs):  # a user's policy: the Linears only, as a bool
    return op is torch.ops.aten.addmm.default


@pytest.mark.parametrize("recompute", POLICIES + [keep_nothing, keep_linear_outputs])
@pytest.mark.parametrize("device", DEVICES)
def test_every_policy_trains_as_pytorch(recompute, device):
    data = gpt_batches(STEPS)
    plain = gpt()
    plain_losses = train_plain(plain, OPTIMIZERS["adamw"][1], lm_loss, data)
    relay_losses, relay = train_relay(gpt(), OPTIMIZERS["adamw"][0], lm_loss, data, u=4, recompute=recompute,
                                      device=device)
    assert_same_training(plain_losses, plain, relay_losses, relay)


@pytest.mark.parametrize("recompute", ["none", "selective"])  # full: test_relay_equivalence's dropout test
@pytest.mark.parametrize("device", DEVICES)
def test_dropout_with_every_policy_matches_pytorch(recompute, device):
    # One micro-batch draws the masks in plain PyTorch's order; the recompute replays them,
    # attention's own dropout included (never served from the cache: it draws).
    data = gpt_batches(STEPS)
    torch.manual_seed(123)
    plain = gpt(dropout=0.2)
    torch.manual_seed(123)
    plain_losses = train_plain(plain, OPTIMIZERS["adamw"][1], lm_loss, data)
    model = gpt(dropout=0.2)
    torch.manual_seed(123)
    relay_losses, relay = train_relay(model, OPTIMIZERS["adamw"][0], lm_loss, data, u=1, recompute=recompute,
                                      device=device)
    assert_same_training(plain_losses, plain, relay_losses, relay)


def test_selective_with_host_activations_matches_pytorch():
    data = mlp_batches(STEPS)
    plain = mlp_layers()
    plain_losses = train_plain(plain, OPTIMIZERS["adamw"][1], nn.functional.mse_loss, data)
    relay = l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu", **OPTIMIZERS["adamw"][0]),
                         micro_batches=3, recompute="selective", activations="host")
    relay_losses = [relay.train_step(x, y) for x, y in data]
    assert_same_training(plain_losses, plain, relay_losses, relay)


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        self.count += op in MATMUL_OPS
        return op(*args, **(kwargs or {}))


def test_selective_recomputes_no_matmul_and_full_recomputes_as_many_as_torch_checkpoint():
    x, y = gpt_batches(1)[0]
    plain = gpt()
    with CountMatmuls() as forward:
        out = plain(x)
    with CountMatmuls() as backward:
        lm_loss(out, y).backward()
    # torch's non-reentrant checkpoint of every layer but the head: its recompute stops after the
    # last tensor the backward saves (each block's output projection is not run again)
    layers = list(gpt())
    with CountMatmuls() as checkpointed:
        h = x
        for layer in layers[:-1]:
            h = checkpoint(layer, h, use_reentrant=False)
        lm_loss(layers[-1](h), y).backward()
    counts = {}
    for recompute in POLICIES:
        relay = l2l_hw.Relay(gpt(), lm_loss, eps=l2l_hw.make_eps("cpu", optimizer="sgd", lr=0.1), micro_batches=2,
                             recompute=recompute)
        relay.train_step(x, y)  # the first step warms up (and finds what full's recompute may skip); count the second
        with CountMatmuls() as step:
            relay.train_step(x, y)
        counts[recompute] = step.count
    per_micro_batch = forward.count + backward.count  # the matmuls of a forward and a backward
    assert counts["none"] == counts["selective"] == 2 * per_micro_batch
    assert counts["full"] == 2 * checkpointed.count
    assert counts["none"] < counts["full"] < counts["none"] + 2 * (forward.count - 1)  # it skipped some


def test_a_kept_output_changed_in_place_is_one_clear_error():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            h.mul_(2)  # changes the addmm output the policy keeps
            return h

    relay = l2l_hw.Relay([nn.Linear(4, 4), InPlace(), nn.Linear(4, 2)], nn.functional.mse_loss,
                         eps=l2l_hw.make_eps("cpu", optimizer="sgd", lr=0.1), recompute="selective")
    with pytest.raises(RuntimeError, match="changes the output of aten.addmm.default in place.*recompute='full'"):
        relay.train_step(torch.randn(4, 4), torch.randn(4, 2))


def test_recompute_takes_only_a_policy_name_or_function():
    with pytest.raises(ValueError, match="recompute=True: must be one of none, full, selective"):
        RelayOptions(recompute=True)


def test_planned_recompute_keeps_within_each_budget_and_trains_as_pytorch():
    data = gpt_batches(STEPS)
    plain = gpt()
    plain_losses = train_plain(plain, OPTIMIZERS["adamw"][1], lm_loss, data)

    def relay_for(**options):
        return l2l_hw.Relay(gpt(), lm_loss, eps=l2l_hw.make_eps("cpu", **OPTIMIZERS["adamw"][0]), micro_batches=3,
                            account_memory=True, **options)

    kept = {}
    for policy in ("full", "none"):  # keeping least and most
        relay = relay_for(recompute=policy)
        relay.train_step(*data[0])
        kept[policy] = relay.memory_report()["kept_activation_peak_bytes"]
    assert kept["full"] < kept["none"]
    plans = []
    for share in (0.3, 0.6, 0.9):
        budget = int(kept["full"] + share * (kept["none"] - kept["full"]))
        relay = relay_for(activation_budget=budget)
        losses = [relay.train_step(*data[0])]  # planned from this step
        relay.reset_memory()
        losses += [relay.train_step(x, y) for x, y in data[1:]]
        assert relay.memory_report()["kept_activation_peak_bytes"] <= budget
        assert_same_training(plain_losses, plain, losses, relay)
        plans.append(list(relay.keep.plan.values()))
    assert plans[-1] != ["full"] * len(plans[-1])  # the largest budget keeps something more than the inputs
    assert plans[0] != plans[-1]


def test_activation_budget_plans_the_recompute_itself():
    with pytest.raises(ValueError, match="recompute='none': is planned per layer under activation_budget"):
        RelayOptions(recompute="none", activation_budget=1 << 20)
