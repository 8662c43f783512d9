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
        """Start moving the working copies of `keys` to the device (no-op if already under way).
        A fetch still under way (a sharded EPS's all-gather) is copied when it is waited for."""
        for key in keys:
            if key not in self._inflight:
                pending = self.eps.fetch_async(key, previous=self.previous)
                self._inflight[key] = self._to_device(pending.wait()) if pending.ready else (pending, None)

    def _to_device(self, host: dict[str, torch.Tensor]):
        """The copies of `host` to the device, and the event that says they landed (CUDA)."""
        if self.copy_stream is None:
            return {n: t.to(self.device) for n, t in host.items()}, None
        with torch.cuda.stream(self.copy_stream):
            dev = {n: t.to(self.device, non_blocking=True) for n, t in host.items()}
            ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        return dev, ready

    def get(self, key: str) -> dict[str, torch.Tensor]:
        """The device tensors of `key`, once their copy has landed on the compute stream."""
        self.prefetch([key])
        dev, ready = self._inflight.pop(key)
        if not isinstance(dev, dict):  # a fetch under way
            dev, ready = self._to_device(dev.wait())
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
