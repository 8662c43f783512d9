"""Eager Param Servers: the model's master weights and optimizer state live here."""
from l2l_hw.eps.base import EPS, OptimConfig
from l2l_hw.eps.registry import known_backends, make_eps, register_backend

# Backends register themselves on import.
from l2l_hw.eps import golden_eps as _golden_eps  # noqa: F401,E402
from l2l_hw.eps import cpu as _cpu  # noqa: F401,E402
from l2l_hw.eps import fpga as _fpga  # noqa: F401,E402  (builds nothing until make_eps("fpga-sim"))

__all__ = ["EPS", "OptimConfig", "known_backends", "make_eps", "register_backend"]
