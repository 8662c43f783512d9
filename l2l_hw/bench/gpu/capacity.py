"""The largest reference GPT each side trains under a device memory cap, searched by probes.

A probe trains a GPT of a given depth for a few steps in a fresh process
(`python -m l2l_hw.bench.gpu.capacity '{json}'`), so that what one probe leaves (the caching
allocator's segments, pinned host buffers, tens of GB of EPS state) cannot help or hurt the
next, and so that the kernel's OOM killer, when the host's memory runs out, ends the probe
and not the campaign (a probe makes itself its first choice: oom_score_adj 1000).

    torch  PyTorch in its leanest form: bf16 autocast, fused AdamW, every block checkpointed,
           micro-batches of one sequence (activation memory of one block for one sequence;
           the state, 16 B per parameter, is what limits it). A probe runs one-sequence
           steps: a longer step of the same micro-batches needs no more memory.
    relay  the relay, full recompute, its stash in host memory (activations="host"), bf16,
           the CPU EPS (fp32 master, m, v and a bf16 working copy): the host's memory limits
           it (the EPS, 14 B per parameter, and the stash, tokens x width x 2 B a layer).
           Built on the meta device and filled layer by layer (never a whole model in fp32
           beside the EPS), with a repeated random tile: the probe measures memory and speed,
           not what the weights learn.

Under CUDA the cap is torch.cuda.set_per_process_memory_fraction and the host's limit its real
memory. In the dry run (CPU) a probe does not fit when its peak resident memory (VmHWM, reset
after its imports) grew by more than a budget: `cap_bytes` for PyTorch, `host_bytes` for the
relay, standing in for the device and for the host's memory.

The search (search()): from a start predicted from the bytes per parameter, double the depth
until a probe does not fit, then bisect until the step between the largest that fits and the
smallest that does not is at most `resolution` of the former (1 layer: exact). A probe that
fails for any other reason than memory fails the search, and with it the part.
"""
from __future__ import annotations

import gc
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

MEMORY_ERRORS = ("out of memory", "can't allocate memory", "cannot allocate memory", "std::bad_alloc")
PROBE_TIMEOUT_S = 300
TILE = 1 << 20  # values in the random tile a relay probe's weights repeat


def search(fits: Callable[[int], dict], start: int, resolution: float = 0.0) -> tuple[int, dict | None, list]:
    """The largest depth that fits, its probe's result, and every probe as (layers, fits, reason)."""
    tries, results = [], {}

    def probe(layers: int) -> bool:
        result = fits(layers)
        tries.append((layers, result["fits"], result.get("reason")))
        results[layers] = result
        return result["fits"]

    lo, hi, n = 0, None, max(1, start)
    while hi is None:
        if probe(n):
            lo, n = n, 2 * n
        else:
            hi = n
    while hi - lo > max(1, int(resolution * lo)):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    return lo, results.get(lo), tries


def run_probe(spec: dict, timeout: float = PROBE_TIMEOUT_S) -> dict:
    """One probe in a fresh process: its result, with fits False where memory stopped it."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "l2l_hw.bench.gpu.capacity", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if done.returncode == -signal.SIGKILL:
        return {"fits": False, "reason": "killed by SIGKILL (the kernel's OOM killer: host memory)",
                "wall_s": time.perf_counter() - t0}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"a {spec['side']} probe of {spec['layers']} layers failed (exit {done.returncode}) for "
                           f"another reason than memory: {done.stderr.strip()[-1500:]}")
    return {**json.loads(lines[-1]), "wall_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------- the probe itself
def _reset_peak() -> int:
    """This process's resident bytes, from which its peak (VmHWM) counts again."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _tiled(shape, tile):
    """A tensor of `shape` filled with `tile` repeated (a copy: the EPS takes it as its own)."""
    n = math.prod(shape)
    return tile.repeat(-(-n // tile.numel()))[:n].view(shape).clone()


def _build(spec: dict):
    """The step function of the probe's side; the model built inside the cap."""
    import torch

    from l2l_hw.bench.gpu.partners import GPTPartner
    from l2l_hw.models import GPTConfig, build_gpt, lm_loss

    cfg = GPTConfig(n_layer=spec["layers"], n_embd=spec["width"], n_head=spec["heads"], block_size=spec["context"],
                    bias=False)
    if spec["side"] == "torch":
        partner = GPTPartner(cfg, torch.device(spec["device"]), "autocast", spec["micro_batches"], checkpointed=True)
        return partner.step, lambda: None
    import l2l_hw

    with torch.device("meta"):
        layers = build_gpt(cfg)
    tile = torch.randn(TILE, generator=torch.Generator().manual_seed(0)) * 0.02

    def init(i, module):
        return {name: _tiled(p.shape, tile) if p.dim() > 1 else torch.ones(p.shape)
                for name, p in module.named_parameters()}

    eps = l2l_hw.make_eps("cpu", optimizer="adamw", lr=1e-4)
    relay = l2l_hw.Relay(layers, lm_loss, eps=eps, init=init, device=spec["relay_device"],
                         micro_batches=spec["micro_batches"], recompute="full", activations="host",
                         precision="bf16")
    return relay.train_step, eps.close


def probe_main(spec: dict) -> dict:
    import torch


    Path("/proc/self/oom_score_adj").write_text("1000")  # the OOM killer's first choice: this probe
    cuda = spec["device"] == "cuda"
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_bytes"] / total))
    g = torch.Generator().manual_seed(0)
    shape = (spec["batch"], spec["context"])
    x, y = torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g)
    if spec["side"] == "torch":
        x, y = x.to(spec["device"]), y.to(spec["device"])
    seconds, close = [], (lambda: None)
    baseline = None
    if not cuda:  # a one-layer model's step first: lazy imports and thread pools are not the model's
        step, close = _build({**spec, "layers": 1})
        step(x, y)
        close()
        del step
        gc.collect()
        baseline = _reset_peak()
    try:
        step, close = _build(spec)
        for _ in range(spec["steps"]):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(x, y)
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not any(m in str(e).lower() for m in MEMORY_ERRORS) and not isinstance(e, MemoryError):
            raise
        return {"fits": False, "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    finally:
        close()
    if baseline is not None:  # the dry run's stand-in for a memory size
        budget = spec["cap_bytes"] if spec["side"] == "torch" else spec["host_bytes"]
        grown = _status_bytes("VmHWM") - baseline
        if grown > budget:
            return {"fits": False, "reason": f"peak resident memory grew by {grown:,} B, over the dry run's budget "
                                             f"of {budget:,} B"}
    return {"fits": True, "seconds": seconds, "peak_rss_bytes": _status_bytes("VmHWM"),
            "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None}


if __name__ == "__main__":
    print(json.dumps(probe_main(json.loads(sys.argv[1]))), flush=True)
