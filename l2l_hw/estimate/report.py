"""The verdict: a run's figures against a machine (shortfalls), the largest context, micro-batch
and state format that fit, the flags that make a run fit (fit_options, ways_to_fit), and the
estimate in words (describe). estimate() and check_fits() are the entry points."""
from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from l2l_hw.estimate.footprint import Estimate, needs
from l2l_hw.estimate.host import import_what_the_run_imports
from l2l_hw.estimate.machine import available, available_disk, rss_bytes
from l2l_hw.estimate.step_time import measure_step
from l2l_hw.estimate.trace import run_model


class NotEnoughMemory(ValueError):
    """A run this machine cannot hold; the message names what is short (one line)."""


STATE_FORMATS_BY_PRECISION = ("fp32", "bf16", "8bit")  # the optimizer state's formats, most exact first


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:,.1f} MiB"


def shortfalls(e: Estimate, have: dict[str, int | None], cfg) -> list[str]:
    """What does not fit, one phrase each ("host memory: 31.2 GiB needed, 23.1 GiB available")."""
    short = []
    if have.get("host") is not None and e.host_bytes > have["host"]:
        short.append(f"host memory: {_gib(e.host_bytes)} needed, {_gib(have['host'])} available")
    if have.get("device") is not None and e.device_bytes > have["device"]:
        short.append(f"device memory ({cfg.device}): {_gib(e.device_bytes)} needed, {_gib(have['device'])} free")
    state_dir = e.disk.get("state_dir", 0)
    same_disk = cfg.state_dir is not None and cfg.out is not None and _same_fs(cfg.state_dir, cfg.out)
    out_need = e.disk_bytes - (0 if not cfg.state_dir or same_disk else state_dir)
    if have.get("disk") is not None and out_need > have["disk"]:
        short.append(f"disk at {cfg.out}: {_gib(out_need)} needed, {_gib(have['disk'])} free")
    if cfg.state_dir is not None and not same_disk and have.get("state_dir_disk") is not None \
            and state_dir > have["state_dir_disk"]:
        short.append(f"disk at {cfg.state_dir}: {_gib(state_dir)} needed, {_gib(have['state_dir_disk'])} free")
    return short


def _same_fs(a, b) -> bool:
    def device(p):
        p = Path(p).expanduser().resolve()
        while not p.exists() and p != p.parent:
            p = p.parent
        return p.stat().st_dev
    return device(a) == device(b)


def memory_fits(cfg, baseline: int, have: dict) -> bool:
    e = needs(cfg, baseline)
    return not [s for s in shortfalls(e, have, cfg) if not s.startswith("disk")]


def largest(cfg, baseline: int, have: dict, run_limit: int | None) -> dict:
    """The largest context, micro-batch (fewest micro-batches) and most exact optimizer state
    format that fit this machine's memory, each with the run's other options as given (None:
    not even the smallest fits)."""
    out = {}
    fits = lambda **change: memory_fits(dataclasses.replace(cfg, **change), baseline, have)
    low, high = 0, run_limit or 1 << 20  # largest fitting context: a bisection
    while low < high:
        mid = (low + high + 1) // 2
        if fits(context=mid):
            low = mid
        else:
            high = mid - 1
    out["context"] = low or None
    out["micro_batches"] = next((u for u in range(1, cfg.batch_size + 1) if cfg.batch_size % u == 0
                                 and fits(micro_batches=u)), None)
    allowed = [f for f in STATE_FORMATS_BY_PRECISION if not (cfg.shard_state and f != "fp32")]
    out["optimizer_state"] = next((f for f in allowed if fits(optimizer_state=f)), None)
    return out


