"""Activation stash: each layer's per-micro-batch inputs, kept for the backward.

"device" keeps them where they were computed: device memory grows with depth.
"host" sends each layer's inputs down to pinned host memory as soon as they are produced
and brings them back one layer ahead of their use in the backward (through the relay's
transport, l2l_hw/relay/transport.py), so device memory is independent of depth (the
constant-memory variant of L2L). On the CPU the "host" copies are real copies into
separate buffers, so the same code runs; only the accounting differs.
"""
from __future__ import annotations

import torch

from l2l_hw.relay.transport import Transfer, Transport

POLICIES = ("device", "host")


class ActivationStash:
    def __init__(self, policy: str, transport: Transport):
        if policy not in POLICIES:
            raise ValueError(f"unknown activations policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.transport = transport
        self._layers: dict[int, list] = {}  # "device": the inputs; "host": (their structure, the transfer down)
        self._coming_back: dict[int, tuple[list, Transfer]] = {}

    def put(self, i: int, acts: list) -> None:
        """Keep layer i's inputs (a list over micro-batches of tensors or tuples of tensors)."""
        if self.policy == "device":
            self._layers[i] = acts
            return
        structure = [None if isinstance(a, torch.Tensor) else len(a) for a in acts]  # not the tensors: they go
        self._layers[i] = (structure, self.transport.down([t for a in acts for t in _items(a)]))

    def prefetch(self, i: int) -> None:
        """Start bringing layer i's inputs back to the device (once they have landed on the host)."""
        if self.policy == "device" or i in self._coming_back or i not in self._layers:
            return
        structure, down = self._layers.pop(i)
        self._coming_back[i] = (structure, self.transport.up(down.tensors, after=down))

    def take(self, i: int) -> list:
        """Layer i's inputs on the device; the stash forgets them."""
        if self.policy == "device":
            return self._layers.pop(i)
        self.prefetch(i)
        structure, up = self._coming_back.pop(i)
        flat = iter(up.wait())
        return [next(flat) if n is None else tuple(next(flat) for _ in range(n)) for n in structure]

    def on_device(self) -> list:
        """What the stash holds in device memory now (for the accounting)."""
        held = [up.tensors for _, up in self._coming_back.values()]
        if self.policy == "device":
            held += list(self._layers.values())
        return held

    def clear(self) -> None:
        self._layers.clear()
        self._coming_back.clear()


def _items(a) -> list:
    return [a] if isinstance(a, torch.Tensor) else list(a)
