"""The CPU EPS's update kernel: the fused host kernel, on host memory (RAM or a state_dir).

Each tensor's update is one call of host/l2l_host_kernel.c through
l2l_hw/eps/host_kernel.py: gradient in (fp32, bf16 or fp16, no conversion pass), unscale,
non-finite check, `golden.apply_rule` bit for bit, working copy out, in one pass over
memory, on `threads` threads of its own (not torch's OpenMP team). The engine
(l2l_hw/eps/engine.py) runs it on its update thread, or between layers where the relay
computes on the same cores.

Once the group's gradients are on the host nothing can fail, so updates run in place:
one copy of param, m, v and the working copy (12 B/parameter with Adam and an fp32
working copy, 14 with bf16; `state="bf16"` 10, `state="8bit"` 8.03 with bf16). Only the
working copy crosses to an accelerator; it alone is pinned, and only when the relay runs
on CUDA. With `state_dir` the same kernel runs on the region images of l2l_hw/eps/disk.py.
Muon's matrices are matrix work, not the kernel's: their updates run in torch (l2l_hw/eps/muon.py).
"""
from __future__ import annotations

from l2l_hw.eps import host_kernel, muon
from l2l_hw.eps.base import OptimConfig
from l2l_hw.eps.engine import Kernel
from l2l_hw.eps.registry import register_backend


class HostKernel(Kernel):
    name = "host"
    computes_on_host = True
    slices = True  # element-wise over any contiguous slice (engine.UPDATE_CHUNK)

    def __init__(self, threads: int | None = None, isa: str | None = None):
        host_kernel.library()  # no silent slow path: say now, and how to build it, if it is missing
        self.isa = host_kernel.resolve_isa(isa)  # argument, else $L2L_HOST_ISA, else the widest the CPU has
        self.threads = host_kernel.default_threads() if threads is None else threads
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")

    def configure(self, threads):
        if threads is not None:
            self.threads = threads

    def run(self, what, rule, s, grad, src, dst):
        if rule.optimizer == "muon":  # matrix work: torch on the host (l2l_hw/eps/muon.py)
            return muon.step(s, grad, src, dst, rule.state, rule.working_dtype)
        return host_kernel.step(rule.optimizer, s, grad, src["param"], src.get("m"), src.get("v"),
                                param_out=dst["param"], m_out=dst.get("m"), v_out=dst.get("v"),
                                working_out=dst.get("working"), state=rule.state,
                                m_scale=src.get("m_scale"), v_scale=src.get("v_scale"),
                                m_scale_out=dst.get("m_scale"), v_scale_out=dst.get("v_scale"),
                                isa=self.isa, threads=self.threads)


@register_backend("cpu")
def cpu(config: OptimConfig, state: str = "fp32", threads: int | None = None, isa: str | None = None) -> HostKernel:
    """`make_eps("cpu", threads=..., isa=...)`: the host kernel (in RAM, or on files with state_dir)."""
    return HostKernel(threads, isa)
