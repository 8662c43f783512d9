"""The relay as a pipeline: contiguous stages of layers on the ranks of a process group.

    stage s      layers [b_s, b_{s+1}) on rank s of the group, relayed from its own EPS (any
                 backend, eager updates): a LayerStage over those layers (stage.py, the
                 Relay's too) does the registration, fetching, clipping, data-parallel
                 reduction over the stage's replicas, pushing, checkpoints and export;
                 this module is the 1F1B / 2BW schedule over it and the links between ranks
    L2L          a stage's layers come up one at a time: each forward fetches a layer, runs
                 it, stashes its input (the relay's recompute policy) and releases it; each
                 backward fetches it again and recomputes; so a stage's device memory does
                 not grow with its depth. A group's gradient sum over the micro-batches waits
                 in host memory between its visits
    schedule     an action list per stage (l2l_hw/relay/actions.py, run by the stage's
                 interpreter): 1F1B, S - s - 1 micro-batches' forwards through the stage to
                 fill the pipe, then one forward and one backward in turn, then the backwards left
    neighbours   activations go to stage s + 1, their gradients come back, by point-to-point
                 isend / irecv posted ahead of use, so transfers overlap compute; receive
                 buffers are sized from a meta-device trace of the model (no shape handshake)
    step end     each group's gradients, accumulated over the minibatch, are pushed once,
                 right after the layer's backward on the last micro-batch (the update runs
                 while the earlier layers' backward goes on); then the stage commits

Schedules ("flush", the default, and "2bw", chosen by name) differ in the weights a step computes on:

    flush   every micro-batch of step t on W(t-1), the step's updates committed before the
            next step's first forward: ordinary minibatch training, equal to the
            single-process relay
    2bw     PipeDream-2BW (Narayanan et al., arXiv 2006.09503): step t computes on the version
            one commit back, W(t+1) = W(t) - lr * grad(W(t-1)), from the EPS's double buffer;
            the commit does not wait for the updates. Equal to the single-process relay with
            pipedream_2bw=True, whatever the split. The staleness costs loss (MEASURED_2BW_COST);
            an EPS with delay_compensation="predict" serves each version's working copy at the
            weights the next step is predicted to reach (l2l_hw/eps/golden.py, predict_rule)

Dropout (every stage replays the single process's draws) and the meta-device trace that sizes
the transfers: l2l_hw/relay/model_trace.py. Failure (one clear error on every rank, a wait
never outliving a failed neighbour): l2l_hw/relay/links.py.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from functools import partial
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from l2l_hw.eps.base import StateEntry, tensor_of
from l2l_hw.relay.actions import SCHEDULES, evaluation
from l2l_hw.relay.interpreter import Interpreter, Peers
from l2l_hw.relay.layer_drop import LayerDrop
from l2l_hw.relay.links import Links, PipelineError, Spec
from l2l_hw.relay.model_trace import Trace, replay, same_rng, trace_model
from l2l_hw.relay.options import PipelineConfig, RelayOptions
from l2l_hw.relay.recompute import rng_state, set_rng_state
from l2l_hw.relay.stage import LayerStage, flatten, unflatten

CHECKPOINT_TAG = 1 << 24  # the tags of a checkpoint's entries, above every step's transfers

# What one-step-stale weights cost the reference GPT (`l2l train`'s defaults, AdamW, 200 steps): the final
# validation loss minus flush's (2.405), mean over seeds 1337-1339, nats per byte, by delay compensation
# (`l2l bench convergence` on 2 CPU stages, docs/BENCHMARKS.md, 2026-12-07).
MEASURED_2BW_COST = {"none": 0.698, "predict": 0.474}


def staleness_trade(compensation: str, exact: str = "--pipeline-schedule flush") -> str:
    """The start banner's line on what PipeDream-2BW trades, with its measured cost; `exact`: what trains exactly."""
    cost = MEASURED_2BW_COST.get(compensation)
    measured = (f"; on the reference GPT (AdamW, 200 steps) that cost {cost:+.3f} nats of validation loss against "
                f"flush, mean of 3 seeds (l2l bench convergence, docs/BENCHMARKS.md)" if cost is not None else "")
    return (f"schedule 2bw (PipeDream-2BW): no step waits for an update, but each computes on the weights one step "
            f"stale, delay compensation {compensation}{measured}; {exact} trains exactly")



