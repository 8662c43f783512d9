"""SIGINT and SIGTERM while a run trains: a stop at the next step boundary, agreed on every rank,
after a checkpoint of that step (TrainingInterrupted), instead of a kill mid-step."""
from __future__ import annotations

import signal
import threading
import time

import torch

from l2l_hw.distributed import Ranks, guarded

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A second signal of the same kind this soon after the first is the same request: under torchrun
# a Ctrl-C reaches each rank twice, from the terminal and forwarded by the agent (milliseconds apart).
REPEAT_S = 1.0


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run at a step boundary, after a checkpoint of that step
    (when the run writes files). `signal` is the signal's number, `step` the step reached."""

    def __init__(self, signum: int, step: int, saved: bool, where: str = ""):
        self.signal, self.step, self.saved = signum, step, saved
        super().__init__(f"interrupted{where} at step {step}" + ("; resume with --resume" if saved else ""))


class StopSignals:
    """SIGINT and SIGTERM, while training, ask the loop to stop at the next step boundary (where
    it checkpoints and raises TrainingInterrupted) instead of killing it mid-step. A second
    signal of the same kind, REPEAT_S after the first or later, acts as it did before (Ctrl-C
    twice raises KeyboardInterrupt). Only the main thread can take signals; elsewhere this does
    nothing."""

    def __init__(self):
        self.received: int | None = None
        self.at = 0.0  # when it was received (time.monotonic)
        self.where = ""  # under torchrun: which rank it reached first, for the ranks' lines
        self.previous: dict[int, object] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received is None:
            self.received, self.at = signum, time.monotonic()
        elif signum == self.received and time.monotonic() - self.at >= REPEAT_S:
            previous = self.previous[signum]
            signal.signal(signum, previous)
            if callable(previous):
                previous(signum, frame)
            else:  # the default action (SIGTERM: the end), or nothing where it was ignored
                signal.raise_signal(signum)

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def agreed(self, ranks: Ranks) -> bool:
        """Whether to stop now: on every rank alike (each rank may see the signal at another step)."""
        if ranks.world == 1:
            return self.received is not None
        import torch.distributed as dist

        flags = torch.zeros(ranks.world, dtype=torch.int64, device=ranks.device or "cpu")
        flags[ranks.rank] = self.received or 0
        guarded(None, "agreeing whether to stop at a signal", dist.all_reduce, flags)
        got = [(rank, int(signum)) for rank, signum in enumerate(flags.tolist()) if signum]
        if got and self.received is None:
            self.received = got[0][1]
        if got:
            self.where = f" by {signal.Signals(got[0][1]).name} to rank {got[0][0]}"
        return bool(got)
