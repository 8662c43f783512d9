"""`l2l bench convergence`: what PipeDream-2BW's one-step-stale weights cost in loss, and what delay compensation recovers.

The reference GPT (`l2l train`'s defaults: 4 layers x 128, context 128, batch 32 in 4
micro-batches, lr 2e-3 cosine, 200 steps) on the corpus, trained as a pipeline of 2 stages (2
processes, one core each) under each schedule, for each optimizer:
  flush          1F1B with a flush each minibatch: exact, the baseline of the seed
  2bw            PipeDream-2BW: every step computes on the weights one step stale
  2bw+predict    2bw with --delay-compensation predict (the EPS writes the working copy at the
                 weights the next step is predicted to reach: l2l_hw/eps/golden.py); only for an
                 optimizer the EPS predicts (AdamW: yes; Muon: not predicted, its rows are flush and 2bw)
Every run of a seed trains on the same tokens from the same initial weights. A run's figure is
the validation loss of its master weights (gathered from the stages, evaluated in plain PyTorch
on the windows `l2l train` validates on), and its gap is that loss minus flush's of the same seed;
the mean gap over the seeds is the schedule's cost. Acceptance (issue 61): AdamW's gap with
compensation at most half of its gap without; Muon's 2bw gap within MUON_TOLERANCE of flush.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

from l2l_hw.bench import print_report

STAGES = 2
SEEDS = (1337, 1338, 1339)  # l2l train's default seed and the next two
VARIANTS = {  # name -> (pipeline schedule, delay compensation)
    "flush": ("flush", "none"),
    "2bw": ("2bw", "none"),
    "2bw+predict": ("2bw", "predict"),
}
MUON_TOLERANCE = 0.02  # nats per byte: issue 61's bound on Muon's cost of 2BW
RUN_TIMEOUT_S = 3600.0  # one run of the two stages; a hang fails the bench instead of waiting forever
MODEL_FIELDS = ("layers", "width", "heads", "context", "batch_size", "micro_batches", "lr", "steps")


def optimizers() -> tuple[str, ...]:
    """AdamW, and Muon where the EPS has it (l2l_hw/eps/base.py OPTIMIZERS)."""
    from l2l_hw.eps.base import OPTIMIZERS

    return ("adamw", "muon") if "muon" in OPTIMIZERS else ("adamw",)


def predicted(optimizer: str) -> bool:
    """Whether the EPS predicts this optimizer's next step (delay compensation "predict")."""
    from l2l_hw.eps.base import OptimConfig
    from l2l_hw.eps.golden import prediction_problem

    return prediction_problem(OptimConfig(optimizer=optimizer)) is None


def _worker(job: dict) -> dict | None:
    """One stage of one run (under run_local_ranks): l2l_hw.train on the reference corpus as a 2-stage
    pipeline, then the whole model gathered; rank 0 returns its validation loss in plain PyTorch."""
    import torch
    import torch.distributed as dist

    from l2l_hw.models import Corpus, lm_loss
    from l2l_hw.train import TrainConfig, corpus_val_batches, train

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # train() uses it as it is; the gather below needs it after the run
    try:
        cfg = TrainConfig(out=None, verbose=False, pipeline_stages=STAGES, **job["config"])
        t0 = time.perf_counter()
        result = train(cfg)
        seconds = time.perf_counter() - t0
        with result.relay as relay:
            model = relay.materialize()  # collective: the master weights of every stage
        if dist.get_rank() != 0:
            return None
        corpus = Corpus.load(cfg.data)
        with torch.no_grad():
            windows = corpus_val_batches(corpus, cfg)  # the windows train() validates on
            val = sum(float(lm_loss(model.eval()(x), y)) for x, y in windows) / len(windows)
        # relay_val_loss: train()'s own validation, on the working copy the stages fetch (under predict, the
        # prediction of the step after the last one, not the master weights)
        return {"val_loss": val, "relay_val_loss": result.val_loss, "seconds": round(seconds, 1)}
    finally:
        dist.destroy_process_group()


