"""`l2l bench disk --memory-limit SIZE`: training inside a memory limit, the EPS state 3x the limit, on disk.

The reference GPT sized by the limit: width 512 x sqrt(limit / 1 GiB) (a multiple of 128; the
four region images in flight about a seventh of the limit), depth until its EPS state (fp32
master, m and v of AdamW: 12 B a parameter, as `l2l estimate` lays out the region files) is
at least STATE_RATIO times the limit. It trains --rounds + 1 steps (the first a warm-up) on
the reference corpus, one sequence of CONTEXT bytes a step, then validates, twice, each in a
process of its own:

  disk  `l2l train`'s path, train(cfg) with --state-dir: the estimate first (which sees the
        limit), the model made layer by layer as the EPS takes it (models/gpt.py
        build_gpt_meta), in a cgroup of the limit (l2l_hw/memory_limit.py)
  RAM   the same run with the state in RAM and no limit, the model built whole by build_gpt
        (where this machine has room for it beside the state; else layer by layer too)

Each reports every step's loss and the validation loss, which must be equal bit for bit (the
same seed, the same data); their step times; the disk run's peak in the cgroup (page cache
included) and both runs' peak RSS. An OOM kill inside the limit is a failure of the bench.

Refused before anything is written, one line each: a limit that cannot be set here (no
writable cgroup), a limit below what even the disk tier needs (l2l estimate), a --dir whose
filesystem has no room for the state, a machine without the memory for the RAM run.
"""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

STATE_RATIO = 3  # the EPS state on disk, at least this many times the memory limit
CONTEXT = 32  # bytes per sequence: the step is the state's I/O and update, not attention
SEED = 1337


class LimitBenchError(ValueError):
    """The bench cannot run as asked; one line says why (nothing was written)."""


