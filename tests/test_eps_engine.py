"""The EPS engine: one copy of the state by default, double buffers only where the semantics
need them, meta-device layers, streamed checkpoints, and a relay that asks its EPS rather
than inspecting it."""
import ast
import math
import re
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import l2l_hw
from l2l_hw.checkpoint import open_checkpoint, save_checkpoint
from l2l_hw.models import GPTConfig, build_gpt, lm_loss
from l2l_hw.relay import init_from_state
from tests.helpers import DEVICES, mlp_layers

ROOT = Path(__file__).resolve().parent.parent


def buffer_bytes_per_param(eps) -> float:
    """Bytes of every buffer the engine holds, per parameter (exact accounting)."""
    n = sum(math.prod(s) for group in eps.shapes.values() for s in group.values())
    held = sum(t.nbytes for group in eps.buffers.values() for b in group.values() for t in b.all())
    return held / n


@pytest.mark.parametrize("working, double_buffer, expected", [
    ("fp32", False, 12), ("bf16", False, 14),  # in place: param, m, v (+ the bf16 working copy)
    ("fp16", True, 30), ("bf16", True, 30),  # + spare param, m, v, working and the previous working copy
])
def test_cpu_eps_holds_one_copy_of_the_state_unless_double_buffered(working, double_buffer, expected):
    eps = l2l_hw.make_eps("cpu", working_dtype=working, double_buffer=double_buffer)
    eps.register("layer0", {"w": torch.randn(64, 33), "b": torch.randn(33)})
    eps.push_grads("layer0", {"w": torch.randn(64, 33), "b": torch.randn(33)})
    eps.commit_step()
    assert buffer_bytes_per_param(eps) == expected


def test_in_place_update_equals_golden_bit_for_bit_over_steps():
    epss = [l2l_hw.make_eps(name, working_dtype="bf16", lr=1e-2) for name in ("golden", "cpu")]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, generator=g)
    for e in epss:
        e.register("layer0", {"w": w})
    for _ in range(5):
        grad = torch.randn(1000, generator=g).to(torch.bfloat16)
        for e in epss:
            e.push_grads("layer0", {"w": grad})
            e.commit_step()
        a, b = (e.state_dict() for e in epss)
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert torch.equal(epss[0].fetch("layer0")["w"].view(torch.int16), epss[1].fetch("layer0")["w"].view(torch.int16))


def tiny_gpt(device=None, seed=0):
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        return build_gpt(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, tie_weights=True))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 256, (4, 16), generator=g)
        yield x, torch.roll(x, -1, 1)


def test_relay_keeps_only_the_structure_and_materialize_gives_the_masters():
    layers = tiny_gpt()
    initial = {k: v.clone() for k, v in nn.Sequential(*layers).state_dict().items()}
    relay = l2l_hw.Relay(layers, lm_loss, eps=l2l_hw.make_eps("cpu"), micro_batches=2)
    assert all(p.is_meta for p in nn.Sequential(*layers).parameters())  # the EPS holds the only copy
    assert layers[0].wte.weight is layers[-1].lm_head.weight  # still tied
    model = relay.materialize()
    assert model[0].wte.weight is model[-1].lm_head.weight
    assert all(torch.equal(v, initial[k]) for k, v in model.state_dict().items())


def test_meta_device_model_filled_by_init_trains_bit_identical_to_the_eager_one():
    eager = l2l_hw.Relay(tiny_gpt(), lm_loss, eps=l2l_hw.make_eps("cpu"), micro_batches=2)
    values = nn.Sequential(*tiny_gpt()).state_dict()
    calls = []

    def init(i, module):
        calls.append(i)
        return {name: values[f"{i}.{name}"] for name, _ in module.named_parameters()}

    meta = l2l_hw.Relay(tiny_gpt("meta"), lm_loss, eps=l2l_hw.make_eps("cpu"), micro_batches=2, init=init)
    assert calls == [0, 1, 2, 3]
    for x, y in batches(3):
        assert eager.train_step(x, y) == meta.train_step(x, y)
    a, b = eager.state_dict(), meta.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_meta_device_layer_without_init_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"layer 0 \(Embedding\) has tensors on the meta device; pass init="):
        l2l_hw.Relay(tiny_gpt("meta"), lm_loss, eps=l2l_hw.make_eps("cpu"))


@pytest.mark.parametrize("precision, pipedream_2bw", [("fp32", False), ("bf16", False), ("fp16", False),
                                                      ("fp32", True)])
