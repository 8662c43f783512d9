"""Shared test utilities: relative difference, ulp distance, small models."""
import numpy as np
import pytest
import torch
from torch import nn

# Where relay tests run: the CPU, the asynchronous twin of a device's transfers
# (l2l_hw/relay/transport.py), and CUDA where there is one.
DEVICES = ["cpu", "cpu-async",
           pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| over the tensor: the tensor-wise relative difference."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def ulp_distance(a, b) -> np.ndarray:
    """Number of float32 values between a and b (0 = bit-identical)."""
    def ordered(x):
        i = np.asarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return np.abs(ordered(a) - ordered(b))


class ResidualMLP(nn.Module):
    """x + W2 gelu(W1 LN(x)), with odd widths."""

    def __init__(self, width: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.norm(x)))))


def mlp_layers(seed=0, width=19, hidden=45, depth=3, n_in=11, n_out=7, dropout=0.0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(n_in, width), *[ResidualMLP(width, hidden, dropout) for _ in range(depth)],
                         nn.Sequential(nn.LayerNorm(width), nn.Linear(width, n_out)))


COHERENT_WIDTH = 32


def coherent_layers(tied: bool = False) -> nn.Sequential:
    """Three linear layers (the last one sharing the first's weight when `tied`) whose gradients
    point the same way in every micro-batch on `coherent_batches`: the case where a running sum's
    rounding errors grow with the sum, as a mean gradient's do over many micro-batches."""
    torch.manual_seed(0)
    first, middle = nn.Linear(COHERENT_WIDTH, COHERENT_WIDTH, bias=False), nn.Linear(COHERENT_WIDTH, COHERENT_WIDTH)
    last = nn.Linear(COHERENT_WIDTH, COHERENT_WIDTH, bias=not tied)
    if tied:
        last.weight = first.weight
    return nn.Sequential(first, middle, last)


def coherent_batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs around 1 and MSE targets around 8, far from the outputs: every sample pulls alike."""
    g = torch.Generator().manual_seed(seed)
    return [(1 + 0.5 * torch.randn(batch, COHERENT_WIDTH, generator=g),
             8 + torch.randn(batch, COHERENT_WIDTH, generator=g)) for _ in range(steps)]


def record_pushes(eps, pushed: dict) -> None:
    """Make `eps` record every gradient pushed to it, as it receives it (landed; dtype kept), in
    `pushed[group][name]`, and the inverse loss scale in `pushed[group]["inv_scale"]`."""
    from l2l_hw.eps.base import landed

    push = eps.push_grads

    def record(key, grads, inv_scale=1.0):
        pushed[key] = {**{n: g.clone() for n, g in landed(grads).items()}, "inv_scale": torch.tensor(inv_scale)}
        push(key, grads, inv_scale)

    eps.push_grads = record


def launch_ranks(worker: str, world: int, cfg: dict, timeout_s: float) -> list:
    """Run the module `worker` (tests.dp_worker, tests.pipe_worker) as `world` local ranks with the
    JSON of `cfg`; their CompletedProcesses once all have exited. A hang fails the test."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from l2l_hw.distributed import run_local_ranks

    root = Path(__file__).resolve().parents[1]
    try:
        return run_local_ranks(["-m", worker, json.dumps(cfg)], world, timeout_s=timeout_s, cwd=root,
                               env=dict(os.environ, PYTHONPATH=str(root)), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank did not finish within {timeout_s} s (hang)")


def ranks_ok(worker: str, world: int, cfg: dict, timeout_s: float) -> None:
    """launch_ranks, every rank exiting 0."""
    for r, res in enumerate(launch_ranks(worker, world, cfg, timeout_s)):
        assert res.returncode == 0, f"rank {r} failed:\n{res.stderr[-3000:]}"

