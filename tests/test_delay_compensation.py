"""Delay compensation "predict" for PipeDream-2BW (l2l_hw/eps/golden.py predict_rule, the engine's
host path, the relay): the working copy an update writes is torch.optim's next step with the
same gradient again; the host path equals the golden rule bit for bit in every working dtype and
state format, chunked or whole; the single-process 2BW relay with it equals plain PyTorch
computing each gradient on the weights predicted one step ahead; it resumes bit-exactly; and
every bad input is one line before any weight is loaded."""
import copy

import pytest
import torch
from torch import nn

import l2l_hw
from l2l_hw.eps import engine
from l2l_hw.eps.base import OptimConfig
from tests.helpers import mlp_layers, rel_diff
from tests.test_relay_equivalence import mlp_batches

STEPS = 8
TOL = 1e-5
SCHEDULE = dict(schedule="cosine", warmup_steps=2, total_steps=STEPS + 2, min_lr=1e-4)
RULES = {  # name -> (EPS options, the torch.optim optimizer of the same rule)
    "adamw": (dict(optimizer="adamw", lr=1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)),
    "adam": (dict(optimizer="adam", lr=1e-2, weight_decay=0.01),
             lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, foreach=False)),
    "sgd-nesterov": (dict(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3,
                                                foreach=False)),
    "sgd": (dict(optimizer="sgd", lr=0.05), lambda ps: torch.optim.SGD(ps, lr=0.05, foreach=False)),
}


def lr_of(options: dict, step: int) -> float:
    return OptimConfig(**{**options, **SCHEDULE}).lr_at(step)


def torch_next_step(opt, params, grads, lr):
    """What torch.optim would make of `params` in one more step with `grads` at `lr`, on copies."""
    twin = copy.deepcopy(opt)  # its params and their state copied together
    ghost = [q for group in twin.param_groups for q in group["params"]]
    assert len(ghost) == len(params) and all(q is not p for q, p in zip(ghost, params))
    for group in twin.param_groups:
        group["lr"] = lr
    for q, g in zip(ghost, grads):
        q.grad = g.clone()
    twin.step()
    return [q.detach() for q in ghost]


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("backend", ["cpu", "golden"])
def test_the_predicted_working_copy_is_torch_optims_next_step_with_the_same_gradient(rule, backend):
    options, make_opt = RULES[rule]
    torch.manual_seed(3)
    w0 = torch.randn(37, 11)
    eps = l2l_hw.make_eps(backend, double_buffer=True, delay_compensation="predict", **options, **SCHEDULE)
    eps.register("g", {"w": w0.clone()})
    p = w0.clone().requires_grad_()
    opt = make_opt([p])
    moved = 0.0
    for step in range(1, STEPS + 1):
        g = torch.randn(37, 11)
        eps.push_grads("g", {"w": g.clone()})
        eps.commit_step()
        for group in opt.param_groups:
            group["lr"] = lr_of(options, step)
        p.grad = g.clone()
        opt.step()
        want = torch_next_step(opt, [p], [g], lr_of(options, step + 1))[0]
        got = eps.fetch("g")["w"]
        assert rel_diff(eps.master("g")["w"], p) <= TOL, (step, "master")
        assert rel_diff(got, want) <= TOL, (step, rel_diff(got, want))
        moved = max(moved, rel_diff(got, p.detach()))
    assert moved > 100 * TOL  # the prediction is a step away from the master weights, not their copy
    eps.close()