def fit_options(cfg) -> list[tuple[str, dict]]:
    """The flags that lower what a run needs, each with its change to cfg, cheapest first: 8-bit
    optimizer state (7.9 B less a parameter, a quantised m and v), a bf16 working copy, the state on
    disk (host memory for groups in flight only; disk traffic each step), activations on the host
    (device memory; transfers each step), no checkpoint (no disk for one; no resume)."""
    options = []
    if cfg.optimizer_state != "8bit" and not cfg.shard_state:
        options.append(("--optimizer-state 8bit", {"optimizer_state": "8bit"}))
    if cfg.precision == "fp32":
        options.append(("--precision bf16", {"precision": "bf16"}))
    if cfg.state_dir is None and cfg.eps_backend in ("cpu", "golden") and not cfg.shard_state:
        options.append(("--state-dir DIR", {"state_dir": str(Path(cfg.out or ".") / "state")}))
    if cfg.device.startswith("cuda") and cfg.activations == "device":
        options.append(("--activations host", {"activations": "host"}))
    if cfg.save and cfg.out is not None:
        options.append(("--no-save", {"save": False}))
    return options


def ways_to_fit(cfg, baseline: int, have: dict) -> list[dict]:
    """Where the run does not fit: the fewest of fit_options' flags that make it fit (host, device
    and disk), each way with what it needs, cheapest first; [] where none does."""
    options = fit_options(cfg)
    for n in range(1, len(options) + 1):
        ways = []
        for chosen in itertools.combinations(options, n):
            change = {k: v for _, c in chosen for k, v in c.items()}
            changed = dataclasses.replace(cfg, **change)
            e = needs(changed, baseline)
            if not shortfalls(e, {**have, **available_disk(changed, have)}, changed):
                ways.append({"flags": [flag for flag, _ in chosen], "host_bytes": e.host_bytes,
                             "disk_bytes": e.disk_bytes, "device_bytes": e.device_bytes})
        if ways:
            return ways
    return []


def estimate(cfg, *, measure: bool = False, search: bool = False, host_memory: int | None = None,
             disk: int | None = None) -> Estimate:
    """What the run of `cfg` needs, and whether it fits this machine (module docstring), or one
    with `host_memory` and `disk` free. search: also the largest context, micro-batch and state
    format that fit, and where the run does not fit, the flags that would make it; measure: the
    step time, from a profile of one layer of each kind."""
    import_what_the_run_imports(cfg)
    have = available(cfg, 0)  # the device's context exists before the baseline is read
    baseline = rss_bytes()
    have = available(cfg, baseline, host_memory, disk)
    e = needs(cfg, baseline)
    e.available = have
    e.shortfall = shortfalls(e, have, cfg)
    e.fits = not e.shortfall
    if search:
        limit = run_model(cfg).max_context
        e.largest = largest(cfg, baseline, have, limit)
        if not e.fits:
            e.ways_to_fit = ways_to_fit(cfg, baseline, have)
    if measure:
        e.step_s, e.profile = measure_step(cfg)
    return e


def check_fits(cfg) -> None:
    """Refuse a run that this machine cannot hold, before anything is loaded: NotEnoughMemory, one
    line naming each shortfall and what the run needs (l2l estimate says more)."""
    e = estimate(cfg)
    if e.fits:
        return
    raise NotEnoughMemory(f"the run does not fit this machine: {'; '.join(e.shortfall)} (l2l estimate with the "
                          "same flags breaks it down, and names the options that would make it fit)")


# ---------------------------------------------------------------------------- in words
HOST_PARTS = {"baseline": "this process (Python, torch, transformers)", "eps": "EPS state",
              "buffers": "layer buffers", "libraries": "libraries' buffers", "data": "data", "tokenizer": "tokenizer",
              "build": "building the model", "step": "the steps' activations and gradients",
              "end": "the model gathered or saved at the end"}


