"""Layer drop: each step skips every droppable layer with probability p (a number, or a
function of the step); a skipped layer passes its input through and costs neither transfer
nor compute, and its weights get no update that step.

The draw is keyed by a seed and the step alone (its own generator: resumable, and dropout's
random stream is untouched), so every rank that asks for a step's layers gets the same ones:
the Relay draws them for its one stage, each pipeline stage for the whole model.
"""
from __future__ import annotations

import numbers
from typing import Callable, Sequence

import torch

from l2l_hw.eps.base import check_number


class LayerDrop:
    def __init__(self, p: float | Callable[[int], float], n_layers: int, *, droppable: Sequence[int] | None = None,
                 seed: int = 0):
        """`droppable`: the layers that may be skipped (default: all but the first and the last)."""
        droppable = set(range(1, n_layers - 1) if droppable is None else droppable)
        if not all(isinstance(i, numbers.Integral) and 0 <= i < n_layers for i in droppable):
            raise ValueError(f"droppable must be layer indices in [0, {n_layers}), got {sorted(droppable)}")
        self.p, self.n_layers, self.droppable = p, n_layers, droppable
        self.seed = check_number("layer_drop_seed", seed, integer=True)

    def probability(self, step: int) -> float:
        return self.p(step) if callable(self.p) else self.p

    def layers(self, step: int) -> list[int]:
        """The layers step `step` (counted from 1) runs, in order."""
        p = self.probability(step)
        if not p:
            return list(range(self.n_layers))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        drawn = torch.rand(self.n_layers, generator=g)
        return [i for i in range(self.n_layers) if i not in self.droppable or float(drawn[i]) >= p]
