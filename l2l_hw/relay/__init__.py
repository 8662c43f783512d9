"""The layer-to-layer relay: layer-major execution over micro-batches with an EPS."""
from l2l_hw.relay.executor import Relay
from l2l_hw.relay.options import RelayOptions, device_problem
from l2l_hw.relay.stage import LayerStage, RelayError, init_from_state

__all__ = ["LayerStage", "Relay", "RelayError", "RelayOptions", "device_problem", "init_from_state"]
