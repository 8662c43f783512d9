"""The golden EPS's update kernel: the update rule of golden.py in numpy float32, op by op.
Slow; the definition the host kernel and the RTL must match bit for bit, for tests. It
computes on host memory, so it runs in RAM or, with state_dir, on the region files of
l2l_hw/eps/disk.py, as the CPU EPS does."""
from __future__ import annotations

import numpy as np

from l2l_hw.eps.base import OptimConfig
from l2l_hw.eps.engine import Kernel
from l2l_hw.eps.golden import (apply_rule_stored, grad_to_numpy, predicted_working, state_arrays, state_tensors,
                               working_copy)
from l2l_hw.eps.registry import register_backend


class GoldenKernel(Kernel):
    name = "golden"
    slices = True  # element-wise over any contiguous slice (engine.UPDATE_CHUNK)

    def run(self, what, rule, s, grad, src, dst):
        g = grad_to_numpy(grad)
        with np.errstate(all="ignore"):
            found = not np.isfinite(g * np.float32(s.inv_scale)).all()
        stored = state_arrays({k: t.reshape(-1) for k, t in src.items() if k not in ("param", "working")})
        p, new = apply_rule_stored(rule.optimizer, s, src["param"].numpy().reshape(-1), stored, g.reshape(-1),
                                   rule.state, shape=grad.shape)
        new = state_tensors({"param": p, **new})
        for slot, t in dst.items():  # every result is computed before the first write (in place)
            if slot == "working":
                t.copy_(working_copy(p, rule.working_dtype).reshape(t.shape))
            else:
                t.copy_(new[slot].reshape(t.shape))
        return found

    def predict(self, rule, s, grad, dst):
        """Delay compensation "predict" by golden.predicted_working, numpy float32 (Kernel.predict)."""
        stored = state_arrays({k: t.reshape(-1) for k, t in dst.items() if k not in ("param", "working")})
        w = dst["working"]
        w.copy_(predicted_working(rule.optimizer, s, dst["param"].numpy().reshape(-1), stored,
                                  grad_to_numpy(grad).reshape(-1), rule.state, rule.working_dtype).reshape(w.shape))


@register_backend("golden")
def golden(config: OptimConfig, state: str = "fp32") -> GoldenKernel:
    """`make_eps("golden")`: the numpy rule (in RAM, or on files with state_dir)."""
    return GoldenKernel()
