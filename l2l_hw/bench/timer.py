"""The one timer of the benchmarks: variants timed round robin.

A shared machine's speed drifts by tens of percent within seconds (a neighbour's load, its
memory bandwidth). Timing each variant in a block of its own would charge the drift to
whichever ran then; taking turns, one run of each variant per round, charges it to every
variant alike, and a ratio within one round compares two runs a moment apart.
"""
from __future__ import annotations

import time
from typing import Callable


def round_robin(fns: dict[str, Callable[[], object]], rounds: int, warmup: int,
                self_timed: bool = False) -> dict[str, list]:
    """Seconds of each function in each round, in the order of `fns`: `warmup` untimed calls
    of each function first, then `rounds` rounds in which every function runs once, back to
    back. With `self_timed` each function returns its own measure, recorded as it is (its
    seconds: a step that waits for its device, or that times only its work and not its set-up;
    or a record such as a disk pass's GB/s each way); otherwise the call is timed."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if self_timed:
                times[name].append(fn())
                continue
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times
