"""The device share of the update (l2l_hw/relay/device_share.py): the first k layers' weights and
AdamW state on the device, updated there by PyTorch's fused AdamW. Checked against plain PyTorch,
against the host share, across checkpoints with another k, and its planner against hand-worked
steps."""
import copy

import pytest
import torch
from torch import nn

import l2l_hw
from l2l_hw.cli import main
from l2l_hw.models.gpt import lm_loss
from l2l_hw.relay import RelayOptions, device_share
from l2l_hw.relay.device_share import DeviceShare, plan_device_share, simulate_step
from tests.helpers import DEVICES, mlp_layers, rel_diff
from tests.test_relay_equivalence import TOL, gpt, gpt_batches, mlp_batches, train_plain
from tests.test_train import TINY

ADAMW = dict(optimizer="adamw", lr=1e-3, weight_decay=0.01)


def relay(model, k, device="cpu", eps=None, **options):
    return l2l_hw.Relay(model, options.pop("loss_fn", lm_loss), eps=eps or l2l_hw.make_eps("cpu", **ADAMW),
                        micro_batches=3, device=device, device_update_layers=k, **options)


def assert_close_to(plain: nn.Module, trained: nn.Module, tol=TOL):
    for (name, p), q in zip(plain.named_parameters(), trained.parameters()):
        assert rel_diff(q, p) <= tol, f"{name}: relative difference {rel_diff(q, p):.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("fused", [False, True], ids=["pytorch-foreach", "pytorch-fused"])
def test_the_shared_layers_train_as_pytorch_adamw(k, device, fused):
    # The shared layers (1 of 4, or all: the tied embedding and head among them) update with
    # PyTorch's fused AdamW, the others in the host EPS: both are PyTorch's AdamW to fp32 rounding.
    model, batches = gpt(), gpt_batches(6)
    plain = copy.deepcopy(model)
    losses = train_plain(plain, lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=not fused,
                                                             fused=fused or None), lm_loss, batches)
    r = relay(model, k, device)
    assert isinstance(r.eps, DeviceShare) and len(r.eps.shared) == k
    got = [r.train_step(x, y) for x, y in batches]
    for a, b in zip(got, losses):
        assert abs(a - b) <= TOL * abs(b)
    assert_close_to(plain, r.materialize())


def test_on_the_disk_tier_the_host_share_is_in_files_and_the_device_share_is_not(tmp_path):
    model, batches = gpt(), gpt_batches(4)
    plain = copy.deepcopy(model)
    losses = train_plain(plain, lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=False),
                         lm_loss, batches)
    eps = l2l_hw.make_eps("cpu", state_dir=tmp_path / "state", **ADAMW)
    r = relay(model, 2, "cpu-async", eps=eps)
    got = [r.train_step(x, y) for x, y in batches]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, losses)) <= TOL
    assert_close_to(plain, r.materialize())
    assert sorted(eps.shapes) == ["layer2", "layer3"]  # the host EPS holds only the host share
    r.close()


@pytest.mark.parametrize("device", DEVICES)
def test_global_clipping_scales_the_device_share_by_the_whole_models_norm(device):
    max_norm, batches = 0.05, mlp_batches(6)
    plain = mlp_layers()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(plain(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm)
        opt.step()
        losses.append(loss.item())
    r = relay(mlp_layers(), 2, device, loss_fn=nn.functional.mse_loss, clip_grad_norm=max_norm, clip_mode="global")
    got = [r.train_step(x, y) for x, y in batches]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, losses)) <= TOL
    assert_close_to(plain, r.materialize())


