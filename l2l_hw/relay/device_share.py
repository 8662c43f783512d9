"""The device share of the update: the first k layers' weights and optimizer state live on the
device and are updated there, so that the host never makes the device wait.

The backward pushes the last layer first and layer 0 last, and the next forward needs layer 0
first: the host's updates of the first layers are the ones the device would wait for. Where
the host cannot update every layer within the device's compute of a step, the first k layers
(pushed last, needed first) keep fp32 master weights and AdamW's m and v on the device, and
PyTorch's own AdamW (fused: one kernel over the group) updates them as the step commits, on
the device's stream, after the backward. Deep Optimizer States (arXiv 2410.21316) and
Megatron's `offload_fraction` make the same split; here `plan_device_share` picks k per model
and batch from a simulation of the step (below), and `device_update_layers` overrides it.

    DeviceShare   an EPS around the host's: the shared groups' fetch gives their device
                  tensors (no transfer), their push is held on the device until the commit;
                  every other call goes to the host EPS. Checkpoints and state_dict hold the
                  same entries whatever k is (fp32 param, m, v), so a run resumes with another k.
    plan_device_share
                  the smallest k whose predicted device wait is within 1% of a step of the
                  least any k gives, within the device memory left.

Global clipping and an overflow skip need nothing more: the shared groups update at the commit,
when the clip factor and the step's non-finite flag are known.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from l2l_hw.eps.base import EPS, OptimConfig, PendingFetch, StateEntry, WORKING_DTYPES, check_state_mapping, \
    new_group, tensor_of

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}  # what PyTorch updates with one fused kernel
SLOTS = ("param", "m", "v")  # what a shared tensor keeps, as the host EPS's exact state stores it
# Device bytes a shared parameter takes: fp32 master, m and v (12), and 4 more: its fp32 gradient held
# from the backward to the commit, or in bf16 / fp16 that gradient and the working copy the layers use.
DEVICE_BYTES_PER_PARAMETER = 16


def share_problem(eps: EPS, layers: int, k: int, stale: bool = False) -> str | None:
    """Why `eps` cannot give the first `k` of `layers` layers a device share (None: it can);
    `stale`: the relay computes on the weights one step back (PipeDream-2BW)."""
    if k > layers:
        return f"is beyond the model: it has {layers} layers (give 0 to {layers})"
    if k == 0:
        return None
    if stale:
        return ("updates at each commit, keeping no previous version; PipeDream-2BW computes on the one before "
                "(give 0)")
    if eps.sharded:
        return "needs whole tensors on each rank: a sharded EPS (shard_state) keeps slices (give 0)"
    kernel = getattr(eps, "kernel", None)
    if kernel is None or kernel.memory != "host" or kernel.name == "rtl":
        return (f"moves updates from the host to the device: the {eps.name} EPS updates in its own kernel "
                f"(the RTL), which a device share would bypass (give 0)")
    if eps.config.optimizer not in OPTIMIZERS:
        return (f"updates with PyTorch's fused AdamW or Adam; the EPS's optimizer is {eps.config.optimizer} "
                f"(give 0, or optimizer adamw or adam)")
    if eps.state_format != "fp32":
        return (f"keeps AdamW's m and v in fp32 on the device; the EPS keeps {eps.state_format} state, which a "
                "checkpoint could not hold for both (give 0, or fp32 optimizer state)")
    if eps.delay_compensation != "none":
        return "updates the newest weights; delay compensation predicts them on the host (give 0)"
    return None


def device_free_bytes(device: torch.device) -> int | None:
    """Memory free on a CUDA device; None for the CPU (the device is host memory)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


