"""CPU-DRAM EPS: fp32 master weights and optimizer state in host memory.

The engine (l2l_hw/eps/engine.py) runs the updates on its update thread; each tensor's
update is one call of the fused host kernel (host/l2l_host_kernel.c through
l2l_hw/eps/host_kernel.py): gradient in (fp32, bf16 or fp16, no conversion pass),
unscale, non-finite check, `golden.apply_rule` bit for bit, working copy out, in one
pass over memory, on `threads` threads of its own (not torch's OpenMP team).

Once the group's gradients are on the host nothing can fail, so updates run in place:
one copy of param, m, v and the working copy (12 B/parameter with Adam and an fp32
working copy, 14 with bf16; `state="bf16"` 10, `state="8bit"` 8.03 with bf16). Only the working copy crosses to an accelerator; it alone
is pinned, and only when the relay runs on CUDA.
"""
from __future__ import annotations

import torch

from l2l_hw.eps import host_kernel
from l2l_hw.eps.base import OptimConfig
from l2l_hw.eps.engine import AsyncEps
from l2l_hw.eps.registry import register_backend


@register_backend("cpu")
class CpuEps(AsyncEps):
    in_place = True
    computes_on_host = True

    def __init__(self, config: OptimConfig, working_dtype: str = "fp32", double_buffer: bool = False,
                 threads: int | None = None, isa: str | None = None, state: str = "fp32"):
        super().__init__(config, working_dtype, double_buffer, state=state)
        host_kernel.library()  # no silent slow path: say now, and how to build it, if it is missing
        self.isa = host_kernel.resolve_isa(isa)  # argument, else $L2L_HOST_ISA, else the widest the CPU has
        self.threads = host_kernel.default_threads() if threads is None else threads
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")

    def configure(self, working_dtype=None, double_buffer=None, defer_updates=None, device=None, threads=None,
                  inline=None) -> None:
        super().configure(working_dtype, double_buffer, defer_updates, device, threads, inline)
        if threads is not None:
            self.threads = threads

    def _allocate(self, shape, dtype, fetched):
        # Pinned memory lets the relay's copy stream move the working copy asynchronously.
        return torch.empty(shape, dtype=dtype, pin_memory=fetched and self.pin_fetched)

    def _write(self, buf, values):
        buf.copy_(values)

    def _read(self, buf, shape, dtype):
        return buf

    def _run(self, key, name, optimizer, s, grad, src, dst):
        return host_kernel.step(optimizer, s, grad, src["param"], src.get("m"), src.get("v"),
                                param_out=dst["param"], m_out=dst.get("m"), v_out=dst.get("v"),
                                working_out=dst.get("working"), state=self.state_format,
                                m_scale=src.get("m_scale"), v_scale=src.get("v_scale"),
                                m_scale_out=dst.get("m_scale"), v_scale_out=dst.get("v_scale"),
                                isa=self.isa, threads=self.threads)
