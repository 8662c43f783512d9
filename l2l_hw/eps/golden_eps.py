"""The golden EPS: the update rule of golden.py in numpy float32, op by op. Slow; the
definition the host kernel and the RTL must match bit for bit, for tests."""
from __future__ import annotations

import numpy as np
import torch

from l2l_hw.eps.engine import AsyncEps
from l2l_hw.eps.golden import apply_rule, canonicalize_nan, grad_to_numpy, working_copy
from l2l_hw.eps.registry import register_backend


@register_backend("golden")
class GoldenEps(AsyncEps):
    def __init__(self, config, working_dtype: str = "fp32", double_buffer: bool = False):
        super().__init__(config, working_dtype, double_buffer, "l2l-golden-update")

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
            p, m, v = apply_rule(optimizer, s, src["param"].numpy(), _array(src.get("m")), _array(src.get("v")),
                                 g, np.sqrt)
        new = {"param": p, "m": m, "v": v}
        for slot, t in dst.items():  # every result is computed before the first write (in place)
            if slot == "working":
                t.copy_(working_copy(canonicalize_nan(np.array(p, dtype=np.float32)), self.working_dtype))
            else:
                t.numpy()[...] = canonicalize_nan(np.array(new[slot], dtype=np.float32))
        return found


def _array(t: torch.Tensor | None):
    return None if t is None else t.numpy()