# -- the pipeline -------------------------------------------------------------------------------
class _Neighbours(Peers):
    """The stage's recv / send actions over its links: receives posted a step ahead (they land
    while this stage computes), buffers sized from the trace, each wait with the links' deadline."""

    TENSORS = 64  # the tags of one micro-batch's transfer: up to 64 tensors an activation

    def __init__(self, pipe: "PipelineRelay", traces: list, training: bool = True):
        self.pipe, self.traces, self.links, self.training = pipe, traces, pipe.links, training
        self.u = pipe.micro_batches
        self.posted: dict[tuple[str, int], tuple] = {}
        self.waited_s = 0.0
        self.across = pipe.links.all_reduce

    def _tag(self, what: str, g: int) -> int:
        return (2 * g + (what == "gradients")) * self.TENSORS

    def start(self, t: int) -> None:
        """Post the receives of step t + 1's micro-batches."""
        t += 1
        if t >= len(self.traces):
            return
        pipe, trace = self.pipe, self.traces[t]
        for g in range(t * self.u, (t + 1) * self.u):
            if pipe.stage > 0:
                self.posted[("activations", g)] = self.links.recv(
                    trace.outputs[pipe.first - 1][g % self.u], pipe.stage - 1, self._tag("activations", g), pipe.device)
            if pipe.stage < pipe.stages - 1 and self.training:
                floating = [s for s in trace.outputs[pipe.end - 1][g % self.u] if s.dtype.is_floating_point]
                self.posted[("gradients", g)] = self.links.recv(floating, pipe.stage + 1, self._tag("gradients", g),
                                                                pipe.device)

    def recv(self, action, work):
        g, what, pipe = action.mbs[0], action.what, self.pipe
        t, j = divmod(g, self.u)
        bufs, works = self.posted.pop((what, g))
        started = time.perf_counter()
        neighbour = pipe.stage - 1 if what == "activations" else pipe.stage + 1
        self.links.wait(works, f"receiving micro-batch {j}'s {what} from stage {neighbour}")
        self.waited_s += time.perf_counter() - started
        trace = self.traces[t]
        if what == "activations":
            return unflatten(trace.like(pipe.first - 1, j), bufs)
        it = iter(bufs)
        return [next(it) if s.dtype.is_floating_point else None for s in trace.outputs[pipe.end - 1][j]]

    def send(self, action, value) -> None:
        pipe, g = self.pipe, action.mbs[0]
        if action.what == "activations":
            self.links.send(flatten(value), pipe.stage + 1, self._tag("activations", g))
        else:
            self.links.send([d for d in value if d is not None], pipe.stage - 1, self._tag("gradients", g))

    def held(self) -> list:
        return [[bufs for bufs, _ in self.posted.values()], [t for t, _, _ in self.links.sends]]


