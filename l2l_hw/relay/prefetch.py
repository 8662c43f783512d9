"""Weight streams: the next layer's weights move to the device while the current one runs.

On CUDA the copies run on a side stream from pinned host memory and an event tells
the compute stream when they have landed (a double buffer: the layer running and the
layer arriving). On the CPU the same code runs with synchronous copies, which for
host tensors are no copies at all.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from l2l_hw.eps.base import EPS


class WeightStream:
    def __init__(self, eps: EPS, device: torch.device, previous: bool = False):
        self.eps = eps
        self.previous = previous  # PipeDream-2BW: compute on the version one step back
        self.device = device
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._inflight: dict[str, tuple[dict[str, torch.Tensor], object]] = {}

    def prefetch(self, keys: list[str]) -> None:
        """Start moving the working copies of `keys` to the device (no-op if already under way)."""
        for key in keys:
            if key in self._inflight:
                continue
            start = getattr(self.eps, "fetch_async", None)  # a sharded EPS all-gathers meanwhile
            if self.copy_stream is None and start is not None:
                self._inflight[key] = (start(key, previous=self.previous), None)
                continue
            host = self.eps.fetch(key, previous=self.previous)
            if self.copy_stream is None:
                self._inflight[key] = ({n: t.to(self.device) for n, t in host.items()}, None)
                continue
            with torch.cuda.stream(self.copy_stream):
                dev = {n: t.to(self.device, non_blocking=True) for n, t in host.items()}
                ready = torch.cuda.Event()
                ready.record(self.copy_stream)
            self._inflight[key] = (dev, ready)

    def get(self, key: str) -> dict[str, torch.Tensor]:
        """The device tensors of `key`, once their copy has landed on the compute stream."""
        self.prefetch([key])
        dev, ready = self._inflight.pop(key)
        if not isinstance(dev, dict):  # an all-gather under way
            dev = {n: t.to(self.device) for n, t in dev.wait().items()}
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
            for t in dev.values():  # the allocator must not reuse them before compute is done
                t.record_stream(torch.cuda.current_stream(self.device))
        return dev

    def on_device(self) -> list:
        """Weights in flight to the device (for the accounting)."""
        return [dev if isinstance(dev, dict) else dev.held() for dev, _ in self._inflight.values()]

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
