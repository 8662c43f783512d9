"""The layer-to-layer relay: layer-major execution over micro-batches with an EPS."""
from l2l_hw.relay.executor import Relay, RelayError, init_from_state
from l2l_hw.relay.options import RelayOptions, device_problem

__all__ = ["Relay", "RelayError", "RelayOptions", "device_problem", "init_from_state"]