class DeviceShare(EPS):
    """`host` with the groups `shared` kept and updated on `device` (module docstring)."""

    name = "device-share"

    def __init__(self, host: EPS, shared: set[str], device: torch.device):
        self.host, self.shared, self.device = host, frozenset(shared), torch.device(device)
        self.shapes: dict[str, dict[str, torch.Size]] = {}
        self.masters: dict[str, dict[str, torch.Tensor]] = {}  # fp32, updated in place
        self.working: dict[str, dict[str, torch.Tensor]] = {}  # what the layers compute on
        self.held: dict[str, tuple[dict[str, torch.Tensor], float]] = {}  # the step's pushes, until the commit
        self.optimizer: torch.optim.Optimizer | None = None

    # -- what the host EPS says -------------------------------------------------
    @property
    def config(self) -> OptimConfig:
        return self.host.config

    @property
    def step(self) -> int:
        return self.host.step

    @property
    def working_dtype(self) -> str:
        return self.host.working_dtype

    @property
    def double_buffer(self) -> bool:
        return self.host.double_buffer

    @property
    def delay_compensation(self) -> str:
        return self.host.delay_compensation

    @property
    def storage(self):
        """The host EPS's storage (the disk tier's files, where it has them)."""
        return self.host.storage

    def on_device(self, key: str) -> bool:
        return key in self.shared

    def lr_at(self, step: int) -> float:
        return self.host.lr_at(step)

    # -- set-up -------------------------------------------------------------------
    def configure(self, working_dtype=None, double_buffer=None, defer_updates=None, device=None, threads=None,
                  inline=None) -> None:
        self.host.configure(working_dtype, double_buffer, defer_updates, device, threads, inline)

    def expect(self, groups: dict[str, dict[str, torch.Size]]) -> None:
        self.host.expect({key: shapes for key, shapes in groups.items() if key not in self.shared})

    def register(self, key: str, params: dict[str, torch.Tensor], no_decay: frozenset[str] = frozenset()) -> None:
        if key not in self.shared:
            self.host.register(key, params, no_decay)
            self.shapes[key] = self.host.shapes[key]
            return
        masters = {n: p.to(self.device) for n, p in new_group(self.shapes, key, params, no_decay).items()}
        self.masters[key] = masters
        self.working[key] = self._working(masters)
        cfg = self.config
        for decays in (True, False):
            params = [p for n, p in masters.items() if (n not in no_decay) == decays]
            if not params:
                continue
            group = {"params": params, "weight_decay": cfg.weight_decay if decays else 0.0}
            if self.optimizer is None:
                self.optimizer = OPTIMIZERS[cfg.optimizer]([group], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                                           fused=True)
            else:
                self.optimizer.add_param_group(group)
            for p in params:  # the state the checkpoints read and load, made now
                self.optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=self.device),
                                           "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def _working(self, masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dtype = WORKING_DTYPES[self.working_dtype]
        return masters if dtype == torch.float32 else {n: p.to(dtype) for n, p in masters.items()}

    def expect_step(self, fetches: list[str], updates: list[str]) -> None:
        self.host.expect_step([k for k in fetches if k not in self.shared],
                              [k for k in updates if k not in self.shared])

    # -- the step -------------------------------------------------------------------
    def fetch(self, key: str, previous: bool = False) -> dict[str, torch.Tensor]:
        if key not in self.shared:
            return self.host.fetch(key, previous=previous)
        if previous:
            raise ValueError(f"group {key!r} is updated on the device at each commit; it keeps no previous version "
                             "(PipeDream-2BW keeps every update on the host)")
        return dict(self.working[key])

    def fetch_async(self, key: str, previous: bool = False) -> PendingFetch:
        if key not in self.shared:
            return self.host.fetch_async(key, previous=previous)
        return PendingFetch(self.fetch(key, previous))

    def push_grads(self, key: str, grads: dict[str, torch.Tensor], inv_scale: float = 1.0) -> None:
        if key not in self.shared:
            self.host.push_grads(key, grads, inv_scale)
            return
        if key in self.held:
            raise RuntimeError(f"gradients for EPS group {key!r} were pushed twice in step {self.step + 1}")
        unknown = sorted(set(grads) - set(self.shapes[key]))
        if unknown:
            raise ValueError(f"gradients for EPS group {key!r} name unknown tensors {unknown}; "
                             f"the group holds {sorted(self.shapes[key])}")
        self.held[key] = (dict(grads), inv_scale)

    def commit_step(self, grad_scale: float = 1.0, skip_nonfinite: bool = False, wait: bool = True,
                    agree: Callable[[bool], bool] | None = None) -> bool:
        """The host's commit, told of a non-finite gradient held here; then, unless the step is
        skipped, the shared groups' update on the device with the step's learning rate."""
        found_here = skip_nonfinite and self._nonfinite()
        either = (lambda found: found or found_here)
        step = self.host.step + 1
        found = self.host.commit_step(grad_scale, skip_nonfinite, wait,
                                      agree=either if agree is None else (lambda found: agree(either(found))))
        if found and skip_nonfinite:
            self.held.clear()
            return True
        self._update(step, grad_scale)
        return found or found_here

    def _nonfinite(self) -> bool:
        grads = [g for held, _ in self.held.values() for g in held.values()]
        if not grads:
            return False
        return not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    @torch.no_grad()
    def _update(self, step: int, grad_scale: float) -> None:
        """PyTorch's AdamW (Adam) over the groups pushed this step, at step `step`'s learning rate."""
        if self.optimizer is None:
            self.held.clear()
            return
        for key, (grads, inv_scale) in self.held.items():
            factor = inv_scale * grad_scale
            for name, g in grads.items():
                p = self.masters[key][name]
                p.grad = g.to(torch.float32) if factor == 1.0 else g.to(torch.float32) * factor
                self.optimizer.state[p]["step"].fill_(step - 1)
        lr = self.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for key in self.held:
            for p in self.masters[key].values():
                p.grad = None
            self._refresh(key)
        self.held.clear()

    def _refresh(self, key: str) -> None:
        """The working copy again from the masters (nothing to do where they are one)."""
        for name, w in self.working[key].items():
            master = self.masters[key][name]
            if w is not master:
                w.copy_(master)

    def discard_step(self) -> None:
        self.held.clear()
        self.host.discard_step()

    def wait(self) -> None:
        self.host.wait()

    def master(self, key: str) -> dict[str, torch.Tensor]:
        if key not in self.shared:
            return self.host.master(key)
        return {n: p.detach().to("cpu", copy=True) for n, p in self.masters[key].items()}

    # -- checkpoints ------------------------------------------------------------------
    def _slot(self, key: str, name: str, slot: str) -> torch.Tensor:
        p = self.masters[key][name]
        return p if slot == "param" else self.optimizer.state[p]["exp_avg" if slot == "m" else "exp_avg_sq"]

    def state_entries(self) -> dict[str, StateEntry]:
        out = self.host.state_entries()
        for key in self.masters:
            for name, shape in self.shapes[key].items():
                for slot in SLOTS:
                    out[f"{key}/{name}/{slot}"] = StateEntry(
                        shape, torch.float32, lambda k=key, n=name, s=slot: self._slot(k, n, s).to("cpu"))
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor | StateEntry]) -> None:
        """The host's entries to the host, the shared groups' here; every shared entry checked
        before anything is written (the host EPS checks its own the same way)."""
        check_state_mapping(state)
        mine = {f"{key}/{name}/{slot}": shape for key in self.masters for name, shape in self.shapes[key].items()
                for slot in SLOTS}
        missing = sorted(set(mine) - set(state))
        if missing:
            raise ValueError(f"EPS state is missing {len(missing)} entries, e.g. {missing[:3]}; was it saved with "
                             f"another model, optimizer ({self.config.optimizer}) or state format?")
        for name, shape in mine.items():
            t = state[name]
            if t.shape != shape or t.dtype != torch.float32:
                raise ValueError(f"EPS state {name} is {t.dtype} {tuple(t.shape)}; expected torch.float32 "
                                 f"{tuple(shape)}")
        shared = tuple(f"{key}/" for key in self.masters)
        self.host.load_state_dict({k: v for k, v in state.items() if not k.startswith(shared)})
        with torch.no_grad():
            for name in mine:
                key, tensor, slot = name.split("/")
                self._slot(key, tensor, slot).copy_(tensor_of(state[name]))
        for key in self.masters:
            self._refresh(key)

    def close(self) -> None:
        self.host.close()
        self.masters.clear()
        self.working.clear()
        self.held.clear()
        self.optimizer = None


