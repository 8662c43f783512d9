"""The relay executor: layer-major forward and backward over micro-batches.

    forward   for layer i = 0..L-1: fetch w_i (prefetched during layer i-1), run it on
              every micro-batch, stash each micro-batch's input of layer i
    last      the last layer runs forward, loss and backward at once per micro-batch
    backward  for layer i = L-2..0: fetch w_i, recompute layer i per micro-batch with
              its forward RNG state replayed, backprop, accumulate dW_i over
              micro-batches, push dW_i to the EPS (its update overlaps layer i-1)
              (recompute=False keeps each layer's forward graph instead: one forward
              less per step, at the memory cost of every layer's intermediates)
    commit    the EPS finishes the step's updates

A parameter used by several layers (tied embedding and head) belongs to the EPS group
of the first layer that uses it; its gradient accumulates over every use and is pushed
once, after its last use in the backward sweep.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call

from l2l_hw.eps.base import EPS
from l2l_hw.relay.prefetch import WeightStream

Activation = torch.Tensor | tuple  # what a layer takes and returns


class RelayError(RuntimeError):
    """A layer or the loss failed inside the relay; the message names the layer and shapes."""


@dataclass
class LayerPlan:
    """Where each of one layer's tensors lives."""

    module: nn.Module
    bindings: dict[str, tuple[str, str]] = field(default_factory=dict)  # module name -> (EPS group, name)
    frozen: dict[str, torch.Tensor] = field(default_factory=dict)  # parameters with requires_grad False
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # host copies, updated in place

    @property
    def groups(self) -> list[str]:
        return sorted({key for key, _ in self.bindings.values()})


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(_describe(t) for t in x) + ")"
    return type(x).__name__


def _flatten(x: Activation) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _unflatten(like: Activation, items: list) -> Activation:
    return items[0] if isinstance(like, torch.Tensor) else tuple(items)


