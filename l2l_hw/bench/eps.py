"""`l2l bench eps`: the fused host kernel against torch, DeepSpeed and the memory limit.

Three comparisons over N = 2^25 fp32 parameters, each timed round robin in one run:
  (1) the L2L step: bf16 gradient in, unscale, non-finite check, AdamW, bf16 working copy
      out, fp32 m and v, in place: the fused host kernel (l2l_hw/eps/host_kernel.py) against
      the fastest torch composition of the same work (widen the bf16 gradient into a
      preallocated fp32 .grad, check and unscale, torch.optim.AdamW fused=True or
      foreach=True, bf16 copy of the weights; every variant timed, the fastest reported);
  (2) DeepSpeed's own ground: fp32 gradient, AdamW in place, no working copy: the kernel
      against DeepSpeedCPUAdam (deepspeed, an optional dependency: skipped with a note when
      it cannot be imported; it runs on torch's OpenMP team, so torch.set_num_threads sets
      its threads);
  (3) compressed optimizer state: the step of (1) with m and v in bf16 and in block-wise
      8-bit (golden.STATE_FORMATS), in elements per second against fp32 state.
Every step is compared with the stream of its own bytes: the host kernel's
l2l_host_stream moves the same reads, in-place updates and writes with no arithmetic,
with plain and with non-temporal stores, on 1 thread and on the kernel's threads; in each
round the fastest of those is the stream. It was meant as a limit that the kernels, which
do strictly more, cannot beat; on a 2-vCPU VM (docs/BENCHMARKS.md) the fused kernel
moved its bytes faster than every no-arithmetic loop tried, so `fused_vs_stream` > 1 says
the stream is no limit there, and the report says so. `stream_thread_scaling` (the stream
on the kernel's threads against 1 thread) says why: near the thread count, the stream is
bound by each core's misses in flight, not by the memory.

Bytes are those the step must move, per element (write-allocate reads not counted):
  fp32 state, bf16 grad and copy: g 2 + p/m/v read 12 + p/m/v write 12 + copy 2 = 28 B;
  fp32 grad, no copy (DeepSpeed's ground): g 4 + 12 + 12 = 28 B;
  bf16 state: g 2 + p 8 + m/v 8 + copy 2 = 20 B; 8-bit state: g 2 + p 8 + m/v 4 + copy 2
  = 16 B, plus the block scales read and written (0.0625 B, counted for the kernel).
GB/s divides N x bytes by the median time of REPEATS timed rounds after WARMUP untimed ones;
in a round every variant of a comparison runs once, back to back. A ratio (`*_vs_*`) is the
median over rounds of the ratio within each round: a shared machine's memory bandwidth
drifts by tens of percent within seconds, and two runs a few milliseconds apart see the
same machine. DeepSpeedCPUAdam updates the kernel's own p, m and v (its state is handed
the kernel's tensors), so both move the same bytes at the same addresses.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
from dataclasses import dataclass

import torch

from l2l_hw.bench import print_report
from l2l_hw.bench.timer import round_robin
from l2l_hw.eps import golden, host_kernel
from l2l_hw.eps.base import OptimConfig

N = 2**25
WARMUP, REPEATS = 2, 11
LOSS_SCALE = 1024.0
CONFIG = OptimConfig(optimizer="adamw", lr=1e-3, weight_decay=0.01)
STEP = 10  # the optimizer step the scalars are computed for
DEEPSPEED_PIN = "deepspeed==0.19.8"


@dataclass(frozen=True)
class Mix:
    """The memory traffic of a step: dtypes of the streams read, updated in place, written."""

    reads: tuple[torch.dtype, ...]
    updates: tuple[torch.dtype, ...]
    writes: tuple[torch.dtype, ...]

    @property
    def bytes_per_element(self) -> int:
        return sum(d.itemsize for d in self.reads) + 2 * sum(d.itemsize for d in self.updates) + \
            sum(d.itemsize for d in self.writes)


F32, BF16, U8 = torch.float32, torch.bfloat16, torch.uint8
L2L_STEP = Mix((BF16,), (F32, F32, F32), (BF16,))
DEEPSPEED_STEP = Mix((F32,), (F32, F32, F32), ())
STATE_STEPS = {"fp32": L2L_STEP, "bf16": Mix((BF16,), (F32, BF16, BF16), (BF16,)),
               "8bit": Mix((BF16,), (F32, U8, U8), (BF16,))}
SCALE_BYTES = 2 * 2 * 4 / golden.QUANT_BLOCK  # 8-bit state: m and v scales, read and written


class Rounds:
    """Seconds of each variant in each round; "stream" is the fastest stream variant of each round."""

    def __init__(self, times: dict[str, list[float]]):
        self.times = dict(times)
        if any(name.startswith("stream ") for name in times):
            self.times["stream"] = self._fastest_stream_per_round("")

    @classmethod
    def timed(cls, fns: dict, repeats: int) -> "Rounds":
        """Each function timed round robin (l2l_hw/bench/timer.py) after WARMUP untimed runs."""
        return cls(round_robin(fns, repeats, WARMUP))

    def median(self, name: str) -> float:
        return statistics.median(self.times[name])

    def speedup(self, name: str, over: str) -> float:
        """How many times faster `name` ran than `over`: the median of the per-round ratios."""
        return round(statistics.median(b / a for a, b in zip(self.times[name], self.times[over])), 3)

    def stream_scaling(self, threads: int) -> float:
        """How many times faster the stream moved on `threads` threads than on 1 (the fastest
        variant of each, median over rounds). Near `threads`, the stream is bound by each
        core's misses in flight, not by the memory: it is then no limit for a kernel that
        keeps more in flight, and only a machine whose memory the cores saturate gives one."""
        one, many = (self._fastest_stream_per_round(f" {n}t") for n in (1, threads))
        return round(statistics.median(a / b for a, b in zip(one, many)), 3)

    def _fastest_stream_per_round(self, suffix: str) -> list[float]:
        """Each round's time of its fastest stream variant whose name ends in `suffix`."""
        variants = [t for k, t in self.times.items() if k.startswith("stream ") and k.endswith(suffix)]
        return [min(ts) for ts in zip(*variants)]

    def fastest_stream(self) -> str:
        """The stream variant with the lowest median."""
        return min((k for k in self.times if k.startswith("stream ")), key=self.median)[len("stream "):]


