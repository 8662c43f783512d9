"""Activation stash: each layer's per-micro-batch inputs, kept for the backward.

"device" keeps them where they were computed: device memory grows with depth.
"host" copies each input to pinned host memory on a side stream as soon as it is
produced and brings a layer's inputs back one layer ahead of their use in the
backward, so device memory is independent of depth (the constant-memory variant of
L2L). On the CPU the "host" copies are real copies into separate buffers, so the
same code runs; only the accounting differs.
"""
from __future__ import annotations

import torch

POLICIES = ("device", "host")


def _map(fn, x):
    return fn(x) if isinstance(x, torch.Tensor) else tuple(fn(t) for t in x)


class ActivationStash:
    def __init__(self, policy: str, device: torch.device):
        if policy not in POLICIES:
            raise ValueError(f"unknown activations policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.device = device
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" and policy == "host" else None
        self._layers: dict[int, list] = {}
        self._coming_back: dict[int, tuple[list, object]] = {}

    def put(self, i: int, acts: list) -> None:
        """Keep layer i's inputs (a list over micro-batches)."""
        if self.policy == "device":
            self._layers[i] = acts
            return
        pin = self.device.type == "cuda"

        def offload(t):
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t, non_blocking=pin)

        if self.side_stream is None:
            self._layers[i] = [_map(offload, a) for a in acts]
            return
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side_stream):
            self._layers[i] = [_map(offload, a) for a in acts]
        for a in acts:  # the device tensors must live until the copy has read them
            _map(lambda t: t.record_stream(self.side_stream), a)

    def prefetch(self, i: int) -> None:
        """Start bringing layer i's inputs back to the device."""
        if self.policy == "device" or i in self._coming_back or i not in self._layers:
            return
        host = self._layers.pop(i)
        if self.side_stream is None:
            self._coming_back[i] = ([_map(lambda t: t.to(self.device), a) for a in host], None)
            return
        with torch.cuda.stream(self.side_stream):
            acts = [_map(lambda t: t.to(self.device, non_blocking=True), a) for a in host]
            ready = torch.cuda.Event()
            ready.record(self.side_stream)
        self._coming_back[i] = (acts, ready)

    def take(self, i: int) -> list:
        """Layer i's inputs on the device; the stash forgets them."""
        if self.policy == "device":
            return self._layers.pop(i)
        self.prefetch(i)
        acts, ready = self._coming_back.pop(i)
        if ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)
            for a in acts:
                _map(lambda t: t.record_stream(current), a)
        return acts

    def on_device(self) -> list:
        """What the stash holds in device memory now (for the accounting)."""
        held = [acts for acts, _ in self._coming_back.values()]
        if self.policy == "device":
            held += list(self._layers.values())
        return held

    def clear(self) -> None:
        self._layers.clear()
        self._coming_back.clear()
