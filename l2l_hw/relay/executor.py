"""The relay executor: layer-major forward and backward over micro-batches.

    forward   for layer i = 0..L-1: fetch w_i (prefetched during layer i-1), run it on
              every micro-batch, stash each micro-batch's input of layer i
    last      the last layer runs forward, loss and backward at once per micro-batch
    backward  for layer i = L-2..0: fetch w_i, recompute layer i per micro-batch with
              its forward RNG state replayed, backprop, accumulate dW_i over
              micro-batches (in fp32 whatever the compute dtype: precision.GradSums),
              push dW_i to the EPS, rounded once to the working dtype (its update
              overlaps layer i-1)
              (what the forward keeps for the backward is the recompute policy,
              l2l_hw/relay/recompute.py: "full" as above, "selective" also keeps the
              matmuls' outputs, "none" keeps each layer's forward graph)
    commit    the EPS finishes the step's updates

Data parallel (torch.distributed initialized, or process_group given): each rank runs
the relay on its own shard of the minibatch; each group's gradients are averaged across
ranks by an asynchronous collective that overlaps the next layer's backward and is
awaited just before the push (l2l_hw/relay/data_parallel.py).

A parameter used by several layers (tied embedding and head) belongs to the EPS group
of the first layer that uses it; its gradient accumulates over every use and is pushed
once, after its last use in the backward sweep.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable, Sequence

import torch
from torch import nn

from l2l_hw.eps.base import EPS
from l2l_hw.relay.device_share import DEVICE_BYTES_PER_PARAMETER, DeviceShare, device_free_bytes, share_problem
from l2l_hw.relay.layer_drop import LayerDrop
from l2l_hw.relay.options import RelayOptions
from l2l_hw.relay.recompute import grad_leaf
from l2l_hw.relay.stage import LayerStage, flatten, registered_groups, to_float
from l2l_hw.relay.transport import torch_device


class Relay(LayerStage):
    """Train `layers` with their weights in `eps`, one layer at a time on `device`: the
    layer-major schedule over one stage that holds the whole model (l2l_hw/relay/stage.py)."""

    def __init__(self, layers: nn.Sequential | Sequence[nn.Module], loss_fn: Callable, eps: EPS,
                 options: RelayOptions | None = None, *, droppable: Sequence[int] | None = None,
                 layer_drop_seed: int = 0, process_group=None,
                 init: Callable[[int, nn.Module], dict[str, torch.Tensor]] | None = None,
                 no_decay: Callable[[int, str], bool] | None = None, plan=None, **option_values):
        """The stage's options (LayerStage), and layer drop: options.layer_drop (a probability,
        or a function of the step) over the `droppable` layers (default: all but the first and
        the last), drawn from a generator keyed by `layer_drop_seed` and the step. `plan`: how
        the run chose an option (device_share.SharePlan: the device share's k), for describe()."""
        p = option_values.get("layer_drop", (options or RelayOptions()).layer_drop)
        self.drop = LayerDrop(p, len(layers), droppable=droppable, seed=layer_drop_seed)  # checked before the EPS
        super().__init__(layers, loss_fn, eps, options, process_group=process_group, init=init,
                         no_decay=no_decay, **option_values)
        self.plan = plan

    streams = False  # train_steps runs each minibatch as a step of its own

    def share_update(self, eps: EPS, options: RelayOptions) -> EPS:
        """`eps`, or, with options.device_update_layers = k > 0, `eps` with the groups of layers
        0..k-1 kept and updated on the device (l2l_hw/relay/device_share.py); a k the EPS, the
        schedule or the device's free memory cannot give is one ValueError, before any weight loads."""
        k = options.device_update_layers or 0
        problem = share_problem(eps, len(self.layers), k, stale=options.pipedream_2bw)
        if problem:
            raise ValueError(f"device_update_layers={k} {problem}")
        if k == 0:
            return eps
        device = torch_device(options.device)
        groups = registered_groups(self.layers[:k])
        need = sum(math.prod(s) for shapes in groups.values() for s in shapes.values()) * DEVICE_BYTES_PER_PARAMETER
        free = device_free_bytes(device)
        if free is not None and need > free:
            raise ValueError(f"device_update_layers={k} keeps {need / 2**30:.2f} GiB of weights and AdamW state on "
                             f"{device}, which has {free / 2**30:.2f} GiB free: give fewer layers (0 keeps every "
                             "update on the host)")
        return DeviceShare(eps, set(groups), device)

    def train_steps(self, batches) -> list[float]:
        """An optimizer step on each `(inputs, targets)` of `batches` in turn; their mean losses."""
        return [self.train_step(inputs, targets) for inputs, targets in batches]

    def active_layers(self, layers) -> list[int]:
        """The layers this step runs, in order: given, or drawn from the layer-drop schedule."""
        L = len(self.layers)
        if layers is None:
            return self.drop.layers(self.step + 1)
        chosen = sorted(set(layers))
        if not chosen or chosen[-1] != L - 1 or any(not 0 <= i < L for i in chosen):
            raise ValueError(f"layers={list(layers)} must be indices in [0, {L}) and include the last layer {L - 1}")
        return chosen

    def train_step(self, inputs, targets, layers: Sequence[int] | None = None) -> float:
        """One optimizer step on the minibatch; returns its mean loss.

        `layers` selects the layers to run this step (the last one always runs); a
        skipped layer passes its input through and costs neither transfer nor compute,
        and its weights get no update. Without it, the layer-drop schedule decides."""
        xs, ts, weights, local_n = self.split_micro_batches(inputs, targets)
        self.start_step_over_ranks(local_n)
        order = self.active_layers(layers)
        users = self._users(order)
        live: dict[str, dict[str, torch.Tensor]] = {}  # EPS groups on the device now
        try:
            acts = self._forward_sweep(order, xs, live, users)
            total, grads_in = self._last_layer(order, acts, ts, weights, live)
            acts = None  # the last layer's inputs are done with, before its gradients leave
            self._release(order[-1], live, users, backward=True)
            self._backward_sweep(order, grads_in, live, users)
        except BaseException as exc:
            self.abandon(exc)
            raise
        return self._commit_step(total, local_n)

    def _users(self, order: list[int]) -> dict[str, list[int]]:
        """EPS group -> the active layers using it, ascending. The EPS is told the order of the
        step's fetches and pushes (a group is pushed after its first user's backward), to read ahead."""
        users: dict[str, list[int]] = {}
        for i in order:
            for key in self.plans[i].groups:
                users.setdefault(key, []).append(i)
        self.eps.expect_step(list(users), sorted(users, key=lambda key: -users[key][0]))
        return users

    def _forward_sweep(self, order: list[int], acts: list, live: dict, users: dict[str, list[int]]) -> list:
        """Every active layer but the last, layer-major, on every micro-batch; what the backward gets
        of each forward is the recompute policy's (self.keep). Returns the last layer's inputs."""
        keep, meter = self.keep, self.memory
        for n, i in enumerate(order[:-1]):
            run = partial(self.call, i)
            visit = self.visit(i, self.layer_params(i, live))
            self.prefetch(order[n + 1], live)
            keep.begin_forward(i, acts)
            outs = []
            with visit, meter.saving(i):
                for j in range(self.micro_batches):
                    outs.append(keep.forward(i, j, acts[j], run, self.plans[i].buffers))
                    self.sample_memory(live, acts, outs)
            keep.end_forward(i)
            if keep.recomputes(i):
                self._release(i, live, users, backward=False)
            acts = outs
        return acts

    def _last_layer(self, order: list[int], acts: list, ts: list, weights: list[float],
                    live: dict) -> tuple[torch.Tensor, list]:
        """The last layer's forward, loss and backward together, micro-batch by micro-batch.
        Returns the minibatch's loss (on the device) and the gradients of the layer's inputs."""
        last, meter = order[-1], self.memory
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        visit = self.visit(last, self.layer_params(last, live))
        if len(order) > 1:
            self.prefetch(order[-2], live)
        grads_in = []
        with visit:
            for j in range(self.micro_batches):
                x = grad_leaf(acts[j])
                with meter.saving(last):
                    loss = self.compute_loss(to_float(self.call(last, x, self.plans[last].buffers)), ts[j])
                self.sample_memory(live, acts, grads_in)
                (loss * (weights[j] * self.loss_scale)).backward()
                total += loss.detach().float() * weights[j]
                grads_in.append(self.input_grads(x))
                meter.drop_saved(last)  # its graph is consumed
        return total, grads_in

    def _backward_sweep(self, order: list[int], grads_in: list, live: dict, users: dict[str, list[int]]) -> None:
        """The other active layers in reverse: each micro-batch's graph kept or recomputed, then
        backprop; each group's gradients pushed after its last use (_release). Then the
        reductions still under way are pushed and the recompute policy's step ends."""
        keep, meter = self.keep, self.memory
        for n in range(len(order) - 2, -1, -1):
            i = order[n]
            run = partial(self.call, i)
            visit = self.visit(i, self.layer_params(i, live))
            if n > 0:
                self.prefetch(order[n - 1], live)
            keep.begin_backward(i)
            grads_out, grads_in = grads_in, []
            with visit:
                for j in range(self.micro_batches):
                    with meter.saving(i):
                        x, out = keep.backward(i, j, run)
                    self.sample_memory(live, grads_out, grads_in)
                    pairs = [(o, g) for o, g in zip(flatten(out), grads_out[j])
                             if g is not None and o.requires_grad]
                    if pairs:
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                    grads_in.append(self.input_grads(x))
                    grads_out[j] = None  # micro-batch j of this layer is done with
                    if keep.recomputes(i):
                        meter.drop_saved(i)
            meter.drop_saved(i)  # without recompute: what its forward graph saved
            self._release(i, live, users, backward=True)
        self.push_reduced()
        keep.end_step()

    def _commit_step(self, total: torch.Tensor, local_n: int) -> float:
        """The EPS finishes the step's updates (clipped by the global norm, discarded where a
        gradient was not finite and skip_nonfinite); returns the minibatch's mean loss."""
        self.memory.drop_saved()
        self.commit_pushed()
        return self.mean_over_ranks(self.transport.read(total), local_n, "averaging the step's loss")

    def _release(self, i: int, live: dict, users: dict[str, list[int]], backward: bool) -> None:
        """Drop device weights layer i no longer needs; after its last backward use, push the gradients."""
        if self.keep.recomputes(i) or backward:  # without recompute, the forward graph holds them until the backward
            live.pop(f"frozen:{i}", None)
        for key in self.plans[i].groups:
            if backward and i == users[key][0]:
                tensors = live.pop(key)
                self.push(key, self.grad_sums.take(tensors))
            elif not backward and len(users[key]) == 1:
                live.pop(key)  # fetched again for the backward sweep

    @torch.no_grad()
    def evaluate(self, inputs, targets) -> float:
        """Mean loss on a minibatch, layer-major, in eval mode; no update. On the newest
        committed weights, under PipeDream-2BW too (its steps compute one version back)."""
        xs, ts, weights, n = self.split_micro_batches(inputs, targets)
        modes = [m.training for m in self.layers]
        for m in self.layers:
            m.train(False)
        live: dict[str, dict[str, torch.Tensor]] = {}
        last_use = {key: i for i, plan in enumerate(self.plans) for key in plan.groups}
        self.eps.expect_step(list(last_use), [])
        try:
            with self.weights.newest():
                acts = xs
                for i in range(len(self.layers)):
                    visit = self.visit(i, self.layer_params(i, live))
                    if i + 1 < len(self.layers):
                        self.prefetch(i + 1, live)
                    with visit:
                        acts = [self.call(i, a, self.plans[i].buffers) for a in acts]
                    self.sample_memory(live, acts)
                    live.pop(f"frozen:{i}", None)
                    for key in self.plans[i].groups:  # as in training, a layer's weights leave after their last use
                        if last_use[key] == i:
                            live.pop(key)
            total = sum(float(self.compute_loss(to_float(a), t)) * w for a, t, w in zip(acts, ts, weights))
        finally:
            for m, mode in zip(self.layers, modes):
                m.train(mode)
        return self.mean_over_ranks(total, n, "averaging the evaluation loss")