# -- how many layers ----------------------------------------------------------------------
@dataclass(frozen=True)
class SharePlan:
    layers: int  # k: layers 0..k-1 update on the device
    reason: str

    def describe(self) -> str:
        return f"device share of the update: {self.layers} layer(s) ({self.reason})"


def simulate_step(k: int, forward_s: Sequence[float], backward_s: Sequence[float], host_s: Sequence[float],
                  device_s: Sequence[float], steps: int = 3) -> tuple[float, float]:
    """The last of `steps` steps of the relay with layers 0..k-1 updated on the device: (step,
    device wait) in seconds. The device runs each layer's forward (`forward_s`), then every
    backward (`backward_s`, the last layer's loss included) from the last layer down, then the
    shared layers' updates (`device_s`); the host thread updates a layer (`host_s`) once its
    backward is done, the pushed layer the next forward needs first before the others, each update
    whole; a forward of a host layer waits for its update."""
    layers = len(forward_s)
    done = [0.0] * layers  # when layer i's newest update lands
    clock, host_free, step_s, wait_s = 0.0, 0.0, 0.0, 0.0
    for _ in range(steps):
        start, wait_s = clock, 0.0
        for i in range(layers):
            if i >= k and done[i] > clock:
                wait_s += done[i] - clock
                clock = done[i]
            clock += forward_s[i]
        pushed = []
        for i in range(layers - 1, -1, -1):
            clock += backward_s[i]
            if i >= k:
                pushed.append((clock, i))
        clock += sum(device_s[:k])
        while pushed:  # next-use order among what has been pushed when the host is free
            ready = [item for item in pushed if item[0] <= host_free] or [min(pushed)]
            at, i = min(ready, key=lambda item: item[1])
            pushed.remove((at, i))
            host_free = max(host_free, at) + host_s[i]
            done[i] = host_free
        step_s = clock - start
    return step_s, wait_s