def test_a_non_finite_gradient_in_the_device_share_skips_the_whole_step():
    host = l2l_hw.make_eps("cpu", double_buffer=True, **ADAMW)
    eps = DeviceShare(host, {"dev"}, torch.device("cpu"))
    torch.manual_seed(0)
    eps.register("dev", {"w": torch.randn(5)})
    eps.register("host", {"w": torch.randn(6)})
    before = eps.state_dict()
    eps.push_grads("host", {"w": torch.ones(6)})
    eps.push_grads("dev", {"w": torch.tensor([1.0, float("inf"), 0.0, 0.0, 0.0])})
    assert eps.commit_step(skip_nonfinite=True) is True
    after = eps.state_dict()
    assert eps.step == 0 and all(torch.equal(before[k], after[k]) for k in before)
    eps.push_grads("host", {"w": torch.ones(6)})  # the next step goes on from there, both parts updated
    eps.push_grads("dev", {"w": torch.ones(5)})
    assert eps.commit_step(skip_nonfinite=True) is False
    after = eps.state_dict()
    assert eps.step == 1 and not torch.equal(before["dev/w/param"], after["dev/w/param"])
    assert not torch.equal(before["host/w/param"], after["host/w/param"])
    eps.close()


@pytest.mark.parametrize("first, then", [(2, 0), (0, 4), (4, 1)])
def test_a_checkpoint_resumes_with_another_device_share(first, then):
    model, batches = gpt(), gpt_batches(6)
    plain = copy.deepcopy(model)
    losses = train_plain(plain, lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=False),
                         lm_loss, batches)
    a = relay(model, first)
    got = [a.train_step(x, y) for x, y in batches[:3]]
    state = a.state_dict()
    assert sorted(state) == sorted(relay(gpt(seed=5), 0).state_dict())  # the same entries whatever k is
    b = relay(gpt(seed=5), then)
    b.load_state_dict(state)
    got += [b.train_step(x, y) for x, y in batches[3:]]
    assert max(abs(x - y) / abs(y) for x, y in zip(got, losses)) <= TOL
    assert_close_to(plain, b.materialize())


def test_a_bad_entry_leaves_both_parts_unchanged():
    r = relay(gpt(), 2)
    r.train_step(*gpt_batches(1)[0])
    state, before = r.state_dict(), r.state_dict()
    shared = next(k for k in state if k.startswith("eps/layer0/") and k.endswith("/m"))
    state[shared] = state[shared][..., :1]
    with pytest.raises(ValueError, match="expected torch.float32"):
        r.load_state_dict(state)
    after = r.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("k, options, wrong", [
    (5, {}, "device_update_layers=5 is beyond the model: it has 4 layers"),
    (1, {"pipedream_2bw": True}, "PipeDream-2BW"),
    (1, {"eps": dict(optimizer="sgd", lr=0.1)}, "the EPS's optimizer is sgd"),
    (1, {"eps": dict(optimizer="lamb")}, "the EPS's optimizer is lamb"),
    (1, {"eps": dict(state="8bit", **ADAMW)}, "keeps 8bit state"),
])
def test_a_share_the_relay_cannot_give_is_one_line_before_any_weight_loads(k, options, wrong):
    eps = l2l_hw.make_eps("cpu", **options.pop("eps", ADAMW))
    model = gpt()
    with pytest.raises(ValueError, match=wrong) as caught:
        relay(model, k, eps=eps, **options)
    assert "\n" not in str(caught.value)
    assert not eps.shapes  # nothing registered


def test_a_share_beyond_the_devices_free_memory_names_both(monkeypatch):
    monkeypatch.setattr(l2l_hw.relay.stage, "device_free_bytes", lambda device: 1 << 10)
    eps = l2l_hw.make_eps("cpu", **ADAMW)
    with pytest.raises(ValueError, match=r"device_update_layers=2 keeps 0\.00 GiB .* which has 0\.00 GiB free"):
        relay(gpt(), 2, eps=eps)
    assert not eps.shapes


def test_a_negative_share_is_refused_by_the_option():
    with pytest.raises(ValueError, match="device_update_layers=-1: must be a whole number >= 0"):
        RelayOptions(device_update_layers=-1)


