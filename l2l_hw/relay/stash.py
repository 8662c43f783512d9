"""Activation stash: what the backward needs of each layer's forward, per micro-batch: its
inputs (key i), and with selective recompute the kept ops' outputs (l2l_hw/relay/recompute.py).

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
        self._layers: dict = {}  # key -> "device": the tensors; "host": (their structure, the transfer down)
        self._coming_back: dict[object, tuple[list, Transfer]] = {}  # key -> (structure, the transfer up)

    def put(self, i, acts: list) -> None:
        """Keep `acts` under key i (a list over micro-batches of tensors or tuples of tensors)."""
        if self.policy == "device":
            self._layers[i] = acts
            return
        structure = [None if isinstance(a, torch.Tensor) else len(a) for a in acts]  # not the tensors: they go
        self._layers[i] = (structure, self.transport.down([t for a in acts for t in _items(a)]))

    def holds(self, i) -> bool:
        return i in self._layers or i in self._coming_back

    def prefetch(self, i) -> None:
        """Start bringing key i's tensors back to the device (once they have landed on the host)."""
        if self.policy == "device" or i in self._coming_back or i not in self._layers:
            return
        structure, down = self._layers.pop(i)
        self._coming_back[i] = (structure, self.transport.up(down.tensors, after=down))

    def take(self, i) -> list:
        """Key i's tensors on the device; the stash forgets them."""
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
