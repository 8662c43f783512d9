"""`l2l bench eps`: the fused host kernel against torch and against the memory limit.

Three ways to do one optimizer step over N = 2^25 fp32 parameters, side by side:
  (a) fused   the host kernel: bf16 gradient in, unscale, non-finite check, AdamW,
              bf16 working copy out, one pass (l2l_hw/eps/host_kernel.py);
  (b) torch   the fastest torch composition of the same work: widen the bf16 gradient
              into a preallocated fp32 .grad, check and unscale, torch.optim.AdamW
              (fused=True or foreach=True), bf16 copy of the weights; several variants
              are timed and the fastest is reported;
  (c) stream  the same bytes with one add per stream and no optimizer (host kernel's
              l2l_host_stream): the memory limit of this access pattern.

Bytes are those the step must move, per element (BYTES_PER_ELEMENT): bf16 gradient read
2 B, p/m/v read 12 B, p/m/v write 12 B, bf16 working copy write 2 B = 28 B. All three
rates divide N * 28 B by the step time (torch moves more: its extra passes are its cost,
not extra useful work). Write-allocate reads of the bf16 copy are not counted.
Each figure is the median of REPEATS timed runs after WARMUP untimed ones, all variants
timed round robin. torch runs on as many threads as the kernel (torch.set_num_threads).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from l2l_hw.eps import golden, host_kernel
from l2l_hw.eps.base import OptimConfig

N = 2**25
BYTES_PER_ELEMENT = 2 + 12 + 12 + 2
WARMUP, REPEATS = 2, 7
LOSS_SCALE = 1024.0
CONFIG = OptimConfig(optimizer="adamw", lr=1e-3, weight_decay=0.01)


def _medians_s(fns: dict, repeats: int) -> dict:
    """Median seconds of each function, timed round robin (one run of each per round) so
    that a neighbour's load on a shared machine slows every variant alike."""
    for fn in fns.values():
        for _ in range(WARMUP):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _state(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 1e-3
    v = torch.rand(n, generator=g) * 1e-6
    grad = (torch.randn(n, generator=g) * LOSS_SCALE).to(torch.bfloat16)
    return p, m, v, grad


def _fused(n: int, threads: int, isa: str):
    p, m, v, grad = _state(n, 0)
    working = torch.empty(n, dtype=torch.bfloat16)
    s = golden.step_scalars(CONFIG, 10, 1 / LOSS_SCALE)
    return lambda: host_kernel.step("adamw", s, grad, p, m, v, working_out=working, isa=isa, threads=threads)


def _stream(n: int, threads: int, isa: str):
    p, m, v, grad = _state(n, 0)
    copy16 = torch.empty(n, dtype=torch.bfloat16)
    return lambda: host_kernel.stream(grad, p, m, v, copy16, isa=isa, threads=threads)


def _torch_variants(n: int):
    """name -> step function, each doing the whole step of (a) with torch ops."""
    p, m, v, grad = _state(n, 0)
    variants = {}
    for impl in ("fused", "foreach"):
        for unscale in ("amp_unscale", "grad_scale"):
            if impl == "foreach" and unscale == "grad_scale":
                continue  # only the fused kernels take grad_scale
            param = torch.nn.Parameter(p.clone())
            param.grad = torch.empty(n)
            opt = torch.optim.AdamW([param], lr=CONFIG.lr, betas=CONFIG.betas, eps=CONFIG.eps,
                                    weight_decay=CONFIG.weight_decay, **{impl: True})
            opt.state[param] = {"step": torch.tensor(9.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
            working = torch.empty(n, dtype=torch.bfloat16)
            found_inf = torch.zeros(())  # 0-dim, as GradScaler hands to fused optimizers
            inv_scale, scale = torch.tensor(1 / LOSS_SCALE), torch.tensor(LOSS_SCALE)

            def step(param=param, opt=opt, working=working, found_inf=found_inf, inv_scale=inv_scale,
                     scale=scale, unscale=unscale):
                param.grad.copy_(grad)  # widen bf16 -> fp32
                if unscale == "amp_unscale":  # check and unscale in one pass, as GradScaler.unscale_
                    found_inf.zero_()
                    torch._amp_foreach_non_finite_check_and_unscale_([param.grad], found_inf, inv_scale)
                else:  # check on the bf16 gradient; the fused step unscales
                    found_inf.copy_(grad.isfinite().all().logical_not())
                    opt.grad_scale, opt.found_inf = scale, found_inf
                opt.step()
                working.copy_(param.detach())  # bf16 working copy, round to nearest even
                return bool(found_inf)

            variants[f"AdamW({impl}=True)+{unscale}"] = step
    return variants


def measure(n: int, threads: int, isa: str, repeats: int) -> dict:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # torch gets the same cores as the kernel
    try:
        fns = {"fused": _fused(n, threads, isa), "stream": _stream(n, threads, isa)}
        torch_fns = _torch_variants(n)
        times = _medians_s({**fns, **torch_fns}, repeats)
    finally:
        torch.set_num_threads(previous)
    torch_variant = min(torch_fns, key=times.get)
    fused, stream, torch_time = times["fused"], times["stream"], times[torch_variant]
    nbytes = n * BYTES_PER_ELEMENT
    return {
        "threads": threads,
        "fused_gbps": round(nbytes / fused / 1e9, 2),
        "torch_gbps": round(nbytes / torch_time / 1e9, 2),
        "stream_gbps": round(nbytes / stream / 1e9, 2),
        "fused_vs_torch": round(torch_time / fused, 3),
        "fused_vs_stream": round(stream / fused, 3),
        "fused_ms": round(fused * 1e3, 2), "torch_ms": round(torch_time * 1e3, 2),
        "stream_ms": round(stream * 1e3, 2),
        "torch_variant": torch_variant, "torch_variants_ms": {k: round(times[k] * 1e3, 2) for k in torch_fns},
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def run(n: int = N, threads: int | None = None, isa: str | None = None, repeats: int = REPEATS) -> dict:
    threads = threads or host_kernel.default_threads()
    isa = host_kernel.resolve_isa(isa)
    report = {
        "n": n, "bytes_per_element": BYTES_PER_ELEMENT,
        "bytes": "bf16 grad read 2 + p/m/v read 12 + p/m/v write 12 + bf16 copy write 2",
        "isa": isa, "cpu": _cpu_model(), "cores_usable": len(os.sched_getaffinity(0)),
        "torch": torch.__version__, "median_of": repeats, "warmup": WARMUP,
    }
    report.update(measure(n, threads, isa, repeats))
    if threads != 1:
        report["threads_1"] = measure(n, 1, isa, repeats)
    return report


def format_report(r: dict) -> str:
    lines = [f"EPS update, N = {r['n']:,} fp32 params, {r['bytes_per_element']} B/element ({r['bytes']}), "
             f"ISA {r['isa']}, {r['cpu']}"]
    for m in [r] + ([r["threads_1"]] if "threads_1" in r else []):
        lines.append(f"  {m['threads']} thread(s): fused {m['fused_gbps']:6.2f} GB/s ({m['fused_ms']} ms)  "
                     f"torch {m['torch_gbps']:6.2f} GB/s ({m['torch_ms']} ms, {m['torch_variant']})  "
                     f"stream {m['stream_gbps']:6.2f} GB/s  fused/torch x{m['fused_vs_torch']}  "
                     f"fused/stream {m['fused_vs_stream']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--n", type=int, default=N, help=f"elements (default 2^25 = {N})")
    p.add_argument("--threads", type=int, default=None,
                   help="kernel and torch threads (default: the cores this process may use); 1 thread is reported too")
    p.add_argument("--isa", choices=host_kernel.ISAS, default=None,
                   help=f"host kernel path (default ${host_kernel.ISA_ENV} or the widest the CPU has)")
    p.add_argument("--repeats", type=int, default=REPEATS, help=f"timed runs per figure (default {REPEATS})")


def run_from_args(args) -> int:
    report = run(n=args.n, threads=args.threads, isa=args.isa, repeats=args.repeats)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="l2l bench eps", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
