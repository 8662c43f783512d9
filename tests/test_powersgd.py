"""PowerSGD gradient compression for the data-parallel relay (gloo, CPU, real processes):
the reducer's result equals the paper's algorithm written here in plain torch (its own
Gram-Schmidt, per-rank error feedback, warm-started Q) on every rank alike; the bytes on
the wire are the factors' (n + m) R per matrix; the error feedback carries what each step
left out; a resumed run is bit-identical to a straight one; bad input is one clear line.

    python -m tests.test_powersgd '<json>'    one rank (RANK, WORLD_SIZE, MASTER_* set)
"""
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.helpers import ranks_ok

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT = 180  # seconds for a whole multi-process run; a hang fails the test instead of CI
TOL = 1e-5
# Two groups of gradients: matrices PowerSGD compresses, a 3-D tensor (shape[0] x the rest),
# a vector and a matrix too small for R to pay (sent exact), one that pays at rank 2 but not 4.
GROUPS = {"layer0": {"w": (48, 20), "b": (48,), "small": (6, 5)},
          "layer1": {"conv": (16, 3, 8), "w": (20, 48), "thin": (6, 200)}}
SHARES = (3, 5)  # samples per rank: unequal shares are weighted n_r / n
STEPS = 3


def grad(rank: int, step: int, key: str, name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + 10 * int(key[-1]) + sorted(GROUPS[key]).index(name))
    return torch.randn(GROUPS[key][name], generator=g)


# -- the ranks -------------------------------------------------------------------------
def reducer_worker(cfg: dict) -> None:
    """Feed GradReducer the synthetic gradients; write its results, errors and wire bytes."""
    import l2l_hw
    from l2l_hw.relay.data_parallel import DataParallelOptions, GradReducer

    rank = int(os.environ["RANK"])
    reducer = GradReducer(None, l2l_hw.make_eps("cpu"), torch.device("cpu"),
                          options=DataParallelOptions(cfg["compression"], cfg["rank"]))
    out = {}
    for step in range(STEPS):
        reducer.start_step(SHARES[rank])
        grads = {key: {n: grad(rank, step, key, n) for n in names} for key, names in GROUPS.items()}
        if step == cfg.get("inf_at_step") and rank == 0:  # rank 0's gradient overflows
            grads["layer0"]["w"][0, 0] = float("inf")
        pending = [reducer.launch(key, group) for key, group in grads.items()]
        for reduction in pending:
            out.update({f"{step}/{reduction.key}/{n}": g for n, g in reducer.finish(reduction).items()})
        out.update({f"wire/{step}/{k}": torch.tensor(v) for k, v in vars(reducer.wire).items()})
    if reducer.powersgd is not None:
        out.update({f"error/{k}": f.error for k, f in reducer.powersgd.factors.items()})
    safetensors.torch.save_file(out, cfg["out"].format(rank=rank))


def relay_worker(cfg: dict) -> None:
    """The reference test GPT on 2 ranks with PowerSGD: `steps` steps from `start` (after loading
    `load`), then rank 0 saves the relay state (`save`) and parameters and losses (`out`)."""
    import l2l_hw
    from l2l_hw.distributed import rank_shard
    from tests.test_relay_equivalence import MODELS, OPTIMIZERS

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    make_model, make_batches, loss_fn = MODELS["gpt"]
    eps = l2l_hw.make_eps("cpu", shard_state=cfg.get("shard_state", False), **OPTIMIZERS["adamw"][0])
    relay = l2l_hw.Relay(make_model(), loss_fn, eps=eps, micro_batches=2, grad_compression="powersgd",
                         powersgd_rank=cfg.get("rank", 2), powersgd_start=cfg.get("powersgd_start", 0))
    if cfg.get("load"):
        relay.load_state_dict(safetensors.torch.load_file(cfg["load"]))
    losses, wire = [], []
    for x, y in make_batches(cfg["steps"], batch=12)[cfg.get("start", 0):]:
        losses.append(relay.train_step(*rank_shard((x, y), rank, world)))
        wire.append([relay.dp.wire.sent, relay.dp.wire.exact])
    state = relay.state_dict()  # a collective: every rank calls it
    params = {f"{i}.{n}": p for i, layer in enumerate(relay.materialize()) for n, p in layer.state_dict().items()}
    relay.close()
    if rank == 0:
        if cfg.get("save"):
            safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, cfg["save"])
        safetensors.torch.save_file({**params, "losses": torch.tensor(losses, dtype=torch.float64),
                                     "wire": torch.tensor(wire)}, cfg["out"])


