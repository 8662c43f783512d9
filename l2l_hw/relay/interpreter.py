"""The one interpreter of action lists (l2l_hw/relay/actions.py) over a layer stage.

Every layer forward and backward the relay and the pipeline run happens here, whatever the
schedule: a schedule is only the list. What the interpreter keeps between actions:

    acts, grads    each micro-batch's activation on its way up (the next forward's input)
                   and gradient on its way down (the next backward's output gradient)
    live           per visit's micro-batches, the EPS groups and frozen parameters on the
                   device: fetched at a visit, kept while a later visit of the same
                   micro-batches uses them (a tied group, a kept graph), released after
    sums           a group's gradient over the step's micro-batches so far, in host memory
                   between visits of one micro-batch (a pipeline stage)

A group's gradient leaves after its last use in the backward: pushed to the EPS where the
visit covers the step's last micro-batch (the relay's visits cover them all), else added to
the step's sum. The next compute visit's weights start up as soon as a visit has its own.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Sequence

import torch

from l2l_hw.relay.actions import COMPUTE, Action, next_visits
from l2l_hw.relay.recompute import grad_leaf
from l2l_hw.relay.stage import LayerStage, flatten, to_float


@dataclass
class StepWork:
    """One optimizer step of an action list: its micro-batches and the stage's layers it runs."""

    xs: list  # the micro-batches' inputs, on the device (a pipeline's later stages: received)
    ts: list  # their targets
    weights: list[float]  # each micro-batch's share of the minibatch
    n: int  # the minibatch's samples (this rank's)
    layers: list[int]  # the stage's layers the step runs (the whole model's indices), ascending
    users: dict[str, list[int]] = field(default_factory=dict)  # EPS group -> those of `layers` using it
    total: torch.Tensor | None = None  # the weighted sum of the micro-batches' losses (where the loss is)
    sums: dict = field(default_factory=dict)  # group -> (sum so far, names, its copy on the way down)
    training: bool = True  # False: an evaluation (nothing pushed)
    started: bool = False  # the EPS told the step's order
    weighted: bool = False  # data parallel: the ranks agreed on the minibatch size