def _run(config: dict) -> dict:
    """One run: the two stages as fresh processes; rank 0's figures."""
    from l2l_hw.distributed import run_local_ranks

    procs = run_local_ranks(["-m", "l2l_hw.bench.convergence", json.dumps({"config": config})], STAGES,
                            timeout_s=RUN_TIMEOUT_S, threads=1, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for rank, p in enumerate(procs):
        if p.returncode:
            tail = "\n".join(p.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"rank {rank} of the run {config} failed (exit {p.returncode}):\n{tail}")
    return json.loads(procs[0].stdout.strip().splitlines()[-1])


def run(steps: int = 200, seeds=SEEDS, optimizer_names=None, variants=tuple(VARIANTS), log=None, **model) -> dict:
    """Every (seed, optimizer, variant) run; seeds outermost, so the first seed's rows come whole first.
    `model`: TrainConfig fields of the GPT and its batch (layers, width, heads, context, batch_size,
    micro_batches, lr), the reference run's where not given."""
    from l2l_hw.train import TrainConfig

    optimizer_names = tuple(optimizer_names or optimizers())
    base = TrainConfig(steps=steps, out=None, **model)
    report = {"stages": STAGES, "seeds": list(seeds), "model": {k: getattr(base, k) for k in MODEL_FIELDS},
              "muon_tolerance": MUON_TOLERANCE, "runs": []}
    for seed in seeds:
        for optimizer in optimizer_names:
            for variant in variants:
                schedule, compensation = VARIANTS[variant]
                if compensation != "none" and not predicted(optimizer):
                    continue
                config = dict(model, steps=steps, seed=seed, optimizer=optimizer, pipeline_schedule=schedule,
                              delay_compensation=compensation)
                t0 = time.perf_counter()
                row = {"optimizer": optimizer, "variant": variant, "seed": seed, **_run(config),
                       "wall_s": round(time.perf_counter() - t0, 1)}
                report["runs"].append(row)
                if log is not None:
                    log(f"{optimizer:<6} {variant:<12} seed {seed}  val loss {row['val_loss']:.4f}  "
                        f"({row['wall_s']:.0f} s)")
    report["summary"] = summarize(report["runs"])
    report["acceptance"] = acceptance(report["summary"])
    return report


def summarize(runs: list[dict]) -> dict:
    """Per optimizer and variant: the validation losses by seed, their mean, and the gaps to flush of
    the same seed with their mean (flush's own: none)."""
    out: dict = {}
    for r in runs:
        out.setdefault(r["optimizer"], {}).setdefault(r["variant"], {"val_loss": {}})["val_loss"][r["seed"]] = \
            r["val_loss"]
    for variants in out.values():
        flush = variants.get("flush", {}).get("val_loss", {})
        for name, v in variants.items():
            v["mean"] = statistics.fmean(v["val_loss"].values())
            if name != "flush":
                gaps = {seed: loss - flush[seed] for seed, loss in v["val_loss"].items() if seed in flush}
                v["gap"] = gaps
                v["mean_gap"] = statistics.fmean(gaps.values()) if gaps else None
    return out


def acceptance(summary: dict) -> dict:
    """Issue 61's two bounds, where the runs made them measurable."""
    out = {}
    adamw = summary.get("adamw", {})
    plain, compensated = (adamw.get(name, {}).get("mean_gap") for name in ("2bw", "2bw+predict"))
    if plain is not None and compensated is not None:
        out["adamw_recovered"] = 1 - compensated / plain if plain else None
        out["adamw_compensated_gap_at_most_half"] = compensated <= plain / 2
    muon = summary.get("muon", {}).get("2bw", {}).get("mean_gap")
    if muon is not None:
        out["muon_2bw_within_tolerance"] = abs(muon) <= MUON_TOLERANCE
    return out


def format_report(r: dict) -> str:
    m = r["model"]
    lines = [f"validation loss after {m['steps']} steps, the reference GPT {m['layers']} x {m['width']} as "
             f"{r['stages']} pipeline stages, batch {m['batch_size']} in {m['micro_batches']} micro-batches, lr "
             f"{m['lr']:g}, seeds {', '.join(map(str, r['seeds']))} (gap: minus flush of the same seed)"]
    for optimizer, variants in r["summary"].items():
        for name, v in variants.items():
            losses = "  ".join(f"{loss:.4f}" for loss in v["val_loss"].values())
            gap = f"  gap {v['mean_gap']:+.4f}" if v.get("mean_gap") is not None else ""
            lines.append(f"  {optimizer:<6} {name:<12} mean {v['mean']:.4f}{gap}   ({losses})")
    a = r["acceptance"]
    if "adamw_recovered" in a:
        lines.append(f"AdamW: compensation recovers {a['adamw_recovered']:.0%} of 2BW's gap "
                     f"({'at most half left: yes' if a['adamw_compensated_gap_at_most_half'] else 'more than half left'})")
    if "muon_2bw_within_tolerance" in a:
        lines.append(f"Muon under 2BW within {r['muon_tolerance']} of flush: "
                     f"{'yes' if a['muon_2bw_within_tolerance'] else 'no'}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--steps", type=int, default=200, help="training steps per run (default 200, l2l train's)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                   help=f"the seeds (default {' '.join(map(str, SEEDS))})")
    p.add_argument("--optimizers", nargs="+", choices=("adamw", "muon"), default=None,
                   help="default: adamw, and muon where the EPS has it")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="the schedules to run (default all; flush is every gap's baseline)")
    for name, kind in (("layers", int), ("width", int), ("heads", int), ("context", int), ("batch-size", int),
                       ("micro-batches", int), ("lr", float)):
        p.add_argument(f"--{name}", type=kind, default=None, help=f"the GPT's or the batch's {name} (default: l2l "
                       "train's)")


def run_from_args(args) -> int:
    model = {k: getattr(args, k) for k in ("layers", "width", "heads", "context", "batch_size", "micro_batches", "lr")
             if getattr(args, k) is not None}
    if args.optimizers and "muon" in args.optimizers and "muon" not in optimizers():
        raise SystemExit("l2l bench convergence: --optimizers muon: this EPS has no Muon optimizer yet")
    report = run(args.steps, tuple(args.seeds), args.optimizers, tuple(args.variants),
                 log=lambda line: print(line, file=sys.stderr, flush=True), **model)
    return print_report(report, args.json, format_report)


if __name__ == "__main__":  # one stage of one run
    result = _worker(json.loads(sys.argv[1]))
    if result is not None:
        print(json.dumps(result))
