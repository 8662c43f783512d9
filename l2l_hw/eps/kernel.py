"""The update-kernel protocol: how one tensor is updated, on the buffers a storage's hold() gives.

    Kernel        run(what, rule, scalars, grad, src, dst) -> non-finite?; predict (delay compensation)
    UpdateRule    what a run computes besides its scalars: the rule, the state format, the working copy

The engine (l2l_hw/eps/engine.py) calls it; the kernels are HostKernel (l2l_hw/eps/cpu.py),
GoldenKernel (l2l_hw/eps/golden_eps.py) and RtlKernel (l2l_hw/eps/fpga.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from l2l_hw.eps import golden

CANONICAL_NAN = torch.tensor(golden.CANONICAL_NAN32, dtype=torch.int32).view(torch.float32)
CANONICAL_NANS = {torch.float32: CANONICAL_NAN,  # torch's own conversions keep or set other NaN bits
                  torch.bfloat16: torch.tensor(golden.CANONICAL_NAN_BF16, dtype=torch.int16).view(torch.bfloat16),
                  torch.float16: torch.tensor(golden.CANONICAL_NAN_FP16, dtype=torch.int16).view(torch.float16)}


@dataclass(frozen=True)
class UpdateRule:
    """What a kernel run computes besides its scalars: the rule, the state format, the working
    copy it writes (when the destinations hold one)."""

    optimizer: str
    state: str
    working_dtype: str
    nesterov: bool = False


class Kernel:
    """The update-kernel protocol: one tensor's update on the buffers a storage's hold() gives."""

    name = "abstract"
    memory = "host"  # the storage's memory it computes on (storage.Storage.memory)
    in_place = True  # False where a run can fail halfway through a tensor: updates then write spare buffers
    computes_on_host = False  # an update is computation on the host's cores (not another device's)
    slices = False  # runs on any contiguous slice of a tensor's buffers (element-wise rules: chunked updates)

    def configure(self, threads: int | None) -> None:
        """The relay's thread policy: the host threads an update may compute with."""

    def prepare(self, shapes: dict[str, torch.Size]) -> None:
        """A group of these tensors is registered: ready what its runs need."""

    def run(self, what: str, rule: UpdateRule, s, grad: torch.Tensor, src: dict, dst: dict) -> bool:
        """One tensor's update (`what` names it in errors): read `src` (param, m, v and their
        pieces), write `dst` (some of param, m, v, working; a destination may be its own
        source). Returns whether the gradient (times the inverse loss scale) held a
        non-finite value."""
        raise NotImplementedError

    def predict(self, rule: UpdateRule, s, grad: torch.Tensor, dst: dict) -> None:
        """Delay compensation "predict" (golden.predict_rule), after run() wrote `dst`: the weights
        the next step is predicted to reach into dst["working"], from dst's param and state, this
        run's gradient and the NEXT step's scalars `s`. Here torch float32 on the host, one rounding
        a statement as golden's (a kernel computing elsewhere has none: the engine refuses it)."""
        state = {slot: _decoded(dst, rule.state, slot) for slot in ("m", "v") if slot in dst}
        g = grad.reshape(dst["param"].shape).float()  # bf16 and fp16 widen exactly
        q = golden.predict_rule(rule.optimizer, s, dst["param"], state.get("m"), state.get("v"), g, _sqrt32)
        w = dst["working"]
        q = q.reshape(w.shape).to(w.dtype)  # bf16 / fp16: round to nearest even
        w.copy_(torch.where(torch.isnan(q), CANONICAL_NANS[w.dtype], q))  # as golden's canonical NaNs

    def close(self) -> None:
        """Release the kernel's threads and device memory."""


def _sqrt32(x: torch.Tensor) -> torch.Tensor:
    """The float32 square root correctly rounded, as the rule's (torch's own float32 sqrt on the CPU is
    not: 1 ulp off in ~15% of values); a float64 root rounded once to float32 is exact."""
    return torch.sqrt(x.double()).float()


def _decoded(dst: dict[str, torch.Tensor], state: str, slot: str) -> torch.Tensor:
    """m or v of a kernel run's destinations as float32 (shaped as param), decoded as golden.decode_state."""
    if state == "fp32":
        return dst[slot].reshape(dst["param"].shape)
    if state == "bf16":
        return dst[slot].reshape(dst["param"].shape).float()  # exact
    stored = golden.state_arrays({piece: dst[piece].reshape(-1) for piece in (slot, f"{slot}_scale")})
    return torch.from_numpy(golden.decode_state(stored, state, slot)).reshape(dst["param"].shape)