def main(cfg: dict) -> None:
    import torch.distributed as dist

    import l2l_hw.distributed  # noqa: F401  before the group (see its import of torch.distributed.nn)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        {"reducer": reducer_worker, "relay": relay_worker}[cfg["mode"]](cfg)
    finally:
        dist.destroy_process_group()


def run_ok(**cfg) -> None:
    ranks_ok("tests.test_powersgd", 2, cfg, LAUNCH_TIMEOUT)


# -- the reference: Vogels et al. 2019, Algorithm 1 + error feedback, in plain torch ----
def gram_schmidt(p: torch.Tensor) -> torch.Tensor:
    p = p.clone()
    for i in range(p.shape[1]):
        for j in range(i):
            p[:, i] -= (p[:, j] @ p[:, i]) * p[:, j]
        p[:, i] /= p[:, i].norm()
    return p


def reference(rank_r: int, skip: tuple[int, str] | None = None) -> tuple[dict, dict]:
    """Every step's averaged gradients and each rank's final error, as the paper computes them;
    `skip` (step, "group/tensor"): that step leaves the tensor's Q and errors as they were."""
    from l2l_hw.relay.powersgd import initial_q, matrix_shape

    world, n_total = len(SHARES), sum(SHARES)
    q, errors, out = {}, {}, {}
    for step in range(STEPS):
        for key, names in GROUPS.items():
            for name, shape in names.items():
                gs = [grad(r, step, key, name) for r in range(world)]
                w = [SHARES[r] / n_total for r in range(world)]
                matrix = matrix_shape(torch.Size(shape), rank_r)
                if matrix is None:  # exact: the weighted mean
                    out[f"{step}/{key}/{name}"] = sum(wr * g for wr, g in zip(w, gs))
                    continue
                n, m = matrix
                label = f"{key}/{name}"
                if label not in q:
                    q[label] = initial_q(label, m, min(n, m, rank_r))
                    errors[label] = [torch.zeros(n, m) for _ in range(world)]
                if skip == (step, label):
                    continue
                ms = [world * w[r] * gs[r].reshape(n, m) + errors[label][r] for r in range(world)]
                p_hat = gram_schmidt(sum(mr @ q[label] for mr in ms))
                q[label] = sum(mr.T @ p_hat for mr in ms) / world
                approx = p_hat @ q[label].T
                errors[label] = [mr - approx for mr in ms]
                out[f"{step}/{key}/{name}"] = approx.reshape(shape)
    return out, errors


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# -- tests -------------------------------------------------------------------------------
@pytest.mark.parametrize("rank_r", [4, 2])
def test_powersgd_equals_the_papers_algorithm_in_plain_torch_on_every_rank(tmp_path, rank_r):
    run_ok(mode="reducer", compression="powersgd", rank=rank_r, out=str(tmp_path / "{rank}.safetensors"))
    got = [safetensors.torch.load_file(tmp_path / f"{r}.safetensors") for r in range(2)]
    want, errors = reference(rank_r)
    for name, w in want.items():
        assert torch.equal(got[0][name], got[1][name]), f"{name}: the ranks' results differ"
        assert rel(got[0][name], w) <= TOL, f"{name} differs from the reference by {rel(got[0][name], w):.2e}"
    for label, per_rank in errors.items():
        for r in range(2):
            e = got[r][f"error/{label}"]
            assert rel(e, per_rank[r]) <= 1e-4, f"rank {r}'s error of {label}: {rel(e, per_rank[r]):.2e}"
    assert set(errors) == {"layer0/w", "layer1/conv", "layer1/w"} | ({"layer1/thin"} if rank_r == 2 else set())


