"""The GPU campaign's checks, each able to fail: finite figures, the loss bound, the order of runs, time limits.

    finite       every loss and rate a part reports must be a finite number: a NaN or an inf
                 anywhere fails the part, naming where it is (Python's max() skips a NaN that
                 is not its first argument, so no check here takes a max without looking)
    drift        PyTorch's own run-to-run drift: the largest spread, at one step, between runs
                 of the same PyTorch recipe from the same saved model on the same data (other
                 micro-batch shapes, other knobs: the same sums in another order, bf16's noise)
    loss bound   another method agrees with PyTorch when its largest difference from it, step
                 by step, is at most LOSS_BOUND_FACTOR x the drift (LOSS_BOUND_FLOOR where the
                 drift is below it); a NaN difference never agrees
    alternation  the runs of the methods compared take turns (A B A B ...), `rounds` runs each:
                 a machine that warms up (clocks, caches, the page cache) favours no one
    time limits  a part past its limit is cut (SIGALRM raises Cut in the campaign's thread,
                 where it runs; its child processes are ended by their owners on the way out)
"""
from __future__ import annotations

import contextlib
import math
import signal
import statistics
import time

LOSS_BOUND_FACTOR = 2.0  # another method may differ from PyTorch twice as much as PyTorch from itself
LOSS_BOUND_FLOOR = 1e-3  # nats: below this two curves agree whatever the reference's noise


class CheckFailed(Exception):
    """A figure broke its rule (not finite, outside its bound): the reason, one line."""


class Cut(BaseException):
    """A part ran past its time limit. A BaseException, so that no `except Exception` on the
    way out (a peer's error kept beside the others) takes it for a failure of its own."""


def finite(name: str, values) -> list[float]:
    """`values` as floats; CheckFailed naming the first one that is NaN, inf or not a number."""
    out = []
    for k, v in enumerate(values):
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise CheckFailed(f"{name}[{k}] is {v!r}, not a number") from None
        if not math.isfinite(x):
            raise CheckFailed(f"{name}[{k}] is {x} (not finite)")
        out.append(x)
    return out


def largest(values) -> float:
    """The largest of `values`, NaN when any is NaN (max() keeps whichever comparison wins)."""
    values = list(values)
    if not values:
        raise ValueError("largest() of no values")
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values)


def by_step(trajectories: list[list[float]]) -> dict[int, list[float]]:
    """{step index: the losses every trajectory has there} (trajectories start at step 1)."""
    steps: dict[int, list[float]] = {}
    for losses in trajectories:
        for k, loss in enumerate(losses, 1):
            steps.setdefault(k, []).append(loss)
    return steps


def drift(trajectories: list[list[float]]) -> dict:
    """PyTorch's run-to-run drift: the largest (max - min) at one step over `trajectories` (each a
    run's losses from step 1, from the same saved model and data), where two or more reach it.
    {"drift": float, "steps": how many steps had two runs or more, "runs": trajectories}; NaN
    anywhere gives a NaN drift; CheckFailed where no step has two runs (no reference)."""
    spans = [largest(v) - min(v) if not any(math.isnan(x) for x in v) else math.nan
             for v in by_step(trajectories).values() if len(v) >= 2]
    if not spans:
        raise CheckFailed(f"no step was run twice by PyTorch ({len(trajectories)} run(s)): no drift to bound "
                          "the loss with")
    return {"drift": largest(spans), "steps": len(spans), "runs": len(trajectories)}


def bound(reference_drift: float) -> float:
    return max(LOSS_BOUND_FACTOR * reference_drift, LOSS_BOUND_FLOOR)


def difference(ours: list[list[float]], theirs: list[list[float]]) -> float:
    """The largest |ours - theirs| at one step over every pair of their runs (NaN where any is)."""
    a, b = by_step(ours), by_step(theirs)
    diffs = [abs(x - y) for k in a.keys() & b.keys() for x in a[k] for y in b[k]]
    if not diffs:
        raise CheckFailed("no step in common to compare the losses at")
    return largest(diffs)


def agrees(diff: float, limit: float) -> bool:
    """diff <= limit, False for a NaN (a comparison with NaN is False: kept explicit)."""
    return not math.isnan(diff) and not math.isnan(limit) and diff <= limit


def alternated(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, name) in the order the runs go: every name once per round, A B A B ..."""
    return [(r, name) for r in range(rounds) for name in names]


def median_range(name: str, values) -> dict:
    """{"median", "min", "max", "runs"} of finite values (CheckFailed otherwise)."""
    xs = finite(name, values)
    if not xs:
        raise CheckFailed(f"{name}: no runs")
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": len(xs)}


@contextlib.contextmanager
def time_limit(seconds: float, reason: str):
    """Raise Cut(reason) in this (the main) thread once `seconds` have passed; the previous
    alarm handler and timer come back on the way out."""
    if seconds <= 0:
        raise Cut(reason)

    def cut(signum, frame):
        raise Cut(reason)

    previous = signal.signal(signal.SIGALRM, cut)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Deadline:
    """The command's time limit: what is left of it, and each part's share (its own limit or
    what is left, whichever is sooner)."""

    def __init__(self, total_s: float, part_s: float):
        self.total_s, self.part_s, self.start = total_s, part_s, time.monotonic()

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.start)

    def for_part(self, name: str) -> tuple[float, str]:
        left = self.left()
        if left <= self.part_s:
            return left, (f"the command's time limit ({self.total_s:g} s) ran out in {name}" if left > 0 else
                          f"not started: the command's time limit ({self.total_s:g} s) was spent")
        return self.part_s, f"{name} ran past its limit of {self.part_s:g} s"
