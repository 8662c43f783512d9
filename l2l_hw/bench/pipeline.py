"""`l2l bench pipeline`: the relay as a pipeline on CPU ranks against one process and torch's 1F1B.

One GPT, one minibatch, one micro-batch count, in one run, each variant in fresh processes:
  relay, 1 thread       the single-process relay (the reference the pipeline is equal to)
  relay, S threads      the same with every core's threads (the user's alternative here)
  pipeline 2bw          S ranks, one thread each, PipeDream-2BW (l2l_hw/relay/pipeline.py),
                        the timed steps as one schedule (train_steps: the pipe fills once)
  pipeline flush        the same with a flush every minibatch
  torch 1F1B            torch.distributed.pipelining's Schedule1F1B, the same split and
                        micro-batches, torch.optim.AdamW per stage
The split is the planner's (l2l_hw/relay/planner.py; this process profiles each layer with
one thread first, and every variant runs that split), printed with its predicted stage
times and those the flush pipeline measured (each stage's compute per step). The
bubble: per stage 1 - (time computing) / (step time), against the schedule's
(S - 1) / (M + S - 1) for flush and (S - 1) / (K M + S - 1) for 2bw's K steps in one schedule.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from l2l_hw.bench import print_report
from l2l_hw.distributed import run_local_ranks
from l2l_hw.relay.pipeline import OneFOneB

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


def _timed(run, steps: int, sync=None) -> float:
    """Mean seconds a step of run(n) (n steps) after WARMUP steps, the ranks lined up first."""
    run(WARMUP)
    if sync is not None:
        sync()
    t0 = time.perf_counter()
    run(steps)
    if sync is not None:
        sync()
    return (time.perf_counter() - t0) / steps


def _each(step):
    """run(n) of a step function: n calls."""
    return lambda n: [step() for _ in range(n)]


def _worker(bench: dict) -> dict:
    import torch.distributed as dist

    import l2l_hw
    from l2l_hw.models.gpt import lm_loss

    torch.set_num_threads(bench["threads"])
    batches = _batches(bench)
    eps_options = dict(optimizer="adamw", lr=1e-4)
    if bench["kind"] == "relay":
        relay = l2l_hw.Relay(_model(bench), lm_loss, eps=l2l_hw.make_eps("cpu", **eps_options),
                             micro_batches=bench["micro_batches"], recompute=bench["recompute"], pipedream_2bw=True)
        return {"step_s": _timed(_each(lambda: relay.train_step(*next(batches))), bench["steps"])}
    dist.init_process_group("gloo")
    stages, stage = dist.get_world_size(), dist.get_rank()
    bounds = bench["bounds"]
    barrier = lambda: dist.barrier()  # noqa: E731
    if bench["kind"] == "torch":
        out = {"step_s": _torch_1f1b(bench, bounds, batches, barrier)}
    else:
        from l2l_hw.relay.options import PipelineConfig
        from l2l_hw.relay.pipeline import PipelineRelay

        relay = PipelineRelay(_model(bench), lm_loss, l2l_hw.make_eps("cpu", **eps_options),
                              pipeline=PipelineConfig(stages=stages, schedule=bench["kind"]), boundaries=bounds,
                              micro_batches=bench["micro_batches"], recompute=bench["recompute"])
        busy = []

        def run(n: int):  # 2bw: the n steps as one schedule (relay.train_steps); flush: a schedule a step
            relay.train_steps([next(batches) for _ in range(n)])
            busy.append((relay.busy_s, relay.last_step_s))

        step_s = _timed(run, bench["steps"], barrier)
        mine = busy[-1]  # the timed run's, per step
        every = [None] * stages
        dist.all_gather_object(every, mine)
        out = {"step_s": step_s, "busy_s": [b for b, _ in every], "stage_step_s": [s for _, s in every]}
    dist.destroy_process_group()
    return out if stage == 0 else {}


def _torch_1f1b(bench: dict, bounds: list[int], batches, barrier) -> float:
    """torch.distributed.pipelining's Schedule1F1B on the plan's split, AdamW per stage."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from l2l_hw.models.gpt import lm_loss

    stages, stage = dist.get_world_size(), dist.get_rank()
    layers = list(_model(bench))
    module = nn.Sequential(*layers[bounds[stage]:bounds[stage + 1]])
    pipe_stage = PipelineStage(module, stage, stages, torch.device("cpu"))
    schedule = Schedule1F1B(pipe_stage, n_microbatches=bench["micro_batches"], loss_fn=lm_loss)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step():
        x, y = next(batches)
        optimizer.zero_grad()
        if stage == 0:
            schedule.step(x)
        elif stage == stages - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        optimizer.step()

    return _timed(_each(step), bench["steps"], barrier)


