"""Device memory accounting: what the relay holds on the accelerator, and its peak.

On CUDA the figures are the caching allocator's. On the CPU there is no separate device,
so the executor counts, when asked (RelayOptions.account_memory; it costs 1-2% of a step, so
it is off unless asked, as DeepSpeed's memory_breakdown), the bytes it holds as device
tensors: resident weights and their gradients, stashed layer inputs (with the "device"
policy), activations and gradients in flight between layers, and the tensors autograd saves
for the backward of the layer-micro-batch being computed (via saved-tensor hooks). Each
storage is counted once.
"""
from __future__ import annotations

import contextlib

import torch


def _storages(obj, out: dict[int, int], known: dict[int, int] | None = None) -> dict[int, int]:
    """Collect {storage pointer: bytes} of every tensor in nested lists/tuples/dicts (and of the
    gradient of a leaf that has one) into `out`, leaving out the storages `known` holds."""
    known = known or {}
    pending = [obj]
    while pending:
        obj = pending.pop()
        if isinstance(obj, torch.Tensor):
            if not obj.is_meta and obj.numel():
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in known:
                    out[ptr] = storage.nbytes()
            if obj.is_leaf and obj.requires_grad and obj.grad is not None:
                pending.append(obj.grad)
        elif isinstance(obj, dict):
            pending.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            pending.extend(obj)
    return out


class DeviceMemory:
    def __init__(self, device: torch.device, account: bool = False):
        self.device = device
        self.counting = device.type != "cuda" and account  # CUDA: the allocator counts
        self.peak_bytes = 0
        self.kept_peak_bytes = 0  # activations kept for the backward: the stash, graphs, cached op outputs
        self._reset_saved()

    def _reset_saved(self) -> None:
        # What autograd saved, counted as it is saved rather than walked at each sample (a step
        # samples once per layer and micro-batch, and the graphs in flight save many tensors):
        # by layer, the saved tensors; over all layers, each storage's (bytes, saved tensors on
        # it) and each saved leaf's (tensor, uses): a leaf's gradient comes and goes, so it is
        # counted at the sample.
        self._saved: dict[object, list[torch.Tensor]] = {}
        self._saved_storages: dict[int, tuple[int, int]] = {}
        self._saved_bytes = 0
        self._saved_leaves: dict[int, tuple[torch.Tensor, int]] = {}

    def reset(self) -> None:
        self.peak_bytes = self.kept_peak_bytes = 0
        self._reset_saved()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def sample(self, *held, kept=()) -> None:
        """Record the bytes of `held`, `kept` and autograd's saved tensors as a candidate peak, and
        of `kept` (what the relay keeps of the forward for the backward) and the saved tensors as
        a candidate peak of the activations kept. Each storage counts once."""
        if not self.counting:
            return
        leaf_grads = [leaf.grad for leaf, _ in self._saved_leaves.values() if leaf.grad is not None]
        beyond = _storages([list(kept), leaf_grads], {}, self._saved_storages)
        self.kept_peak_bytes = max(self.kept_peak_bytes, self._saved_bytes + sum(beyond.values()))
        beyond = _storages(list(held), beyond, self._saved_storages)
        self.peak_bytes = max(self.peak_bytes, self._saved_bytes + sum(beyond.values()))

    @contextlib.contextmanager
    def saving(self, layer=None):
        """Count what autograd saves for backward inside this block, as `layer`'s (until
        `drop_saved(layer)`)."""
        if not self.counting:  # no hook per saved tensor
            yield
            return
        def pack(t):
            self._saved.setdefault(layer, []).append(t)
            self._count(t, 1)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def _count(self, t: torch.Tensor, sign: int) -> None:
        """Add (sign 1) or take away (-1) one saved tensor: its storage's use and, for a leaf, its own."""
        if not t.is_meta and t.numel():
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            nbytes, uses = self._saved_storages.pop(ptr, (storage.nbytes(), 0))
            if uses + sign:
                self._saved_storages[ptr] = (nbytes, uses + sign)
            if uses == 0 or uses + sign == 0:  # the storage's first saved tensor came, or its last went
                self._saved_bytes += sign * nbytes
        if t.is_leaf and t.requires_grad:
            _, uses = self._saved_leaves.pop(id(t), (t, 0))
            if uses + sign:
                self._saved_leaves[id(t)] = (t, uses + sign)

    def drop_saved(self, layer=None) -> None:
        """Forget what `layer`'s graph saved (its backward ran); every layer's without one."""
        if layer is None:
            self._reset_saved()
            return
        for t in self._saved.pop(layer, ()):
            self._count(t, -1)

    def report(self) -> dict:
        if self.device.type == "cuda":
            return {"device": str(self.device), "source": "cuda allocator",
                    "peak_bytes": torch.cuda.max_memory_allocated(self.device)}
        if not self.counting:
            raise RuntimeError("memory_report(): on the CPU the relay counts its device memory only when asked: build "
                               "it with account_memory=True (l2l train --account-memory)")
        return {"device": str(self.device), "source": "relay accounting", "peak_bytes": self.peak_bytes,
                "kept_activation_peak_bytes": self.kept_peak_bytes}
