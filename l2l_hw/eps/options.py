"""A training run's EPS and learning-rate schedule, as options declared once (l2l_hw/options.py):
which backend keeps the weights, the optimizer and its state format, the schedule. The
optimizer's own rules are OptimConfig's (l2l_hw/eps/base.py), applied here as make_eps
applies them; `make_eps(**eps_options.make_eps_arguments(schedule))` builds the EPS."""
from __future__ import annotations

import math
from dataclasses import dataclass

from l2l_hw.eps.base import MAX_NS_STEPS, MUON_MOMENTUM, OPTIMIZERS, SCHEDULES, WHOLE_TENSOR_RULES, OptimConfig
from l2l_hw.eps.golden import DELAY_COMPENSATIONS, STATE_FORMATS, prediction_problem
from l2l_hw.eps.registry import disk_tier_backends, known_backends
from l2l_hw.options import OptionError, check_options, fail, option


@dataclass(frozen=True)
class ScheduleOptions:
    """How long the run is and how its learning rate moves."""

    steps: int = option(200, "total optimizer steps; with --resume a new target", kind="int", low=1)
    epochs: int | None = option(None, "passes over the data instead of --steps (steps: this times the minibatches "
                                "of a pass)", kind="int", low=1, commands=("finetune",))
    schedule: str = option("cosine", "lr schedule: constant; cosine down to --min-lr; or linear down to --min-lr "
                           "(transformers' default)", kind="choice", choices=SCHEDULES,
                           command_defaults={"finetune": "linear"})
    warmup: int | None = option(None, {"train": "linear warm-up steps (default: a tenth of --steps)",
                                       "finetune": "linear warm-up steps"}, kind="int",
                                low=0, command_defaults={"finetune": 0})
    warmup_ratio: float | None = option(None, "warm-up as a share of the steps: ceil(steps x this) steps, as "
                                        "transformers' Trainer takes a warmup_steps below 1 (a --warmup above 0 wins)",
                                        kind="float", low=0.0, high=1.0, high_open=True, metavar="SHARE")
    min_lr: float | None = option(None, "the learning rate the schedule ends at (default: lr/10 for cosine, 0 for "
                                  "linear)", kind="float", low=0.0)

    def __post_init__(self):
        check_options(self)
        given = "warmup_ratio" if self.warmup_ratio is not None and not self.warmup else "warmup"
        if getattr(self, given) is not None and (self.warmup_steps > self.steps or (
                self.schedule != "constant" and self.warmup_steps == self.steps)):
            decaying = f" (less with the {self.schedule} schedule)" if self.schedule != "constant" else ""
            fail(given, getattr(self, given), f"gives {self.warmup_steps} warm-up steps; there must be from 0 to "
                 f"steps ({self.steps}){decaying}")

    def floor(self, lr: float) -> float:
        """The learning rate the schedule ends at, for a peak of `lr`."""
        if self.min_lr is not None:
            return self.min_lr
        return lr / 10 if self.schedule == "cosine" else 0.0

    @property
    def warmup_steps(self) -> int:
        """warmup where above 0, else ceil(steps x warmup_ratio) (Trainer's rule) where given, else warmup (0),
        or l2l train's tenth of the steps. A run records the number it began with as its warmup."""
        if self.warmup_ratio is not None and not self.warmup:
            return math.ceil(self.steps * self.warmup_ratio)
        return self.steps // 10 if self.warmup is None else self.warmup


OPTIMIZER_ARGUMENTS = {"optimizer": "optimizer", "lr": "lr", "weight_decay": "weight_decay",  # EpsOptions field
                       "momentum": "momentum", "adam_eps": "eps",  # -> the OptimConfig argument it is
                       "trust_coefficient": "trust_coefficient"}
MUON_ARGUMENTS = {"muon_momentum": "momentum", "muon_nesterov": "nesterov", "muon_ns_steps": "ns_steps",
                  "muon_adjust_lr": "adjust_lr_fn"}  # with --optimizer muon only
MUON_ADJUST_LR = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn (None is "original")


# LAMB's base learning rate for the reference GPT at batch 32 (docs/BENCHMARKS.md, "LAMB (and LARS) at a 4x
# larger batch": within 0.03 nats/byte of AdamW there; AdamW's 2e-3 leaves LAMB far behind in 30 steps).
LAMB_LR = 2e-2


