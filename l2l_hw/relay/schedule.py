"""What the training loop calls of a schedule over layer stages: the Relay (one stage, the
whole model, layer-major) and the pipeline (one stage per rank, 1F1B / 2BW) both are one.

l2l_hw.train talks to this and nothing else of either: no getattr, no isinstance.
"""
from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class Schedule(Protocol):
    layers: list[nn.Module]  # the whole model's layers (structure; the EPS holds the weights)
    streams: bool  # train_steps runs several minibatches as one schedule (a 2BW pipeline)
    plan: object | None  # a planner's choice, where one was made (describe()): the pipeline's boundaries, the
    # relay's device share of the update

    @property
    def step(self) -> int: ...  # optimizer steps committed

    @property
    def eps(self): ...  # this rank's EPS (its config, shapes and state)

    @property
    def keep(self): ...  # the recompute policy (describe())

    @property
    def transport(self): ...  # host <-> device (asynchronous or not)

    @property
    def threads(self) -> int: ...

    @property
    def loss_scale(self) -> float: ...

    def train_step(self, inputs, targets) -> float: ...

    def train_steps(self, batches: Iterable) -> list[float]: ...

    def evaluate(self, inputs, targets) -> float: ...

    def memory_report(self) -> dict: ...

    def state_entries(self) -> dict: ...

    def load_state_dict(self, state) -> None: ...

    def materialize(self) -> nn.Sequential: ...

    def close(self) -> None: ...
