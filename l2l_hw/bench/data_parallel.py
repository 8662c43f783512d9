"""`l2l bench dp`: the data-parallel relay on CPU, 1 rank against N ranks (gloo).

The same global minibatch of the `l2l train` default GPT, timed per step:
  1 rank     one process on the whole minibatch, with every core's threads (the
             strongest single-process alternative)
  N ranks    N processes on 1/N of the minibatch each, cores shared out, gradients
             averaged per layer by asynchronous collectives overlapping the backward
  N ranks, no overlap   the same with each collective waited for at once: the time
             the ranks spend blocked there is the whole communication time

hidden_comm_fraction = 1 - (blocked time with overlap) / (blocked time without it),
rank 0's figures, mean per step after warm-up.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from l2l_hw.bench import print_report, train_steps
from l2l_hw.distributed import run_local_ranks
from l2l_hw.train import TrainConfig, build_relay

WARMUP = 2
MODEL_FIELDS = ("layers", "width", "heads", "context", "batch_size", "micro_batches")  # reported, of TrainConfig()


def _worker(bench: dict) -> dict:
    """One rank (or the single process): time `bench['steps']` steps of the `l2l train`
    default GPT through l2l_hw.train after warm-up; train() cuts this rank's shard."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(bench["threads"])
    if world > 1:
        dist.init_process_group("gloo")
    cfg = TrainConfig(seed=0)
    relay = build_relay(cfg, shard_state=bench["shard_state"] and world > 1)
    if relay.dp is not None:
        relay.dp.overlap = bench["overlap"]
    g = torch.Generator().manual_seed(1)

    def batches():  # random tokens: the timing does not depend on the text
        while True:
            x = torch.randint(0, 256, (cfg.batch_size, cfg.context), generator=g)
            yield x, torch.roll(x, -1, 1)

    blocked = []
    times = train_steps(relay, batches(), WARMUP + bench["steps"],
                        on_step=lambda row: blocked.append(relay.dp.wait_s if relay.dp is not None else 0.0))
    times, blocked = times[WARMUP:], blocked[WARMUP:]
    if world > 1:
        dist.destroy_process_group()
    return {"step_s": sum(times) / len(times), "blocked_s": sum(blocked) / len(blocked)}


def _launch(world: int, steps: int, overlap: bool, shard_state: bool) -> dict:
    """Run the benchmark as `world` fresh processes; rank 0's figures."""
    threads = max(1, (os.cpu_count() or 1) // world)
    cfg = {"steps": steps, "overlap": overlap, "shard_state": shard_state, "threads": threads}
    procs = run_local_ranks(["-m", "l2l_hw.bench.data_parallel", json.dumps(cfg)], world, threads=threads,
                            stdout=subprocess.PIPE)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank of the {world}-rank benchmark failed (exit codes {[p.returncode for p in procs]})")
    return json.loads(procs[0].stdout.strip().splitlines()[-1])


def run(steps: int = 5, world: int = 2, shard_state: bool = False) -> dict:
    one = _launch(1, steps, True, False)
    overlapped = _launch(world, steps, True, shard_state)
    blocking = _launch(world, steps, False, shard_state)
    comm = blocking["blocked_s"]
    return {
        "model": {k: getattr(TrainConfig(), k) for k in MODEL_FIELDS}, "steps": steps, "world": world, "shard_state": shard_state, "cores": os.cpu_count(),
        "step_s_1_rank": round(one["step_s"], 4),
        f"step_s_{world}_ranks": round(overlapped["step_s"], 4),
        f"step_s_{world}_ranks_no_overlap": round(blocking["step_s"], 4),
        f"speedup_{world}_vs_1": round(one["step_s"] / overlapped["step_s"], 3),
        "comm_s_per_step": round(comm, 4),
        "exposed_comm_s_per_step": round(overlapped["blocked_s"], 4),
        "hidden_comm_fraction": round(1 - overlapped["blocked_s"] / comm, 3) if comm > 0 else None,
    }


def format_report(r: dict) -> str:
    w = r["world"]
    return (f"data-parallel relay, GPT {r['model']['layers']} x {r['model']['width']}, global batch "
            f"{r['model']['batch_size']}, {r['cores']} cores, EPS {'sharded' if r['shard_state'] else 'replicated'}:\n"
            f"  1 rank   {r['step_s_1_rank']:.3f} s/step\n"
            f"  {w} ranks  {r[f'step_s_{w}_ranks']:.3f} s/step ({r[f'speedup_{w}_vs_1']:.2f}x of 1 rank), "
            f"without overlap {r[f'step_s_{w}_ranks_no_overlap']:.3f} s/step\n"
            f"  communication {r['comm_s_per_step'] * 1e3:.1f} ms/step, exposed {r['exposed_comm_s_per_step'] * 1e3:.1f} "
            f"ms: {r['hidden_comm_fraction']:.0%} hidden behind the backward")


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--steps", type=int, default=5, help=f"timed steps per run, after {WARMUP} of warm-up (default 5)")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the data-parallel runs (default 2)")
    p.add_argument("--shard-state", action="store_true", help="the sharded (ZeRO-style) EPS")


def run_from_args(args) -> int:
    return print_report(run(steps=args.steps, world=args.ranks, shard_state=args.shard_state), args.json,
                        format_report)


if __name__ == "__main__":  # one rank of a benchmark run
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
