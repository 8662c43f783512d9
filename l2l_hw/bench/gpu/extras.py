"""The first GPU campaign's parts (H200, 2026-11-26), kept for `l2l bench gpu --parts ...`.

    memory_by_depth  the relay's peak device memory at 12, 24 and 48 layers (activations="host")
    trace            a torch.profiler trace of capped relay steps (DIR/trace.json, trimmed to
                     16 MiB) and the fraction of the step the compute stream is idle; again with
                     fewer cores for the EPS's host kernel (idle_by_eps_threads). The profiler's
                     own messages go to DIR/log.txt, not the terminal.
    syncs            blocking host-device transfers per step (the transport's count, and CUDA's
                     sync debug mode's warnings)
    eps              `l2l bench eps` on this machine's host cores (DeepSpeedCPUAdam beside it)
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import warnings

import torch

DEPTHS = {False: (12, 24, 48), True: (2, 4, 8)}  # real, dry run
EPS_ELEMENTS = {False: 2**25, True: 2**16}
TRACE_STEPS = 2


@contextlib.contextmanager
def capped(c):
    """The device memory cap: CUDA's own; none in the dry run (the twin is the host)."""
    if c.device.type == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, c.cap_bytes / total))
    try:
        yield
    finally:
        if c.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0)


@contextlib.contextmanager
def output_to(path):
    """This process's stdout and stderr (file descriptors 1 and 2: C++ writes there too) into `path`."""
    saved = [os.dup(1), os.dup(2)]
    with open(path, "ab") as f:
        for fd in (1, 2):
            os.dup2(f.fileno(), fd)
        try:
            yield
        finally:
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)


def peak_bytes(c, relay) -> int:
    if c.device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return relay.memory_report()["peak_bytes"]


def memory_by_depth(c) -> dict:
    out = {}
    x, y = c.batch(c.sizes.micro_batch * c.sizes.capacity_micro_batches)
    for layers in DEPTHS[c.dry_run]:
        c.free()
        relay = c.relay(c.gpt(layers), c.sizes.capacity_micro_batches, recompute="full", activations="host",
                        account_memory=True)
        relay.train_step(x, y)
        out[str(layers)] = {"peak_device_bytes": peak_bytes(c, relay),
                            "parameters": sum(math.prod(s) for g in relay.eps.shapes.values() for s in g.values())}
        c.say(f"memory_by_depth: {layers} layers, peak device {out[str(layers)]['peak_device_bytes']:,} B")
        del relay
    return out


def trace(c) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cfg = c.gpt(2 * c.sizes.resident_layers)
    x, y = c.batch(c.sizes.capacity_batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if c.device.type == "cuda" else [])
    result, idle_by_threads = {"layers": cfg.n_layer, "steps_profiled": TRACE_STEPS}, {}
    # The relay's default, then fewer cores for the host kernel, more left to the threads that
    # launch the kernels (the relay's and autograd's): whether the host kernel starves them.
    cores = len(os.sched_getaffinity(0))
    for threads in dict.fromkeys((None, max(1, cores // 2))):
        with capped(c):
            relay = c.relay(cfg, c.sizes.capacity_micro_batches, recompute="full", activations="host",
                            threads=threads)
            relay.train_step(x, y)  # warm-up
            with output_to(c.out / "log.txt"), profile(activities=activities) as prof:
                for _ in range(TRACE_STEPS):
                    relay.train_step(x, y)
        path = c.out / ".trace.raw.json"
        with output_to(c.out / "log.txt"):
            prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
        path.unlink()
        idle = compute_idle_fraction(events)
        idle_by_threads[str(relay.eps.kernel.threads)] = idle["compute_idle_fraction"]
        c.say(f"trace: compute stream idle {idle['compute_idle_fraction']:.3f} with the host kernel on "
              f"{relay.eps.kernel.threads} threads ({idle['measured_on']})")
        if threads is None:  # the relay as it runs by default: its figure and its trace
            events = trim(events, c.max_file_bytes)
            c.write("trace.json", json.dumps({"traceEvents": events}))
            result.update({**idle, "eps_threads": relay.eps.kernel.threads, "events_kept": len(events)})
        del relay, prof, events
        c.free()
    return {**result, "idle_by_eps_threads": idle_by_threads}


def syncs(c) -> dict:
    relay = c.relay(c.gpt(c.sizes.resident_layers), c.sizes.capacity_micro_batches, recompute="full")
    x, y = c.batch(c.sizes.capacity_batch)
    relay.train_step(x, y)
    counts, warned = [], []
    for _ in range(3):
        before = relay.transport.blocking
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if c.device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                relay.train_step(x, y)
            finally:
                if c.device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        counts.append(relay.transport.blocking - before)
        warned.append(sum("synchroniz" in str(w.message) for w in caught))
    c.say(f"syncs: blocking transfers per step {counts}, CUDA sync warnings {warned}")
    return {"transport_blocking_per_step": counts, "cuda_sync_warnings_per_step": warned}


def eps(c) -> dict:
    from l2l_hw.bench import eps as eps_bench

    # found, not imported: importing it here would pick the CUDA accelerator before eps sets
    # DS_ACCELERATOR=cpu for DeepSpeedCPUAdam
    with_deepspeed = not c.dry_run and importlib.util.find_spec("deepspeed") is not None
    return eps_bench.run(n=EPS_ELEMENTS[c.dry_run], repeats=3, deepspeed=with_deepspeed)


def overlap(c) -> dict:
    """`l2l bench overlap` on the device (the twin in the dry run): the host update under the
    compute at 1, 2, 4 and 8 micro-batches, and the planned device share's wait (issue 57)."""
    from l2l_hw.bench import overlap as overlap_bench

    if c.dry_run:
        return overlap_bench.run(layers=4, params=100_000, micro_batches=(1, 2), compute_ratio=5.0, steps=2, warmup=1)
    return overlap_bench.run(device="cuda")


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