def test_error_feedback_carries_what_each_step_left_out(tmp_path):
    # e_r = M_r - out telescopes: what the steps applied plus the ranks' mean error is exactly
    # the sum of the true mean gradients. Without the carried error, the sum would miss it.
    run_ok(mode="reducer", compression="powersgd", rank=2, out=str(tmp_path / "{rank}.safetensors"))
    got = [safetensors.torch.load_file(tmp_path / f"{r}.safetensors") for r in range(2)]
    for key, name in (("layer0", "w"), ("layer1", "conv")):
        applied = sum(got[0][f"{s}/{key}/{name}"] for s in range(STEPS)).reshape(GROUPS[key][name][0], -1)
        true = sum(sum(SHARES[r] / sum(SHARES) * grad(r, s, key, name) for r in range(2))
                   for s in range(STEPS)).reshape(applied.shape)
        mean_error = (got[0][f"error/{key}/{name}"] + got[1][f"error/{key}/{name}"]) / 2
        assert rel(applied, true) > 0.1  # rank 2 is lossy: the error is no rounding matter
        assert rel(applied + mean_error, true) <= TOL, rel(applied + mean_error, true)


def test_an_overflow_on_one_rank_leaves_the_powersgd_state_as_it_was_on_every_rank(tmp_path):
    # a discarded step (skip_nonfinite, fp16) must not poison the error and Q of the steps after it
    run_ok(mode="reducer", compression="powersgd", rank=4, inf_at_step=1, out=str(tmp_path / "{rank}.safetensors"))
    got = [safetensors.torch.load_file(tmp_path / f"{r}.safetensors") for r in range(2)]
    want, errors = reference(4, skip=(1, "layer0/w"))
    assert not torch.isfinite(got[0]["1/layer0/w"]).all() and not torch.isfinite(got[1]["1/layer0/w"]).all()
    for name, w in want.items():
        if name != "1/layer0/w":
            assert rel(got[0][name], w) <= TOL, f"{name} differs from the reference by {rel(got[0][name], w):.2e}"
    for r in range(2):
        assert rel(got[r]["error/layer0/w"], errors["layer0/w"][r]) <= 1e-4


def test_wire_bytes_are_the_factors_against_every_element_exact(tmp_path):
    from l2l_hw.relay.powersgd import matrix_shape

    for compression in ("none", "powersgd"):
        run_ok(mode="reducer", compression=compression, rank=4,
               out=str(tmp_path / f"{compression}{{rank}}.safetensors"))
    exact = safetensors.torch.load_file(tmp_path / "none0.safetensors")
    low = safetensors.torch.load_file(tmp_path / "powersgd0.safetensors")
    shapes = [torch.Size(s) for names in GROUPS.values() for s in names.values()]
    every = 4 * sum(s.numel() for s in shapes)
    factors = 4 * sum((n + m) * min(n, m, 4) for n, m in filter(None, (matrix_shape(s, 4) for s in shapes)))
    vectors = 4 * sum(s.numel() for s in shapes if matrix_shape(s, 4) is None)
    for step in range(STEPS):
        assert exact[f"wire/{step}/sent"].item() == exact[f"wire/{step}/exact"].item() == every
        assert low[f"wire/{step}/sent"].item() == factors + vectors
        assert low[f"wire/{step}/exact"].item() == every
        assert low[f"wire/{step}/matrix_sent"].item() == factors
        assert low[f"wire/{step}/matrix_exact"].item() == every - vectors


def test_resumed_powersgd_run_is_bit_identical_to_a_straight_one_and_sharded_equals_replicated(tmp_path):
    # the first step exact (powersgd_start=1), the next 4 compressed; split after step 3
    straight, split, state = tmp_path / "straight.st", tmp_path / "split.st", tmp_path / "state.st"
    run_ok(mode="relay", steps=5, powersgd_start=1, out=str(straight))
    run_ok(mode="relay", steps=3, powersgd_start=1, save=str(state), out=str(tmp_path / "first.st"))
    run_ok(mode="relay", steps=5, powersgd_start=1, start=3, load=str(state), out=str(split))
    want, got = safetensors.torch.load_file(straight), safetensors.torch.load_file(split)
    for name, w in want.items():
        if name not in ("losses", "wire"):
            assert torch.equal(got[name], w), f"{name}: the resumed run differs from the straight one"
    assert torch.equal(got["losses"], want["losses"][3:])
    saved = safetensors.torch.load_file(state)
    errors = {k: v for k, v in saved.items() if k.startswith("dp/") and k.endswith("/error")}
    assert errors and all(v.shape[0] == 2 and v.abs().sum() > 0 for v in errors.values())  # every rank's error
    (sent_1, exact_1), *compressed = want["wire"].tolist()
    assert sent_1 == exact_1 and all(exact == exact_1 and exact > 4 * sent for sent, exact in compressed)
    sharded = tmp_path / "sharded.st"
    run_ok(mode="relay", steps=5, powersgd_start=1, shard_state=True, out=str(sharded))
    for name, w in safetensors.torch.load_file(sharded).items():
        if name not in ("losses", "wire"):
            assert rel(w, want[name]) <= TOL, f"{name}: the sharded EPS differs by {rel(w, want[name]):.2e}"


