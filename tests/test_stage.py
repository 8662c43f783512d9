"""The layer stage is public: a schedule written outside the package from its calls alone trains
as plain PyTorch does, and its state is under the whole model's names. The Relay and the
pipeline are both a Schedule, and the training loop reads nothing of them outside it."""
import ast
import copy
from pathlib import Path

import torch
from torch import nn

import l2l_hw
from l2l_hw.relay import LayerStage
from l2l_hw.relay.pipeline import PipelineRelay
from l2l_hw.relay.schedule import Schedule
from l2l_hw.relay.stage import to_float
from tests.helpers import mlp_layers

ROOT = Path(__file__).resolve().parents[1]
ADAMW = dict(optimizer="adamw", lr=1e-3, weight_decay=0.01)


def batches(steps, batch=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 11, generator=g), torch.randn(batch, 7, generator=g)) for _ in range(steps)]


def gpipe_step(stages: list[LayerStage], x, y) -> float:
    """GPipe's order over stages in one process, from LayerStage's public calls: every stage's
    weights up for the step, each micro-batch forward through every stage (graphs kept), each
    backward, then every group's gradient summed over the micro-batches pushed, and a commit."""
    xs, ts, weights, _ = stages[0].split_micro_batches(x, y)
    live = [{} for _ in stages]
    params = [[s.layer_params(k, here) for k in range(len(s.layers))] for s, here in zip(stages, live)]
    total = 0.0
    for j in range(stages[0].micro_batches):
        a = xs[j]
        for s, ps in zip(stages, params):
            for k, p in enumerate(ps):
                a = s.call(k, a, s.plans[k].buffers, p)
        loss = stages[-1].compute_loss(to_float(a), ts[j])
        (loss * weights[j]).backward()
        total += float(loss.detach()) * weights[j]
    for s, here in zip(stages, live):
        for key in s.groups:
            s.push(key, s.grad_sums.take(here[key]))
        s.push_reduced()
        s.commit_pushed()
        s.weights.clear()
    return total


def test_a_schedule_written_outside_the_package_over_two_layer_stages_trains_as_plain_pytorch():
    model = mlp_layers(depth=3)  # 5 layers: stages [0, 2) and [2, 5)
    plain = copy.deepcopy(model)
    layers = list(model)
    stages = [LayerStage(layers[:2], nn.functional.mse_loss, l2l_hw.make_eps("cpu", **ADAMW), micro_batches=3),
              LayerStage(layers[2:], nn.functional.mse_loss, l2l_hw.make_eps("cpu", **ADAMW), micro_batches=3,
                         first=2)]
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    for x, y in batches(5):
        got = gpipe_step(stages, x, y)
        opt.zero_grad()
        loss = nn.functional.mse_loss(plain(x), y)
        loss.backward()
        opt.step()
        assert abs(got - loss.item()) <= 1e-5 * loss.item()
    trained = [e for s in stages for e in s.export()]
    assert sorted({e.layer for e in trained}) == list(range(5))  # the whole model's layer indices
    for (i, name), p in (((i, n), p) for i, layer in enumerate(plain) for n, p in layer.named_parameters()):
        e = next(e for e in trained if (e.layer, e.name) == (i, name))
        assert torch.allclose(e.tensor, p.detach(), rtol=1e-5, atol=1e-6), (i, name)
    names = set(stages[0].state_dict()) | set(stages[1].state_dict())
    whole = l2l_hw.Relay(mlp_layers(depth=3), nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu", **ADAMW))
    assert {n for n in names if n.startswith(("eps/layer", "buffers/"))} == \
        {n for n in whole.state_dict() if n.startswith(("eps/layer", "buffers/"))}
    for s in stages:
        s.close()
    whole.close()


def schedule_members() -> set[str]:
    return set(Schedule.__annotations__) | {name for name in vars(Schedule) if not name.startswith("_")}


def test_the_relay_and_the_pipeline_are_each_a_schedule():
    relay = l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu"))
    assert isinstance(relay, Schedule)
    assert all(hasattr(PipelineRelay, name) for name in schedule_members() - {"layers", "plan"})
    relay.close()


def test_the_training_loop_reads_nothing_of_a_relay_outside_the_schedule():
    """Every attribute the training loop (train.py and its parts in l2l_hw/training/) reads of a
    relay (`relay.x`, `state.relay.x`, `result.relay.x`) is the Schedule's: it trains a Relay or a
    pipeline alike (finetune.py builds Relays only)."""
    allowed, read = schedule_members() | {"bounds"}, set()  # bounds: the banner's, under a pipeline
    loop = [ROOT / "l2l_hw/train.py", *sorted((ROOT / "l2l_hw/training").glob("*.py"))]
    for node in (n for path in loop for n in ast.walk(ast.parse(path.read_text()))):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "relay") or \
                    (isinstance(owner, ast.Attribute) and owner.attr == "relay"):
                read.add(node.attr)
    assert read and read <= allowed, sorted(read - allowed)
