"""The update's life (docs/ARCHITECTURE.md): no step barrier, the backlog served in the order of
the next use, in chunks a sooner group overtakes, and the same numbers as updates finished
before the next step."""
import copy
import threading

import pytest
import torch
from torch import nn

import l2l_hw
from l2l_hw.eps import golden, host_kernel
from l2l_hw.eps.base import Landing
from l2l_hw.eps.engine import UPDATE_CHUNK
from l2l_hw.eps.worker import UpdateWorker


def recorded(log: list, key: str, chunks: int = 1, gate: threading.Event | None = None,
             started: threading.Event | None = None):
    """An update that logs each of its chunks as (key, k); the first sets `started`, then waits for `gate`."""
    for k in range(chunks):
        if gate is not None and k == 0:
            started.set()
            assert gate.wait(10)
        log.append((key, k))
        yield
    return False


def test_the_backlog_is_served_in_the_next_forwards_order_not_first_in_first_out():
    worker, log, gate, started = UpdateWorker(), [], threading.Event(), threading.Event()
    worker.order(["layer0", "layer1", "layer2", "layer3"])
    worker.submit("layer3", recorded(log, "layer3", gate=gate, started=started))  # the backward pushes it first
    assert started.wait(10)  # the update thread is busy with it while the others queue up
    for key in ("layer2", "layer1", "layer0"):
        worker.submit(key, recorded(log, key))
    gate.set()
    worker.wait()
    worker.shutdown(wait=True)
    assert [key for key, _ in log] == ["layer3", "layer0", "layer1", "layer2"]


def test_a_waited_for_group_overtakes_the_backlog_and_a_long_update_at_its_next_chunk():
    worker, log, gate, started = UpdateWorker(), [], threading.Event(), threading.Event()
    worker.order(["layer0", "layer1", "layer2"])
    worker.submit("layer2", recorded(log, "layer2", chunks=6, gate=gate, started=started))
    assert started.wait(10)
    worker.submit("layer0", recorded(log, "layer0"))
    worker.submit("layer1", recorded(log, "layer1"))
    threading.Timer(0.5, gate.set).start()  # layer2's first chunk ends once this thread waits for layer1
    worker.result("layer1")  # a reader needs layer1 now
    worker.wait()
    worker.shutdown(wait=True)
    assert log[:2] == [("layer2", 0), ("layer1", 0)], log  # before layer0 (sooner in order) and layer2's rest
    assert log[2:] == [("layer0", 0)] + [("layer2", k) for k in range(1, 6)], log


def test_commit_does_not_wait_and_a_fetch_waits_for_its_own_group_only():
    eps = l2l_hw.make_eps("cpu", optimizer="sgd", lr=0.5)
    eps.register("layer0", {"w": torch.ones(4)})
    eps.register("layer1", {"w": torch.ones(4)})
    eps.expect_step(["layer0", "layer1"], ["layer1", "layer0"])
    gate = threading.Event()
    eps.push_grads("layer0", {"w": torch.ones(4)})
    eps.push_grads("layer1", Landing({"w": torch.ones(4)}, lambda: gate.wait(10), lambda: None))
    assert eps.commit_step(wait=False) is False  # returns while layer1's gradients have not landed
    assert eps.step == 1
    assert torch.equal(eps.fetch("layer0")["w"], torch.full((4,), 0.5))  # layer0's update only
    assert not gate.is_set()
    gate.set()
    assert torch.equal(eps.fetch("layer1")["w"], torch.full((4,), 0.5))
    eps.close()


def test_an_update_failing_after_a_commit_without_waiting_is_raised_by_the_next_reader():
    eps = l2l_hw.make_eps("cpu")
    eps.register("layer0", {"w": torch.ones(4)})
    gate = threading.Event()

    def fail():
        gate.wait(10)
        raise OSError("the gradient copy failed")

    eps.push_grads("layer0", Landing({"w": torch.ones(4)}, fail, lambda: None))
    eps.commit_step(wait=False)
    gate.set()
    with pytest.raises(RuntimeError, match="update of group 'layer0' failed: the gradient copy failed"):
        eps.fetch("layer0")
    eps.close()


@pytest.mark.parametrize("state", ["fp32", "8bit"])
def test_a_chunked_update_is_bit_identical_to_one_kernel_run_over_the_whole_tensor(state):
    n = 2 * UPDATE_CHUNK + 3 * golden.QUANT_BLOCK + 17  # three chunks, the last a partial block
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(3)]
    eps = l2l_hw.make_eps("cpu", optimizer="adamw", lr=1e-2, state=state, working_dtype="bf16")
    eps.register("layer0", {"w": param})
    whole = {slot: t.clone() for slot, t in eps.state_dict().items() if slot.startswith("layer0/w/")}
    whole = {key.rsplit("/", 1)[1]: t for key, t in whole.items()}
    working = torch.empty(n, dtype=torch.bfloat16)
    for step, g in enumerate(grads, 1):
        eps.push_grads("layer0", {"w": g})
        eps.commit_step()
        host_kernel.step("adamw", golden.step_scalars(eps.config, step), g, whole["param"], whole["m"], whole["v"],
                         working_out=working, state=state, m_scale=whole.get("m_scale"),
                         v_scale=whole.get("v_scale"))
    state_now = eps.state_dict()
    for slot, t in whole.items():
        assert torch.equal(state_now[f"layer0/w/{slot}"], t), slot
    assert torch.equal(eps.fetch("layer0")["w"].view(torch.int16), working.view(torch.int16))
    eps.close()


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x))