def plan_device_share(layer_params: Sequence[int], compute_s: float, host_s_per_parameter: float,
                      device_s_per_parameter: float, free_bytes: int | None) -> SharePlan:
    """The smallest k whose predicted device wait is within 1% of a step of the least any k gives,
    among those whose state fits `free_bytes` (None: no bound). `compute_s`: the device's step
    (forward and backward of every layer), split over the layers by their parameters, a quarter
    forward (the backward runs the forward again)."""
    total = sum(layer_params)
    share = [n / total for n in layer_params]
    forward = [compute_s * f / 4 for f in share]
    backward = [compute_s * f * 3 / 4 for f in share]
    host = [n * host_s_per_parameter for n in layer_params]
    device = [n * device_s_per_parameter for n in layer_params]
    fits, held = 0, 0
    while fits < len(layer_params) and (free_bytes is None or
                                        held + layer_params[fits] * DEVICE_BYTES_PER_PARAMETER <= free_bytes):
        held += layer_params[fits] * DEVICE_BYTES_PER_PARAMETER
        fits += 1
    runs = [simulate_step(k, forward, backward, host, device) for k in range(fits + 1)]
    least = min(wait for _, wait in runs)
    k = next(k for k, (step, wait) in enumerate(runs) if wait <= least + 0.01 * step)
    step, wait = runs[k]
    bound = "" if fits == len(layer_params) else f"; {fits} fit the device's free memory"
    return SharePlan(k, f"host updates {sum(host) * 1e3:.0f} ms a step against {compute_s * 1e3:.0f} ms of device "
                        f"compute; predicted device wait {wait / step:.0%} of a step{bound}")


def time_device_update(device: torch.device, elements: int = 1 << 22, repeats: int = 3) -> float:
    """Seconds PyTorch's fused AdamW takes per parameter on `device` (the fastest of `repeats`)."""
    p = torch.zeros(elements, device=device)
    p.grad = torch.full_like(p, 1e-3)
    optimizer = torch.optim.AdamW([p], fused=True)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best / elements
