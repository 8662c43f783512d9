"""The relay executor: layer-major forward and backward over micro-batches, as an action
list (l2l_hw/relay/actions.py, layer_major) run by the stage's interpreter.

    forward   for layer i = 0..L-2: fetch w_i (prefetched during layer i-1), run it on
              every micro-batch, keep for the backward what the recompute policy keeps
              (l2l_hw/relay/recompute.py: "full" the inputs, "selective" also the matmuls'
              outputs, "none" each layer's forward graph)
    loss      the last layer runs forward, loss and backward at once per micro-batch
    backward  for layer i = L-2..0: fetch w_i, recompute layer i per micro-batch with
              its forward RNG state replayed, backprop, accumulate dW_i over
              micro-batches (in fp32 whatever the compute dtype: precision.GradSums),
              push dW_i to the EPS, rounded once to the working dtype (its update
              overlaps layer i-1)
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

from typing import Callable, Sequence

import torch
from torch import nn

from l2l_hw.eps.base import EPS
from l2l_hw.relay.actions import evaluation, layer_major
from l2l_hw.relay.interpreter import Interpreter
from l2l_hw.relay.layer_drop import LayerDrop
from l2l_hw.relay.options import RelayOptions
from l2l_hw.relay.stage import LayerStage


class Relay:
    """Train `layers` with their weights in `eps`, one layer at a time on `device`: the
    layer-major action list (l2l_hw/relay/actions.py) over one stage that holds the whole model
    (`self.stage`, l2l_hw/relay/stage.py), run by the stage's interpreter."""

    def __init__(self, layers: nn.Sequential | Sequence[nn.Module], loss_fn: Callable, eps: EPS,
                 options: RelayOptions | None = None, *, droppable: Sequence[int] | None = None,
                 layer_drop_seed: int = 0, process_group=None,
                 init: Callable[[int, nn.Module], dict[str, torch.Tensor]] | None = None,
                 no_decay: Callable[[int, str], bool] | None = None, plan=None, **option_values):
        """The stage's options (LayerStage), and layer drop: options.layer_drop (a probability,
        or a function of the step) over the `droppable` layers (default: all but the first and
        the last), drawn from a generator keyed by `layer_drop_seed` and the step. `plan`: how
        the run chose an option (device_share.SharePlan: the device share's k), for describe().
        options.device_update_layers = k > 0 keeps layers 0..k-1's update on the device."""
        p = option_values.get("layer_drop", (options or RelayOptions()).layer_drop)
        self.drop = LayerDrop(p, len(layers), droppable=droppable, seed=layer_drop_seed)  # checked before the EPS
        self.stage = LayerStage(layers, loss_fn, eps, options, process_group=process_group, init=init,
                                no_decay=no_decay, device_share=True, **option_values)
        self.plan = plan

    streams = False  # train_steps runs each minibatch as a step of its own

    # What the training loop, the benches and the tests read of the relay: its stage's.
    layers = property(lambda self: self.stage.layers)
    options = property(lambda self: self.stage.options)
    eps = property(lambda self: self.stage.eps)
    step = property(lambda self: self.stage.step)
    device = property(lambda self: self.stage.device)
    micro_batches = property(lambda self: self.stage.micro_batches)
    loss_fn = property(lambda self: self.stage.loss_fn)
    transport = property(lambda self: self.stage.transport)
    keep = property(lambda self: self.stage.keep)
    threads = property(lambda self: self.stage.threads)
    loss_scale = property(lambda self: self.stage.loss_scale)
    scaler = property(lambda self: self.stage.scaler)
    compute_dtype = property(lambda self: self.stage.compute_dtype)
    dp = property(lambda self: self.stage.dp)

    def memory_report(self) -> dict:
        return self.stage.memory_report()

    def reset_memory(self) -> None:
        self.stage.reset_memory()

    def export(self):
        return self.stage.export()

    def materialize(self) -> nn.Sequential:
        return self.stage.materialize()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.stage.state_dict()

    def state_entries(self) -> dict:
        return self.stage.state_entries()

    def load_state_dict(self, state) -> None:
        self.stage.load_state_dict(state)

    def close(self) -> None:
        self.stage.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def train_steps(self, batches) -> list[float]:
        """An optimizer step on each `(inputs, targets)` of `batches` in turn; their mean losses."""
        return [self.train_step(inputs, targets) for inputs, targets in batches]

    def active_layers(self, layers) -> list[int]:
        """The layers this step runs, in order: given, or drawn from the layer-drop schedule."""
        L = len(self.stage.layers)
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
        stage = self.stage
        xs, ts, weights, local_n = stage.split_micro_batches(inputs, targets)
        order = self.active_layers(layers)
        run = Interpreter(stage, stage.micro_batches)
        work = run.work(xs, ts, weights, local_n, order)
        try:
            run.run(layer_major(order, stage.micro_batches), [work])
        except BaseException as exc:
            stage.abandon(exc)
            raise
        stage.memory.drop_saved()
        return stage.mean_over_ranks(stage.transport.read(work.total), local_n, "averaging the step's loss")

    @torch.no_grad()
    def evaluate(self, inputs, targets) -> float:
        """Mean loss on a minibatch, layer-major, in eval mode; no update. On the newest
        committed weights, under PipeDream-2BW too (its steps compute one version back)."""
        stage = self.stage
        xs, ts, weights, n = stage.split_micro_batches(inputs, targets)
        modes = [m.training for m in stage.layers]
        for m in stage.layers:
            m.train(False)
        run = Interpreter(stage, stage.micro_batches)
        every = list(range(len(stage.layers)))
        work = run.work(xs, ts, weights, n, every, training=False)
        try:
            with stage.weights.newest():
                run.run(evaluation(every, stage.micro_batches), [work])
            total = stage.transport.read(work.total)
        finally:
            for m, mode in zip(stage.layers, modes):
                m.train(mode)
        return stage.mean_over_ranks(total, n, "averaging the evaluation loss")
