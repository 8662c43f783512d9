"""The optimizers an EPS runs: their names, which rule updates each tensor and which state slots
it keeps, and OptimConfig (one optimizer and its learning-rate schedule, checked as torch.optim
checks its arguments). The rules themselves are l2l_hw/eps/golden.py's (docs/NUMERICS.md)."""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

from l2l_hw.options import OptionError

OPTIMIZERS = ("adamw", "adam", "sgd", "lamb", "lars", "muon")
# The layer-wise optimizers: each tensor's step is scaled by a trust ratio of its whole norms
# (docs/NUMERICS.md, "LAMB and LARS"), so an update sees the whole tensor, never a slice.
LAYERWISE = ("lamb", "lars")
# Muon (docs/NUMERICS.md): the Muon rule on every matrix (2 dimensions, as torch.optim.Muon takes
# them), AdamW on every other tensor. The rules that read a whole tensor: never run on a slice.
MUON_MATRIX_NDIM = 2
WHOLE_TENSOR_RULES = LAYERWISE + ("muon",)
SCHEDULES = ("constant", "cosine", "linear")
# Optimizer state slots per optimizer: m is Adam's (LAMB's) exp_avg or SGD's (LARS's, Muon's)
# momentum buffer, v is Adam's exp_avg_sq. Muon's: what any tensor of a Muon EPS may keep (a
# matrix keeps m alone, every other tensor AdamW's m and v: tensor_rule).
STATE_SLOTS = {"adamw": ("m", "v"), "adam": ("m", "v"), "sgd": ("m",), "lamb": ("m", "v"), "lars": ("m",),
               "muon": ("m", "v")}
