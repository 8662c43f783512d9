"""`l2l bench gpu --out DIR`: the whole GPU campaign in one call.

Parts, in order; each writes its result into DIR/summary.json as it ends, so a run cut
short keeps what finished, and prints what it is doing as it goes:

    tests            the CUDA-parametrized relay tests (relay == PyTorch to 1e-5, TF32 off)
    matmul_peak      the bf16 matmul peak (8192^3), the denominator of every MFU figure
    resident         a ~1.3 B GPT that fits the device: the relay against PyTorch in tokens/s,
                     without recompute against plain PyTorch, with recompute against
                     per-block checkpointed PyTorch (bf16 autocast, fused AdamW on the device,
                     the same micro-batches accumulated); each pair interleaved
    capacity         under a 16 GiB cap (set_per_process_memory_fraction): the deepest GPT
                     PyTorch trains, then the relay (host stash, bf16) at 4x that depth:
                     tokens/s and MFU (6 x parameters x tokens / step / matmul peak)
    memory_by_depth  the relay's peak device memory at 12, 24 and 48 layers
    trace            a torch.profiler trace of capped relay steps (DIR/trace.json, trimmed to
                     16 MiB) and the fraction of the step the compute stream is idle; again
                     with fewer cores for the EPS's host kernel (idle_by_eps_threads)
    syncs            blocking host-device transfers per step (the transport's count, and
                     CUDA's sync debug mode's warnings)
    eps              `l2l bench eps` on this machine's host cores

Files: summary.json, tests.txt (the tests' output), trace.json. `--dry-run` runs every
part at toy size on the CPU, the relay on the asynchronous twin of a device's transfers
(device cpu-async), and writes the same files; CI runs it.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.utils.checkpoint

import l2l_hw
from l2l_hw.bench import print_report
from l2l_hw.bench.timer import round_robin
from l2l_hw.models import GPTConfig, build_gpt, count_parameters, lm_loss

FILES = ("summary.json", "tests.txt", "trace.json")
MAX_FILE_BYTES = 16 * 2**20
TEST_FILES = ("tests/test_relay_equivalence.py", "tests/test_relay_options.py", "tests/test_precision.py",
              "tests/test_eps_engine.py", "tests/test_transport.py")


@dataclass(frozen=True)
class Sizes:
    """What each part runs: a real campaign's sizes, or the dry run's toys."""

    width: int  # the GPT's width in every part (2048: ~50 M parameters a block)
    heads: int
    context: int
    batch: int  # sequences a step
    micro_batches: int
    resident_layers: int  # ~1.3 B parameters at width 2048
    depths: tuple[int, ...]  # memory_by_depth
    cap_bytes: int  # the device memory cap of `capacity` and `trace`
    matmul_n: int
    steps: int  # timed steps per variant
    eps_n: int  # elements of `l2l bench eps`
    tests_k: str  # the pytest -k expression that picks the tests to run here


REAL = Sizes(width=2048, heads=16, context=1024, batch=64, micro_batches=8, resident_layers=24, depths=(12, 24, 48),
             cap_bytes=16 * 2**30, matmul_n=8192, steps=3, eps_n=2**25, tests_k="cuda")
DRY = Sizes(width=64, heads=4, context=32, batch=8, micro_batches=2, resident_layers=2, depths=(2, 4, 8),
            cap_bytes=64 * 2**20, matmul_n=256, steps=2, eps_n=2**16, tests_k="twin and transport")


class Campaign:
    """One campaign's device, sizes and output folder; each part a method."""

    def __init__(self, out: Path, dry_run: bool):
        self.out, self.dry_run = out, dry_run
        self.sizes = DRY if dry_run else REAL
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.relay_device = "cpu-async" if dry_run else "cuda"
        self.dtype = torch.float32 if dry_run else torch.bfloat16  # the dry run keeps to fp32 on the CPU
        self.summary = {"dry_run": dry_run, "device": self._device_name(), "sizes": asdict(self.sizes),
                        "torch": torch.__version__, "parts": {}}
        self.peak_flops = None

    def _device_name(self) -> str:
        if self.dry_run:
            return f"cpu ({torch.get_num_threads()} threads), relay on the asynchronous twin"
        return f"{torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB"

    def say(self, text: str) -> None:
        print(f"[l2l bench gpu {time.strftime('%H:%M:%S')}] {text}", flush=True)

    def write(self, name: str, text: str) -> None:
        """DIR/name, written whole (a temporary renamed), cut to MAX_FILE_BYTES."""
        data = text.encode()[-MAX_FILE_BYTES:]
        tmp = self.out / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.out / name)

    def run(self, parts) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        for name in FILES[1:]:  # every file exists, whatever parts fail
            self.write(name, "")
        for name in parts:
            self.say(f"{name} ...")
            t0 = time.perf_counter()
            try:
                result = getattr(self, name)()
            except Exception as exc:  # one part failing must not cost the others
                result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
            result["seconds"] = round(time.perf_counter() - t0, 1)
            self.summary["parts"][name] = result
            self.write("summary.json", json.dumps(self.summary, indent=1))
            self.say(f"{name} done in {result['seconds']} s{': ' + result['error'] if 'error' in result else ''}")
            self._free()
        return self.summary

    def _free(self) -> None:
        gc.collect()  # a relay's EPS (tens of GB of host state) goes before the next part builds its own
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # -- the models ----------------------------------------------------------------------
    def gpt(self, layers: int) -> GPTConfig:
        s = self.sizes
        return GPTConfig(n_layer=layers, n_embd=s.width, n_head=s.heads, block_size=s.context, bias=False)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        shape = (self.sizes.batch, self.sizes.context)
        return torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g)

    def torch_step(self, cfg: GPTConfig, checkpointed: bool):
        """A step of PyTorch on the device: the minibatch in the relay's micro-batches, gradients
        accumulated, fused AdamW (foreach on the CPU); returns a function giving its seconds."""
        torch.manual_seed(0)
        with self.device:  # built where it runs: no host copy of a model that only the device trains
            model = build_gpt(cfg)
        fused = {"fused": True} if self.device.type == "cuda" else {"foreach": True}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
        x, y = (t.to(self.device) for t in self.batch())
        u = self.sizes.micro_batches
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                    else contextlib.nullcontext())

        def forward(xj):
            if not checkpointed:
                return model(xj)
            h = model[0](xj)
            for block in model[1:-1]:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            return model[-1](h)

        def step() -> float:
            self._sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            for xj, yj in zip(x.tensor_split(u), y.tensor_split(u)):
                with autocast:
                    loss = lm_loss(forward(xj), yj) / u
                loss.backward()
            opt.step()
            self._sync()
            return time.perf_counter() - t0

        return step

    def relay(self, cfg: GPTConfig, recompute: str = "full", activations: str = "device",
              threads: int | None = None) -> l2l_hw.Relay:
        torch.manual_seed(0)
        eps = l2l_hw.make_eps("cpu", optimizer="adamw", lr=1e-4)
        return l2l_hw.Relay(build_gpt(cfg), lm_loss, eps=eps, device=self.relay_device,
                            micro_batches=self.sizes.micro_batches, recompute=recompute, activations=activations,
                            precision="fp32" if self.dry_run else "bf16", threads=threads)

    def relay_step(self, relay: l2l_hw.Relay):
        x, y = self.batch()

        def step() -> float:
            t0 = time.perf_counter()
            relay.train_step(x, y)  # returns the loss: the step has finished on the device
            return time.perf_counter() - t0

        return step

    def throughput(self, steps: dict, cfg: GPTConfig) -> dict:
        """Tokens/s (median of the timed steps, taken in turns) and MFU of each step function."""
        times = round_robin(steps, self.sizes.steps, warmup=1, self_timed=True)
        tokens = self.sizes.batch * self.sizes.context
        params = count_parameters(cfg)
        out = {"parameters": params, "tokens_per_step": tokens}
        for name, t in times.items():
            s = statistics.median(t)
            out[name] = {"step_s": s, "tokens_per_s": tokens / s,
                         "mfu": 6 * params * tokens / s / self.peak_flops if self.peak_flops else None}
        return out

    # -- the parts ---------------------------------------------------------------------------
    def tests(self) -> dict:
        root = Path(__file__).resolve().parents[2]
        if not (root / "tests").is_dir():
            return {"skipped": f"no tests folder under {root} (an installed package): run from a checkout"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", self.sizes.tests_k,
               *TEST_FILES]
        env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
        self.write("tests.txt", done.stdout + done.stderr)
        last = (done.stdout.strip().splitlines() or [""])[-1]
        return {"command": " ".join(cmd[1:]), "returncode": done.returncode, "result": last}

    def matmul_peak(self) -> dict:
        n = self.sizes.matmul_n
        a = torch.randn(n, n, dtype=self.dtype, device=self.device)
        b = torch.randn(n, n, dtype=self.dtype, device=self.device)
        for _ in range(3):
            a @ b
        self._sync()
        repeats = 20
        t0 = time.perf_counter()
        for _ in range(repeats):
            a @ b
        self._sync()
        seconds = (time.perf_counter() - t0) / repeats
        self.peak_flops = 2 * n ** 3 / seconds
        return {"n": n, "dtype": str(self.dtype), "seconds": seconds, "tflops": self.peak_flops / 1e12}

    def resident(self) -> dict:
        cfg = self.gpt(self.sizes.resident_layers)
        result = {}
        for pair, recompute, checkpointed in [("no_recompute", "none", False), ("recompute", "full", True)]:
            relay = self.relay(cfg, recompute=recompute)
            figures = self.throughput({"relay": self.relay_step(relay),
                                       "torch": self.torch_step(cfg, checkpointed=checkpointed)}, cfg)
            figures["relay_over_torch_tokens_per_s"] = figures["relay"]["tokens_per_s"] / figures["torch"]["tokens_per_s"]
            figures["torch_variant"] = "per-block checkpointed" if checkpointed else "plain"
            result[pair] = figures
            del relay
            self._free()
        return result

    @contextlib.contextmanager
    def capped(self):
        """The device memory cap: CUDA's own; none in the dry run (the twin is the host)."""
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.sizes.cap_bytes / total))
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0)

    def _trains(self, layers: int) -> bool:
        """Whether PyTorch trains a GPT of `layers` blocks under the cap: two steps, since the
        optimizer's state is made at the end of the first."""
        try:
            step = self.torch_step(self.gpt(layers), checkpointed=False)
            step()
            step()
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            self._free()

    def largest_torch_depth(self) -> int:
        if self.dry_run:  # no cap on the host: the toy's depth stands in
            return 2
        lo, hi = 0, 1
        while self._trains(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._trains(mid) else (lo, mid)
        return lo

    def capacity(self) -> dict:
        with self.capped():
            depth = self.largest_torch_depth()
            result = {"cap_bytes": self.sizes.cap_bytes, "torch_largest_layers": depth}
            if depth:
                result["torch"] = self.throughput({"torch": self.torch_step(self.gpt(depth), False)}, self.gpt(depth))
            self._free()
            layers = 4 * max(depth, 1)  # 4x the layers, and more if the embedding keeps it under 4x the parameters
            target = 4 * count_parameters(self.gpt(max(depth, 1)))
            while count_parameters(self.gpt(layers)) < target:
                layers += 1
            cfg = self.gpt(layers)
            relay = self.relay(cfg, activations="host")
            result["relay_layers"] = cfg.n_layer
            result["relay"] = self.throughput({"relay": self.relay_step(relay)}, cfg)
            result["relay_peak_device_bytes"] = self.peak_bytes(relay)
        return result

    def peak_bytes(self, relay) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated()
        return relay.memory_report()["peak_bytes"]

    def memory_by_depth(self) -> dict:
        out = {}
        for layers in self.sizes.depths:
            self._free()
            relay = self.relay(self.gpt(layers), activations="host")
            self.relay_step(relay)()
            out[str(layers)] = {"peak_device_bytes": self.peak_bytes(relay),
                                "parameters": sum(math.prod(s) for g in relay.eps.shapes.values() for s in g.values())}
            del relay
        return out

    def trace(self) -> dict:
        from torch.profiler import ProfilerActivity, profile

        cfg = self.gpt(2 * self.sizes.resident_layers)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        result, idle_by_threads = {"layers": cfg.n_layer, "steps_profiled": 2}, {}
        # The relay's default, then fewer cores for the host kernel, more left to the threads that
        # launch the kernels (the relay's and autograd's): whether the host kernel starves them.
        cores = len(os.sched_getaffinity(0))
        for threads in dict.fromkeys((None, max(1, cores - 1), max(1, cores // 2))):
            with self.capped():
                relay = self.relay(cfg, activations="host", threads=threads)
                step = self.relay_step(relay)
                step()  # warm-up
                with profile(activities=activities) as prof:
                    for _ in range(2):
                        step()
            path = self.out / ".trace.raw.json"
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text()).get("traceEvents", [])
            path.unlink()
            idle = compute_idle_fraction(events)
            idle_by_threads[str(relay.eps.threads)] = idle["compute_idle_fraction"]
            if threads is None:  # the relay as it runs by default: its figure and its trace
                events = trim(events, MAX_FILE_BYTES)
                self.write("trace.json", json.dumps({"traceEvents": events}))
                result.update({**idle, "eps_threads": relay.eps.threads, "events_kept": len(events)})
            del relay, step, prof, events
            self._free()
        return {**result, "idle_by_eps_threads": idle_by_threads}

    def syncs(self) -> dict:
        relay = self.relay(self.gpt(self.sizes.resident_layers))
        step = self.relay_step(relay)
        step()
        counts, warned = [], []
        for _ in range(3):
            before = relay.transport.blocking
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if self.device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    step()
                finally:
                    if self.device.type == "cuda":
                        torch.cuda.set_sync_debug_mode("default")
            counts.append(relay.transport.blocking - before)
            warned.append(sum("synchroniz" in str(w.message) for w in caught))
        return {"transport_blocking_per_step": counts, "cuda_sync_warnings_per_step": warned}

    def eps(self) -> dict:
        from l2l_hw.bench import eps

        # found, not imported: importing it here would pick the CUDA accelerator before eps sets
        # DS_ACCELERATOR=cpu for DeepSpeedCPUAdam
        with_deepspeed = not self.dry_run and importlib.util.find_spec("deepspeed") is not None
        return eps.run(n=self.sizes.eps_n, repeats=3, deepspeed=with_deepspeed)


def compute_idle_fraction(events: list[dict]) -> dict:
    """The fraction of the profiled window in which the compute stream runs nothing: CUDA
    kernels on the stream with the most kernel time; without kernels (the dry run), the
    CPU operators of the main thread."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if kernels:
        by_stream: dict = {}
        for e in kernels:
            by_stream.setdefault(e.get("args", {}).get("stream"), []).append(e)
        busy_events = max(by_stream.values(), key=lambda es: sum(e.get("dur", 0) for e in es))
        what = "CUDA kernels on the compute stream"
    else:
        ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        main = max({e.get("tid") for e in ops}, key=lambda t: sum(e.get("dur", 0) for e in ops if e.get("tid") == t),
                   default=None)
        busy_events = [e for e in ops if e.get("tid") == main]
        what = "CPU operators of the main thread (no device kernels)"
    if not busy_events:
        return {"compute_idle_fraction": None, "measured_on": what}
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in busy_events)
    busy, end = 0.0, -math.inf
    for start, stop in spans:  # the union of the intervals
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    window = max(s for _, s in spans) - spans[0][0]
    return {"compute_idle_fraction": 1 - busy / window if window else 0.0, "measured_on": what}


def trim(events: list[dict], max_bytes: int) -> list[dict]:
    """The longest events whose trace file ({"traceEvents": [...]}) fits in max_bytes (the short
    ones go first): measured after each cut, since the long events carry the longer records."""
    kept = sorted(events, key=lambda e: e.get("dur", 0), reverse=True)
    while kept and (size := len(json.dumps({"traceEvents": kept}))) > max_bytes:
        kept = kept[:int(len(kept) * max_bytes / size * 0.95)]
    return sorted(kept, key=lambda e: e.get("ts", 0))


PARTS = ("tests", "matmul_peak", "resident", "capacity", "memory_by_depth", "trace", "syncs", "eps")


def run(out: str, dry_run: bool = False, parts: tuple[str, ...] = PARTS) -> dict:
    if not dry_run and not torch.cuda.is_available():
        raise ValueError("l2l bench gpu needs a CUDA device (torch.cuda.is_available() is False); "
                         "--dry-run runs it at toy size on the CPU")
    return Campaign(Path(out), dry_run).run(parts)


def format_report(summary: dict) -> str:
    lines = [f"GPU campaign on {summary['device']}{' (dry run)' if summary['dry_run'] else ''}"]
    for name, result in summary["parts"].items():
        brief = {k: v for k, v in result.items() if not isinstance(v, dict) and k != "traceback"}
        lines.append(f"  {name}: {json.dumps(brief)[:300]}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR", help="folder for summary.json, tests.txt and trace.json")
    p.add_argument("--dry-run", action="store_true", help="every part at toy size on the CPU (the relay on the "
                                                          "asynchronous twin): the same files")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="the parts to run (default: all)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run_from_args(args) -> int:
    return print_report(run(args.out, args.dry_run, tuple(args.parts)), args.json, format_report)