class RunFailed(RuntimeError):
    """One of the two runs exited with an error; the message is its last line."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def config(limit: int, layers: int, steps: int, state_dir: str | None):
    """The run: the reference GPT of `layers` blocks at the limit's width, batch 1, AdamW with
    fp32 state, no output folder, validated once at the end."""
    from l2l_hw.train import TrainConfig

    width = 128 * max(1, round(4 * math.sqrt(limit / 2**30)))
    return TrainConfig(layers=layers, width=width, heads=max(1, width // 64), context=CONTEXT, batch_size=1,
                       micro_batches=1, steps=steps, eval_every=steps, seed=SEED, out=None, verbose=False,
                       state_dir=state_dir)


def sized(limit: int, steps: int, state_dir: str):
    """config() deep enough that its state on disk is at least STATE_RATIO x the limit."""
    from l2l_hw import estimate

    state = lambda n: estimate.needs(config(limit, n, steps, state_dir), 0).disk["state_dir"]
    one, two = state(1), state(2)
    layers = max(1, math.ceil((STATE_RATIO * limit - (one - (two - one))) / (two - one)))
    while state(layers) < STATE_RATIO * limit:
        layers += 1
    return config(limit, layers, steps, state_dir)


def check(disk_cfg, ram_cfg, limit: int) -> dict:
    """Refuse what will not fit, before anything is written (LimitBenchError); the estimates."""
    from l2l_hw import estimate

    on_disk = estimate.estimate(disk_cfg, host_memory=limit)
    if any(s.startswith("host memory") for s in on_disk.shortfall):
        raise LimitBenchError(f"--memory-limit {_gib(limit)} is below what even the disk tier needs for "
                              f"{on_disk.model}: {_gib(on_disk.host_bytes)} (l2l estimate --state-dir); give at least "
                              "that")
    room = [s for s in on_disk.shortfall if s.startswith("disk")]
    if room:
        raise LimitBenchError(f"--dir: no room for the disk tier's state: {room[0]} (nothing was written)")
    in_ram = estimate.estimate(ram_cfg)
    if not in_ram.fits:
        raise LimitBenchError(f"the same model with its state in RAM, which the bench runs outside the limit to "
                              f"compare, does not fit this machine: {'; '.join(in_ram.shortfall)}; give a smaller "
                              "--memory-limit")
    whole = in_ram.trained * 4  # build_gpt's fp32 weights, beside the state as it streams in
    return {"disk": on_disk.to_json(), "ram": in_ram.to_json(),
            "ram_build": "whole" if in_ram.host_bytes + whole <= in_ram.available["host"] else "layered"}


def child(spec: dict) -> dict:
    """One run (module docstring), in this process: train(cfg) as `l2l train` runs it, or with
    the model built whole (spec["build"] == "whole"); its losses, step times and peaks."""
    import torch

    from l2l_hw import Relay
    from l2l_hw.models import build_gpt, lm_loss
    from l2l_hw.train import (CorpusBatches, TrainConfig, build_eps, corpus_val_batches, load_corpus,
                              relay_options, train)

    cfg = TrainConfig(**spec["config"])
    rows, t0 = [], time.perf_counter()
    if spec["build"] == "whole":  # as build_relay built the reference GPT before build_gpt_meta
        torch.manual_seed(cfg.seed)
        relay = Relay(build_gpt(cfg.model_config()), lm_loss, eps=build_eps(cfg), options=relay_options(cfg))
        corpus = load_corpus(cfg)
        result = train(cfg, relay=relay, data=CorpusBatches(corpus, cfg.batch_size, cfg.context, cfg.seed),
                       val_data=corpus_val_batches(corpus, cfg), callbacks=[rows.append])
    else:
        result = train(cfg, callbacks=[rows.append])
    wall = time.perf_counter() - t0
    storage = result.relay.eps.storage
    report = {"losses": [r["loss"] for r in result.history], "val_loss": result.val_loss,  # resumed rows too
              "step_s": [b["elapsed"] - a["elapsed"] for a, b in zip([{"elapsed": 0.0}, *rows], rows)],
              "other_s": wall - result.elapsed,  # the estimate, the build, the validation
              "parameters": sum(p.numel() for g in result.relay.eps.shapes.values() for p in g.values())}
    if cfg.state_dir is not None:
        report.update(state_bytes=storage.disk_bytes(), memory_bound_bytes=storage.memory_bound())
    result.close()
    report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return report


def _argv(spec: dict) -> list[str]:
    return [sys.executable, "-m", "l2l_hw.bench.disk_limit", json.dumps(spec)]


def _result(name: str, returncode: int, stdout: str, stderr: str) -> dict:
    if returncode:
        last = (stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RunFailed(f"the {name} run failed (exit {returncode}): {last}")
    return json.loads(stdout.strip().splitlines()[-1])


def run(folder: str, limit: int, rounds: int = 3) -> dict:
    """The two runs (module docstring): checked first, then the disk tier inside the limit, then
    RAM; their comparison. OutOfMemoryKill where the kernel killed the disk run."""
    from l2l_hw.memory_limit import MemoryLimit, OutOfMemoryKill

    steps = rounds + 1
    root = Path(folder).expanduser().resolve() / f"l2l-bench-limit-{os.getpid()}"
    disk_cfg = sized(limit, steps, str(root / "state"))
    ram_cfg = config(limit, disk_cfg.layers, steps, None)
    estimates = check(disk_cfg, ram_cfg, limit)
    with MemoryLimit(limit) as cgroup:  # refused in one line where no limit can be set
        root.mkdir(parents=True)
        try:
            fields = lambda cfg: {k: getattr(cfg, k) for k in ("layers", "width", "heads", "context", "batch_size",
                                  "micro_batches", "steps", "eval_every", "seed", "out", "verbose", "state_dir")}
            t0 = time.perf_counter()
            limited = cgroup.run(_argv({"config": {**fields(disk_cfg), "remove_state_dir": True}, "build": "layered"}))
            disk_wall = time.perf_counter() - t0
            if limited.oom_killed:
                raise OutOfMemoryKill(f"the disk-tier run was killed by the kernel's OOM killer inside the "
                                      f"{_gib(limit)} limit (the cgroup's peak {_gib(limited.peak_bytes)}; the "
                                      f"estimate was {_gib(estimates['disk']['host_bytes'])})")
            disk = _result("disk-tier", limited.returncode, limited.stdout, limited.stderr)
            t0 = time.perf_counter()
            done = subprocess.run(_argv({"config": fields(ram_cfg), "build": estimates["ram_build"]}),
                                  capture_output=True, text=True)
            ram = _result("RAM-tier", done.returncode, done.stdout, done.stderr)
            ram_wall = time.perf_counter() - t0
        finally:
            shutil.rmtree(root, ignore_errors=True)
    timed = lambda r: statistics.median(r["step_s"][1:] or r["step_s"])
    return {"limit_bytes": limit, "cgroup_version": limited.version, "kernel_limit_bytes": limited.limit_bytes,
            "model": {"layers": disk_cfg.layers, "width": disk_cfg.width, "context": CONTEXT, "batch_size": 1,
                      "parameters": disk["parameters"]},
            "state_bytes": disk["state_bytes"], "state_vs_limit": disk["state_bytes"] / limit, "steps": steps,
            "estimate_host_bytes": {"disk": estimates["disk"]["host_bytes"], "ram": estimates["ram"]["host_bytes"]},
            "disk": {**disk, "cgroup_peak_bytes": limited.peak_bytes, "oom_kills": limited.oom_kills,
                     "wall_s": disk_wall, "step_median_s": timed(disk)},
            "ram": {**ram, "build": estimates["ram_build"], "wall_s": ram_wall, "step_median_s": timed(ram)},
            "ratio": timed(disk) / timed(ram),
            "bit_identical": disk["losses"] == ram["losses"] and disk["val_loss"] == ram["val_loss"]}


def format_report(r: dict) -> str:
    m, d, ram = r["model"], r["disk"], r["ram"]
    build = "built whole by build_gpt" if ram["build"] == "whole" else "made layer by layer"
    return "\n".join([
        f"inside a {_gib(r['limit_bytes'])} memory limit (cgroup v{r['cgroup_version']}): GPT {m['layers']} x "
        f"{m['width']} ({m['parameters'] / 1e9:.2f} B parameters), AdamW fp32 state {_gib(r['state_bytes'])} on disk "
        f"= {r['state_vs_limit']:.2f}x the limit; {m['batch_size']} x {m['context']} bytes a step, {r['steps']} "
        "steps (the first a warm-up), then validation",
        f"  disk tier in the limit: step {d['step_median_s']:.1f} s (median; all {_steps(d)}); peak in the cgroup "
        f"{_gib(d['cgroup_peak_bytes'])} (page cache included), RSS {_gib(d['peak_rss_bytes'])}, estimated "
        f"{_gib(r['estimate_host_bytes']['disk'])}; {d['oom_kills']} OOM kills; regions in memory at most "
        f"{_gib(d['memory_bound_bytes'])}; {d['other_s']:.0f} s estimate, build and validation",
        f"  RAM tier, no limit ({build}): step {ram['step_median_s']:.1f} s (all {_steps(ram)}); peak RSS "
        f"{_gib(ram['peak_rss_bytes'])}, estimated {_gib(r['estimate_host_bytes']['ram'])}; {ram['other_s']:.0f} s "
        "estimate, build and validation",
        f"  step time disk / RAM: {r['ratio']:.2f}x",
        f"  losses {'bit-identical' if r['bit_identical'] else 'DIFFER'}: disk {d['losses']} val {d['val_loss']!r}; "
        f"RAM {ram['losses']} val {ram['val_loss']!r}"])


def _steps(r: dict) -> str:
    return ", ".join(f"{s:.1f}" for s in r["step_s"])


def run_from_args(args) -> int:
    """`l2l bench disk --memory-limit SIZE`: the report, or one line and a non-zero exit."""
    from l2l_hw.bench import print_report
    from l2l_hw.memory_limit import MemoryLimitError, OutOfMemoryKill

    try:
        report = run(args.dir, args.memory_limit, args.rounds)
    except (LimitBenchError, MemoryLimitError) as e:
        print(f"l2l bench disk: {e}", file=sys.stderr)
        return 2
    except (OutOfMemoryKill, RunFailed) as e:
        print(f"l2l bench disk: {e}", file=sys.stderr)
        return 1
    print_report(report, args.json, format_report)
    if not report["bit_identical"]:
        print("l2l bench disk: the disk tier's losses differ from the RAM tier's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # one run (child): its report as the last line of stdout
    try:
        print(json.dumps(child(json.loads(sys.argv[1]))))
    except ValueError as e:  # a refusal (the estimate inside the limit, a state dir): one line
        print(f"{type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
