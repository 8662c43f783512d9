"""`l2l bench overlap`: does the EPS's optimizer update hide under the device's compute?

A model whose device compute is a sleep trains through the relay on the asynchronous twin of
a device ("cpu-async"; --device cuda for a GPU) with the real CPU EPS (make_eps("cpu"): fp32
AdamW in the host kernel). Each of --layers layers holds one fp32 weight of --params elements
and sleeps t per forward and 2t per backward of a micro-batch (time.sleep holds no core and
releases the GIL, as a GPU kernel does); its gradient is a full-size tensor, made once a step
(by the last micro-batch's backward: the sum over micro-batches is the device's work), so the
update is of the full size. t is set first, so that the compute alone of a step at the largest
of --micro-batches is --compute-ratio times the update alone (both measured; t is searched for,
the compute being more than the sleeps: the relay's own work, each sleep's wake-up): the
compute grows with the micro-batches, from under the update to over it. Per micro-batch
count, four variants take turns round by round (l2l_hw/bench/timer.py), each figure the
median of its --steps timed rounds after --warmup, with its [min, max]:

    update    the update alone: every layer's gradient pushed to the step variant's EPS,
              last layer first as the relay does, and commit_step() waited for; no relay
    compute   the compute alone: the same relay, schedule and sleeps with 1-element weights
    step      the relay's step with the real EPS, overlapped as the EPS does it today
    inline    the same relay with every update run on the caller's thread as it is pushed
              (eps.configure(inline=True) after the relay is built): compute plus update,
              nothing hidden. The bench checks which thread ran each update's kernel.
    shared    the step with the device share the planner picks (l2l_hw/relay/device_share.py:
              the first k layers updated by PyTorch's fused AdamW on the device), from this
              row's compute alone (timed first), the update alone and the device's own AdamW

A step and an inline step are timed as in training: each right after an untimed step of its
own relay, so it begins with its predecessor's updates under way (none where commit_step is a
barrier) and ends when train_step returns; the updates it leaves running are then waited for,
untimed (`step_drain_s`, their median), so that none runs into another variant's turn. From
the medians:

    efficiency   (inline - step) / min(compute, update): the share of the smaller of the two
                 the overlap hid (1: all of it, 0: none)
    vs_bound     step / max(compute, update): 1 is the best a step can do
    device_wait  max(0, step - compute) / step: the share of the step the device waited
    shared_wait  the same of the shared step, its k layers' device updates counted as compute
                 (the fused AdamW timed alone)

On the twin, the relay's per-element work besides the update (the weights' copies up, the
gradients' copies down, the twin's poisoning of every destination and of every staging buffer
given back, the gradient's fill) runs on the host's cores too; the compute variant, with
1-element weights, has none of it. It falls on step and inline alike: efficiency subtracts it,
vs_bound and device_wait count it against the overlap.
"""
from __future__ import annotations

import ctypes
import math
import os
import statistics
import sys
import threading
import time
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

import l2l_hw
from l2l_hw.bench import print_report
from l2l_hw.bench.timer import round_robin
from l2l_hw.relay.device_share import device_free_bytes, plan_device_share, time_device_update
from l2l_hw.relay.transport import torch_device

LAYERS, PARAMS = 16, 1_500_000
MICRO_BATCHES = (1, 2, 4, 8)
COMPUTE_RATIO = 3.5  # compute / update at the largest micro-batch count (issue 57, point 5)
STEPS, WARMUP = 6, 2
CALIBRATION_REPEATS = 3  # timed updates alone, or compute steps, after one untimed: a median behind t
CALIBRATION_ROUNDS = 4  # interpolations of t inside its bracket, at most
CALIBRATION_TOLERANCE = 0.05  # ... until the compute is this close to its target (a shared machine's noise)
FEATURES = 4  # columns of the input: the activations cost nothing beside the sleeps
SHORTEST_T = 1e-6  # the shortest t tried: the sleeps stay (where the target is under the compute there)
TIMER_SLACK_NS = 1  # Linux wakes a sleeper up to its timer slack late (50 us by default; ~100 us past t measured
                    # here, ~35 us with 1 ns): a kernel on a device ends when it ends
