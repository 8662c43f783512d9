"""The golden EPS: the update rule of golden.py in numpy float32, op by op. Slow; the
definition the host kernel and the RTL must match bit for bit, for tests."""
from __future__ import annotations

import numpy as np
import torch

from l2l_hw.eps.engine import AsyncEps
from l2l_hw.eps.golden import apply_rule_stored, grad_to_numpy, state_arrays, state_tensors, working_copy
from l2l_hw.eps.registry import register_backend


@register_backend("golden")
class GoldenEps(AsyncEps):
    def __init__(self, config, working_dtype: str = "fp32", double_buffer: bool = False, state: str = "fp32"):
        super().__init__(config, working_dtype, double_buffer, "l2l-golden-update", state=state)

    def _allocate(self, shape, dtype, fetched):
        return torch.empty(shape, dtype=dtype)

    def _write(self, buf, values):
        buf.copy_(values)

    def _read(self, buf, shape, dtype):
        return buf

    def _run(self, key, name, optimizer, s, grad, src, dst):
        g = grad_to_numpy(grad)
        with np.errstate(all="ignore"):
            found = not np.isfinite(g * np.float32(s.inv_scale)).all()
        stored = state_arrays({k: t.reshape(-1) for k, t in src.items() if k not in ("param", "working")})
        p, new = apply_rule_stored(optimizer, s, src["param"].numpy().reshape(-1), stored, g.reshape(-1),
                                   self.state_format)
        new = state_tensors({"param": p, **new})
        for slot, t in dst.items():  # every result is computed before the first write (in place)
            if slot == "working":
                t.copy_(working_copy(p, self.working_dtype).reshape(t.shape))
            else:
                t.copy_(new[slot].reshape(t.shape))
        return found
