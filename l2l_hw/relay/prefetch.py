"""Weight streams: the next layer's weights move to the device while the current one runs.

The EPS's working copy goes up through the relay's transport (l2l_hw/relay/transport.py):
on CUDA from pinned host memory on the up stream, the compute stream waiting on the
transfer's event (a double buffer: the layer running and the layer arriving); on the CPU
the same code runs with no copies at all.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from l2l_hw.eps.base import EPS
from l2l_hw.relay.transport import Transfer, Transport


class WeightStream:
    def __init__(self, eps: EPS, transport: Transport, previous: bool = False):
        self.eps = eps
        self.previous = previous  # PipeDream-2BW: compute on the version one step back
        self.transport = transport
        self._inflight: dict[str, tuple[list[str], Transfer | object]] = {}

    def prefetch(self, keys: list[str]) -> None:
        """Start moving the working copies of `keys` to the device (no-op if already under way).
        A fetch still under way (a sharded EPS's all-gather) goes up when it is waited for."""
        for key in keys:
            if key not in self._inflight:
                pending = self.eps.fetch_async(key, previous=self.previous)
                self._inflight[key] = self._up(pending.wait()) if pending.ready else (None, pending)

    def _up(self, host: dict[str, torch.Tensor]) -> tuple[list[str], Transfer]:
        return list(host), self.transport.up(list(host.values()))

    def get(self, key: str) -> dict[str, torch.Tensor]:
        """The device tensors of `key`, once their copy has landed on the compute stream."""
        self.prefetch([key])
        names, moving = self._inflight.pop(key)
        if names is None:  # a fetch under way
            names, moving = self._up(moving.wait())
        return dict(zip(names, moving.wait()))

    def on_device(self) -> list:
        """Weights in flight to the device (for the accounting)."""
        return [moving.tensors if names is not None else moving.held() for names, moving in self._inflight.values()]

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
