"""Mixed precision: compute dtypes and dynamic loss scaling.

Layers run in bf16 or fp16 on weights the EPS rounds from its fp32 masters; the
gradients pushed back are bf16 or fp16 too and the EPS widens them to fp32. fp16
needs loss scaling: the loss is multiplied by `scale` before the backward so small
gradients stay representable, and the EPS multiplies every gradient by 1/scale. An
overflow (a non-finite gradient anywhere) discards the whole step and halves the
scale; `growth_interval` clean steps in a row double it (torch.cuda.amp.GradScaler's
policy and defaults).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    if precision not in COMPUTE_DTYPES:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[precision]


@dataclass
class LossScaler:
    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    clean_steps: int = 0  # steps since the last overflow or growth

    def update(self, found_nonfinite: bool) -> None:
        if found_nonfinite:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