def backprop(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """autograd over a layer's outputs with the gradients given (None: that output has none)."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


class Peers:
    """A pipeline stage's neighbours: what recv / send actions do (the relay has none)."""

    def start(self, t: int) -> None:
        """Step t of the list begins here."""

    def recv(self, action: Action, work: StepWork):
        """The activation (a tensor or tuple) or the list of gradients (None where an output is
        not floating) of the action's micro-batch."""
        raise NotImplementedError

    def send(self, action: Action, value) -> None:
        raise NotImplementedError

    def held(self) -> list:
        """What the links hold on the device now (memory accounting)."""
        return []

    across = None  # all-reduce over the stages holding the rest of the model (commit's norm and overflow)


class Interpreter:
    """Runs action lists over `stage`. Hooks: `call(t, i, j, x, buffers)` runs layer i on micro-batch
    j of step t (default: the stage's call; a pipeline sets the generator as the single process
    has it); `version(t)` is the context step t's fetches read in, or None for the weight
    stream's own version (the default); `peers` does the recv / send actions."""

    def __init__(self, stage: LayerStage, micro_batches: int, *, peers: Peers | None = None,
                 call: Callable | None = None, version: Callable[[int], object] | None = None):
        self.stage, self.micro_batches = stage, micro_batches
        self.peers = peers or Peers()
        self.call = call or (lambda t, i, j, x, buffers: stage.call(i - stage.first, x, buffers))
        self.version = version or (lambda t: None)

    def work(self, xs, ts, weights, n, layers, training: bool = True) -> StepWork:
        """A step's work over the stage's active `layers` (whole-model indices, ascending)."""
        stage = self.stage
        users: dict[str, list[int]] = {}
        for i in layers:
            for key in stage.plans[i - stage.first].groups:
                users.setdefault(key, []).append(i)
        return StepWork(xs, ts, weights, n, list(layers), users,
                        torch.zeros((), dtype=torch.float32, device=stage.device), training=training)

    # -- the list ---------------------------------------------------------------------------
    def run(self, actions: Sequence[Action], steps: Sequence[StepWork]) -> None:
        """Run `actions` over the `steps` they number (step t: micro-batches t*M .. t*M + M - 1).
        Each step's losses add into its `total`; a failure leaves the caller to abandon the step."""
        self.actions, self.steps = list(actions), list(steps)
        self.next_visit = next_visits(self.actions)
        self.acts = {t * self.micro_batches + j: x for t, s in enumerate(steps) for j, x in enumerate(s.xs or ())}
        self.grads: dict[int, list] = {}
        self.live: dict[tuple[int, ...], dict[str, dict[str, torch.Tensor]]] = {}
        for n, action in enumerate(self.actions):
            self.at = n
            if action.op in COMPUTE:
                t = action.mbs[0] // self.micro_batches
                self._start(t)
                with self.version(t) or contextlib.nullcontext():
                    getattr(self, action.op)(action, self.steps[t])
            elif action.op == "recv":
                t = action.mbs[0] // self.micro_batches
                self._start(t)
                value = self.peers.recv(action, self.steps[t])
                (self.acts if action.what == "activations" else self.grads)[action.mbs[0]] = value
            elif action.op == "send":
                g = action.mbs[0]
                self.peers.send(action, self.acts.pop(g) if action.what == "activations" else self.grads.pop(g))
            elif action.op == "commit":
                self.commit(self.steps[action.step])
            else:
                raise ValueError(f"unknown action {action}")

    def _start(self, t: int) -> None:
        """Step t's first action here: the EPS told the order of its fetches and pushes (a group is
        pushed after its first user's backward), to read ahead; the peers told."""
        work = self.steps[t]
        if not work.started:
            work.started = True
            users = work.users
            pushes = sorted(users, key=lambda key: -users[key][0]) if work.training else []
            self.stage.eps.expect_step(list(users), pushes)
            self.peers.start(t)

    def _key(self, i: int, mbs: tuple[int, ...]):
        """What the recompute policy and the memory meter call a visit: the layer, for a visit over
        several micro-batches; (layer, micro-batch of its step), for one."""
        return i if len(mbs) > 1 else (i, mbs[0] % self.micro_batches)

    def _bind(self, action: Action) -> tuple[dict, dict]:
        """The visit's live groups and its layer's device parameters (fetched where not live); then
        the next compute visit's weights on their way."""
        live = self.live.setdefault(action.mbs, {})
        params = self.stage.layer_params(action.layer - self.stage.first, live)
        self._prefetch_next(action)
        return live, params

    def _prefetch_next(self, current: Action | None) -> None:
        """Start the next compute visit's fetch (and its stashed inputs) where it reads the
        weights this one does: in the same step, or both in the stream's own version."""
        nxt = self.next_visit[self.at]
        if nxt is None:
            return
        t = nxt.mbs[0] // self.micro_batches
        here = None if current is None else current.mbs[0] // self.micro_batches
        if here != t and (self.version(t) is not None or (here is not None and self.version(here) is not None)):
            return
        self.stage.prefetch(nxt.layer - self.stage.first, self.live.get(nxt.mbs, {}), self._key(nxt.layer, nxt.mbs))

    def _sample(self, *held) -> None:
        if self.stage.memory.counting:
            self.stage.sample_memory(*held, list(self.live.values()), list(self.acts.values()),
                                     list(self.grads.values()), self.peers.held())

    # -- the actions --------------------------------------------------------------------------
    def forward(self, action: Action, work: StepWork) -> None:
        """One visit of a layer on its micro-batches: each forward kept or stashed for the backward as
        the recompute policy says; the layer's weights released after (module docstring)."""
        stage, i, mbs = self.stage, action.layer, action.mbs
        k, key, keep = i - stage.first, self._key(action.layer, mbs), stage.keep
        t = mbs[0] // self.micro_batches
        live, params = self._bind(action)
        run = lambda j: partial(self.call, t, i, j)  # noqa: E731
        outs = []
        with stage.visit(k, params):
            keep.begin_forward(key, [self.acts[g] for g in mbs])
            with stage.memory.saving(key):
                for p, g in enumerate(mbs):
                    outs.append(keep.forward(key, p, self.acts[g], run(g % self.micro_batches), stage.plans[k].buffers))
                    self._sample(outs)
            keep.end_forward(key)
        self.acts.update(zip(mbs, outs))
        kept = lambda u: not keep.recomputes(self._key(u, mbs))  # noqa: E731 (its graph holds its weights)
        if not kept(i):
            live.pop(f"frozen:{k}", None)
        for group in stage.plans[k].groups:
            users = work.users[group]
            if users[-1] == i and not any(kept(u) for u in users):
                live.pop(group)  # its last use in this forward: the backward fetches it again
        self._drop_if_empty(mbs)

    def loss(self, action: Action, work: StepWork) -> None:
        """The model's last layer: forward, loss and backward on each micro-batch in turn."""
        stage, i, mbs = self.stage, action.layer, action.mbs
        k, key = i - stage.first, self._key(action.layer, mbs)
        t = mbs[0] // self.micro_batches
        live, params = self._bind(action)
        grads_in = []
        with stage.visit(k, params):
            for g in mbs:
                j = g % self.micro_batches
                x = grad_leaf(self.acts[g])
                with stage.memory.saving(key):
                    loss = stage.compute_loss(to_float(self.call(t, i, j, x, stage.plans[k].buffers)), work.ts[j])
                self._sample(grads_in)
                (loss * (work.weights[j] * stage.loss_scale)).backward()
                work.total += loss.detach().float() * work.weights[j]
                grads_in.append(self._input_grads(x, i, work))
                self._sample(grads_in)
                stage.memory.drop_saved(key)  # its graph is consumed
        for g in mbs:
            self.acts.pop(g)  # the last layer's inputs are done with, before its gradients leave
        self.grads.update((g, d) for g, d in zip(mbs, grads_in) if d is not None)
        self._release_backward(action, work, live)

    def backward(self, action: Action, work: StepWork) -> None:
        """One visit of a layer in the backward: each micro-batch's graph kept or recomputed, then
        backpropagated with the gradient of its output; its groups' gradients leave after their
        last use."""
        stage, i, mbs = self.stage, action.layer, action.mbs
        k, key, keep, meter = i - stage.first, self._key(action.layer, mbs), stage.keep, stage.memory
        t = mbs[0] // self.micro_batches
        live, params = self._bind(action)
        grads_out, grads_in = [self.grads.pop(g) for g in mbs], []
        with stage.visit(k, params):
            keep.begin_backward(key)
            for p, g in enumerate(mbs):
                with meter.saving(key):
                    x, out = keep.backward(key, p, partial(self.call, t, i, g % self.micro_batches))
                self._sample(grads_out, grads_in)
                backprop(flatten(out), grads_out[p])
                grads_in.append(self._input_grads(x, i, work))
                self._sample(grads_out, grads_in)  # with the gradients it made: the visit's peak
                grads_out[p] = None  # micro-batch g of this layer is done with
                if keep.recomputes(key):
                    meter.drop_saved(key)
        meter.drop_saved(key)  # without recompute: what its forward graph saved
        self.grads.update((g, d) for g, d in zip(mbs, grads_in) if d is not None)
        self._release_backward(action, work, live)

    def infer(self, action: Action, work: StepWork) -> None:
        """Evaluation: one visit of a layer, its forward on each micro-batch without grad; its frozen
        parameters leave, and each group after its last use."""
        stage, i, mbs = self.stage, action.layer, action.mbs
        k, t = i - stage.first, mbs[0] // self.micro_batches
        live, params = self._bind(action)
        with torch.no_grad(), stage.visit(k, params):
            for g in mbs:
                self.acts[g] = self.call(t, i, g % self.micro_batches, self.acts[g], stage.plans[k].buffers)
        self._sample()
        live.pop(f"frozen:{k}", None)
        for group in stage.plans[k].groups:
            if work.users[group][-1] == i:
                live.pop(group)
        self._drop_if_empty(mbs)

    def score(self, action: Action, work: StepWork) -> None:
        """Evaluation: the last layer, then the loss of each micro-batch into the step's total."""
        self.infer(action, work)
        with torch.no_grad():
            for g in action.mbs:
                j = g % self.micro_batches
                work.total += self.stage.compute_loss(to_float(self.acts.pop(g)), work.ts[j]).float() * work.weights[j]

    def _input_grads(self, x, i: int, work: StepWork) -> list | None:
        """The gradients of layer i's inputs (None for the model's input: data)."""
        if i == work.layers[0] and self.stage.first == 0:
            return None
        return self.stage.input_grads(x)

    def _release_backward(self, action: Action, work: StepWork, live: dict) -> None:
        """After a layer's backward visit: its frozen parameters leave; a group at its last use (its
        first user) gives its gradient: pushed where the visit covers the step's last micro-batch,
        else added to the step's sum in host memory."""
        stage, i, mbs = self.stage, action.layer, action.mbs
        k = i - stage.first
        live.pop(f"frozen:{k}", None)
        last = any(g % self.micro_batches == self.micro_batches - 1 for g in mbs)
        for group in stage.plans[k].groups:
            if work.users[group][0] == i:
                self._gradient(work, group, live.pop(group), last)
        self._drop_if_empty(mbs)

    def _drop_if_empty(self, mbs: tuple[int, ...]) -> None:
        if not self.live.get(mbs, True):
            del self.live[mbs]

    def _gradient(self, work: StepWork, key: str, leaves: dict, last: bool) -> None:
        """Group `key`'s gradient from its device leaves: added to the step's sum, which waits in host
        memory between the group's visits (a sum on the device for each layer of a stage would grow
        with its depth; the micro-batches add in order, as autograd accumulates them in one visit);
        on the last micro-batch the sum comes up, takes this gradient and is pushed to the EPS."""
        stage = self.stage
        transport, pool = stage.transport, stage.transport.grad_pool
        grads = stage.grad_sums.take(leaves)
        total = {}
        if key in work.sums:  # the micro-batches before: landed long since (a backward ago)
            total, names, moving = work.sums.pop(key)
            for name, g in zip(names, moving.landed()):
                total[name] = total[name].add_(g) if name in total else g.clone() if transport.asynchronous else g
            if transport.asynchronous:
                pool.give_back(moving.tensors)
        if not last:
            work.sums[key] = (total, list(grads), transport.down(list(grads.values()), pool=pool))
            return
        if total:
            up = dict(zip(total, transport.up(list(total.values())).wait()))
            grads = {name: up[name].add_(grads[name]) if name in grads else up[name] for name in up} | \
                {name: g for name, g in grads.items() if name not in up}
        if not work.weighted:  # data parallel: the ranks' weights of the step's pushes
            work.weighted = True
            stage.start_step_over_ranks(work.n)
        stage.push(key, grads)

    def commit(self, work: StepWork) -> None:
        """The step's every group is pushed: the reductions under way pushed, the recompute policy's
        step ended, the EPS's commit (PipeDream-2BW: without waiting); what is on its way was read
        before the commit, so it goes, and the next visit's fetch starts afresh."""
        stage = self.stage
        if not work.weighted:
            work.weighted = True
            stage.start_step_over_ranks(work.n)
        stage.push_reduced()
        stage.keep.end_step()
        stage.commit_pushed(across=self.peers.across)
        stage.weights.clear()
        self._prefetch_next(None)