RULE_SLOTS = {**STATE_SLOTS, "muon": ("m",)}  # per update rule: the Muon rule keeps one momentum buffer
MOMENTUM_OPTIMIZERS = ("sgd", "lars")  # take momentum=; without it they keep no state
MUON_MOMENTUM = 0.95  # torch.optim.Muon's default momentum
MUON_ADJUST_LR = (None, "original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn values (None: original)
MAX_NS_STEPS = 99  # torch.optim.Muon refuses 100 or more Newton-Schulz steps


def tensor_rule(optimizer: str, shape) -> str:
    """The rule a tensor of `shape` is updated by: with optimizer "muon", "muon" for a matrix
    (MUON_MATRIX_NDIM dimensions: the shape it was registered with, the whole tensor's) and
    "adamw" for any other tensor; every other optimizer its own rule."""
    if optimizer == "muon":
        return "muon" if len(shape) == MUON_MATRIX_NDIM else "adamw"
    return optimizer


def updated_slots(optimizer: str, momentum: float, shape=None) -> tuple[str, ...]:
    """The state slots an update of a tensor of `shape` reads and writes: SGD and LARS without
    momentum keep none; Muon's matrices m alone (its momentum buffer, even at momentum 0, as torch)."""
    rule = optimizer if shape is None else tensor_rule(optimizer, shape)
    return () if rule in MOMENTUM_OPTIMIZERS and momentum == 0 else RULE_SLOTS[rule]


def check_number(name: str, value, low=None, high=None, integer: bool = False, high_open: bool = False):
    """`value` as a finite float (or an int), within [low, high] (high excluded with high_open);
    otherwise one OptionError naming the argument, the value and what is allowed."""
    kind = "an integer" if integer else "a finite number"
    bounds = ([f">= {low:g}"] if low is not None else []) + ([f"{'<' if high_open else '<='} {high:g}"]
                                                            if high is not None else [])
    rule = f"must be {' and '.join(bounds)} ({kind})" if bounds else f"must be {kind}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            (integer and not isinstance(value, numbers.Integral)):
        raise OptionError(f"{name} {rule}, got {value!r} ({type(value).__name__})", name, value, rule)
    number = int(value) if integer else float(value)
    if not math.isfinite(number) or (low is not None and number < low) or (high is not None and (
            number >= high if high_open else number > high)):
        raise OptionError(f"{name} {rule}, got {number!r}", name, value, rule)
    return number


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and learning-rate schedule; names and defaults follow torch.optim."""

    optimizer: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float | None = None  # None: torch's (AdamW 1e-2, Adam/SGD 0, Muon 0.1); LAMB 1e-2, LARS 0
    momentum: float | None = None  # SGD, LARS and Muon; None: torch's default (Muon 0.95, SGD 0)
    dampening: float = 0.0
    nesterov: bool | None = None  # None: torch's default (Muon True, SGD False)
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr: float = 0.0
    # LARS's eta: the trust ratio is eta ||p|| / (||g|| + weight_decay ||p||) (You et al., arXiv 1708.03888)
    trust_coefficient: float = 1e-3
    # Muon's, with torch.optim.Muon's names and defaults: Newton-Schulz iterations, and how its step
    # is scaled to a matrix's shape (None or "original": sqrt(max(1, rows / cols)); "match_rms_adamw":
    # 0.2 sqrt(max(rows, cols)), Moonshot's, arXiv 2502.16982, so that AdamW's lr and decay carry over)
    ns_steps: int = 5
    adjust_lr_fn: str | None = None

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise OptionError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}",
                              "optimizer", self.optimizer, f"must be one of {', '.join(OPTIMIZERS)}")
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", {"adamw": 1e-2, "lamb": 1e-2, "muon": 0.1}.get(self.optimizer, 0.))
        muon = self.optimizer == "muon"
        if self.momentum is None:
            object.__setattr__(self, "momentum", MUON_MOMENTUM if muon else 0.0)
        if self.nesterov is None:
            object.__setattr__(self, "nesterov", muon)
        # finite: an infinite one trains to NaN
        for name in ("lr", "eps", "weight_decay", "min_lr", "trust_coefficient"):
            object.__setattr__(self, name, check_number(name, getattr(self, name), low=0.0))
        # momentum >= 1 grows the buffer without bound (torch.optim.SGD takes it and diverges)
        object.__setattr__(self, "momentum", check_number("momentum", self.momentum, low=0.0, high=1.0,
                                                          high_open=True))
        if self.momentum and self.optimizer not in MOMENTUM_OPTIMIZERS + ("muon",):
            rule = f"is for the sgd and lars optimizers; {self.optimizer} takes none (its betas play that part)"
            raise OptionError(f"momentum is SGD's; {self.optimizer} takes none (its betas play that part; lars and "
                              f"muon take momentum too), got momentum={self.momentum!r}", "momentum", self.momentum, rule)
        object.__setattr__(self, "ns_steps", check_number("ns_steps", self.ns_steps, low=1, high=MAX_NS_STEPS,
                                                          integer=True))
        if self.adjust_lr_fn not in MUON_ADJUST_LR:
            rule = f"must be one of {', '.join(map(repr, MUON_ADJUST_LR))} (torch.optim.Muon's)"
            raise OptionError(f"adjust_lr_fn {rule}, got {self.adjust_lr_fn!r}", "adjust_lr_fn", self.adjust_lr_fn,
                              rule)
        object.__setattr__(self, "dampening", check_number("dampening", self.dampening, low=0.0, high=1.0))
        betas = self.betas
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        object.__setattr__(self, "betas", tuple(check_number("betas", b, low=0.0, high=1.0, high_open=True)
                                                for b in betas))
        object.__setattr__(self, "warmup_steps", check_number("warmup_steps", self.warmup_steps, low=0, integer=True))
        if self.total_steps is not None:
            object.__setattr__(self, "total_steps", check_number("total_steps", self.total_steps, low=1, integer=True))
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"nesterov must be True or False, got {self.nesterov!r}")
        checks = [
            (not self.nesterov or muon or (self.momentum > 0 and self.dampening == 0),
             "nesterov needs momentum > 0 and dampening = 0 (as torch.optim.SGD)"),
            (self.schedule in SCHEDULES, f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}"),
            (self.schedule == "constant" or (self.total_steps or 0) > self.warmup_steps,
             f"the {self.schedule} schedule needs total_steps greater than warmup_steps"),
            (self.min_lr <= self.lr, f"min_lr must be <= lr ({self.lr}), got {self.min_lr}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (1-based): linear warm-up, then constant or
        cosine; or "linear", transformers' get_linear_schedule_with_warmup (its factor of the
        steps taken before this one: up from 0 over the warm-up, then down to min_lr at total_steps)."""
        if self.schedule == "linear":
            done, warmup, total = step - 1, self.warmup_steps, self.total_steps
            factor = done / max(1, warmup) if done < warmup else max(0.0, (total - done) / max(1, total - warmup))
            return self.min_lr + (self.lr - self.min_lr) * factor
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def to_dict(self) -> dict:
        return asdict(self)