GRAD = 1e-3  # every element of every gradient: AdamW's steps stay small
LR, SEED = 1e-3, 0
VARIANTS = ("update", "compute", "step", "inline", "shared")


class Clock:
    """The sleeps of the bench's models: `t_fwd` seconds per forward of a layer on one
    micro-batch (a backward sleeps twice that), and `units` of t slept so far (counted with
    t = 0 too: how many a step takes)."""

    def __init__(self):
        self.t_fwd = 0.0
        self.units = 0

    def sleep(self, units: int) -> None:
        self.units += units
        if self.t_fwd > 0:
            time.sleep(units * self.t_fwd)


class _Sleep(torch.autograd.Function):
    """The device compute of a layer: a sleep, with an output that depends on the weight at
    O(1) cost per element of the input, and a full-size gradient of the weight from the
    backward of the layer's last micro-batch (None from the others: on a device the sum over
    micro-batches is a kernel of the compute; on the twin it would be host work beside the
    update that the compute variant lacks)."""

    @staticmethod
    def forward(ctx, x, weight, layer):
        layer.clock.sleep(1)
        ctx.layer = layer
        ctx.weight_like = (weight.shape, weight.dtype, weight.device)
        return x + weight[0]  # (u_j, FEATURES)

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        layer.clock.sleep(2)
        layer.backwards += 1
        if layer.backwards % layer.micro_batches:
            return grad, None, None
        shape, dtype, device = ctx.weight_like
        return grad, torch.full(shape, GRAD, dtype=dtype, device=device), None


class SleepLayer(nn.Module):
    """One fp32 weight of `params` elements; the relay runs its backward on `micro_batches`
    micro-batches per step."""

    def __init__(self, params: int, clock: Clock, micro_batches: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(params))
        self.clock, self.micro_batches = clock, micro_batches
        self.backwards = 0

    def forward(self, x):
        return _Sleep.apply(x, self.weight, self)


def mean_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


@contextmanager
def precise_sleeps():
    """This thread's sleeps end on time, not up to 50 us late (Linux's timer slack; elsewhere
    nothing changes)."""
    if not sys.platform.startswith("linux"):
        yield
        return
    pr_set_timerslack, pr_get_timerslack = 29, 30  # <linux/prctl.h>
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    previous = prctl(pr_get_timerslack, 0, 0, 0, 0)
    if previous < 0 or prctl(pr_set_timerslack, TIMER_SLACK_NS, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_TIMERSLACK) failed")
    try:
        yield
    finally:
        prctl(pr_set_timerslack, previous, 0, 0, 0)


def _relay(layers: int, params: int, micro_batches: int, clock: Clock, device: str, share: int = 0) -> l2l_hw.Relay:
    eps = l2l_hw.make_eps("cpu", optimizer="adamw", lr=LR)
    try:
        model = [SleepLayer(params, clock, micro_batches) for _ in range(layers)]
        return l2l_hw.Relay(model, mean_loss, eps=eps, device=device, micro_batches=micro_batches,
                            device_update_layers=share)
    except BaseException:
        eps.close()
        raise


def watch_update_threads(eps) -> set[str]:
    """The threads that run `eps`'s update kernel from now on, filled in as they run:
    "caller" (this thread) or "worker" (any other)."""
    seen: set[str] = set()
    caller, run = threading.current_thread(), eps.kernel.run

    def watched(*args, **kwargs):
        seen.add("caller" if threading.current_thread() is caller else "worker")
        return run(*args, **kwargs)

    eps.kernel.run = watched
    return seen


def _update_alone(eps):
    """One update of every group of `eps` (last layer first, as the relay pushes), waited for:
    its seconds. The gradients are made once, outside the timing."""
    grads = {key: {name: torch.full(shape, GRAD) for name, shape in names.items()}
             for key, names in reversed(list(eps.shapes.items()))}

    def update() -> float:
        t0 = time.perf_counter()
        for key, group in grads.items():
            eps.push_grads(key, group)
        eps.commit_step()
        return time.perf_counter() - t0

    return update