def random_state(n: int, seed: int, grad_dtype=torch.bfloat16, grad_scale: float = LOSS_SCALE):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 1e-3
    v = torch.rand(n, generator=g) * 1e-6
    grad = (torch.randn(n, generator=g) * grad_scale).to(grad_dtype)
    return p, m, v, grad


def _stream_fns(mix: Mix, n: int, thread_counts: list[int], isa: str) -> dict:
    """The stream of `mix`, plain and non-temporal stores, at each thread count."""
    make = lambda dtypes: [torch.zeros(n, dtype=d) for d in dtypes]  # noqa: E731
    reads, updates, writes = make(mix.reads), make(mix.updates), make(mix.writes)
    return {f"stream {'non-temporal' if nt else 'plain'} {t}t": (
        lambda nt=nt, t=t: host_kernel.stream(reads, updates, writes, nontemporal=nt, isa=isa, threads=t))
        for nt in (False, True) for t in thread_counts}


def _thread_counts(threads: int) -> list[int]:
    return sorted({1, threads})


# ---------------------------------------------------------------------------- (1) the L2L step

def _fused(n: int, threads: int, isa: str):
    p, m, v, grad = random_state(n, 0)
    working = torch.empty(n, dtype=torch.bfloat16)
    s = golden.step_scalars(CONFIG, STEP, 1 / LOSS_SCALE)
    return lambda: host_kernel.step("adamw", s, grad, p, m, v, working_out=working, isa=isa, threads=threads)