def describe(e: Estimate, cfg, explain: bool = False) -> str:
    """The estimate as `l2l estimate` prints it; `explain`: then each stage's step, action by action
    (relay/actions.py), with the device bytes the replay holds after each."""
    millions = lambda n: f"{n / 1e6:,.1f} M" if n < 1e9 else f"{n / 1e9:,.2f} B"
    lines = [f"{e.model}: {millions(e.parameters)} parameters ({millions(e.trained)} trained), device {e.device}"
             + (f", {e.ranks} ranks" if e.ranks > 1 else "")]
    parts = ", ".join(f"{HOST_PARTS.get(k, k)} {_gib(v)}" for k, v in e.host.items() if v)
    each = f" ({_gib(sum(e.host.values()))} the largest rank)" if e.ranks > 1 else ""
    lines.append(f"host memory   {_gib(e.host_bytes)} at the peak{each}: {parts}")
    disk = []
    if "state_dir" in e.disk:
        disk.append(f"--state-dir {cfg.state_dir} {_gib(e.disk['state_dir'])}")
    if "checkpoint" in e.disk:
        disk.append(f"each checkpoint {_gib(e.disk['checkpoint'])} (two while one replaces the other)")
    if "model" in e.disk:
        disk.append(f"the saved model {_gib(e.disk['model'] // 2)} (two while one replaces the other)")
    if e.disk.get("tokens"):
        disk.append(f"tokens {_gib(e.disk['tokens'])}")
    lines.append(f"disk          {_gib(e.disk_bytes)}" + (f": {', '.join(disk)}" if disk else " (nothing written)"))
    source = ("the relay's accounting" if len(e.stages) == 1 else "the 1F1B stage's accounting") + (
        "" if not e.device.startswith("cuda") else ", without the allocator's transients")
    for s, stage in enumerate(e.stages):
        name = "device" if len(e.stages) == 1 else f"stage {s}"
        first, end = stage["layers"]
        lines.append(f"{name:<13} {_gib(stage['device_bytes'])} peak on {e.device} ({source}; activations kept "
                     f"{_gib(stage['kept_activation_bytes'])}), layers {first} to {end - 1}")
    have = e.available
    machine = [f"host {_gib(have['host'])} available" if have.get("host") is not None else None,
               f"disk {_gib(have['disk'])} free at {cfg.out}" if have.get("disk") is not None else None,
               f"device {_gib(have['device'])} free" if have.get("device") is not None else None]
    verdict = "fits" if e.fits else "does not fit: " + "; ".join(e.shortfall)
    lines.append(f"this machine  {', '.join(m for m in machine if m)}: {verdict}")
    if e.largest:
        big = e.largest
        lines.append("largest that fits this machine's memory (the rest as given): "
                     f"context {big['context'] or 'none'}, micro-batches "
                     f"{big['micro_batches'] or 'none'} (of batch {cfg.batch_size}), optimizer state "
                     f"{big['optimizer_state'] or 'none'}")
    if e.ways_to_fit:
        lines.append("fits with     " + "; or ".join(
            f"{' '.join(w['flags'])} (host {_gib(w['host_bytes'])}, disk {_gib(w['disk_bytes'])}"
            + ("; no checkpoint and no saved model: a trial only" if "--no-save" in w["flags"] else "")
            + (f", device {_gib(w['device_bytes'])}" if e.device.startswith("cuda") else "") + ")"
            for w in e.ways_to_fit))
    elif not e.fits and e.largest:
        tried = ", ".join(flag for flag, _ in fit_options(cfg))
        lines.append(f"fits with     {'none of ' + tried if tried else 'no option'}: a smaller model, context or batch")
    if e.step_s is not None:
        p = e.profile
        lines.append(f"step time     {e.step_s:.3g} s (measured profile: compute {p['compute_s']:.3g} s, EPS updates "
                     f"{p['update_s']:.3g} s {p['updates']})")
    for s, actions in enumerate(e.schedules if explain else []):
        lines.append(f"{'the step' if len(e.schedules) == 1 else f'stage {s} step'}, action by action (device "
                     "memory after each; the peak falls inside an action):")
        lines += [f"  {action:<28} {_gib(nbytes)}" for action, nbytes in actions]
    return "\n".join(lines)
