"""l2l-hw: layer-to-layer relay training with an Eager Param Server (EPS)."""
__version__ = "0.1.0"

from l2l_hw.eps import make_eps  # noqa: E402
from l2l_hw.relay import Relay  # noqa: E402

__all__ = ["make_eps", "Relay", "__version__"]