def _torch_variants(n: int):
    """name -> step function, each doing the whole step of (1) with torch ops."""
    p, m, v, grad = random_state(n, 0)
    variants = {}
    for impl in ("fused", "foreach"):
        for unscale in ("amp_unscale", "grad_scale"):
            if impl == "foreach" and unscale == "grad_scale":
                continue  # only the fused kernels take grad_scale
            param = torch.nn.Parameter(p.clone())
            param.grad = torch.empty(n)
            opt = torch.optim.AdamW([param], lr=CONFIG.lr, betas=CONFIG.betas, eps=CONFIG.eps,
                                    weight_decay=CONFIG.weight_decay, **{impl: True})
            opt.state[param] = {"step": torch.tensor(float(STEP - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
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


def measure_l2l_step(n: int, threads: int, isa: str, repeats: int) -> dict:
    torch_fns = _torch_variants(n)
    fns = {"fused": _fused(n, threads, isa), **torch_fns,
           **_stream_fns(L2L_STEP, n, _thread_counts(threads), isa)}
    r = Rounds.timed(fns, repeats)
    torch_variant = min(torch_fns, key=r.median)
    nbytes = n * L2L_STEP.bytes_per_element
    return {
        "threads": threads, "bytes_per_element": L2L_STEP.bytes_per_element,
        "fused_gbps": round(nbytes / r.median("fused") / 1e9, 2),
        "torch_gbps": round(nbytes / r.median(torch_variant) / 1e9, 2),
        "stream_gbps": round(nbytes / r.median("stream") / 1e9, 2), "stream_variant": r.fastest_stream(),
        "fused_vs_torch": r.speedup("fused", torch_variant),
        "fused_vs_stream": r.speedup("fused", "stream"), "stream_thread_scaling": r.stream_scaling(threads),
        "fused_ms": round(r.median("fused") * 1e3, 2), "torch_ms": round(r.median(torch_variant) * 1e3, 2),
        "torch_variant": torch_variant, "torch_variants_ms": {k: round(r.median(k) * 1e3, 2) for k in torch_fns},
        "stream_variants_ms": _stream_variants_ms(r),
    }


def _stream_variants_ms(r: Rounds) -> dict:
    return {k: round(r.median(k) * 1e3, 2) for k in r.times if k.startswith("stream ")}


# ---------------------------------------------------------------------------- (2) DeepSpeed

def _deepspeed_adam():
    """DeepSpeedCPUAdam, or the reason it cannot be used here."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # ImportError, or deepspeed failing to set itself up
        return None, f"deepspeed is not importable ({type(e).__name__}: {e}); `pip install {DEEPSPEED_PIN}`"
    return DeepSpeedCPUAdam, None


def measure_deepspeed(n: int, threads: int, isa: str, repeats: int) -> dict:
    adam, why = _deepspeed_adam()
    if adam is None:
        return {"skipped": why}
    import deepspeed

    p, m, v, grad = random_state(n, 1, torch.float32, 1.0)
    s = golden.step_scalars(CONFIG, STEP)
    ours = lambda: host_kernel.step("adamw", s, grad, p, m, v, isa=isa, threads=threads)  # noqa: E731
    param = torch.nn.Parameter(p)  # the kernel's tensors: same bytes, same addresses
    param.grad = grad
    opt = adam([param], lr=CONFIG.lr, betas=CONFIG.betas, eps=CONFIG.eps, weight_decay=CONFIG.weight_decay,
               adamw_mode=True)
    opt.state[param] = {"step": STEP - 1, "exp_avg": m, "exp_avg_sq": v}  # taken as is (a non-empty state)
    opt.step()  # builds or loads the op
    if opt.state[param]["exp_avg"].data_ptr() != m.data_ptr():
        raise RuntimeError("DeepSpeedCPUAdam replaced the state it was handed: the comparison would not be like for like")
    fns = {"fused": ours, "deepspeed": opt.step, **_stream_fns(DEEPSPEED_STEP, n, _thread_counts(threads), isa)}
    r = Rounds.timed(fns, repeats)
    nbytes = n * DEEPSPEED_STEP.bytes_per_element
    return {
        "deepspeed": deepspeed.__version__, "threads": threads,
        "bytes_per_element": DEEPSPEED_STEP.bytes_per_element,
        "fused_gelem_s": round(n / r.median("fused") / 1e9, 3),
        "deepspeed_gelem_s": round(n / r.median("deepspeed") / 1e9, 3),
        "fused_vs_deepspeed": r.speedup("fused", "deepspeed"),
        "fused_gbps": round(nbytes / r.median("fused") / 1e9, 2),
        "deepspeed_gbps": round(nbytes / r.median("deepspeed") / 1e9, 2),
        "stream_gbps": round(nbytes / r.median("stream") / 1e9, 2), "stream_variant": r.fastest_stream(),
        "fused_vs_stream": r.speedup("fused", "stream"),
        "deepspeed_vs_stream": r.speedup("deepspeed", "stream"), "stream_thread_scaling": r.stream_scaling(threads),
        "stream_variants_ms": _stream_variants_ms(r),
    }


# ---------------------------------------------------------------------------- (3) state formats

def measure_state_formats(n: int, threads: int, isa: str, repeats: int) -> dict:
    """The step of (1) with m and v in each state format; p, the gradient and the copy shared."""
    p, m, v, grad = random_state(n, 2)
    working = torch.empty(n, dtype=torch.bfloat16)
    s = golden.step_scalars(CONFIG, STEP, 1 / LOSS_SCALE)
    fns = {}
    for state in golden.STATE_FORMATS:
        stored = {}
        for slot, x in (("m", m), ("v", v)):  # cloned: 64-byte aligned, as the EPS's buffers (numpy's are not)
            stored.update({k: t.clone() for k, t in golden.state_tensors(golden.encode_state(x.numpy(), state, slot)).items()})
        fns[f"fused {state}"] = (lambda stored=stored, state=state: host_kernel.step(
            "adamw", s, grad, p, stored["m"], stored["v"], m_scale=stored.get("m_scale"),
            v_scale=stored.get("v_scale"), working_out=working, state=state, isa=isa, threads=threads))
        for name, fn in _stream_fns(STATE_STEPS[state], n, _thread_counts(threads), isa).items():
            fns[f"{name} {state}"] = fn
    times = Rounds.timed(fns, repeats).times
    report = {"threads": threads}
    for state in golden.STATE_FORMATS:  # this format's fused step and streams, and the fp32-state step
        own = Rounds({"fp32 state": times["fused fp32"],
                      **{k[: -len(state) - 1]: t for k, t in times.items() if k.endswith(" " + state)}})
        stream_bytes = n * STATE_STEPS[state].bytes_per_element
        fused_bytes = stream_bytes + (n * SCALE_BYTES if state == "8bit" else 0)
        # the kernel moves the scales too: its GB/s against the stream's is its elements/s ratio x bytes ratio
        vs_stream = own.speedup("fused", "stream") * fused_bytes / stream_bytes
        t = own.median("fused")
        report[state] = {
            "bytes_per_element": fused_bytes / n, "fused_gelem_s": round(n / t / 1e9, 3),
            "fused_gbps": round(fused_bytes / t / 1e9, 2), "stream_gbps": round(stream_bytes / own.median("stream") / 1e9, 2),
            "stream_variant": own.fastest_stream(), "fused_vs_stream": round(vs_stream, 3),
            "elements_vs_fp32_state": own.speedup("fused", "fp32 state"), "fused_ms": round(t * 1e3, 2),
            "stream_gelem_s": round(n / own.median("stream") / 1e9, 3),
        }
    return report


# ---------------------------------------------------------------------------- the report

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def run(n: int = N, threads: int | None = None, isa: str | None = None, repeats: int = REPEATS,
        deepspeed: bool = True) -> dict:
    threads = threads or host_kernel.default_threads()
    isa = host_kernel.resolve_isa(isa)
    report = {
        "n": n, "isa": isa, "cpu": _cpu_model(), "cores_usable": len(os.sched_getaffinity(0)),
        "torch": torch.__version__, "rounds": repeats, "warmup": WARMUP,
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
    }
    previous = torch.get_num_threads()
    try:
        for t in [threads] + ([1] if threads != 1 else []):
            torch.set_num_threads(t)  # torch (and DeepSpeed, on torch's OpenMP team) get the kernel's cores
            suffix = "" if t == threads else f"_threads_{t}"
            report["l2l_step" + suffix] = measure_l2l_step(n, t, isa, repeats)
            report["deepspeed" + suffix] = (measure_deepspeed(n, t, isa, repeats) if deepspeed
                                            else {"skipped": "--no-deepspeed"})
        torch.set_num_threads(threads)
        report["state_formats"] = measure_state_formats(n, threads, isa, repeats)
    finally:
        torch.set_num_threads(previous)
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return report


def format_report(r: dict) -> str:
    lines = [f"EPS update, N = {r['n']:,} fp32 params, ISA {r['isa']}, {r['cpu']}, "
             f"load average {r['load_average_before'][0]} -> {r['load_average_after'][0]}"]
    for key in ("l2l_step", "l2l_step_threads_1"):
        if key in r:
            m = r[key]
            lines.append(f"  L2L step ({m['bytes_per_element']} B/elem), {m['threads']} thread(s): fused "
                         f"{m['fused_gbps']:6.2f} GB/s ({m['fused_ms']} ms)  torch {m['torch_gbps']:6.2f} GB/s "
                         f"({m['torch_variant']})  stream {m['stream_gbps']:6.2f} GB/s ({m['stream_variant']})  "
                         f"fused/torch x{m['fused_vs_torch']}  fused/stream {m['fused_vs_stream']}")
    for key in ("deepspeed", "deepspeed_threads_1"):
        if key in r:
            m = r[key]
            if "skipped" in m:
                lines.append(f"  DeepSpeedCPUAdam: skipped: {m['skipped']}")
                continue
            lines.append(f"  fp32 grad, in place, no copy ({m['bytes_per_element']} B/elem), {m['threads']} "
                         f"thread(s): fused {m['fused_gelem_s']} G elem/s ({m['fused_gbps']} GB/s)  "
                         f"DeepSpeedCPUAdam {m['deepspeed']} {m['deepspeed_gelem_s']} G elem/s "
                         f"({m['deepspeed_gbps']} GB/s)  stream {m['stream_gbps']} GB/s ({m['stream_variant']})  "
                         f"fused/deepspeed x{m['fused_vs_deepspeed']}  fused/stream {m['fused_vs_stream']}  "
                         f"deepspeed/stream {m['deepspeed_vs_stream']}")
    sf = r["state_formats"]
    for state in golden.STATE_FORMATS:
        m = sf[state]
        lines.append(f"  state {state:4} ({m['bytes_per_element']:.4g} B/elem), {sf['threads']} thread(s): fused "
                     f"{m['fused_gelem_s']} G elem/s, {m['fused_gbps']} GB/s  stream {m['stream_gbps']} GB/s "
                     f"({m['stream_variant']})  fused/stream {m['fused_vs_stream']}  "
                     f"elements/s vs fp32 state x{m['elements_vs_fp32_state']}  (the stream moves "
                     f"{m['stream_gelem_s']} G elem/s)")
    if any(m.get("fused_vs_stream", 0) > 1 for m in [*(r.get(k, {}) for k in r), *(sf[s] for s in golden.STATE_FORMATS)]
           if isinstance(m, dict)):
        lines.append("  note: a fused step outran its no-arithmetic stream (fused/stream > 1): on this machine "
                     "the stream is not an upper bound")
    for key in ("l2l_step", "deepspeed"):
        m = r.get(key, {})
        if m.get("threads", 1) > 1 and m.get("stream_thread_scaling", 0) >= 0.75 * m["threads"]:
            lines.append(f"  note: the stream ({key}) moved x{m['stream_thread_scaling']} on {m['threads']} threads "
                         f"against 1: it is bound by each core, not by the memory, so it bounds no implementation; "
                         f"a limit needs a machine whose cores saturate its memory")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--n", type=int, default=N, help=f"elements (default 2^25 = {N})")
    p.add_argument("--threads", type=int, default=None,
                   help="kernel and torch threads (default: the cores this process may use); 1 thread is reported too")
    p.add_argument("--isa", choices=host_kernel.ISAS, default=None,
                   help=f"host kernel path (default ${host_kernel.ISA_ENV} or the widest the CPU has)")
    p.add_argument("--repeats", type=int, default=REPEATS, help=f"timed runs per figure (default {REPEATS})")
    p.add_argument("--no-deepspeed", action="store_true",
                   help=f"skip the DeepSpeedCPUAdam comparison (optional dependency {DEEPSPEED_PIN})")


def run_from_args(args) -> int:
    report = run(n=args.n, threads=args.threads, isa=args.isa, repeats=args.repeats,
                 deepspeed=not args.no_deepspeed)
    return print_report(report, args.json, format_report)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="l2l bench eps", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
