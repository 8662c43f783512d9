"""Data-parallel relay on torch.distributed (gloo, CPU): N ranks on shards of the
minibatch equal one process on the whole minibatch; resume across world sizes; a dead
rank makes the others fail, never hang. Every rank is a real process (tests/dp_worker.py)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from l2l_hw.distributed import free_port
from tests.helpers import launch_ranks, ranks_ok, rel_diff
from tests.test_relay_equivalence import MODELS, OPTIMIZERS

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
LAUNCH_TIMEOUT = 180  # seconds for a whole multi-process run; a hang fails the test instead of CI


def launch(world: int, **cfg) -> list[subprocess.CompletedProcess]:
    return launch_ranks("tests.dp_worker", world, cfg, LAUNCH_TIMEOUT)


def run_ok(world: int, **cfg) -> dict:
    ranks_ok("tests.dp_worker", world, cfg, LAUNCH_TIMEOUT)
    return safetensors.torch.load_file(cfg["out"]) if cfg.get("out") else {}


def plain(model: str, optimizer: str, steps: int, batch: int, clip: float | None = None, clip_mode: str = "layer"):
    """One process, whole minibatch, plain PyTorch (torch.nn.utils.clip_grad_norm_): the reference."""
    make_model, make_batches, loss_fn = MODELS[model]
    net = make_model()
    opt = OPTIMIZERS[optimizer][1](net.parameters())
    losses = []
    for x, y in make_batches(steps, batch=batch):
        opt.zero_grad()
        loss = loss_fn(net(x), y)
        loss.backward()
        if clip is not None:
            groups = [list(layer.parameters()) for layer in net] if clip_mode == "layer" else [list(net.parameters())]
            for params in groups:
                torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        losses.append(loss.item())
    return {f"{i}.{n}": p for i, layer in enumerate(net) for n, p in layer.state_dict().items()}, losses


def assert_params_close(got: dict, want: dict, what: str):
    for name, w in want.items():
        assert rel_diff(got[name], w) <= TOL, f"{what}: {name} differs by {rel_diff(got[name], w):.2e}"


@pytest.mark.parametrize("shard_state", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("model,optimizer,batch,device", [("gpt", "adamw", 12, "cpu"), ("mlp", "sgd-momentum", 13, "cpu"),
                                                          ("gpt", "adamw", 12, "cpu-async")])
def test_two_ranks_equal_one_process_on_the_whole_minibatch(tmp_path, model, optimizer, batch, device, shard_state):
    # batch 13 splits 7 / 6: the ranks' gradients are weighted by their share of the samples
    steps = 4
    got = run_ok(2, model=model, optimizer=optimizer, steps=steps, batch=batch, shard_state=shard_state,
                 device=device, out=str(tmp_path / "out.safetensors"))
    want, losses = plain(model, optimizer, steps, batch)
    assert_params_close(got, want, f"{model} after {steps} steps on 2 ranks")
    assert torch.allclose(got["losses"], torch.tensor(losses, dtype=torch.float64), rtol=TOL)
    numel = sum(t.numel() for n, t in want.items() if not n.endswith(("running_mean", "running_var")))
    held = got["held"].tolist()
    if shard_state:  # each rank's EPS holds its half of every tensor (rounded up)
        assert all(numel / 2 <= h <= numel / 2 + len(want) for h in held), (held, numel)
    else:
        assert held == [numel, numel]


def test_two_ranks_with_a_device_share_equal_one_process(tmp_path):
    # each rank updates its own copy of the shared layers on its device with the averaged gradients
    steps = 4
    got = run_ok(2, model="gpt", optimizer="adamw", steps=steps, batch=12, device="cpu-async",
                 device_update_layers=2, out=str(tmp_path / "out.safetensors"))
    want, losses = plain("gpt", "adamw", steps, 12)
    assert_params_close(got, want, f"gpt after {steps} steps on 2 ranks, 2 layers updated on the device")
    assert torch.allclose(got["losses"], torch.tensor(losses, dtype=torch.float64), rtol=TOL)


@pytest.mark.parametrize("clip_mode", ["layer", "global"])
def test_clipping_on_sharded_state_uses_the_norm_over_all_ranks(tmp_path, clip_mode):
    # each rank holds slices of the averaged gradients: a norm of its own slices alone would be wrong
    got = run_ok(2, model="mlp", optimizer="adamw", steps=4, batch=12, shard_state=True, clip_grad_norm=0.05,
                 clip_mode=clip_mode, out=str(tmp_path / "out.safetensors"))
    want, _ = plain("mlp", "adamw", 4, 12, clip=0.05, clip_mode=clip_mode)
    assert_params_close(got, want, f"{clip_mode} clipping on 2 ranks")


@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)], ids=["2-then-1", "1-then-2"])
def test_resume_across_world_sizes_continues_the_losses_and_weights_of_plain_pytorch(tmp_path, first, second):
    # 3 steps on `first` ranks, state saved, 2 more on `second` ranks: every step's loss, the
    # two after the resume included, and the final weights equal 5 steps of plain PyTorch on one
    # process, at TOL (the 2-rank side with the sharded EPS: a checkpoint of whole tensors). A
    # resume that loses the optimizer's moments or step count shows in the loss of step 5.
    ckpt = tmp_path / "state.safetensors"
    before = run_ok(first, model="gpt", optimizer="adamw", batch=12, steps=3, shard_state=first > 1, save=str(ckpt),
                    out=str(tmp_path / "before.safetensors"))
    got = run_ok(second, model="gpt", optimizer="adamw", batch=12, steps=5, start=3, shard_state=second > 1,
                 load=str(ckpt), out=str(tmp_path / "after.safetensors"))
    want, losses = plain("gpt", "adamw", 5, 12)
    resumed = torch.cat([before["losses"], got["losses"]])
    assert len(got["losses"]) == 2 and torch.allclose(resumed, torch.tensor(losses, dtype=torch.float64), rtol=TOL), \
        (resumed.tolist(), losses)
    assert_params_close(got, want, f"{first} rank(s) for 3 steps, then {second} for 2")


def test_pipedream_2bw_sharded_resumes_on_one_rank(tmp_path):
    # the sharded checkpoint carries the version one step back that 2BW computes on
    from tests.test_relay_options import adamw_one_step_late

    ckpt, out = tmp_path / "state.safetensors", tmp_path / "out.safetensors"
    run_ok(2, model="mlp", optimizer="adamw", batch=12, steps=3, shard_state=True, pipedream_2bw=True, save=str(ckpt))
    got = run_ok(1, model="mlp", optimizer="adamw", batch=12, steps=5, start=3, pipedream_2bw=True, load=str(ckpt),
                 out=str(out))
    make_model, make_batches, loss_fn = MODELS["mlp"]
    net = make_model()
    adamw_one_step_late(net, make_batches(5, batch=12), loss_fn, **{k: v for k, v in OPTIMIZERS["adamw"][0].items()
                                                                   if k != "optimizer"})
    want = {f"{i}.{n}": p for i, layer in enumerate(net) for n, p in layer.state_dict().items()}
    assert_params_close(got, want, "2BW: 2 sharded ranks for 3 steps, then 1 rank for 2")


def test_fp16_overflow_on_one_rank_is_discarded_by_every_rank(tmp_path):
    # The Inf lands in the other rank's slice after the reduce-scatter: the ranks must agree
    # to discard the step, or one would commit while the other skips.
    got = run_ok(2, model="gpt", optimizer="adamw", steps=4, batch=8, shard_state=True, precision="fp16",
                 inf_at_step=2, out=str(tmp_path / "out.safetensors"))
    assert got["flags"].tolist() == [[1, 1], [1, 1]]  # per rank: state unchanged (as gathered), scale halved
    assert got["step"].item() == 3  # 4 steps, one discarded


def test_a_dead_rank_fails_the_others_with_a_clear_error_not_a_hang(tmp_path):
    t0 = time.monotonic()
    results = launch(2, model="mlp", optimizer="adamw", steps=4, batch=8, die_before_step=2, timeout=20)
    elapsed = time.monotonic() - t0
    assert results[1].returncode == -signal.SIGKILL  # the rank that died
    survivor = results[0]
    assert survivor.returncode != 0
    assert "DataParallelError: rank 0 of 2" in survivor.stderr and "died or stopped answering" in survivor.stderr, \
        survivor.stderr[-2000:]
    assert elapsed < LAUNCH_TIMEOUT


def torchrun(world: int, *argv: str) -> subprocess.CompletedProcess:
    """`l2l train ...` under torchrun (`world` = 1: a plain process)."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                 "--master-port", str(free_port()), "-m", "l2l_hw.cli"] if world > 1 else
                [sys.executable, "-m", "l2l_hw.cli"])
    res = subprocess.run([*launcher, "train", *argv], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


@pytest.mark.parametrize("first,second,shard", [(2, 1, True), (1, 2, False)],
                         ids=["torchrun-2-sharded-then-1", "1-then-torchrun-2"])
def test_l2l_train_under_torchrun_resumes_across_world_sizes(tmp_path, first, second, shard):
    from l2l_hw.checkpoint import load_checkpoint
    from tests.test_cli import TINY

    # SGD: with Adam, the attention key bias (an exactly zero gradient, docs/NUMERICS.md) turns
    # the rounding noise of a different reduction order into full-size steps
    opts = [*TINY, "--batch-size", "8", "--steps", "4", "--eval-every", "2", "--optimizer", "sgd", "--momentum",
            "0.9", "--lr", "0.05"]
    straight = torchrun(1, *opts, "--out", str(tmp_path / "straight"))
    split = tmp_path / "split"
    res = torchrun(first, *opts, "--out", str(split), "--stop-after", "2", *(["--shard-state"] if shard else []))
    # one report (rank 0); no progress bar, as stderr is no terminal here
    assert res.stdout.count("final val loss") == 1 and "| 0/2 [" not in res.stderr
    torchrun(second, "--resume", "--out", str(split), *(["--shard-state"] if second > 1 and not shard else []))
    want, _ = load_checkpoint(tmp_path / "straight" / "checkpoint.safetensors")
    got, meta = load_checkpoint(split / "checkpoint.safetensors")
    assert meta["step"] == 4 and "final val loss" in straight.stdout
    # the losses of every step, the two after the resume included, are the uninterrupted run's
    losses = {run: {r["step"]: r["loss"] for r in map(json.loads, (where / "metrics.jsonl").read_text().splitlines())}
              for run, where in (("straight", tmp_path / "straight"), ("split", split))}
    assert sorted(losses["split"]) == sorted(losses["straight"]) == [1, 2, 3, 4], losses
    for step, loss in losses["straight"].items():
        assert losses["split"][step] == pytest.approx(loss, rel=TOL), (step, losses)
    for name, w in want.items():
        if name.startswith("relay.eps/") and w.is_floating_point():
            assert rel_diff(got[name], w) <= TOL, f"{name} differs by {rel_diff(got[name], w):.2e}"


ONE_RANK = """
import torch, torch.distributed as dist
import l2l_hw
from tests.helpers import coherent_batches, coherent_layers
from torch import nn

def relay():
    torch.manual_seed(0)
    return l2l_hw.Relay(coherent_layers(), nn.functional.mse_loss, l2l_hw.make_eps("cpu", optimizer="adamw", lr=1e-2),
                        micro_batches=2)

alone = relay()  # torch.distributed not initialized: no data parallelism
dist.init_process_group("gloo")
grouped = relay()  # the world group, of one rank
for x, y in coherent_batches(3, 8):
    assert alone.train_step(x, y) == grouped.train_step(x, y)
same = all(torch.equal(a, b) for a, b in zip(alone.state_dict().values(), grouped.state_dict().values()))
print(grouped.dp is None, same)
dist.destroy_process_group()
"""


def test_a_group_of_one_rank_averages_nothing_and_equals_the_relay_alone():
    """A pipeline stage without replicas, or torchrun with one process: no gradient reducer (no
    all-reduce of every gradient over one rank), and the steps bit for bit those of a relay
    without torch.distributed."""
    from l2l_hw.distributed import run_local_ranks

    (res,) = run_local_ranks(["-c", ONE_RANK], 1, timeout_s=LAUNCH_TIMEOUT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["True", "True"], res.stdout