@pytest.mark.parametrize("working", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("state", ["fp32", "bf16", "8bit"])
def test_the_host_path_predicts_as_the_golden_rule_bit_for_bit_chunked_or_whole(monkeypatch, working, state):
    shape = (3 * 4096 + 100,)  # 4 chunks of 4096 below, the last one short
    torch.manual_seed(5)
    w0 = torch.randn(shape)
    grads = [torch.randn(shape).to(torch.bfloat16 if working == "bf16" else torch.float32) for _ in range(3)]
    grads[1][7] = float("nan")  # a non-finite gradient: canonical NaNs in both
    runs = {}
    for backend, chunk in (("golden", 1 << 30), ("cpu", 1 << 30), ("cpu", 4096)):
        monkeypatch.setattr(engine, "UPDATE_CHUNK", chunk)
        eps = l2l_hw.make_eps(backend, optimizer="adamw", lr=1e-2, working_dtype=working, state=state,
                              double_buffer=True, delay_compensation="predict", **SCHEDULE)
        eps.register("g", {"w": w0.clone()})
        copies = []
        for g in grads:
            eps.push_grads("g", {"w": g.clone()}, inv_scale=0.5)
            eps.commit_step()
            copies.append(eps.fetch("g")["w"].clone())
        runs[backend, chunk] = (copies, eps.master("g")["w"])
        eps.close()
    want_copies, want_master = runs["golden", 1 << 30]
    for key, (copies, master) in runs.items():
        assert torch.equal(master.view(torch.int32), want_master.view(torch.int32)), key
        for got, want in zip(copies, want_copies):
            bits = torch.int32 if working == "fp32" else torch.int16
            assert torch.equal(got.view(bits), want.view(bits)), key


def reference_2bw_predicted(steps: int, options: dict, make_opt):
    """Plain PyTorch, no relay, no EPS: step t's gradient taken on the weights predicted one step
    ahead from version t - 2 (torch.optim's next step with that version's gradient again; the loaded
    weights for steps 1 and 2), applied to W(t - 1). Returns (losses, final weights)."""
    model = mlp_layers()
    opt = make_opt(model.parameters())
    batches = mlp_batches(steps)
    versions = [copy.deepcopy(model), copy.deepcopy(model)]  # what steps 1 and 2 compute on
    losses = []
    for step, (x, y) in enumerate(batches, 1):
        at = versions[step - 1]
        at.zero_grad()
        loss = nn.functional.mse_loss(at(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        grads = [q.grad.clone() for q in at.parameters()]
        for group in opt.param_groups:
            group["lr"] = lr_of(options, step)
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
        ahead = copy.deepcopy(model)
        with torch.no_grad():
            for q, w in zip(ahead.parameters(), torch_next_step(opt, list(model.parameters()), grads,
                                                                lr_of(options, step + 1))):
                q.copy_(w)
        versions.append(ahead)  # step + 2 computes on it
    return losses, model


def relay_2bw(eps_backend="cpu", **options):
    eps = l2l_hw.make_eps(eps_backend, delay_compensation="predict", **options, **SCHEDULE)
    return l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, eps=eps, pipedream_2bw=True)


@pytest.mark.parametrize("rule", ["adamw", "sgd-nesterov"])
def test_the_2bw_relay_with_prediction_equals_plain_pytorch_on_the_predicted_weights(rule):
    options, make_opt = RULES[rule]
    want_losses, want_model = reference_2bw_predicted(STEPS, options, make_opt)
    with relay_2bw(**options) as relay:
        losses = [relay.train_step(x, y) for x, y in mlp_batches(STEPS)]
        model = relay.materialize()
    assert losses == pytest.approx(want_losses, rel=TOL)
    for got, want in zip(model.parameters(), want_model.parameters()):
        assert rel_diff(got, want) <= TOL
    # the prediction changes the run: plain 2BW computes on the unpredicted version
    eps = l2l_hw.make_eps("cpu", **options, **SCHEDULE)
    with l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, eps=eps, pipedream_2bw=True) as plain:
        plain_losses = [plain.train_step(x, y) for x, y in mlp_batches(STEPS)]
    assert abs(plain_losses[-1] - losses[-1]) > 1e3 * TOL * abs(losses[-1])


def test_a_2bw_relay_with_prediction_resumes_bit_exactly_from_its_state():
    options = RULES["adamw"][0]
    batches = mlp_batches(2 * 4)
    with relay_2bw(**options) as straight:
        want = [straight.train_step(x, y) for x, y in batches]
        want_state = straight.state_dict()
    with relay_2bw(**options) as first:
        got = [first.train_step(x, y) for x, y in batches[:4]]
        state = first.state_dict()
    assert any(name.endswith("/predicted") for name in state)  # the newest version's predicted copy
    with relay_2bw(**options) as second:
        second.load_state_dict(state)
        got += [second.train_step(x, y) for x, y in batches[4:]]
        got_state = second.state_dict()
    assert got == want
    assert want_state.keys() == got_state.keys()
    for name, t in want_state.items():
        assert torch.equal(t, got_state[name]), name


def test_compensation_without_stale_weights_is_one_line_before_any_weight_is_loaded(capsys):
    eps = l2l_hw.make_eps("cpu", delay_compensation="predict")
    with pytest.raises(ValueError, match=r"^the EPS's delay_compensation='predict' corrects the weights PipeDream-2BW "
                                         r"computes on, one step stale; this relay computes on the newest"):
        l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, eps=eps)
    assert not eps.shapes  # nothing registered
    eps.close()
    from l2l_hw.cli import main
    from l2l_hw.train import ConfigError, TrainConfig

    for extra in ({}, {"pipeline_stages": 2}, {"pipeline_stages": 2, "pipeline_schedule": "flush"}):
        with pytest.raises(ConfigError, match="delay_compensation='predict': corrects the weights PipeDream-2BW"):
            TrainConfig(delay_compensation="predict", **extra)
    assert main(["train", "--pipeline-stages", "2", "--delay-compensation", "predict", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--delay-compensation predict: corrects the weights PipeDream-2BW" in err[0], err


@pytest.mark.parametrize("options, says", [
    (dict(name="fpga-sim"), "the fpga-sim EPS keeps it in its own memory and its kernel does not predict"),
    (dict(name="cpu", optimizer="lamb"), "lamb's step reads whole tensors (a trust ratio of its norms)"),
    (dict(name="cpu", optimizer="lars", momentum=0.9), "lars's step reads whole tensors"),
    (dict(name="golden", delay_compensation="error-feedback"), "unknown delay_compensation 'error-feedback'"),
])
def test_an_eps_that_cannot_predict_refuses_in_one_line(options, says):
    options = {"delay_compensation": "predict", **options}
    with pytest.raises(ValueError) as e:
        l2l_hw.make_eps(**options)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_fpga_eps_and_a_layerwise_rule_refuse_compensation_as_options_in_one_line():
    from l2l_hw.train import ConfigError, TrainConfig

    stale = dict(pipeline_stages=2, pipeline_schedule="2bw", delay_compensation="predict")
    with pytest.raises(ConfigError, match="use --eps cpu or golden"):
        TrainConfig(eps_backend="fpga-sim", **stale)
    with pytest.raises(ConfigError, match="lamb's step reads whole tensors"):
        TrainConfig(optimizer="lamb", **stale)
    assert TrainConfig(**stale).stale_weights


def test_prediction_costs_a_working_copy_of_its_own_in_fp32_and_nothing_in_bf16():
    from l2l_hw.estimate import eps_bytes_per_parameter
    from l2l_hw.train import TrainConfig

    for precision, extra in (("fp32", 8.0), ("bf16", 0.0)):  # current and spare fp32 copies; bf16 has them already
        plain = eps_bytes_per_parameter(TrainConfig(pipedream_2bw=True, precision=precision))
        predicted = eps_bytes_per_parameter(TrainConfig(pipedream_2bw=True, precision=precision,
                                                        delay_compensation="predict"))
        assert predicted - plain == extra, precision


def test_the_disk_tier_predicts_as_host_memory_does(tmp_path):
    options = RULES["adamw"][0]
    runs = []
    for state_dir in (None, tmp_path / "state"):
        eps = l2l_hw.make_eps("cpu", delay_compensation="predict", state_dir=state_dir, **options, **SCHEDULE)
        with l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, eps=eps, pipedream_2bw=True) as relay:
            runs.append(([relay.train_step(x, y) for x, y in mlp_batches(5)], relay.state_dict()))
    (losses, state), (disk_losses, disk_state) = runs
    assert losses == disk_losses and state.keys() == disk_state.keys()
    assert all(torch.equal(t, disk_state[k]) for k, t in state.items())
