"""Device memory accounting: what the relay holds on the accelerator, and its peak.

On CUDA the figures are the caching allocator's. On the CPU there is no separate
device, so the executor counts the bytes it holds as device tensors: resident
weights and their gradients, stashed layer inputs (with the "device" policy),
activations and gradients in flight between layers, and the tensors autograd saves
for the backward of the layer-micro-batch being computed (via saved-tensor hooks).
Each storage is counted once.
"""
from __future__ import annotations

import contextlib

import torch


def _storages(obj, out: dict[int, int]) -> dict[int, int]:
    """Collect {storage pointer: bytes} of every tensor in nested lists/tuples/dicts."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta" and obj.numel():
            storage = obj.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
        grad = obj.grad if obj.is_leaf and obj.requires_grad else None
        if grad is not None:
            _storages(grad, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _storages(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _storages(v, out)
    return out


class DeviceMemory:
    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes = 0
        self.kept_peak_bytes = 0  # activations kept for the backward: the stash, graphs, cached op outputs
        self._saved: dict[object, list[torch.Tensor]] = {}  # tensors autograd saved, by layer

    def reset(self) -> None:
        self.peak_bytes = self.kept_peak_bytes = 0
        self._saved = {}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def sample(self, *held, kept=()) -> None:
        """Record the bytes of `held`, `kept` and autograd's saved tensors as a candidate peak, and
        of `kept` (what the relay keeps of the forward for the backward) and the saved tensors as
        a candidate peak of the activations kept."""
        if self.device.type == "cuda":
            return  # the allocator keeps its own peak
        activations = _storages([list(kept), [t for saved in self._saved.values() for t in saved]], {})
        self.kept_peak_bytes = max(self.kept_peak_bytes, sum(activations.values()))
        self.peak_bytes = max(self.peak_bytes, sum(_storages(list(held), activations).values()))

    @contextlib.contextmanager
    def saving(self, layer=None):
        """Count what autograd saves for backward inside this block, as `layer`'s (until
        `drop_saved(layer)`)."""
        if self.device.type == "cuda":  # the allocator keeps the peak: no hook per saved tensor
            yield
            return
        saved = self._saved.setdefault(layer, [])

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def drop_saved(self, layer=None) -> None:
        """Forget what `layer`'s graph saved (its backward ran); every layer's without one."""
        if layer is None:
            self._saved = {}
        else:
            self._saved.pop(layer, None)

    def report(self) -> dict:
        if self.device.type == "cuda":
            return {"device": str(self.device), "source": "cuda allocator",
                    "peak_bytes": torch.cuda.max_memory_allocated(self.device)}
        return {"device": str(self.device), "source": "relay accounting", "peak_bytes": self.peak_bytes,
                "kept_activation_peak_bytes": self.kept_peak_bytes}
