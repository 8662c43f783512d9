"""The relay's thread policy: never more busy threads than cores."""
import os
import threading

import pytest
import torch

import l2l_hw
from tests.helpers import mlp_layers


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def updating_threads(device: str, **options) -> set[str]:
    """The names of the threads the EPS's updates ran on, in a step of a relay on `device`."""
    eps = l2l_hw.make_eps("cpu", optimizer="sgd", lr=0.1)
    seen, run = set(), eps.kernel.run
    eps.kernel.run = lambda *args, **kwargs: seen.add(threading.current_thread().name) or run(*args, **kwargs)
    relay = l2l_hw.Relay(mlp_layers(), torch.nn.functional.mse_loss, eps=eps, device=device, micro_batches=2,
                         **options)
    relay.train_step(torch.randn(4, 11), torch.randn(4, 7))
    return seen, relay


def test_on_the_cpu_updates_run_between_layers_on_the_callers_thread(torch_threads):
    seen, relay = updating_threads("cpu", threads=1)
    assert seen == {threading.current_thread().name}
    assert torch.get_num_threads() == 1 and relay.eps.kernel.threads == 1 and relay.threads == 1


def test_beside_a_device_updates_run_on_the_update_thread_with_cores_left_to_the_launchers(torch_threads,
                                                                                          monkeypatch):
    seen, relay = updating_threads("cpu-async", threads=2)
    assert seen and threading.current_thread().name not in seen
    assert relay.eps.kernel.threads == 1  # the threads launching kernels keep the rest (never fewer than 1 for updates)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))  # a machine of 8 cores
    _, relay = updating_threads("cpu-async", threads=4)
    assert relay.eps.kernel.threads == 2  # the relay's thread and autograd's device thread keep one core each


def test_threads_must_be_a_positive_whole_number():
    with pytest.raises(ValueError, match="threads=0: must be a whole number >= 1"):
        l2l_hw.Relay(mlp_layers(), torch.nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu"), threads=0)


def test_more_threads_than_the_cores_this_process_may_use_are_refused_naming_the_count():
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=f"threads={cores + 1}: must be at most {cores}, the cores"):
        l2l_hw.Relay(mlp_layers(), torch.nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu"), threads=cores + 1)
