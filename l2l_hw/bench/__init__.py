"""Benchmarks behind `l2l bench`; each returns a JSON-able report.

Every benchmark module has a docstring (its first paragraph is its `--help` description),
`add_arguments(parser)` and `run_from_args(args)`; l2l_hw/cli.py lists them in BENCHES. The GPU
campaign is a package of its own, l2l_hw/bench/gpu/ (its command: gpu/campaign.py).
"""
from __future__ import annotations

import json
from typing import Callable, Iterable


def train_steps(relay, batches: Iterable, steps: int, on_step: Callable[[dict], None] | None = None) -> list[float]:
    """`steps` more training steps of `relay` on `batches` through l2l_hw.train (no files, no
    printing, no validation): the seconds of each step, as train() times them."""
    from l2l_hw.train import TrainConfig, train

    cfg = TrainConfig(steps=relay.step + steps, out=None, verbose=False, eval_every=steps)
    seconds, last = [], [0.0]

    def record(row: dict) -> None:
        seconds.append(row["elapsed"] - last[0])
        last[0] = row["elapsed"]
        if on_step is not None:
            on_step(row)

    train(cfg, relay=relay, data=batches, callbacks=[record])
    return seconds


def print_report(report: dict, as_json: bool, format_report: Callable[[dict], str]) -> int:
    print(json.dumps(report, indent=2) if as_json else format_report(report))
    return 0