def _timed_step(relay: l2l_hw.Relay, x, y, drains: list[float] | None = None, steady: bool = False):
    """One step of `relay`: its seconds. `steady`: right after an untimed one, so it begins with
    its predecessor's updates under way, as in training (with a barrier at commit there are none).
    Then, untimed, the wait for the updates it left running (appended to `drains`), so that
    they run into no other variant's turn."""

    def train_step() -> None:
        loss = relay.train_step(x, y)
        if not math.isfinite(loss):  # the twin's poison: a transfer used before it landed
            raise RuntimeError(f"l2l bench overlap: a step's loss is {loss} (a missing wait in the relay or the EPS?)")

    def step() -> float:
        if steady:
            train_step()
        t0 = time.perf_counter()
        train_step()
        t1 = time.perf_counter()
        relay.eps.wait()
        if drains is not None:
            drains.append(time.perf_counter() - t1)
        return t1 - t0

    return step


def _batch(micro_batches: int):
    x = torch.randn(micro_batches, FEATURES, generator=torch.Generator().manual_seed(SEED))  # one row per micro-batch
    return x, torch.zeros(micro_batches, 1)


def _device(device: str) -> str:
    if device == "cpu-async":
        return device
    if torch.device(device).type != "cuda":
        raise ValueError(f"--device {device}: the bench runs on cpu-async (the twin) or cuda[:N]")
    if not torch.cuda.is_available():
        raise RuntimeError(f"--device {device}: no CUDA device here")
    return device


def _describe(device: str) -> str:
    if device == "cpu-async":
        return f"cpu-async (the CUDA twin on the CPU, {len(os.sched_getaffinity(0))} cores)"
    return torch.cuda.get_device_name(torch.device(device))


def run(layers: int = LAYERS, params: int = PARAMS, micro_batches=MICRO_BATCHES, compute_ratio: float = COMPUTE_RATIO,
        steps: int = STEPS, warmup: int = WARMUP, device: str = "cpu-async") -> dict:
    device = _device(device)
    micro_batches = tuple(micro_batches)
    clock = Clock()  # one t for every model: set once, after the calibration
    report = {"device": _describe(device),
              "model": {"layers": layers, "params_per_layer": params, "features": FEATURES, "optimizer": "adamw",
                        "eps": "cpu"},
              "compute_ratio": compute_ratio, "steps": steps, "warmup": warmup, "rows": []}
    with precise_sleeps():
        for n, u in enumerate(micro_batches):
            report["rows"].append(_measure(u, layers, params, clock, device, steps, warmup, report if n == 0 else None,
                                           max(micro_batches), compute_ratio))
    return report


def _measure(u: int, layers: int, params: int, clock: Clock, device: str, steps: int, warmup: int,
             calibrate: dict | None, reference: int, ratio: float) -> dict:
    """The row of `u` micro-batches: its three relays built, the four variants timed in turns.
    Given `calibrate` (the report), t is set first (_calibrate) on this row's EPS."""
    with ExitStack() as stack:
        relays = {name: stack.enter_context(_relay(layers, 1 if name == "compute" else params, u, clock, device))
                  for name in ("compute", "step", "inline")}
        relays["inline"].eps.configure(inline=True)
        threads = {name: watch_update_threads(relays[name].eps) for name in ("step", "inline")}
        x, y = _batch(u)
        update = _update_alone(relays["step"].eps)
        if calibrate is not None:
            calibrate["calibration"] = _calibrate(clock, update, layers, reference, ratio, device)
        drains: list[float] = []
        fns = {"update": update, "compute": _timed_step(relays["compute"], x, y),
               "step": _timed_step(relays["step"], x, y, drains, steady=True),
               "inline": _timed_step(relays["inline"], x, y, steady=True)}
        plan, device_update_s = _plan_share(fns["compute"], update, layers, params, device)
        relays["shared"] = stack.enter_context(_relay(layers, params, u, clock, device, plan.layers))
        fns["shared"] = _timed_step(relays["shared"], x, y, steady=True)
        times = round_robin(fns, steps, warmup, self_timed=True)
        if threads["inline"] != {"caller"}:
            raise RuntimeError(f"l2l bench overlap: eps.configure(inline=True) left the updates on "
                               f"{sorted(threads['inline'])} threads, not only the caller's")
        return _row(u, times, drains[-steps:], threads, plan, plan.layers * params * device_update_s)