def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class Relay:
    """Train `layers` with their weights in `eps`, one layer at a time on `device`."""

    def __init__(self, layers: nn.Sequential | Sequence[nn.Module], loss_fn: Callable, eps: EPS,
                 device: str | torch.device = "cpu", micro_batches: int = 1, recompute: bool = True):
        self.layers = list(layers)
        if not self.layers:
            raise ValueError("Relay needs at least one layer")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"layer {i} is a {type(layer).__name__}; layers must be torch.nn.Module instances")
        if not isinstance(eps, EPS):
            raise TypeError(f"eps must be an EPS from l2l_hw.make_eps(...), got {type(eps).__name__}")
        if int(micro_batches) < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.loss_fn = loss_fn
        self.eps = eps
        self.device = torch.device(device)
        self.micro_batches = int(micro_batches)
        self.recompute = bool(recompute)
        self.plans = self._plan()
        self.weights = WeightStream(eps, self.device)
        # Layers that use each EPS group: it is pushed after its lowest user's backward.
        self.users: dict[str, list[int]] = {}
        for i, plan in enumerate(self.plans):
            for key in plan.groups:
                self.users.setdefault(key, []).append(i)

    # -- set-up ---------------------------------------------------------------
    def _plan(self) -> list[LayerPlan]:
        owner: dict[int, tuple[str, str]] = {}  # id(parameter) -> (EPS group, name)
        plans = []
        for i, module in enumerate(self.layers):
            plan = LayerPlan(module)
            own: dict[str, torch.Tensor] = {}
            for name, p in module.named_parameters():
                if not p.requires_grad:
                    plan.frozen[name] = p.detach()
                    continue
                if id(p) not in owner:
                    owner[id(p)] = (f"layer{i}", name)
                    own[name] = p
                plan.bindings[name] = owner[id(p)]
            plan.buffers = {name: b for name, b in module.named_buffers()}
            if own:
                self.eps.register(f"layer{i}", own)
            plans.append(plan)
        return plans

    @property
    def step(self) -> int:
        return self.eps.step

    # -- one layer on one micro-batch -------------------------------------------
    def _call(self, i: int, x: Activation, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]):
        plan = self.plans[i]
        frozen = {n: t.to(self.device) for n, t in plan.frozen.items()}
        try:
            out = functional_call(plan.module, {**params, **frozen, **buffers}, (x,))
        except Exception as exc:
            raise RelayError(f"layer {i} ({type(plan.module).__name__}) failed on an input of "
                             f"{_describe(x)}: {exc}") from exc
        if not (isinstance(out, torch.Tensor) or
                (isinstance(out, (tuple, list)) and out and all(isinstance(t, torch.Tensor) for t in out))):
            raise RelayError(f"layer {i} ({type(plan.module).__name__}) returned {_describe(out)}; "
                             f"a layer must return a tensor or a tuple of tensors")
        return out if isinstance(out, torch.Tensor) else tuple(out)

    def _loss(self, out, target) -> torch.Tensor:
        try:
            loss = self.loss_fn(out, target)
        except Exception as exc:
            raise RelayError(f"loss_fn failed on output {_describe(out)} and targets {_describe(target)}: {exc}") from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise RelayError(f"loss_fn returned {_describe(loss)}; it must return the mean loss of the "
                             f"micro-batch as a scalar tensor")
        return loss.reshape(())

    def _params(self, i: int, live: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Layer i's device parameters by module name, fetching groups not yet on the device."""
        for key in self.plans[i].groups:
            if key not in live:
                live[key] = {n: t.detach().requires_grad_(t.is_floating_point())
                             for n, t in self.weights.get(key).items()}
        return {name: live[key][gname] for name, (key, gname) in self.plans[i].bindings.items()}

    def _device_buffers(self, i: int, snapshot: dict | None = None) -> dict[str, torch.Tensor]:
        source = snapshot if snapshot is not None else self.plans[i].buffers
        return {n: b.to(self.device) for n, b in source.items()}

    def _store_buffers(self, i: int, device_buffers: dict[str, torch.Tensor]) -> None:
        for n, b in self.plans[i].buffers.items():
            if device_buffers[n] is not b:
                b.copy_(device_buffers[n])

    # -- the batch --------------------------------------------------------------
    def _split(self, inputs, targets):
        """Split into micro-batches along dim 0; weights n_j / B make the loss the minibatch mean."""
        def batch_size(x, what):
            items = _flatten(x) if isinstance(x, (torch.Tensor, tuple, list)) else None
            if not items or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in items):
                raise ValueError(f"{what} must be a tensor or a tuple of tensors with a batch dimension, "
                                 f"got {_describe(x)}")
            sizes = {t.shape[0] for t in items}
            if len(sizes) != 1:
                raise ValueError(f"the tensors of {what} disagree on the batch size: {_describe(x)}")
            return sizes.pop()

        n = batch_size(inputs, "inputs")
        if batch_size(targets, "targets") != n:
            raise ValueError(f"inputs have batch size {n} but targets have {batch_size(targets, 'targets')}")
        if self.micro_batches > n:
            raise ValueError(f"micro_batches={self.micro_batches} is larger than the batch ({n} samples); "
                             f"use at most {n}")

        def split(x):
            parts = [torch.tensor_split(t, self.micro_batches) for t in _flatten(x)]
            return [_unflatten(x, [p[j].to(self.device) for p in parts]) for j in range(self.micro_batches)]

        xs, ts = split(inputs), split(targets)
        weights = [_flatten(t)[0].shape[0] / n for t in ts]
        return xs, ts, weights

    def train_step(self, inputs, targets) -> float:
        """One optimizer step on the minibatch; returns its mean loss."""
        xs, ts, weights = self._split(inputs, targets)
        L, u = len(self.layers), self.micro_batches
        live: dict[str, dict[str, torch.Tensor]] = {}  # EPS groups on the device now
        # Per layer i < L-1 and micro-batch j: the input, the RNG state and the buffers the
        # forward saw (for the recompute), or the forward graph (without recompute).
        stash, rng, buffer_snapshots, graphs = [], [], [], []
        acts = xs
        try:
            # Forward, layer-major.
            for i in range(L - 1):
                params = self._params(i, live)
                self.weights.prefetch([k for k in self.plans[i + 1].groups if k not in live])
                stash.append(acts)
                rng.append([])
                buffer_snapshots.append([])
                graphs.append([])
                outs = []
                with torch.set_grad_enabled(not self.recompute):
                    for j in range(u):
                        if self.recompute:
                            rng[i].append(_rng_state(self.device))
                            buffer_snapshots[i].append({n: b.clone() for n, b in self.plans[i].buffers.items()})
                        x = acts[j] if self.recompute else self._grad_leaf(acts[j])
                        bufs = self._device_buffers(i)
                        out = self._call(i, x, params, bufs)
                        self._store_buffers(i, bufs)
                        if not self.recompute:
                            graphs[i].append((x, out))
                            out = _unflatten(out, [t.detach() for t in _flatten(out)])
                        outs.append(out)
                if self.recompute:
                    self._release(i, live, backward=False)
                acts = outs

            # Last layer: forward, loss and backward together, micro-batch by micro-batch.
            total = torch.zeros((), dtype=torch.float32, device=self.device)
            params = self._params(L - 1, live)
            if L > 1:
                self.weights.prefetch([k for k in self.plans[L - 2].groups if k not in live])
            grads_in = []
            for j in range(u):
                x = self._grad_leaf(acts[j])
                bufs = self._device_buffers(L - 1)
                loss = self._loss(self._call(L - 1, x, params, bufs), ts[j])
                self._store_buffers(L - 1, bufs)
                (loss * weights[j]).backward()
                total += loss.detach().float() * weights[j]
                grads_in.append(self._input_grads(x))
            self._release(L - 1, live, backward=True)

            # Backward, reverse layer order, recomputing each layer per micro-batch.
            for i in range(L - 2, -1, -1):
                params = self._params(i, live)
                if i > 0:
                    self.weights.prefetch([k for k in self.plans[i - 1].groups if k not in live])
                grads_out, grads_in = grads_in, []
                for j in range(u):
                    if self.recompute:
                        x = self._grad_leaf(stash[i][j])
                        saved = _rng_state(self.device)
                        _set_rng_state(self.device, rng[i][j])
                        try:
                            out = self._call(i, x, params, self._device_buffers(i, buffer_snapshots[i][j]))
                        finally:
                            _set_rng_state(self.device, saved)
                    else:
                        x, out = graphs[i][j]
                    pairs = [(o, g) for o, g in zip(_flatten(out), grads_out[j]) if g is not None and o.requires_grad]
                    if pairs:
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                    grads_in.append(self._input_grads(x))
                stash[i] = graphs[i] = None  # this layer's inputs are done with
                self._release(i, live, backward=True)
        except BaseException:
            self.weights.clear()
            self.eps.wait()  # let scheduled updates finish before the error propagates
            raise
        self.eps.commit_step()
        return float(total)

    @staticmethod
    def _grad_leaf(x: Activation) -> Activation:
        return _unflatten(x, [t.detach().requires_grad_(t.is_floating_point()) for t in _flatten(x)])

    @staticmethod
    def _input_grads(x: Activation) -> list[torch.Tensor | None]:
        return [t.grad if t.grad is not None or not t.requires_grad else torch.zeros_like(t)
                for t in _flatten(x)]

    def _release(self, i: int, live: dict, backward: bool) -> None:
        """Drop device weights layer i no longer needs; after its last backward use, push the gradients."""
        for key in self.plans[i].groups:
            users = self.users[key]
            if backward and i == users[0]:
                tensors = live.pop(key)
                self.eps.push_grads(key, {n: t.grad for n, t in tensors.items() if t.grad is not None})
            elif not backward and len(users) == 1:
                live.pop(key)  # fetched again for the backward sweep

    # -- evaluation and export -------------------------------------------------
    @torch.no_grad()
    def evaluate(self, inputs, targets) -> float:
        """Mean loss on a minibatch, layer-major, in eval mode; no update."""
        xs, ts, weights = self._split(inputs, targets)
        modes = [m.training for m in self.layers]
        for m in self.layers:
            m.train(False)
        live: dict[str, dict[str, torch.Tensor]] = {}
        try:
            acts = xs
            for i in range(len(self.layers)):
                params = self._params(i, live)
                acts = [self._call(i, a, params, self._device_buffers(i)) for a in acts]
            total = sum(float(self._loss(a, t)) * w for a, t, w in zip(acts, ts, weights))
        finally:
            self.weights.clear()
            for m, mode in zip(self.layers, modes):
                m.train(mode)
        return total

    def materialize(self) -> nn.Sequential:
        """The trained model as an nn.Sequential on the CPU with the fp32 master weights."""
        model = copy.deepcopy(nn.Sequential(*self.layers)).to("cpu")
        masters = {key: self.eps.master(key) for key in self.users}
        for layer, plan in zip(model, self.plans):
            for name, p in layer.named_parameters():
                if name in plan.bindings:
                    key, gname = plan.bindings[name]
                    p.data.copy_(masters[key][gname])
        return model

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"eps/{k}": v for k, v in self.eps.state_dict().items()}
        for i, plan in enumerate(self.plans):
            state.update({f"buffers/{i}/{n}": b.detach().clone() for n, b in plan.buffers.items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.eps.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("eps/")})
        for i, plan in enumerate(self.plans):
            for n, b in plan.buffers.items():
                name = f"buffers/{i}/{n}"
                if name not in state:
                    raise KeyError(f"checkpoint has no buffer {name}; was it saved from another model?")
                b.copy_(state[name])
