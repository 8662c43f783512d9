"""Weight streams: the next layer's weights move to the device while the current one runs.

The EPS's working copy goes up through the relay's transport (l2l_hw/relay/transport.py):
on CUDA from pinned host memory on the up stream, the compute stream waiting on the
transfer's event (a double buffer: the layer running and the layer arriving); on the CPU
the same code runs with no copies at all. A group whose update is still running when the
relay asks for it (no step barrier: docs/ARCHITECTURE.md, "The update's life") starts its
copy up when the update lands, from the EPS's update thread, not when the layer needs it.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable

import torch

from l2l_hw.eps.base import EPS, PendingFetch
from l2l_hw.relay.transport import Transfer, Transport


class WeightStream:
    def __init__(self, eps: EPS, transport: Transport, previous: bool = False):
        self.eps = eps
        self.previous = previous  # PipeDream-2BW: compute on the version one step back
        self.transport = transport
        self._inflight: dict[str, _Arrival] = {}

    def prefetch(self, keys: list[str]) -> None:
        """Start moving the working copies of `keys` to the device (no-op if already under way):
        now, or where the group's update is still running, as soon as it lands (on the EPS's
        update thread). A fetch still under way (a sharded EPS's all-gather) goes up when it
        is waited for."""
        for key in keys:
            if key in self._inflight:
                continue
            if self.eps.on_device(key):  # the device share's: no copy
                self._inflight[key] = _Resident(self.eps.fetch(key), self.transport)
            else:
                self._inflight[key] = _Arrival(self.eps.fetch_async(key, previous=self.previous), self._up)

    def _up(self, host: dict[str, torch.Tensor]) -> tuple[list[str], Transfer]:
        return list(host), self.transport.up(list(host.values()))

    def get(self, key: str) -> dict[str, torch.Tensor]:
        """The device tensors of `key`, once their copy has landed on the compute stream."""
        self.prefetch([key])
        names, moving = self._inflight.pop(key).wait()
        return dict(zip(names, moving.wait()))

    def on_device(self) -> list:
        """Weights in flight to the device (for the accounting)."""
        return [arrival.held() for arrival in self._inflight.values()]

    def clear(self) -> None:
        self._inflight.clear()

    @contextmanager
    def newest(self):
        """Inside the block, fetch the newest committed version even under PipeDream-2BW:
        evaluation and export see the weights the run has reached, W(t), not W(t-1)."""
        self.clear()
        previous, self.previous = self.previous, False
        try:
            yield
        finally:
            self.previous = previous
            self.clear()


class _Arrival:
    """One group's working copy on its way up: its copy starts at once where the fetch is
    ready, else when the EPS hands the values on (its update has landed: on the update thread),
    else when it is waited for. wait() collects the fetch once (an update's error is raised there)."""

    def __init__(self, pending: PendingFetch, up: Callable[[dict], tuple[list[str], Transfer]]):
        self.pending, self.up = pending, up
        self.moving: tuple[list[str], Transfer] | None = None
        self._lock = threading.Lock()
        self._collected = pending.ready
        if self._collected:
            self.moving = up(pending.wait())
        else:
            pending.when_ready(self._landed)

    def _landed(self, host: dict[str, torch.Tensor]) -> None:
        with self._lock:
            if self.moving is None and not self._collected:
                self.moving = self.up(host)

    def wait(self) -> tuple[list[str], Transfer]:
        host = None if self._collected else self.pending.wait()
        with self._lock:
            self._collected = True
            if self.moving is None:
                self.moving = self.up(host)
            return self.moving

    def held(self) -> list[torch.Tensor]:
        moving = self.moving
        return moving[1].tensors if moving is not None else self.pending.held()


class _Resident:
    """A group that lives on the device (the device share): its tensors as they are."""

    def __init__(self, tensors: dict[str, torch.Tensor], transport: Transport):
        self.moving = (list(tensors), Transfer(list(tensors.values()), None, transport))

    def wait(self) -> tuple[list[str], Transfer]:
        return self.moving

    def held(self) -> list[torch.Tensor]:
        return []  # kept on the device for the whole run, not in flight