@dataclass(frozen=True)
class EpsOptions:
    """Which EPS keeps the weights and how it updates them."""

    eps_backend: str = option("cpu", "EPS backend", kind="choice", choices=lambda: tuple(known_backends()),
                              flag="--eps", aliases=("--eps-backend",))
    optimizer: str = option("adamw", "the update rule: adamw, adam, sgd as torch.optim's; lamb, lars: layer-wise "
                            "trust ratios for large batches (docs/NUMERICS.md), which want a larger --lr than AdamW's: 2e-2 trains "
                            "the reference GPT at batch 32, x sqrt(k) at k times the batch (docs/BENCHMARKS.md); "
                            "muon: torch.optim.Muon on every 2-D weight (orthogonalised momentum, on the host), AdamW "
                            "on the rest, one --lr and --weight-decay for both (--muon-*)",
                            kind="choice", choices=OPTIMIZERS)
    # lr, momentum, weight_decay: their ranges and rules are OptimConfig's (OPTIMIZER_ARGUMENTS)
    lr: float = option(2e-3, "peak learning rate", kind="float", command_defaults={"finetune": 5e-5})
    momentum: float = option(0.0, "SGD and LARS momentum, in [0, 1)", kind="float")
    trust_coefficient: float = option(1e-3, "LARS's eta: the trust ratio is eta ||w|| / (||g|| + weight decay ||w||)",
                                      kind="float")
    weight_decay: float = option(0.1, "decoupled weight decay (AdamW), L2 (Adam, SGD)", kind="float",
                                 command_defaults={"finetune": 0.0})
    adam_beta1: float = option(0.9, "Adam's beta1", kind="float", low=0.0, high=1.0, high_open=True)
    adam_beta2: float = option(0.999, "Adam's beta2", kind="float", low=0.0, high=1.0, high_open=True)
    adam_eps: float = option(1e-8, "Adam's epsilon, added to the square root of v", kind="float")
    muon_momentum: float = option(MUON_MOMENTUM, "Muon's momentum, in [0, 1) (torch.optim.Muon's default)",
                                  kind="float", low=0.0, high=1.0, high_open=True)
    muon_nesterov: bool = option(True, "Muon: plain momentum instead of Nesterov's (which is torch.optim.Muon's "
                                 "default)", kind="bool", flag="--no-muon-nesterov")
    muon_ns_steps: int = option(5, "Muon's Newton-Schulz iterations per update (torch.optim.Muon's default)",
                                kind="int", low=1, high=MAX_NS_STEPS)
    muon_adjust_lr: str = option("match_rms_adamw", "how Muon scales --lr to a matrix's shape: match_rms_adamw, "
                                 "0.2 sqrt(max(rows, cols)) (Moonshot's, so one --lr serves Muon and AdamW); "
                                 "original, sqrt(max(1, rows/cols)) (torch.optim.Muon's default; wants ~10x "
                                 "AdamW's lr)",
                                 kind="choice", choices=MUON_ADJUST_LR)
    optimizer_state: str = option("fp32", "how the EPS keeps m and v: fp32, bf16 or block-wise 8bit", kind="choice",
                                  choices=STATE_FORMATS)
    delay_compensation: str = option(
        "none", "under PipeDream-2BW (--pipeline-schedule 2bw, --pipedream-2bw), whose steps compute on weights one "
        "step stale: predict, the EPS writes the working copy at the weights the next step is predicted to reach "
        "(weight prediction from the optimizer's own update, SpecTrain / PipeMare; docs/PIPELINE.md); none",
        kind="choice", choices=DELAY_COMPENSATIONS)
    shard_state: bool = option(False, "under torchrun: each rank's EPS keeps 1/N of the optimizer state (ZeRO-style)",
                               kind="bool")
    overlay: str | None = option(None, "--eps fpga-pynq: the overlay to load (.bit with its .hwh, or .xclbin; "
                                 "docs/BOARD.md)", kind="path", metavar="PATH")
    kernel: str | None = option(None, "--eps fpga-pynq: the kernel's IP name in the overlay (default: every IP "
                                "named l2l_optim*, each a compute unit)", kind="text", metavar="NAME")
    state_dir: str | None = option(None, "--eps cpu or golden: keep the master weights, optimizer state and working "
                                   "copy in files under PATH (a disk filesystem with direct I/O), only the layer "
                                   "groups in flight in memory (docs/DISK.md)", kind="path", metavar="PATH")

    def __post_init__(self):
        check_options(self)
        try:  # the optimizer's rules, as make_eps applies them
            OptimConfig(**self.optimizer_arguments())
        except OptionError as e:  # named as here
            fail(next(f for f, a in OPTIMIZER_ARGUMENTS.items() if a == e.field), e.value, e.rule)
        self._check_muon()
        self._check_delay_compensation()
        if self.shard_state and self.optimizer in WHOLE_TENSOR_RULES:
            needs = "each matrix whole" if self.optimizer == "muon" else "each tensor's whole norms"
            fail("optimizer", self.optimizer, f"needs {needs}; shard_state keeps slices: drop "
                 "--shard-state or use adamw, adam or sgd")
        if self.shard_state and self.optimizer_state != "fp32":
            fail("optimizer_state", self.optimizer_state, "shard_state keeps fp32 optimizer state only; drop one "
                 "of them")
        if self.state_dir is not None and (self.eps_backend not in disk_tier_backends() or self.shard_state):
            fail("state_dir", self.state_dir, f"keeps the state of the {' or '.join(disk_tier_backends())} EPS "
                 "(unsharded) on disk; drop --state-dir or use --eps cpu"
                 f"{' without --shard-state' if self.shard_state else ''}")
        if self.kernel is not None and self.overlay is None:
            fail("kernel", self.kernel, "names an IP in an overlay: give --overlay too (the fpga-pynq EPS)")
        if (self.eps_backend == "fpga-pynq") != (self.overlay is not None):
            if self.overlay is None:
                fail("eps_backend", self.eps_backend, "needs an overlay (--overlay PATH: the .bit with its .hwh "
                     "beside it, or an xclbin; docs/BOARD.md)")
            fail("overlay", self.overlay, f"is for the fpga-pynq EPS, not {self.eps_backend}")

    def _check_muon(self) -> None:
        """Muon's options go with --optimizer muon, which runs on the host (cpu or golden EPS)."""
        if self.optimizer != "muon":
            given = [f for f in MUON_ARGUMENTS if getattr(self, f) != EpsOptions.__dataclass_fields__[f].default]
            if given:
                fail(given[0], getattr(self, given[0]), f"is Muon's; the {self.optimizer} optimizer takes none: "
                     "give --optimizer muon or drop it")
            return
        if self.momentum:
            fail("momentum", self.momentum, "is SGD's and LARS's; Muon's momentum is --muon-momentum "
                 f"(default {MUON_MOMENTUM:g})")
        if self.eps_backend not in disk_tier_backends():
            fail("optimizer", self.optimizer, f"runs Newton-Schulz iterations, matrix work, on the host; the "
                 f"{self.eps_backend} EPS's RTL kernel has none: use --eps {' or '.join(disk_tier_backends())}")

    def _check_delay_compensation(self) -> None:
        """A compensation runs in the update on the host, for a rule whose state predicts its next step."""
        if self.delay_compensation == "none":
            return
        if self.eps_backend not in disk_tier_backends():
            fail("delay_compensation", self.delay_compensation, f"is computed on the host from the EPS's state; the "
                 f"{self.eps_backend} EPS keeps it in FPGA DRAM and its RTL kernel does not predict: use --eps "
                 f"{' or '.join(disk_tier_backends())}")
        problem = prediction_problem(OptimConfig(**self.optimizer_arguments()))
        if problem:
            fail("delay_compensation", self.delay_compensation, problem)

    def optimizer_arguments(self) -> dict:
        """OptimConfig's arguments of these options (the schedule's aside); Muon's with --optimizer muon."""
        arguments = {**{argument: getattr(self, name) for name, argument in OPTIMIZER_ARGUMENTS.items()},
                     "betas": (self.adam_beta1, self.adam_beta2)}
        if self.optimizer == "muon":
            arguments.update({argument: getattr(self, name) for name, argument in MUON_ARGUMENTS.items()})
        return arguments

    def make_eps_arguments(self, schedule: ScheduleOptions) -> dict:
        """make_eps's arguments for these options and `schedule` (by default cosine floors at lr/10, as
        nanoGPT's, and linear ends at 0, as transformers')."""
        backend = {"overlay": self.overlay, "kernel": self.kernel} if self.overlay else {}
        if self.optimizer_state != "fp32":  # a backend registered without state formats still takes the default
            backend["state"] = self.optimizer_state
        if self.state_dir is not None:
            backend["state_dir"] = self.state_dir
        if self.delay_compensation != "none":
            backend["delay_compensation"] = self.delay_compensation
        return dict(name=self.eps_backend, **self.optimizer_arguments(), schedule=schedule.schedule,
                    warmup_steps=schedule.warmup_steps, total_steps=schedule.steps, min_lr=schedule.floor(self.lr),
                    shard_state=self.shard_state, **backend)
