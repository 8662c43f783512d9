"""l2l-hw: layer-to-layer relay training with an Eager Param Server (EPS)."""
from l2l_hw.version import __version__
from l2l_hw.eps import make_eps
from l2l_hw.relay import Relay
from l2l_hw.train import TrainConfig, train  # the name l2l_hw.train is this function; the module is l2l_hw/train.py

__all__ = ["make_eps", "Relay", "TrainConfig", "train", "__version__"]