def torchrun_train(*argv: str, world: int = 2) -> subprocess.CompletedProcess:
    from l2l_hw.distributed import free_port

    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
                str(free_port()), "-m", "l2l_hw.cli"] if world > 1 else [sys.executable, "-m", "l2l_hw.cli"]
    return subprocess.run([*launcher, "train", *argv], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)


def test_l2l_train_checkpoints_powersgd_state_and_resumes_bit_identically_on_as_many_ranks(tmp_path):
    from l2l_hw.checkpoint import load_checkpoint
    from tests.test_cli import TINY

    opts = [*TINY, "--batch-size", "8", "--steps", "4", "--eval-every", "2", "--grad-compression", "powersgd",
            "--rank", "2"]
    for run in (torchrun_train(*opts, "--out", str(tmp_path / "straight")),
                torchrun_train(*opts, "--out", str(tmp_path / "split"), "--stop-after", "2"),
                torchrun_train("--resume", "--out", str(tmp_path / "split"))):
        assert run.returncode == 0, run.stderr[-3000:]
    want, _ = load_checkpoint(tmp_path / "straight" / "checkpoint.safetensors")
    got, meta = load_checkpoint(tmp_path / "split" / "checkpoint.safetensors")
    assert meta["step"] == 4 and set(got) == set(want) and any(k.startswith("relay.dp/") for k in want)
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{name}: the resumed run differs from the straight one"
    alone = torchrun_train("--resume", "--steps", "6", "--out", str(tmp_path / "split"), world=1)
    assert alone.returncode == 2 and "runs alone" in alone.stderr and "Traceback" not in alone.stderr, alone.stderr


def test_a_rank_below_1_is_refused_naming_the_option():
    from l2l_hw.options import OptionError
    from l2l_hw.relay import RelayOptions

    with pytest.raises(OptionError, match=r"^powersgd_rank=0: must be a whole number >= 1$"):
        RelayOptions(grad_compression="powersgd", powersgd_rank=0)


def test_powersgd_without_data_parallelism_or_with_fp16_is_one_clear_line():
    import l2l_hw
    from l2l_hw.relay.data_parallel import DataParallelOptions, check_compression
    from tests.helpers import mlp_layers

    with pytest.raises(ValueError, match=r"^grad_compression='powersgd' .* this relay runs alone: run it under "
                                         r"torchrun"):
        l2l_hw.Relay(mlp_layers(), torch.nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu"),
                     grad_compression="powersgd")
    with pytest.raises(ValueError, match="fp16's changing loss scale"):
        check_compression(DataParallelOptions("powersgd"), "fp16", data_parallel=True)
    check_compression(DataParallelOptions("powersgd"), "bf16", data_parallel=True)  # allowed


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("flags,words", [(["--grad-compression", "powersgd", "--rank", "0"], ["--rank 0", ">= 1"]),
                                         (["--grad-compression", "powersgd"], ["runs alone", "torchrun"])])
def test_l2l_train_refuses_bad_compression_flags_in_one_line(tmp_path, capsys, flags, words):
    from tests.test_cli import TINY
    from tests.test_cli_errors import assert_one_clear_line, run_cli

    rc, err = run_cli(capsys, *TINY, "--steps", "1", "--out", str(tmp_path / "run"), *flags)
    assert rc == 2
    assert_one_clear_line(err, *words)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