def _plan_share(compute, update, layers: int, params: int, device: str):
    """The planner's device share for this row, from the compute alone and the update alone (medians
    of a few, timed here) and the device's fused AdamW per parameter; with that per parameter."""
    compute_s = statistics.median(compute() for _ in range(CALIBRATION_REPEATS))
    update_s = statistics.median(update() for _ in range(CALIBRATION_REPEATS))
    dev = torch_device(device)
    per_parameter = time_device_update(dev)
    plan = plan_device_share([params] * layers, compute_s, update_s / (layers * params), per_parameter,
                             device_free_bytes(dev))
    return plan, per_parameter


def _calibrate(clock: Clock, update, layers: int, reference: int, ratio: float, device: str) -> dict:
    """Set t so that the compute alone of a step at `reference` micro-batches is `ratio` times the
    update alone (timed first, median of a few), on a compute relay of its own. That compute is
    the step's sleeps plus the relay's own work and each sleep's wake-up past its time, which
    is not linear in t (short sleeps wake sooner), so t is searched for: between the shortest
    sleeps (SHORTEST_T) and target / sleeps (over the target: a sleep never ends early), by
    interpolation inside the bracket. Where the compute at the shortest sleeps is over the
    target already, t stays there (`reached` false)."""
    update()  # untimed: the first touch of the EPS's state
    update_s = statistics.median(update() for _ in range(CALIBRATION_REPEATS))
    target = ratio * update_s
    x, y = _batch(reference)
    with _relay(layers, 1, reference, clock, device) as relay:
        step = _timed_step(relay, x, y)

        def compute_at(t: float) -> tuple[float, float]:
            clock.t_fwd = t
            step()  # untimed: the first at this t
            return t, statistics.median(step() for _ in range(CALIBRATION_REPEATS))

        clock.t_fwd, clock.units = 0.0, 0
        step()
        sleeps = clock.units  # units of t in one step
        low, high = compute_at(SHORTEST_T), compute_at(max(target / sleeps, SHORTEST_T))
        points, reached = [low, high], low[1] < target
        while reached and len(points) < 2 + CALIBRATION_ROUNDS and high[1] > low[1]:
            t = low[0] + (target - low[1]) * (high[0] - low[0]) / (high[1] - low[1])
            points.append(compute_at(t))
            if abs(points[-1][1] - target) <= CALIBRATION_TOLERANCE * target:
                break
            low, high = (points[-1], high) if points[-1][1] < target else (low, points[-1])
    t, compute_s = min(points, key=lambda p: abs(p[1] - target))
    clock.t_fwd = t
    return {"update_s": update_s, "reference_micro_batches": reference, "target_compute_s": target,
            "sleeps_per_micro_batch": sleeps / reference, "t_fwd_s": t, "compute_s": compute_s, "reached": reached,
            "points": [list(p) for p in points]}


def _row(u: int, times: dict[str, list[float]], drains: list[float], threads: dict[str, set[str]], plan,
         device_update_s: float) -> dict:
    m = {name: statistics.median(times[name]) for name in VARIANTS}
    return {"micro_batches": u, **{f"{name}_s": m[name] for name in VARIANTS},
            "step_drain_s": statistics.median(drains),
            "spread_s": {name: [min(times[name]), max(times[name])] for name in VARIANTS},
            "efficiency": (m["inline"] - m["step"]) / min(m["compute"], m["update"]),
            "vs_bound": m["step"] / max(m["compute"], m["update"]),
            "device_wait": max(0.0, m["step"] - m["compute"]) / m["step"],
            "shared_layers": plan.layers, "shared_plan": plan.reason,
            "shared_wait": max(0.0, m["shared"] - m["compute"] - device_update_s) / m["shared"],
            "update_threads": {name: sorted(seen) for name, seen in threads.items()}}