class PipelineRelay:
    """Relay `layers` as a pipeline: this rank runs stage `group rank` of `pipeline.stages`.

    Every rank builds it with the whole model (layers of other stages may be on the meta
    device; they are moved there) and calls train_step with the same minibatch: the first
    stage reads the inputs, the last the targets. train_step returns the minibatch's mean
    loss on every rank.

    Data parallel replicas of each stage: `group` holds one replica's stages and `replicas` this
    stage's ranks across the replicas (torch.distributed groups; every rank of `replicas` runs the
    same stage on its own shard of the minibatch). A stage's gradients are averaged over its
    replicas as the Relay averages them over data-parallel ranks, and the loss over all the
    replicas' samples is returned. A sharded EPS shards over `replicas`."""

    def __init__(self, layers: nn.Sequential | Sequence[nn.Module], loss_fn: Callable, eps,
                 options: RelayOptions | None = None, *, pipeline: PipelineConfig, group=None, replicas=None,
                 boundaries: Sequence[int] | None = None, plan=None, droppable: Sequence[int] | None = None,
                 layer_drop_seed: int = 0, init: Callable[[int, nn.Module], dict[str, torch.Tensor]] | None = None,
                 no_decay: Callable[[int, str], bool] | None = None, **option_values):
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("a pipeline runs on the ranks of a torch.distributed process group; none is "
                                "initialized (start it under torchrun --nproc-per-node S)")
        self.group = group or dist.group.WORLD
        self.stages = dist.get_world_size(self.group)
        if self.stages != pipeline.stages:
            raise ValueError(f"pipeline.stages={pipeline.stages} but the process group has {self.stages} ranks; "
                                f"a pipeline runs one stage per rank")
        self.stage = dist.get_rank(self.group)
        self.config = pipeline
        self.schedule = SCHEDULES[pipeline.schedule]
        options = dataclasses.replace(options or RelayOptions(), **option_values)
        if options.pipedream_2bw and not self.schedule.pipedream_2bw:
            raise ValueError("pipedream_2bw=True asks for weights one step back: use schedule '2bw', not 'flush'")
        options = dataclasses.replace(options, pipedream_2bw=self.schedule.pipedream_2bw)
        unsupported = [(options.grad_compression != "none",
                        f"grad_compression={options.grad_compression!r} (it compresses data parallelism's gradient "
                        "all-reduce; the stages have none)")]
        for bad, what in unsupported:
            if bad:
                raise ValueError(f"the pipeline does not support {what} yet")
        self.layers = list(layers)
        L = len(self.layers)
        bounds = list(boundaries) if boundaries is not None else plan.bounds if plan is not None else None
        if bounds is None and pipeline.boundaries == "auto":
            raise ValueError("boundaries 'auto' are the planner's: give plan=planner.plan_on_ranks(layers, loss_fn, "
                             "inputs, targets, stages, micro_batches) (every rank, before the pipeline takes the layers)")
        self.bounds = pipeline.bounds(L, bounds)
        # Every stage draws the whole model's layers for a step, from the step alone: the same ones.
        self.drop = LayerDrop(options.layer_drop, L, droppable=droppable, seed=layer_drop_seed)
        self.plan = plan  # the planner's (l2l_hw/relay/planner.py), where the caller planned
        self.first, self.end = self.bounds[self.stage], self.bounds[self.stage + 1]
        self._check_no_shared_parameters()
        self._groups = []  # made here, destroyed by close()
        if replicas is None:
            # Every rank joins one single-rank group per rank (new_group is collective): the stage's
            # Relay then runs without data parallelism over the pipeline's ranks.
            solo = [dist.new_group([r]) for r in range(dist.get_world_size())]
            self._groups = [g for g in solo if g is not dist.GroupMember.NON_GROUP_MEMBER]
            replicas = solo[dist.get_rank()]
        # This rank's layers, under the whole model's names; its replicas average its gradients.
        # 1F1B keeps at most S - s micro-batches in flight on stage s: what planned recompute budgets for.
        self.layer_stage = LayerStage(self.layers[self.first:self.end], loss_fn, eps, options, first=self.first,
                                      process_group=replicas, init=init, no_decay=no_decay,
                                      in_flight=min(self.stages - self.stage, options.micro_batches))
        self.device = self.layer_stage.device
        self.micro_batches = options.micro_batches
        for i, layer in enumerate(self.layers):  # other stages' weights: not held here
            if not self.first <= i < self.end:
                layer.to("meta")
        self._meta = [copy.deepcopy(m).to("meta") for m in self.layers]  # for the trace
        self._traces: dict[tuple, Trace] = {}
        self.links = Links(self.group, self.stage, self.stages, pipeline.timeout_s)
        self._closed = False
        self.last_step_s = 0.0  # wall time a step of the last train_step(s) call
        self.busy_s = 0.0  # of which computing (not waiting for a neighbour)

    def close(self) -> None:
        """End the stage before its process group is destroyed: the links' sends finished (or
        cancelled after a failure) and their waiter thread joined, the single-rank groups made
        here destroyed, the stage's Relay (its EPS) closed. Idempotent; not a collective."""
        if self._closed:
            return
        self._closed = True
        try:
            self.links.close()
        finally:
            groups, self._groups = self._groups, []
            if dist.is_initialized():
                for group in groups:
                    dist.destroy_process_group(group)
            self.layer_stage.close()

    def __enter__(self) -> "PipelineRelay":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # What the training loop reads of a relay, this stage's: its recompute policy (keep.describe()),
    # its transport (asynchronous or not), its host threads, its loss scale and its device memory.
    keep = property(lambda self: self.layer_stage.keep)
    transport = property(lambda self: self.layer_stage.transport)
    threads = property(lambda self: self.layer_stage.threads)
    loss_scale = property(lambda self: self.layer_stage.loss_scale)

    def memory_report(self) -> dict:
        """This stage's peak device memory since it was built (Relay.memory_report)."""
        return self.layer_stage.memory_report()

    def _check_no_shared_parameters(self) -> None:
        where: dict[int, int] = {}
        for i, layer in enumerate(self.layers):
            for p in layer.parameters():
                j = where.setdefault(id(p), i)
                if self._stage_of(j) != self._stage_of(i):
                    raise ValueError(f"layers {j} and {i} share a parameter (tied weights) but fall in different "
                                        f"stages ({self.bounds}); untie them or choose boundaries that keep them together")

    def _stage_of(self, i: int) -> int:
        return next(s for s in range(self.stages) if self.bounds[s] <= i < self.bounds[s + 1])

    @property
    def step(self) -> int:
        return self.layer_stage.step

    @property
    def eps(self):
        return self.layer_stage.eps

    # -- one step -----------------------------------------------------------------------
    def _trace(self, xs: list) -> Trace:
        key = tuple((t.shape, t.dtype) for x in xs for t in flatten(x))
        if key not in self._traces:
            trace = trace_model(self._meta, xs, self.layer_stage.compute_dtype)
            if self.drop.p:
                self._check_droppable(trace, xs)
            self._traces[key] = trace
        return self._traces[key]

    def _check_droppable(self, trace: Trace, xs: list) -> None:
        """A skipped layer's input goes on in place of its output, and the stages size their
        transfers from the trace: a droppable layer must return what it takes."""
        for i in sorted(self.drop.droppable):
            for j, x in enumerate(xs):
                takes = ([Spec(t.shape, t.dtype) for t in flatten(x)], isinstance(x, torch.Tensor)) if i == 0 else \
                    (trace.outputs[i - 1][j], trace.single[i - 1][j])
                if (trace.outputs[i][j], trace.single[i][j]) != takes:
                    raise PipelineError(f"layer {i} may be dropped (layer_drop) but returns {trace.outputs[i][j]} "
                                        f"from {takes[0]}; a droppable layer must return what it takes (give "
                                        f"droppable= the layers that do)")

    def _rng_plan(self, trace: Trace, active: list[int]) -> tuple[dict, object] | None:
        """The generator's state before each of this stage's (layer, micro-batch) calls, and at
        the step's end, as the single process (layer-major draws, the step's `active` layers)
        would have them."""
        if not trace.random:
            return None
        states = {}  # (layer, micro-batch) -> (before the call, after it)
        for i in active:
            for j in range(self.micro_batches):
                before = rng_state(self.device) if self.first <= i < self.end else None
                replay(trace.ops[i][j], self.device)
                if before is not None:
                    states[(i, j)] = (before, rng_state(self.device))
        return states, rng_state(self.device)

    def train_step(self, inputs, targets) -> float:
        """One optimizer step of the whole pipeline on the minibatch; its mean loss (every rank)."""
        return self.train_steps([(inputs, targets)])[0]

    @property
    def streams(self) -> bool:
        """Whether train_steps runs its minibatches as one schedule: under 2bw, where a stage's
        micro-batches in flight (at most S) span at most two weight versions (M >= S)."""
        return self.schedule.pipedream_2bw and self.micro_batches >= self.stages

    def train_steps(self, batches) -> list[float]:
        """An optimizer step on each `(inputs, targets)` of `batches` in turn; their mean losses
        (every rank, every rank the same batches). Under "2bw" (with micro_batches >= stages) the
        steps run as one 1F1B schedule: the next minibatch's forwards start while this one's
        backwards drain, each on the weights 2BW gives it (the version one commit back, which is
        the newest while the step before has not committed here), so the pipeline fills and
        drains once for all the steps, not once a step. Under "flush" every step fills and drains."""
        batches, t0, busy, losses = list(batches), time.perf_counter(), 0.0, []
        if not batches:
            return losses
        runs = [batches] if self.streams else [[batch] for batch in batches]
        if self.streams and self.layer_stage.keep.measuring and len(batches) > 1:
            runs = [batches[:1], batches[1:]]  # planned recompute plans from a step with no other in flight
        for run in runs:
            busy += self._run(run, losses)
        self.last_step_s, self.busy_s = (time.perf_counter() - t0) / len(batches), busy / len(batches)
        return losses

    def _run(self, batches: list, losses: list[float]) -> float:
        """The steps of `batches` as one 1F1B list over all their micro-batches, run by the stage's
        interpreter; their losses appended to `losses`; returns the seconds this stage computed
        (not waiting for a neighbour)."""
        own, links, u = self.layer_stage, self.links, self.micro_batches
        try:
            steps, traces, rng = [], [], []
            for t, (inputs, targets) in enumerate(batches):
                xs, ts, weights, n = own.split_micro_batches(inputs, targets)
                trace = self._trace(xs)
                active = self.drop.layers(own.step + t + 1)  # the step commits as own.step + t + 1
                here = [i for i in active if self.first <= i < self.end]
                traces.append(trace)
                rng.append(self._rng_plan(trace, active))
                steps.append((xs if self.stage == 0 else [], ts, weights, n, here))
        except PipelineError as exc:
            raise PipelineError(links.report(f"pipeline stage {self.stage}: {exc}")) from exc
        base, start = own.eps.step, time.perf_counter()
        peers = _Neighbours(self, traces)
        run = Interpreter(own, u, peers=peers, call=partial(self._call, rng, base),
                          version=lambda t: self._weights_of(base + t))
        work = [run.work(*step) for step in steps]
        actions = self.schedule.actions(self.stage, self.stages, [w.layers for w in work], u, len(self.layers) - 1)
        try:
            peers.start(-1)
            run.run(actions, work)
            links.finish_sends()
        except PipelineError as exc:
            own.abandon(exc)
            raise
        except Exception as exc:
            own.abandon(exc)
            raise PipelineError(links.report(f"pipeline stage {self.stage} (rank {dist.get_rank()}) failed: "
                                             f"{exc}")) from exc
        plans = [plan for plan in rng if plan is not None]
        if plans:
            set_rng_state(self.device, plans[-1][1])
        shared = self._share_loss(torch.stack([w.total for w in work]))
        losses += [own.mean_over_ranks(loss, w.n, "averaging the step's loss over the replicas")
                   for loss, w in zip(shared, work)]
        return time.perf_counter() - start - peers.waited_s

    # -- one layer's weights on the device at a time ----------------------------------------
    def _weights_of(self, step: int):
        """Where the fetches of the step that commits as `step + 1` read: under 2bw the version one
        commit back, which is the newest while the step before (`step`) has not committed on this
        stage (a context around them); None: the weight stream's own."""
        own = self.layer_stage
        return own.weights.newest() if own.eps.step < step else None

    def _call(self, rng: list, base: int, t: int, i: int, j: int, x, buffers):
        """Layer i on micro-batch j of step t (which commits as `base + t + 1`), with the generator
        where the single process has it."""
        if self.layer_stage.eps.step < base + t - 1:
            raise PipelineError(f"pipeline stage {self.stage}: step {base + t + 1} would start two commits ahead; "
                                f"2bw keeps two weight versions (micro_batches >= stages)")
        k = i - self.first
        if rng[t] is not None:
            before, expected = rng[t][0][(i, j)]
            set_rng_state(self.device, before)
        else:
            expected = rng_state(self.device)  # no layer draws: the generator must not move
        out = self.layer_stage.call(k, x, buffers)
        if not same_rng(rng_state(self.device), expected):
            raise PipelineError(f"layer {i} drew random numbers that its meta-device trace did not predict; the "
                                f"pipeline cannot replay its draws as the single process makes them")
        return out

    @torch.no_grad()
    def evaluate(self, inputs, targets) -> float:
        """Mean loss on a minibatch through the pipeline, in eval mode, on the newest committed
        weights (under 2BW too, as Relay.evaluate); no update. Every rank, the same minibatch."""
        own, links = self.layer_stage, self.links
        modes = [m.training for m in own.layers]
        for m in own.layers:
            m.train(False)
        try:
            xs, ts, weights, n = own.split_micro_batches(inputs, targets)
            trace = self._trace(xs)
            peers = _Neighbours(self, [trace], training=False)
            run = Interpreter(own, self.micro_batches, peers=peers, call=partial(self._call, [None], own.eps.step))
            work = run.work(xs if self.stage == 0 else [], ts, weights, n, list(range(self.first, self.end)),
                            training=False)
            with own.weights.newest():
                peers.start(-1)
                run.run(evaluation(work.layers, self.micro_batches, self.stages, self.stage), [work])
            links.finish_sends()
        except PipelineError:
            raise
        except Exception as exc:
            raise PipelineError(links.report(f"pipeline stage {self.stage} (rank {dist.get_rank()}) failed in "
                                             f"evaluation: {exc}")) from exc
        finally:
            for m, mode in zip(own.layers, modes):
                m.train(mode)
        return own.mean_over_ranks(self._share_loss(work.total)[0], n, "averaging the evaluation loss over the replicas")

    def _share_loss(self, totals: torch.Tensor) -> list[float]:
        """The last stage's losses (one per step), sent to every other stage."""
        last = self.stages - 1
        tag = 1 << 30
        if self.stage == last:
            values = totals.detach().float().cpu().reshape(-1)
            for s in range(last):
                self.links.send([values], s, tag)
            self.links.finish_sends()
            return values.tolist()
        bufs, works = self.links.recv([Spec(totals.reshape(-1).shape, torch.float32)], last, tag, "cpu")
        self.links.wait(works, f"receiving the steps' losses from stage {last}")
        return bufs[0].tolist()

    # -- state, evaluation and export -------------------------------------------------------
    def _holds(self, name: str) -> bool:
        """Whether a whole-model state entry is this stage's: a layer's (eps/layer{i}/..,
        buffers/{i}/..) where layer i is here, and every entry not a layer's (the EPS's step)."""
        for prefix in ("eps/layer", "buffers/"):
            if name.startswith(prefix):
                return self.first <= int(name[len(prefix):].partition("/")[0]) < self.end
        return True

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's state under the whole model's layer indices: the union over the stages
        is a single-process relay's state_dict (and loads into one)."""
        return self.layer_stage.state_dict()

    def load_state_dict(self, state) -> None:
        """Load this stage's part of a whole-model state (a single-process relay's, or the union
        of the stages' state_dicts); entries of other stages are skipped."""
        self.layer_stage.load_state_dict({k: v for k, v in state.items() if self._holds(k)})

    def state_entries(self) -> dict[str, StateEntry]:
        """What a checkpoint writes (l2l_hw.train; collective over the stages): the whole model's
        state under its layer indices, without a stage holding another's. The stages announce
        their entries' names, shapes and dtypes; on the rank that writes (global rank 0: stage 0
        of replica 0) another stage's entry is received when it is read, and every other stage
        of that replica sends its entries one at a time, in that order, before this returns.
        Other replicas (their state is replica 0's) keep theirs: they return their own entries."""
        mine = self.layer_stage.state_entries()
        parts = [None] * self.stages
        self.links.gather(parts, {k: (tuple(e.shape), e.dtype) for k, e in mine.items()},
                          "announcing the stages' state for a checkpoint")
        order = {}  # name -> (stage, its index there): a name every stage holds (the step) is stage 0's
        for stage, part in enumerate(parts):
            for n, name in enumerate(part):
                order.setdefault(name, (stage, n))
        if dist.get_global_rank(self.group, 0) != 0:  # not the writing replica
            return mine
        if self.stage > 0:
            for name, (stage, n) in order.items():
                if stage == self.stage:
                    self.links.send([tensor_of(mine[name]).to(self.links.device)], 0, CHECKPOINT_TAG + n)
                    self.links.finish_sends()
            return {}
        return {name: mine[name] if stage == 0 else
                StateEntry(torch.Size(parts[stage][name][0]), parts[stage][name][1],
                           partial(self.links.receive_one, Spec(*parts[stage][name]), stage, CHECKPOINT_TAG + n))
                for name, (stage, n) in order.items()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state, gathered on every rank (small models: tests, export)."""
        parts = [None] * self.stages
        self.links.gather(parts, self.state_dict(), "gathering the stages' state")
        out = {}
        for part in parts:
            out.update(part)
        return out

    def gather(self) -> "GatheredModel":
        """The whole trained model, gathered from every stage (collective: every rank calls it):
        what `export()` gives, with the model's layers; `hf.save_pretrained(own.gather(), path)`
        on one rank writes a transformers folder."""
        mine = list(self.layer_stage.export())
        parts = [None] * self.stages
        self.links.gather(parts, mine, "gathering the stages' weights")
        return GatheredModel(self.layers, [e for part in parts for e in part], self._meta)

    def materialize(self) -> nn.Sequential:
        """The trained model as an nn.Sequential on the CPU with fp32 master weights (collective)."""
        return self.gather().materialize()


class GatheredModel:
    """A pipeline's whole model on one rank: its layers (structure) and exported tensors."""

    def __init__(self, layers: list[nn.Module], exported: list, meta: list[nn.Module]):
        self.layers, self._exported, self._meta = layers, exported, meta

    def export(self):
        return iter(self._exported)

    def materialize(self) -> nn.Sequential:
        model = copy.deepcopy(nn.Sequential(*self._meta))
        values = {}
        for e in self._exported:
            values[(e.layer, e.name)] = values[e.first] if e.tensor is None else e.tensor
        for i, layer in enumerate(model):
            state = {name: values[(i, name)] for name, _ in (*layer.named_parameters(), *layer.named_buffers())}
            layer.load_state_dict(state, assign=True, strict=False)
        return model