def _launch(bench: dict, kind: str, world: int, threads: int) -> dict:
    cfg = dict(bench, kind=kind, threads=threads)
    procs = run_local_ranks(["-m", "l2l_hw.bench.pipeline", json.dumps(cfg)], world, threads=threads,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if any(p.returncode for p in procs):
        errors = "; ".join(p.stderr.strip().splitlines()[-1] for p in procs if p.returncode and p.stderr.strip())
        raise RuntimeError(f"a rank of the {kind} run failed (exit codes {[p.returncode for p in procs]}): {errors}")
    return json.loads(procs[0].stdout.strip().splitlines()[-1])


def run(stages: int = 2, steps: int = 5, layers: int = 8, width: int = 256, heads: int = 4, context: int = 128,
        batch: int = 32, micro_batches: int = 8, recompute: str = "none") -> dict:
    bench = dict(steps=steps, layers=layers, width=width, heads=heads, context=context, batch=batch,
                 micro_batches=micro_batches, recompute=recompute)
    torch.set_num_threads(1)
    plan = _plan(bench, stages)  # one split for every variant
    bench["bounds"] = plan.bounds
    one = _launch(bench, "relay", 1, 1)
    many = _launch(bench, "relay", 1, stages)
    twobw = _launch(bench, "2bw", stages, 1)
    flush = _launch(bench, "flush", stages, 1)
    torch_1f1b = _launch(bench, "torch", stages, 1)
    bubble = {name: [round(1 - b / s, 3) for b, s in zip(r["busy_s"], r["stage_step_s"])]
              for name, r in (("flush", flush), ("2bw", twobw))}
    plan.measured_s = flush["busy_s"]
    return {
        "model": {k: v for k, v in bench.items() if k not in ("steps", "bounds")}, "steps": steps, "stages": stages,
        "cores": os.cpu_count(), "bounds": plan.bounds, "plan": plan.describe(),
        "step_s_relay_1_thread": round(one["step_s"], 4),
        f"step_s_relay_{stages}_threads": round(many["step_s"], 4),
        "step_s_pipeline_2bw": round(twobw["step_s"], 4),
        "step_s_pipeline_flush": round(flush["step_s"], 4),
        "step_s_torch_1f1b": round(torch_1f1b["step_s"], 4),
        "speedup_2bw_vs_relay_1_thread": round(one["step_s"] / twobw["step_s"], 3),
        f"speedup_2bw_vs_relay_{stages}_threads": round(many["step_s"] / twobw["step_s"], 3),
        "speedup_2bw_vs_torch_1f1b": round(torch_1f1b["step_s"] / twobw["step_s"], 3),
        "bubble_measured_flush": bubble["flush"],
        "bubble_theoretical": round(OneFOneB.bubble(stages, micro_batches), 3),
        "bubble_measured_2bw": bubble["2bw"],  # the timed steps as one schedule: the pipe fills once
        "bubble_theoretical_2bw": round(OneFOneB.bubble(stages, steps * micro_batches), 3),
    }


def format_report(r: dict) -> str:
    S, m = r["stages"], r["model"]
    return (f"pipeline, GPT {m['layers']} x {m['width']}, context {m['context']}, batch {m['batch']} in "
            f"{m['micro_batches']} micro-batches, recompute {m['recompute']}, {S} stages, {r['cores']} cores, "
            f"split {r['bounds']}:\n"
            f"{r['plan']}\n"
            f"  relay, 1 thread        {r['step_s_relay_1_thread']:.3f} s/step\n"
            f"  relay, {S} threads       {r[f'step_s_relay_{S}_threads']:.3f} s/step\n"
            f"  pipeline 2bw           {r['step_s_pipeline_2bw']:.3f} s/step  "
            f"({r['speedup_2bw_vs_relay_1_thread']:.2f}x relay 1 thread, "
            f"{r[f'speedup_2bw_vs_relay_{S}_threads']:.2f}x relay {S} threads, "
            f"{r['speedup_2bw_vs_torch_1f1b']:.2f}x torch 1F1B)\n"
            f"  pipeline flush         {r['step_s_pipeline_flush']:.3f} s/step\n"
            f"  torch 1F1B             {r['step_s_torch_1f1b']:.3f} s/step\n"
            f"  bubble (flush) measured {r['bubble_measured_flush']} vs theoretical {r['bubble_theoretical']}\n"
            f"  bubble (2bw, {r['steps']} steps in one schedule) measured {r['bubble_measured_2bw']} vs theoretical "
            f"{r['bubble_theoretical_2bw']}")


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages = ranks (default 2)")
    p.add_argument("--steps", type=int, default=5, help=f"timed steps per variant, after {WARMUP} of warm-up")
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
    for name in ("stages", "steps", "layers", "width", "context", "batch", "micro_batches"):
        if getattr(args, name) < 1:
            raise SystemExit(f"l2l bench pipeline: --{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.batch % args.micro_batches:
        raise SystemExit(f"l2l bench pipeline: --batch {args.batch} must be a multiple of --micro-batches "
                         f"{args.micro_batches} (torch's 1F1B splits evenly)")
    return print_report(run(stages=args.stages, steps=args.steps, layers=args.layers, width=args.width,
                            context=args.context, batch=args.batch, micro_batches=args.micro_batches,
                            recompute=args.recompute),
                        args.json, format_report)


if __name__ == "__main__":  # one rank of a benchmark run
    print(json.dumps(_worker(json.loads(sys.argv[1]))))
