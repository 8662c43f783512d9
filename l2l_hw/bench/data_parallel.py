"""`l2l bench dp`: the data-parallel relay on CPU, 1 rank against N ranks (gloo).

The same global minibatch of the `l2l train` default GPT, timed per step:
  1 rank     one process on the whole minibatch, with every core's threads (the
             strongest single-process alternative)
  N ranks    N processes on 1/N of the minibatch each, cores shared out, gradients
             averaged per layer by asynchronous collectives overlapping the backward
  N ranks, no overlap   the same with each collective waited for at once: the time
             the ranks spend blocked there is the whole communication time
  N ranks, powersgd     the same with PowerSGD's rank-R factors instead of the exact
             all-reduce (l2l_hw/relay/powersgd.py): step time and bytes on the wire

hidden_comm_fraction = 1 - (blocked time with overlap) / (blocked time without it),
rank 0's figures, mean per step after warm-up. Bytes on the wire: what rank 0 hands to
the step's gradient collectives (GradReducer.wire), all of them and the matrices alone.
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
    rank = bench["powersgd_rank"]
    compression = dict(grad_compression="powersgd", powersgd_rank=rank) if rank is not None else {}
    cfg = TrainConfig(seed=0, **compression)
    relay = build_relay(cfg, shard_state=bench["shard_state"] and world > 1)
    if relay.dp is not None:
        relay.dp.overlap = bench["overlap"]
    g = torch.Generator().manual_seed(1)

    def batches():  # random tokens: the timing does not depend on the text
        while True:
            x = torch.randint(0, 256, (cfg.batch_size, cfg.context), generator=g)
            yield x, torch.roll(x, -1, 1)

    blocked, wire = [], []

    def on_step(row):
        blocked.append(relay.dp.wait_s if relay.dp is not None else 0.0)
        wire.append(vars(relay.dp.wire) if relay.dp is not None else {})

    times = train_steps(relay, batches(), WARMUP + bench["steps"], on_step=on_step)
    times, blocked = times[WARMUP:], blocked[WARMUP:]
    if world > 1:
        dist.destroy_process_group()
    return {"step_s": sum(times) / len(times), "blocked_s": sum(blocked) / len(blocked), "wire": wire[-1]}


def _launch(world: int, steps: int, overlap: bool, shard_state: bool, powersgd_rank: int | None = None) -> dict:
    """Run the benchmark as `world` fresh processes; rank 0's figures. powersgd_rank: PowerSGD at that rank."""
    threads = max(1, (os.cpu_count() or 1) // world)
    cfg = {"steps": steps, "overlap": overlap, "shard_state": shard_state, "threads": threads,
           "powersgd_rank": powersgd_rank}
    procs = run_local_ranks(["-m", "l2l_hw.bench.data_parallel", json.dumps(cfg)], world, threads=threads,
                            stdout=subprocess.PIPE)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank of the {world}-rank benchmark failed (exit codes {[p.returncode for p in procs]})")
    return json.loads(procs[0].stdout.strip().splitlines()[-1])


def run(steps: int = 5, world: int = 2, shard_state: bool = False, powersgd_rank: int = 4) -> dict:
    one = _launch(1, steps, True, False)
    overlapped = _launch(world, steps, True, shard_state)
    blocking = _launch(world, steps, False, shard_state)
    powersgd = _launch(world, steps, True, shard_state, powersgd_rank)
    comm = blocking["blocked_s"]
    exact_wire, low_wire = overlapped["wire"], powersgd["wire"]
    return {
        "model": {k: getattr(TrainConfig(), k) for k in MODEL_FIELDS}, "steps": steps, "world": world, "shard_state": shard_state, "cores": os.cpu_count(),
        "step_s_1_rank": round(one["step_s"], 4),
        f"step_s_{world}_ranks": round(overlapped["step_s"], 4),
        f"step_s_{world}_ranks_no_overlap": round(blocking["step_s"], 4),
        f"speedup_{world}_vs_1": round(one["step_s"] / overlapped["step_s"], 3),
        "comm_s_per_step": round(comm, 4),
        "exposed_comm_s_per_step": round(overlapped["blocked_s"], 4),
        "hidden_comm_fraction": round(1 - overlapped["blocked_s"] / comm, 3) if comm > 0 else None,
        "powersgd_rank": powersgd_rank,
        f"step_s_{world}_ranks_powersgd": round(powersgd["step_s"], 4),
        "exposed_comm_s_per_step_powersgd": round(powersgd["blocked_s"], 4),
        "wire_bytes_per_step_exact": exact_wire["sent"],
        "wire_bytes_per_step_powersgd": low_wire["sent"],
        "wire_reduction_powersgd": round(exact_wire["sent"] / low_wire["sent"], 2),
        "wire_reduction_powersgd_matrices": round(low_wire["matrix_exact"] / low_wire["matrix_sent"], 2),
    }


def format_report(r: dict) -> str:
    w = r["world"]
    return (f"data-parallel relay, GPT {r['model']['layers']} x {r['model']['width']}, global batch "
            f"{r['model']['batch_size']}, {r['cores']} cores, EPS {'sharded' if r['shard_state'] else 'replicated'}:\n"
            f"  1 rank   {r['step_s_1_rank']:.3f} s/step\n"
            f"  {w} ranks  {r[f'step_s_{w}_ranks']:.3f} s/step ({r[f'speedup_{w}_vs_1']:.2f}x of 1 rank), "
            f"without overlap {r[f'step_s_{w}_ranks_no_overlap']:.3f} s/step\n"
            f"  communication {r['comm_s_per_step'] * 1e3:.1f} ms/step, exposed {r['exposed_comm_s_per_step'] * 1e3:.1f} "
            f"ms: {r['hidden_comm_fraction']:.0%} hidden behind the backward\n"
            f"  {w} ranks, PowerSGD rank {r['powersgd_rank']}  {r[f'step_s_{w}_ranks_powersgd']:.3f} s/step, exposed "
            f"communication {r['exposed_comm_s_per_step_powersgd'] * 1e3:.1f} ms/step\n"
            f"  gradient bytes on the wire per step and rank: exact {r['wire_bytes_per_step_exact'] / 2**20:.3f} MiB, "
            f"PowerSGD {r['wire_bytes_per_step_powersgd'] / 2**20:.3f} MiB ({r['wire_reduction_powersgd']:.1f}x less; "
            f"{r['wire_reduction_powersgd_matrices']:.1f}x on the matrices)")


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--steps", type=int, default=5, help=f"timed steps per run, after {WARMUP} of warm-up (default 5)")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the data-parallel runs (default 2)")
    p.add_argument("--shard-state", action="store_true", help="the sharded (ZeRO-style) EPS")
    p.add_argument("--rank", type=int, default=4, help="rank R of the PowerSGD run (default 4)")


def run_from_args(args) -> int:
    if args.rank < 1:
        raise SystemExit(f"l2l bench dp: --rank {args.rank}: must be a whole number >= 1")
    return print_report(run(steps=args.steps, world=args.ranks, shard_state=args.shard_state,
                            powersgd_rank=args.rank), args.json, format_report)


if __name__ == "__main__":  # one rank of a benchmark run
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
