"""`l2l bench pipeline`: the relay as a pipeline on CPU ranks against one process and torch's 1F1B.

One GPT, one minibatch, one micro-batch count, every variant built in the same S processes
(rank s holds stage s of each pipeline) and timed in turns, round after round, so a drift of
the machine's speed falls on every variant alike; each figure is the median over the rounds
with its [min - max], and each ratio is taken within a round:
  relay, 1 thread       the single-process relay (the reference the pipeline is equal to), on
                        rank 0 while the other ranks wait
  relay, S threads      the same with every core's threads
  pipeline 2bw          S ranks, one thread each, PipeDream-2BW (l2l_hw/relay/pipeline.py),
                        a round's steps as one schedule (train_steps: the pipe fills once)
  pipeline flush        the same with a flush every minibatch
  torch 1F1B            torch.distributed.pipelining's Schedule1F1B, the same split and
                        micro-batches, torch.optim.AdamW(fused=True) per stage
The split is the planner's (l2l_hw/relay/planner.py; this process profiles each layer with
one thread first, and every variant runs that split), printed with its predicted stage
times and those the flush pipeline measured (each stage's compute per step). The
bubble: per stage 1 - (time computing) / (step time) over the rounds, against the schedule's
(S - 1) / (M + S - 1) for flush and (S - 1) / (K M + S - 1) for 2bw's K steps in one schedule.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

from l2l_hw.bench import print_report
from l2l_hw.distributed import run_local_ranks
from l2l_hw.relay.actions import OneFOneB

WARMUP = 2


def _model(bench: dict):
    from l2l_hw.models.gpt import GPTConfig, build_gpt

    torch.manual_seed(0)
    return build_gpt(GPTConfig(n_layer=bench["layers"], n_embd=bench["width"], n_head=bench["heads"],
                               block_size=bench["context"], bias=False))


def _batches(bench: dict):
    g = torch.Generator().manual_seed(1)
    while True:  # random tokens: the timing does not depend on the text
        x = torch.randint(0, 256, (bench["batch"], bench["context"]), generator=g)
        yield x, torch.roll(x, -1, 1)


def _plan(bench: dict, stages: int):
    """The planner's split and its prediction: each layer profiled here, one thread, before any variant runs."""
    from l2l_hw.models.gpt import lm_loss
    from l2l_hw.relay.planner import plan_pipeline, profile_layers

    x, y = next(_batches(bench))
    size = bench["batch"] // bench["micro_batches"]
    costs = profile_layers(list(_model(bench)), lm_loss, x, y, sizes=(max(1, size // 2), size), threads=1)
    return plan_pipeline(costs, stages, bench["batch"], bench["micro_batches"])


def _relay(bench: dict, alone):
    """The single-process relay on rank 0 (a group of its own, `alone`: no data parallelism): run(n)
    trains n steps."""
    import l2l_hw
    from l2l_hw.models.gpt import lm_loss

    relay = l2l_hw.Relay(_model(bench), lm_loss, eps=l2l_hw.make_eps("cpu", optimizer="adamw", lr=1e-4),
                         micro_batches=bench["micro_batches"], recompute=bench["recompute"], pipedream_2bw=True,
                         process_group=alone)
    batches = _batches(bench)
    return lambda n: [relay.train_step(*next(batches)) for _ in range(n)]


def _pipeline(bench: dict, schedule: str, busy: list):
    """This rank's stage of a pipeline on a group of its own: run(n) trains n steps as one schedule
    (2bw: the pipe fills once; flush: a flush every step) and appends (busy, step) seconds to `busy`."""
    import torch.distributed as dist

    import l2l_hw
    from l2l_hw.models.gpt import lm_loss
    from l2l_hw.relay.options import PipelineConfig
    from l2l_hw.relay.pipeline import PipelineRelay

    relay = PipelineRelay(_model(bench), lm_loss, l2l_hw.make_eps("cpu", optimizer="adamw", lr=1e-4),
                          pipeline=PipelineConfig(stages=dist.get_world_size(), schedule=schedule),
                          group=dist.new_group(), boundaries=bench["bounds"], micro_batches=bench["micro_batches"],
                          recompute=bench["recompute"])
    batches = _batches(bench)

    def run(n: int) -> None:
        relay.train_steps([next(batches) for _ in range(n)])
        busy.append((relay.busy_s, relay.last_step_s))

    return run


def _torch_1f1b(bench: dict):
    """torch.distributed.pipelining's Schedule1F1B on the plan's split, AdamW per stage, on a group
    of its own: run(n) trains n steps."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from l2l_hw.models.gpt import lm_loss

    stages, stage, bounds = dist.get_world_size(), dist.get_rank(), bench["bounds"]
    module = nn.Sequential(*list(_model(bench))[bounds[stage]:bounds[stage + 1]])
    pipe_stage = PipelineStage(module, stage, stages, torch.device("cpu"), group=dist.new_group())
    schedule = Schedule1F1B(pipe_stage, n_microbatches=bench["micro_batches"], loss_fn=lm_loss)
    # fused: PyTorch's fastest AdamW (its docs), on the CPU too; without it the CPU runs the for-loop one
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
    batches = _batches(bench)

    def step() -> None:
        x, y = next(batches)
        optimizer.zero_grad()
        if stage == 0:
            schedule.step(x)
        elif stage == stages - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        optimizer.step()

    return lambda n: [step() for _ in range(n)]


def _worker(bench: dict) -> dict:
    """One rank: every variant built, warmed up, then timed in turns for bench["rounds"] rounds;
    rank 0 returns each variant's seconds a step per round and each stage's (busy, step) seconds."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    stages, rank = dist.get_world_size(), dist.get_rank()
    busy = {"2bw": [], "flush": []}
    alone = dist.new_group([0])  # every rank makes it
    one = _relay(bench, alone) if rank == 0 else None
    variants = {  # name: (run(n), torch threads while it runs); torch's 1F1B between the pipelines it is
        "pipeline_2bw": (_pipeline(bench, "2bw", busy["2bw"]), 1),  # compared with, in the same round
        "torch_1f1b": (_torch_1f1b(bench), 1),
        "pipeline_flush": (_pipeline(bench, "flush", busy["flush"]), 1),
        "relay_1_thread": (one, 1), f"relay_{stages}_threads": (one, stages)}
    step_s = {name: [] for name in variants}
    for r in range(bench["rounds"] + 1):  # round 0: the warm-up
        for name, (run, threads) in variants.items():
            torch.set_num_threads(threads)
            dist.barrier()
            t0 = time.perf_counter()
            if run is not None:  # the single-process relay runs on rank 0 alone
                run(WARMUP if r == 0 else bench["steps"])
            dist.barrier()
            if r > 0:
                step_s[name].append((time.perf_counter() - t0) / bench["steps"])
    torch.set_num_threads(1)
    timed = {k: v[1:] for k, v in busy.items()}  # the warm-up's left out
    mine = {k: (sum(b for b, _ in v), sum(s for _, s in v)) for k, v in timed.items()}  # (busy, step) seconds
    every = [None] * stages
    dist.all_gather_object(every, mine)
    dist.destroy_process_group()
    return {"step_s": step_s, "busy": {k: [e[k] for e in every] for k in busy}} if rank == 0 else {}


def _spread(values: list[float], digits: int) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def run(stages: int = 2, steps: int = 5, rounds: int = 4, layers: int = 8, width: int = 256, heads: int = 4,
        context: int = 128, batch: int = 32, micro_batches: int = 8, recompute: str = "none") -> dict:
    bench = dict(steps=steps, rounds=rounds, layers=layers, width=width, heads=heads, context=context, batch=batch,
                 micro_batches=micro_batches, recompute=recompute)
    torch.set_num_threads(1)
    plan = _plan(bench, stages)  # one split for every variant
    bench["bounds"] = plan.bounds
    procs = run_local_ranks(["-m", "l2l_hw.bench.pipeline", json.dumps(bench)], stages, threads=1,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if any(p.returncode for p in procs):
        errors = "; ".join(p.stderr.strip().splitlines()[-1] for p in procs if p.returncode and p.stderr.strip())
        raise RuntimeError(f"a rank of the pipeline benchmark failed (exit codes {[p.returncode for p in procs]}): "
                           f"{errors}")
    out = json.loads(procs[0].stdout.strip().splitlines()[-1])
    t, busy = out["step_s"], out["busy"]
    many = f"relay_{stages}_threads"
    bubble = {k: [round(1 - b / s, 3) for b, s in busy[k]] for k in busy}
    plan.measured_s = [b / rounds for b, _ in busy["flush"]]  # a step's, over the rounds

    def speedup(base: str, variant: str) -> dict:  # within each round
        return _spread([a / b for a, b in zip(t[base], t[variant])], 3)

    return {
        "model": {k: v for k, v in bench.items() if k not in ("steps", "rounds", "bounds")}, "steps": steps,
        "rounds": rounds, "stages": stages, "cores": os.cpu_count(), "bounds": plan.bounds, "plan": plan.describe(),
        **{f"step_s_{name}": _spread(times, 4) for name, times in t.items()},
        "speedup_2bw_vs_relay_1_thread": speedup("relay_1_thread", "pipeline_2bw"),
        f"speedup_2bw_vs_{many}": speedup(many, "pipeline_2bw"),
        "speedup_2bw_vs_torch_1f1b": speedup("torch_1f1b", "pipeline_2bw"),
        "speedup_flush_vs_torch_1f1b": speedup("torch_1f1b", "pipeline_flush"),
        "bubble_measured_flush": bubble["flush"],
        "bubble_theoretical": round(OneFOneB.bubble(stages, micro_batches), 3),
        "bubble_measured_2bw": bubble["2bw"],  # a round's steps as one schedule: the pipe fills once a round
        "bubble_theoretical_2bw": round(OneFOneB.bubble(stages, steps * micro_batches), 3),
    }


def format_report(r: dict) -> str:
    S, m = r["stages"], r["model"]

    def line(name: str, variant: str, against: str = "") -> str:
        t = r[f"step_s_{variant}"]
        return f"  {name:<22} {t['median']:.3f} s/step [{t['min']:.3f} - {t['max']:.3f}]{against}\n"

    def x(key: str, what: str) -> str:
        v = r[key]
        return f"{v['median']:.2f}x [{v['min']:.2f} - {v['max']:.2f}] {what}"

    return (f"pipeline, GPT {m['layers']} x {m['width']}, context {m['context']}, batch {m['batch']} in "
            f"{m['micro_batches']} micro-batches, recompute {m['recompute']}, {S} stages, {r['cores']} cores, "
            f"split {r['bounds']}; {r['rounds']} rounds of {r['steps']} steps a variant, median [min - max]:\n"
            f"{r['plan']}\n"
            + line("relay, 1 thread", "relay_1_thread")
            + line(f"relay, {S} threads", f"relay_{S}_threads")
            + line("pipeline 2bw", "pipeline_2bw",
                   f"  ({x('speedup_2bw_vs_relay_1_thread', 'relay 1 thread')}, "
                   f"{x(f'speedup_2bw_vs_relay_{S}_threads', f'relay {S} threads')}, "
                   f"{x('speedup_2bw_vs_torch_1f1b', 'torch 1F1B')})")
            + line("pipeline flush", "pipeline_flush", f"  ({x('speedup_flush_vs_torch_1f1b', 'torch 1F1B')})")
            + line("torch 1F1B", "torch_1f1b")
            + f"  bubble (flush) measured {r['bubble_measured_flush']} vs theoretical {r['bubble_theoretical']}\n"
            f"  bubble (2bw, {r['steps']} steps in one schedule) measured {r['bubble_measured_2bw']} vs theoretical "
            f"{r['bubble_theoretical_2bw']}")


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages = ranks (default 2)")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each variant a round (default 5)")
    p.add_argument("--rounds", type=int, default=4,
                   help=f"rounds, each variant timed once a round in turn, after {WARMUP} steps of warm-up (default 4)")
    p.add_argument("--layers", type=int, default=8, help="GPT blocks (default 8)")
    p.add_argument("--width", type=int, default=256, help="GPT width (default 256)")
    p.add_argument("--context", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument("--batch", type=int, default=32, help="samples per minibatch (default 32)")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per minibatch (default 8)")
    p.add_argument("--recompute", choices=("full", "selective", "none"), default="none",
                   help="the relay's and the stages' recompute policy (default none: the forward graphs kept, "
                        "the same work as torch's 1F1B; full runs each forward again in the backward, as L2L's "
                        "memory wants)")


def run_from_args(args) -> int:
    for name in ("stages", "steps", "rounds", "layers", "width", "context", "batch", "micro_batches"):
        if getattr(args, name) < 1:
            raise SystemExit(f"l2l bench pipeline: --{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.batch % args.micro_batches:
        raise SystemExit(f"l2l bench pipeline: --batch {args.batch} must be a multiple of --micro-batches "
                         f"{args.micro_batches} (torch's 1F1B splits evenly)")
    return print_report(run(stages=args.stages, steps=args.steps, rounds=args.rounds, layers=args.layers,
                            width=args.width, context=args.context, batch=args.batch,
                            micro_batches=args.micro_batches, recompute=args.recompute),
                        args.json, format_report)


if __name__ == "__main__":  # one rank of a benchmark run
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