RUNS = {
    "adamw": dict(eps=dict(optimizer="adamw"), relay={}),
    "lamb": dict(eps=dict(optimizer="lamb"), relay={}),
    "8bit-bf16": dict(eps=dict(optimizer="adamw", state="8bit"), relay=dict(precision="bf16")),
    "global-clip": dict(eps=dict(optimizer="adamw"), relay=dict(clip_grad_norm=0.05, clip_mode="global")),
    "disk": dict(eps=dict(optimizer="adamw"), relay={}, disk=True),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_the_relay_without_a_barrier_gives_the_numbers_of_updates_finished_at_each_push(run, tmp_path):
    """cpu-async: updates on the update thread, overlapping the next step; cpu: each update runs
    when it is pushed. Losses and final state bit for bit, with a tensor of several chunks."""
    spec, width = RUNS[run], 1100  # 1100 x 1100 weights: two chunks each (UPDATE_CHUNK)
    assert UPDATE_CHUNK < width * width <= 2 * UPDATE_CHUNK
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(width) for _ in range(3)))
    xs, ys = torch.randn(4, 8, width), torch.randn(4, 8, width)
    out = {}
    for device in ("cpu", "cpu-async"):
        extra = dict(state_dir=tmp_path / device) if spec.get("disk") else {}
        eps = l2l_hw.make_eps("cpu", lr=1e-2, **spec["eps"], **extra)
        with l2l_hw.Relay(copy.deepcopy(model), nn.functional.mse_loss, eps=eps, device=device, micro_batches=2,
                          **spec["relay"]) as relay:
            losses = [relay.train_step(x, y) for x, y in zip(xs, ys)]
            out[device] = losses, relay.state_dict()
    (losses_cpu, state_cpu), (losses_async, state_async) = out["cpu"], out["cpu-async"]
    assert losses_cpu == losses_async
    assert state_cpu.keys() == state_async.keys()
    for key in state_cpu:
        assert torch.equal(state_cpu[key], state_async[key]), key


def test_a_relay_step_returns_while_its_updates_run_and_the_next_step_waits_for_them(monkeypatch):
    from l2l_hw.eps.engine import Engine

    gate, update = threading.Event(), vars(Engine)["_update"]

    def gated(self, key, grads, scalars):
        if key == "layer0":
            assert gate.wait(10)
        return (yield from update(self, key, grads, scalars))

    monkeypatch.setattr(Engine, "_update", gated)
    torch.manual_seed(0)
    model = nn.Sequential(Block(8), Block(8))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    eps = l2l_hw.make_eps("cpu", optimizer="sgd", lr=0.1)
    with l2l_hw.Relay(copy.deepcopy(model), nn.functional.mse_loss, eps=eps, device="cpu-async") as relay:
        step = threading.Thread(target=relay.train_step, args=(x, y))
        step.start()
        step.join(10)
        assert not step.is_alive()  # the step ended with layer0's update still held back
        assert not gate.is_set()
        gate.set()
        relay.train_step(x, y)  # its forward waited for layer0's update
        trained = relay.materialize()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
    for a, b in zip(trained.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_prefetched_groups_copy_up_starts_when_its_update_lands_not_when_the_layer_needs_it():
    from l2l_hw.relay.prefetch import WeightStream
    from l2l_hw.relay.transport import Transport

    eps = l2l_hw.make_eps("cpu", optimizer="sgd", lr=0.5)
    eps.register("layer0", {"w": torch.ones(4)})
    gate = threading.Event()
    eps.push_grads("layer0", Landing({"w": torch.ones(4)}, lambda: gate.wait(10), lambda: None))
    eps.commit_step(wait=False)
    stream = WeightStream(eps, Transport("cpu-async"))
    stream.prefetch(["layer0"])  # the relay asks one layer ahead; the update has not landed
    assert stream.on_device() == [[]]
    gate.set()
    for _ in range(10_000):  # the update thread starts the copy up as the update lands
        if stream.on_device() != [[]]:
            break
        threading.Event().wait(0.001)
    assert stream.on_device() != [[]]
    assert torch.equal(stream.get("layer0")["w"], torch.full((4,), 0.5))
    eps.close()


EXIT_WITH_UPDATES_RUNNING = """
import torch, l2l_hw
eps = l2l_hw.make_eps("cpu")
for i in range(8):
    eps.register(f"layer{i}", {"w": torch.zeros(1 << 21)})
for i in reversed(range(8)):
    eps.push_grads(f"layer{i}", {"w": torch.ones(1 << 21)})
eps.commit_step(wait=False)
print("committed", flush=True)
"""


def test_a_process_ending_with_updates_still_running_and_its_eps_not_closed_exits_cleanly():
    import subprocess
    import sys

    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", EXIT_WITH_UPDATES_RUNNING], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0 and done.stdout == "committed\n", (done.returncode, done.stderr[-2000:])
        assert "terminate called" not in done.stderr
