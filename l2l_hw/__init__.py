"""l2l-hw: layer-to-layer relay training with an Eager Param Server (EPS)."""
import os

# OpenMP threads that wait at the end of a parallel region sleep instead of spinning, unless
# the user says otherwise: on a machine shared with one busy process, spinning threads took
# the core from the thread they waited for, and a step of the relay (many small regions, one
# per layer and micro-batch) ran 2-3x slower, plain PyTorch's too (docs/BENCHMARKS_HISTORY.md,
# `l2l bench relay --contention`). Read once, when torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from l2l_hw import startup  # noqa: E402  (before torch: the l2l command's signal handlers; l2l_hw/startup.py)

startup.install()

from l2l_hw.version import __version__
from l2l_hw.eps import make_eps
from l2l_hw.relay import Relay
from l2l_hw.train import TrainConfig, train  # the name l2l_hw.train is this function; the module is l2l_hw/train.py

__all__ = ["make_eps", "Relay", "TrainConfig", "train", "__version__"]
