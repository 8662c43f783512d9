"""A run between its steps (TrainState: what train() trains, where it writes, how far it is) and
what it hands back (TrainResult)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from l2l_hw.distributed import Ranks
from l2l_hw.eps.disk_store import remove_state
from l2l_hw.relay.schedule import Schedule
from l2l_hw.training.config import TrainConfig


@dataclass
class TrainState:
    """One train() call between steps: the relay, the data position, the rows."""

    cfg: TrainConfig
    relay: Schedule
    data: Iterable
    val_data: Iterable | None
    ranks: Ranks
    tokens: bool = True  # the loss is a cross entropy over tokens: perplexity and tokens/s mean something
    callbacks: list[Callable[[dict], None]] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    elapsed: float = 0.0
    resumed_elapsed: float | None = None  # the training seconds of the run's earlier segments, if resumed
    skip: int = 0  # batches of a fresh pass over `data` already trained on (resume without a data state)
    saved_step: int | None = None  # the step of the newest checkpoint in out
    val_loss: float | None = None  # the last validation of this call
    discarded: int = 0  # steps discarded in a row (non-finite): MAX_DISCARDED stops the run
    out: Path | None = field(init=False)
    files: bool = field(init=False)  # rank 0 alone writes files
    shard: tuple[int, int] = field(init=False)

    def __post_init__(self):
        self.out = Path(self.cfg.out) if self.cfg.out is not None else None
        self.files = self.out is not None and self.ranks.lead
        # Where each rank's part of a minibatch comes from: its shard (data parallel), its replica's (a pipeline
        # replicated over the ranks, rank = replica * stages + stage)
        stages = self.cfg.pipeline_stages if self.ranks.world > 1 else 1
        self.shard = (self.ranks.rank // stages, self.ranks.world // stages)


@dataclass
class TrainResult:
    relay: Schedule  # a Relay, or this rank's PipelineRelay
    history: list[dict] = field(default_factory=list)  # the metrics rows, resumed ones included
    val_loss: float | None = None  # the last validation
    elapsed: float = 0.0  # seconds in train steps, over every resumed segment
    state_dir: Path | None = None  # removed by close() (--remove-state-dir, once the run has finished)

    def close(self) -> None:
        """Close the relay (its EPS's updates finished, its files released); then, with
        --remove-state-dir, remove this process's state folder (and the parent of torchrun's
        rankR folders, once empty)."""
        self.relay.close()
        if self.state_dir is not None:
            remove_state(self.state_dir)
            if self.state_dir.name.startswith("rank"):
                with contextlib.suppress(OSError):
                    self.state_dir.parent.rmdir()