@pytest.mark.sim
def test_the_rtl_kernel_gives_no_device_share():
    eps = l2l_hw.make_eps("fpga-sim", double_buffer=True, lr=1e-2)
    try:
        with pytest.raises(ValueError, match="fpga-sim EPS updates in its own kernel"):
            relay(mlp_layers(), 1, eps=eps, loss_fn=nn.functional.mse_loss)
    finally:
        eps.close()


# -- the planner ---------------------------------------------------------------------------------
def test_the_simulated_step_waits_for_the_host_as_worked_by_hand():
    # 2 layers, forward 1 s each, backward 1 s each, host update 3 s each, none on the device.
    # Step 1: forward 0-2, backward 2-4 (layer 1 pushed at 3, layer 0 at 4); host: layer 1 3-6,
    # layer 0 6-9. Step 2 starts at 4: layer 0 waits to 9 (5 s), runs 9-10; layer 1 done at 6,
    # runs 10-11; backward 11-13; host: layer 1 12-15, layer 0 15-18. Step 3 starts at 13: layer 0
    # waits to 18 (5 s) ... a step of 9 s, 5 of them waiting.
    assert simulate_step(0, [1, 1], [1, 1], [3, 3], [0, 0]) == (9.0, 5.0)
    # Layer 0 on the device (its update 0.5 s after the backward). Step 2 starts at 4.5: layer 0
    # 4.5-5.5, layer 1 waits for its host update (3-6: 0.5 s), 6-7; backward 7-9, update 9-9.5;
    # host: layer 1 8-11. Step 3 from 9.5: layer 1 waits to 11 (0.5 s): a step of 5 s.
    step, wait = simulate_step(1, [1, 1], [1, 1], [3, 3], [0.5, 0.5])
    assert (step, wait) == (5.0, 0.5)


def test_the_planner_keeps_everything_on_the_host_where_the_host_keeps_up():
    plan = plan_device_share([100] * 8, compute_s=1.0, host_s_per_parameter=1e-5, device_s_per_parameter=1e-6,
                             free_bytes=None)
    assert plan.layers == 0 and "predicted device wait 0%" in plan.reason


def test_the_planner_moves_the_first_layers_to_the_device_where_the_host_is_slow():
    slow = dict(compute_s=1.0, host_s_per_parameter=3e-3, device_s_per_parameter=1e-6)
    plan = plan_device_share([100] * 8, free_bytes=None, **slow)
    assert 0 < plan.layers < 8
    wait = simulate_step(plan.layers, *[[v] * 8 for v in (1 / 32, 3 / 32, 0.3, 1e-4)])[1]
    fewer = simulate_step(plan.layers - 1, *[[v] * 8 for v in (1 / 32, 3 / 32, 0.3, 1e-4)])[1]
    assert wait < fewer
    bounded = plan_device_share([100] * 8, free_bytes=2 * 100 * device_share.DEVICE_BYTES_PER_PARAMETER, **slow)
    assert bounded.layers <= 2 and "2 fit the device's free memory" in bounded.reason


@pytest.mark.parametrize("flag, line", [
    ([], "device share of the update: 0 layer(s) (the device is this machine's CPU"),
    (["--device-update-layers", "2"], "device share of the update: 2 layer(s) (--device-update-layers)"),
])
def test_l2l_train_says_its_device_share_and_why_in_the_banner(tmp_path, capsys, flag, line):
    assert main(["train", *TINY, "--steps", "1", "--device", "cpu-async", "--no-save", "--out", str(tmp_path),
                 *flag]) == 0
    out = capsys.readouterr().out
    assert line in out
    assert ("weights and state on it" in out) == bool(flag)  # the EPS line counts what the device holds


@pytest.mark.parametrize("flags", [["--pipeline-stages", "2"], ["--pipedream-2bw"]])
def test_l2l_train_refuses_a_share_beside_a_pipeline_or_stale_weights_in_one_line(tmp_path, capsys, flags):
    assert main(["train", *TINY, "--steps", "1", "--device-update-layers", "1", *flags,
                 "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--device-update-layers" in err and "keep every update on the host" in err
    assert not any(tmp_path.iterdir())  # nothing written