def format_report(r: dict) -> str:
    m, c = r["model"], r["calibration"]
    lines = [f"EPS update under the device's compute on {r['device']}: {m['layers']} layers x "
             f"{m['params_per_layer'] / 1e6:.2f} M fp32 params, AdamW on the host kernel; t_fwd "
             f"{c['t_fwd_s'] * 1e3:.3f} ms (compute {r['compute_ratio']}x the update's {c['update_s'] * 1e3:.1f} ms at "
             f"{c['reference_micro_batches']} micro-batches"
             + ("" if c["reached"] else f": not reached, {c['compute_s'] * 1e3:.1f} ms at the shortest sleeps")
             + f"); ms, median of {r['steps']} steps [min - max]",
             f"  {'u':>3}" + "".join(f"{v:>20}" for v in VARIANTS) + f"{'effic.':>8}{'vs bound':>9}{'dev wait':>9}"
             f"{'k':>4}{'wait k':>8}  updates on"]
    for row in r["rows"]:
        low, high = ({v: row["spread_s"][v][k] * 1e3 for v in VARIANTS} for k in (0, 1))
        cells = "".join(f"{row[f'{v}_s'] * 1e3:>8.1f} [{low[v]:.1f}-{high[v]:.1f}]".rjust(20) for v in VARIANTS)
        lines.append(f"  {row['micro_batches']:>3}{cells}{row['efficiency']:>8.2f}{row['vs_bound']:>9.2f}"
                     f"{row['device_wait']:>9.2f}{row['shared_layers']:>4}{row['shared_wait']:>8.2f}"
                     f"  step: {'+'.join(row['update_threads']['step'])}, "
                     f"inline: {'+'.join(row['update_threads']['inline'])}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--layers", type=int, default=LAYERS, help=f"layers of the model (default {LAYERS})")
    p.add_argument("--params", type=float, default=PARAMS,
                   help=f"fp32 elements of each layer's weight (default {PARAMS:.2g})")
    p.add_argument("--micro-batches", type=int, nargs="+", default=list(MICRO_BATCHES),
                   help=f"micro-batch counts, one row each (default {' '.join(map(str, MICRO_BATCHES))})")
    p.add_argument("--compute-ratio", type=float, default=COMPUTE_RATIO,
                   help="one step's compute at the largest micro-batch count over the update alone "
                        f"(default {COMPUTE_RATIO})")
    p.add_argument("--steps", type=int, default=STEPS, help=f"timed rounds per micro-batch count (default {STEPS})")
    p.add_argument("--warmup", type=int, default=WARMUP, help=f"untimed steps of each variant first (default {WARMUP})")
    p.add_argument("--device", default="cpu-async", help="cpu-async (the twin) or cuda[:N] (default cpu-async)")


def run_from_args(args) -> int:
    for name in ("layers", "params", "steps", "compute_ratio"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"l2l bench overlap: --{name.replace('_', '-')} {getattr(args, name)}: must be > 0")
    if args.warmup < 0 or min(args.micro_batches) < 1:
        raise SystemExit("l2l bench overlap: --warmup must be >= 0 and every --micro-batches >= 1")
    if args.params != int(args.params):
        raise SystemExit(f"l2l bench overlap: --params {args.params}: must be a whole number")
    try:
        _device(args.device)
    except (ValueError, RuntimeError) as e:  # a device this bench cannot run on: one line, exit 1
        raise SystemExit(f"l2l bench overlap: {e}") from None
    return print_report(run(layers=args.layers, params=int(args.params), micro_batches=args.micro_batches,
                            compute_ratio=args.compute_ratio, steps=args.steps, warmup=args.warmup,
                            device=args.device), args.json, format_report)
