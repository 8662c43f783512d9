"""The transport and its asynchronous twin (l2l_hw/relay/transport.py): data is poison until
waited for, a missing wait shows as a relay that no longer equals PyTorch, and the relay's
thread blocks on the device a constant number of times per step."""
import threading

import pytest
import torch
from torch import nn

import l2l_hw
from l2l_hw.relay.transport import StagingPool, Transfer, Transport
from tests.helpers import mlp_layers
from tests.test_relay_equivalence import OPTIMIZERS, mlp_batches, train_relay


def test_twin_transfer_is_poison_until_waited_for():
    twin = Transport("cpu-async", late_s=0.5)
    host = [torch.arange(6, dtype=torch.float32), torch.arange(4)]
    moving = twin.up(host)
    assert torch.isnan(moving.tensors[0]).all() and (moving.tensors[1] == torch.iinfo(torch.int64).min).all()
    assert all(torch.equal(a, b) for a, b in zip(moving.wait(), host))
    down = twin.down([torch.ones(3)])
    assert torch.isnan(down.tensors[0]).all()
    assert torch.equal(down.landed()[0], torch.ones(3))


def test_twin_copy_up_after_a_copy_down_reads_what_landed():
    twin = Transport("cpu-async", late_s=0.5)
    down = twin.down([torch.full((5,), 3.0)])
    up = twin.up(down.tensors, after=down)
    assert torch.equal(up.wait()[0], torch.full((5,), 3.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_copy_up_never_lands_in_memory_the_compute_stream_still_writes():
    # The compute stream sleeps, then fills a tensor already let go: the caching allocator
    # hands its block to the next allocation of the same stream at once. A copy up that
    # allocated there would land during the sleep and be overwritten by the fill.
    transport = Transport("cuda")
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    for _ in range(3):
        busy = torch.empty(1 << 20, device="cuda")
        torch.cuda._sleep(100_000_000)
        busy.fill_(-1.0)
        del busy
        assert torch.equal(transport.up([host]).wait()[0].cpu(), host)


def test_staging_buffer_given_back_is_poisoned_on_the_twin_and_reused():
    pool = StagingPool(pinned=False, poison_returned=True)
    b = pool.take(torch.Size([4]), torch.float32)
    b.fill_(1.0)
    pool.give_back([b])
    assert torch.isnan(b).all()
    assert pool.take(torch.Size([4]), torch.float32) is b


def test_a_transport_whose_eps_does_not_wait_for_its_gradients_fails_the_twin_equivalence(monkeypatch):
    # The permanent mutation: the gradients' copy down is never waited for, so the EPS
    # updates from staging buffers that still hold poison. The relay must then differ
    # from PyTorch; with the wait it equals PyTorch (test_relay_equivalence on cpu-async).
    monkeypatch.setattr(Transfer, "landed", lambda self: self.tensors)
    data = mlp_batches(3)
    eps_options, make_opt = OPTIMIZERS["adamw"]
    _, relay = train_relay(mlp_layers(), eps_options, nn.functional.mse_loss, data, u=2, device="cpu-async")
    assert not all(torch.isfinite(p).all() for p in relay.materialize().parameters())


@pytest.mark.parametrize("clip_mode", [None, "layer", "global"])
def test_blocking_transfers_per_step_do_not_grow_with_depth_or_micro_batches(clip_mode):
    per_step = {}
    for depth, u in [(2, 2), (6, 2), (2, 6), (6, 6)]:
        clip = dict(clip_grad_norm=1.0, clip_mode=clip_mode) if clip_mode else {}
        relay = l2l_hw.Relay(mlp_layers(depth=depth), nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu"),
                             micro_batches=u, activations="host", device="cpu-async", **clip)
        counts = []
        for x, y in mlp_batches(3):
            before = relay.transport.blocking
            relay.train_step(x, y)
            counts.append(relay.transport.blocking - before)
        per_step[(depth, u)] = counts
    assert len({c for counts in per_step.values() for c in counts}) == 1, per_step
    # the loss, read back once; with global clipping, the clip factor too
    assert per_step[(2, 2)][0] == (2 if clip_mode == "global" else 1)


def test_unknown_device_is_refused_naming_the_kinds():
    with pytest.raises(ValueError, match="must be cpu, cuda or cuda:N"):
        l2l_hw.Relay(mlp_layers(), nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu"), device="cpu-sync")


def test_the_twin_s_stream_threads_end_with_their_transport():
    import gc

    before = set(threading.enumerate())
    twin = Transport("cpu-async")
    threads = [t for t in threading.enumerate() if t not in before and t.name.startswith("l2l-twin-")]
    assert len(threads) == 2  # its up and down streams
    assert all(t.is_alive() for t in threads)
    twin.up([torch.ones(3)]).wait()
    del twin
    gc.collect()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads)
