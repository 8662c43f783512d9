"""The layer-to-layer relay: layer-major execution over micro-batches with an EPS."""
from l2l_hw.relay.executor import Relay, RelayError, device_problem, init_from_state

__all__ = ["Relay", "RelayError", "device_problem", "init_from_state"]
