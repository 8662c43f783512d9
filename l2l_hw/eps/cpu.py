"""CPU-DRAM EPS: fp32 master weights and optimizer state in host memory.

Updates run on one worker thread, in the order the relay pushes them, so the update
of layer i overlaps the backward of layer i-1 on the caller's thread. Each tensor's
update is one call of the fused host kernel (host/l2l_host_kernel.c through
l2l_hw/eps/host_kernel.py): gradient in (fp32, bf16 or fp16, no conversion pass),
unscale, non-finite check, `golden.apply_rule` bit for bit, working copy out, in one
pass over memory, on `threads` threads of its own (not torch's OpenMP team).

Buffers: every tensor has two copies of param, m, v and of the bf16/fp16 working copy.
An update reads the committed copy and writes the other ("spare"); a failure (a gradient
that cannot be moved to the CPU, a kernel error) therefore leaves the group exactly as it
was. The price is twice the state memory.
  - default: the copies are swapped as soon as every tensor of the group has been
    written, on the worker thread; `fetch` waits for the group's pending update.
  - double_buffer=True (step-level, see EPS.commit_step): the copies are swapped for
    every group at commit, so a step can be discarded whole; param and working copy get
    a third copy holding the version one commit back, for fetch(previous=True)
    (PipeDream-2BW computes on it while the update writes the newest).
"""
from __future__ import annotations

import torch

from l2l_hw.eps import host_kernel
from l2l_hw.eps.base import EPS, STATE_SLOTS, WORKING_DTYPES, OptimConfig, register_backend
from l2l_hw.eps.golden import step_scalars
from l2l_hw.eps.worker import UpdateWorker


@register_backend("cpu")
class CpuEps(EPS):
    def __init__(self, config: OptimConfig, working_dtype: str = "fp32", double_buffer: bool = False,
                 threads: int | None = None, isa: str | None = None):
        super().__init__(config, working_dtype, double_buffer)
        host_kernel.library()  # no silent slow path: say now, and how to build it, if it is missing
        self.isa = host_kernel.resolve_isa(isa)  # argument, else $L2L_HOST_ISA, else the widest the CPU has
        self.threads = host_kernel.default_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        # Pinned host memory lets the relay's copy stream move weights asynchronously.
        self._pin = torch.cuda.is_available()
        # state[key][name] is the committed {param, m, v, working}; spare[key][name] the buffers
        # updates write; previous[key][name] {param, working} one commit back (double_buffer only).
        self.state: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self.spare: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self.previous: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self._worker = UpdateWorker()
        self._written: dict[str, set[str]] = {}  # double buffering: tensors updated in the step, per group

    def _host(self, shape, dtype=torch.float32) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self._pin)

    def _slots_updated(self) -> tuple[str, ...]:
        """State slots the rule writes: SGD without momentum leaves m as it is."""
        cfg = self.config
        return ("param",) + (() if cfg.optimizer == "sgd" and cfg.momentum == 0 else STATE_SLOTS[cfg.optimizer])

    def _register(self, key, params):
        for name, p in params.items():
            self._load(key, name, {"param": p})

    def _load(self, key, name, slots):
        p = slots["param"]
        entry = {"param": self._host(p.shape).copy_(p)}
        for slot in STATE_SLOTS[self.config.optimizer]:
            entry[slot] = self._host(p.shape).copy_(slots[slot]) if slot in slots else self._host(p.shape).zero_()
        spare = {slot: self._host(p.shape) for slot in self._slots_updated()}
        if self.working_dtype != "fp32":
            low = WORKING_DTYPES[self.working_dtype]
            entry["working"], spare["working"] = self._host(p.shape, low), self._host(p.shape, low)
            # The working copy of the loaded weights: the kernel's conversion, from a zero-step SGD
            # (p - 0 * 0 = p for finite p; NaN stays canonical NaN).
            self._convert(entry["param"], entry["working"])
        self.state.setdefault(key, {})[name] = entry
        self.spare.setdefault(key, {})[name] = spare
        if self.double_buffer:  # before the first commit the previous version is the loaded one
            self.previous.setdefault(key, {})[name] = {
                slot: entry[slot].clone() for slot in ("param", "working") if slot in entry}

    def _load_previous(self, key, name, working):
        slot = "param" if self.working_dtype == "fp32" else "working"
        self.previous[key][name][slot].copy_(working)

    def _convert(self, param: torch.Tensor, working: torch.Tensor) -> None:
        """Round-to-nearest-even working copy of `param`, by the kernel's own conversion."""
        zero = step_scalars(OptimConfig(optimizer="sgd", lr=0.0), 1)
        scratch = torch.empty_like(param)
        host_kernel.step("sgd", zero, torch.zeros_like(param), param, param_out=scratch, working_out=working,
                         isa=self.isa, threads=self.threads)

    def _tensors(self, key, name):
        return {slot: t for slot, t in self.state[key][name].items() if slot != "working"}

    def _fetch(self, key, previous=False):
        if not self.double_buffer:  # double buffered: updates write the spare, fetch need not wait
            self.found_nonfinite |= self._worker.result(key)
        entries = self.previous[key] if previous and self.double_buffer else self.state[key]
        slot = "param" if self.working_dtype == "fp32" else "working"
        return {name: e[slot] for name, e in entries.items()}

    def _push(self, key, grads, inv_scale):
        s = step_scalars(self.config, self.step + 1, inv_scale)
        self._worker.submit(key, self._update, key, grads, s)

    def _update(self, key, grads, s):
        """Worker thread: write every tensor's new state into its spare buffers, then swap them in."""
        found = False
        for name, grad in grads.items():
            e, out = self.state[key][name], self.spare[key][name]
            g = grad.detach().to("cpu").contiguous()  # fp32, bf16 or fp16 as it came: the kernel widens it
            found |= host_kernel.step(
                self.config.optimizer, s, g, e["param"], e.get("m"), e.get("v"),
                param_out=out["param"], m_out=out.get("m"), v_out=out.get("v"), working_out=out.get("working"),
                isa=self.isa, threads=self.threads)
        if not self.double_buffer:  # commit the group: nothing above changed its committed buffers
            for name in grads:
                self._rotate(key, name)
        else:
            self._written.setdefault(key, set()).update(grads)
        return found

    def _rotate(self, key, name):
        """spare -> committed; with double buffering committed param/working -> previous -> spare."""
        e, out, prev = self.state[key][name], self.spare[key][name], self.previous.get(key, {}).get(name)
        for slot in out:
            if prev is not None and slot in prev:
                e[slot], prev[slot], out[slot] = out[slot], e[slot], prev[slot]
            else:
                e[slot], out[slot] = out[slot], e[slot]

    def _swap(self):
        for key, group in self.state.items():
            written = self._written.pop(key, set())
            for name, e in group.items():
                if name in written:
                    self._rotate(key, name)
                else:  # unchanged in the step: its version one step back is the committed one
                    for slot, t in self.previous.get(key, {}).get(name, {}).items():
                        t.copy_(e[slot])

    def discard_step(self):
        super().discard_step()  # waits for the updates first; they wrote only spare buffers
        self._written.clear()

    def wait(self):
        self.found_nonfinite |= self._worker.wait()

    def __del__(self):
        if hasattr(self, "_worker"):
            self._worker.shutdown(wait=False)