@pytest.mark.parametrize("device", DEVICES)
def test_streamed_checkpoint_resumes_on_a_meta_model_bit_identical(tmp_path, precision, pipedream_2bw, device):
    options = dict(micro_batches=2, precision=precision, pipedream_2bw=pipedream_2bw, device=device)
    whole = l2l_hw.Relay(tiny_gpt(), lm_loss, eps=l2l_hw.make_eps("cpu", lr=1e-2), **options)
    first = l2l_hw.Relay(tiny_gpt(), lm_loss, eps=l2l_hw.make_eps("cpu", lr=1e-2), **options)
    data = list(batches(4))
    for x, y in data[:2]:
        whole.train_step(x, y)
        first.train_step(x, y)
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {f"relay.{k}": v for k, v in first.state_entries().items()}, {"step": 2})
    state = open_checkpoint(path).view("relay.")
    resumed = l2l_hw.Relay(tiny_gpt("meta"), lm_loss, eps=l2l_hw.make_eps("cpu", lr=1e-2), init=init_from_state(state),
                           **options)
    resumed.load_state_dict(state)
    for x, y in data[2:]:
        assert whole.train_step(x, y) == resumed.train_step(x, y)
    a, b = whole.state_dict(), resumed.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_gradient_propagates_as_in_torch_unless_steps_are_skipped():
    def run(skip):
        torch.manual_seed(0)
        layers = mlp_layers(depth=1)
        relay = l2l_hw.Relay(layers, nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu"), skip_nonfinite=skip)
        before = relay.state_dict()
        relay.train_step(torch.full((4, 11), float("inf")), torch.zeros(4, 7))
        return before, relay.state_dict()

    before, after = run(skip=True)
    assert all(torch.equal(before[k], after[k]) for k in before if k != "eps/step")
    torch.manual_seed(0)
    reference = mlp_layers(depth=1)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    nn.functional.mse_loss(reference(torch.full((4, 11), float("inf"))), torch.zeros(4, 7)).backward()
    opt.step()
    _, after = run(skip=False)
    assert torch.isnan(after["eps/layer0/weight/param"]).all() and torch.isnan(reference[0].weight).all()


RELAY_SOURCES = ["l2l_hw/relay/executor.py", "l2l_hw/relay/stage.py", "l2l_hw/relay/pipeline.py",
                 "l2l_hw/relay/interpreter.py", "l2l_hw/relay/actions.py", "l2l_hw/relay/links.py",
                 "l2l_hw/relay/prefetch.py", "l2l_hw/relay/data_parallel.py"]
NAMES_AN_EPS = re.compile(r"\beps\b", re.IGNORECASE)  # eps, self.eps, own.eps: not steps


@pytest.mark.parametrize("source", RELAY_SOURCES)
def test_relay_asks_its_eps_and_never_inspects_or_writes_it(source):
    tree = ast.parse((ROOT / source).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "getattr", "hasattr"):
            if ast.unparse(node) == "isinstance(eps, EPS)":  # the argument check against the interface itself
                continue
            assert not any(NAMES_AN_EPS.search(ast.unparse(arg)) for arg in node.args), ast.unparse(node)
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute):
                    assert not NAMES_AN_EPS.search(ast.unparse(target.value)), ast.unparse(node)
        if isinstance(node, ast.ImportFrom):
            assert not any(alias.name.endswith(("Eps", "EPS")) and alias.name != "EPS" for alias in node.names), \
                ast.unparse(node)


@pytest.mark.parametrize("options, message", [  # RelayOptions' declarations, in their one style
    (dict(layer_drop=1.5), r"^layer_drop=1.5: must be a finite number in \[0, 1\)$"),
    (dict(clip_grad_norm=float("inf")), r"^clip_grad_norm=inf: must be a finite number > 0 or None$"),
    (dict(clip_grad_norm=0.0), r"^clip_grad_norm=0.0: must be a finite number > 0"),
    (dict(micro_batches=2.5), r"^micro_batches=2.5: must be a whole number >= 1$"),
    (dict(micro_batches="4"), r"^micro_batches='4': must be a whole number >= 1$"),
    (dict(clip_grad_norm="1"), r"^clip_grad_norm='1': must be a finite number > 0"),
    (dict(device="tpu"), r"^device='tpu': must be cpu, cuda or cuda:N \(or cpu-async: the CPU with asynchronous transfers, for tests\)$"),
    (dict(device="cuda:7"), "device='cuda:7': is not available here"),
    (dict(recompute="no"), r"^recompute='no': must be one of none, full, selective$"),
    (dict(droppable=[9]), r"droppable must be layer indices in \[0, 5\), got \[9\]"),
])
def test_bad_relay_options_are_refused_naming_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu"), **options)
    with pytest.raises(TypeError, match="loss_fn must be a callable"):
        l2l_hw.Relay(mlp_layers(), None, eps=l2l_hw.make_eps("cpu"))


# ---------------------------------------------------------------------------- closing

def update_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("l2l-eps-update")}


@pytest.mark.parametrize("backend", ["cpu", "golden"])
def test_close_joins_the_update_thread_and_a_closed_eps_refuses_use_in_one_line(backend):
    before = update_threads()
    with l2l_hw.make_eps(backend, lr=1e-2) as eps:  # not configured inline: updates run on the update thread
        eps.register("g", {"w": torch.randn(8)})
        eps.push_grads("g", {"w": torch.randn(8)})
        eps.commit_step()
        started = update_threads() - before
        assert started  # its own thread ran the update
    assert not any(t.is_alive() for t in started)  # joined by close(), not left to the garbage collector
    with pytest.raises(RuntimeError, match=f"the {backend} EPS is closed"):
        eps.fetch("g")
    eps.close()  # again: nothing to do


def test_closing_a_relay_closes_its_eps_and_its_update_thread():
    before = update_threads()
    with l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu"), device="cpu-async") as relay:
        relay.train_step(torch.randn(4, 11), torch.randn(4, 7))  # beside a device: updates on the update thread
        started = update_threads() - before
        assert started
    assert not any(t.is_alive() for t in started)
    with pytest.raises(RuntimeError, match="the cpu EPS is closed"):
        relay.train_step(torch.randn(4, 11), torch.randn(4, 7))
