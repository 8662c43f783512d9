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
    schedule     a list of actions per stage (F j: forward of micro-batch j through the
                 stage, B j: its backward), 1F1B: S - s - 1 forwards to fill the pipe, then
                 one forward and one backward in turn, then the backwards left
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

Dropout: the single process draws its random numbers layer-major (layer 0 on every
micro-batch, then layer 1, ...). Every stage traces the random ops of the whole model once
per input shape (on the meta device: op, shape, dtype; no compute), replays the other layers'
draws on its own generator, and so sets the generator to the single process's state before
each of its own (layer, micro-batch) calls; after each call the state is checked against the
trace's prediction, so a layer drawing numbers the trace missed fails loudly.

Failure: every wait polls its transfer with a deadline (PipelineConfig.timeout_s) and a shared
error slot in the process group's store. A stage that fails writes its error there first and
raises PipelineError; its neighbours see it (or see the connection drop, for a killed rank) and
raise a PipelineError naming the stage that failed, so every rank stops with one clear error.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import datetime
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from l2l_hw.distributed import short_cause
from l2l_hw.eps.base import StateEntry, tensor_of
from l2l_hw.relay.layer_drop import LayerDrop
from l2l_hw.relay.options import PipelineConfig, RelayOptions
from l2l_hw.relay.recompute import grad_leaf, rng_state, set_rng_state
from l2l_hw.relay.stage import LayerStage, flatten, to_float, unflatten

CHECKPOINT_TAG = 1 << 24  # the tags of a checkpoint's entries, above every step's transfers
STORE_POLL_S = 0.05  # how often a waiting stage looks for another stage's error in the store
ERROR_LINGER_S = 3.0  # how long rank 0 (the store's host) waits for every rank to read an error
CLOSE_JOIN_S = 10.0  # how long close() waits for the waiter thread, its waits done or cancelled
CANCEL_TAG = (1 << 30) + 1  # Links._cancel's receive: no transfer of the pipeline uses it (losses: 1 << 30)


class PipelineError(RuntimeError):
    """A stage failed or stopped answering; every stage of the pipeline raises it. (A pipeline
    that cannot be built as asked, a bad input, raises ValueError.)"""


# -- schedules ------------------------------------------------------------------------------
class Action(NamedTuple):
    kind: str  # "F": forward of micro-batch `mb` through the stage; "B": its backward
    mb: int


@dataclass(frozen=True)
class OneFOneB:
    """1F1B (PipeDream-Flush's order): fill with S - s - 1 forwards, then alternate one forward
    and one backward, then drain. At most S - s micro-batches in flight on stage s."""

    name: str
    pipedream_2bw: bool  # compute on the weights one commit back (2bw) or on the newest (flush)

    def actions(self, stage: int, stages: int, micro_batches: int) -> list[Action]:
        fill = min(stages - stage - 1, micro_batches)
        out = [Action("F", j) for j in range(fill)]
        for j in range(micro_batches - fill):
            out += [Action("F", fill + j), Action("B", j)]
        out += [Action("B", j) for j in range(micro_batches - fill, micro_batches)]
        return out

    @staticmethod
    def bubble(stages: int, micro_batches: int) -> float:
        """The idle fraction of a step with equal stages and free transfers: (S - 1) / (M + S - 1)."""
        return (stages - 1) / (micro_batches + stages - 1)


SCHEDULES = {"flush": OneFOneB("flush", pipedream_2bw=False), "2bw": OneFOneB("2bw", pipedream_2bw=True)}

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


# -- the random ops of the model, traced on the meta device ------------------------------------
class RandomOp(NamedTuple):
    func: object  # an aten OpOverload tagged nondeterministic_seeded
    args: tuple  # tensors as (shape, dtype) specs
    kwargs: dict


class _Spec(NamedTuple):
    shape: torch.Size
    dtype: torch.dtype


def _specs(x):
    if isinstance(x, torch.Tensor):
        return _Spec(x.shape, x.dtype)
    if isinstance(x, (tuple, list)):
        return type(x)(_specs(t) for t in x)
    return x


def _real(x, device):
    if isinstance(x, _Spec):
        return torch.empty(x.shape, dtype=x.dtype, device=device)
    if isinstance(x, (tuple, list)):
        return type(x)(_real(t, device) for t in x)
    return x


class _RandomOpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[RandomOp] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.ops.append(RandomOp(func, _specs(args), {k: _specs(v) for k, v in kwargs.items()}))
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            # A value read on the meta device (Hugging Face's mask helpers test `mask.all()` for a
            # fast path): there is none; zero takes the general path, whose shapes do not depend
            # on the values. A wrong guess shows: a receive of the wrong size fails, a draw the
            # trace missed fails the generator check.
            return args[0].dtype.is_floating_point and 0.0 or (False if args[0].dtype == torch.bool else 0)
        return func(*args, **kwargs)


@dataclass
class Trace:
    """What one minibatch shape does, per layer i and micro-batch j: the random ops it runs
    (`ops[i][j]`) and the shapes and dtypes of what it returns (`outputs[i][j]`)."""

    ops: list[list[list[RandomOp]]]
    outputs: list[list[list[_Spec]]]
    single: list[list[bool]]  # the output is one tensor (not a tuple)

    def like(self, i: int, j: int):
        """Something with the structure of layer i's output on micro-batch j, for unflatten."""
        return torch.empty(0) if self.single[i][j] else ()

    @property
    def random(self) -> bool:
        return any(ops for layer in self.ops for ops in layer)


def trace_model(layers: Sequence[nn.Module], xs: list, dtype: torch.dtype = torch.float32) -> Trace:
    """Run meta copies of `layers` on meta micro-batches `xs`, recording random ops and output shapes;
    their trainable parameters in `dtype`, as the relay computes on the EPS's working copy."""
    ops, outputs, single = [[] for _ in layers], [[] for _ in layers], [[] for _ in layers]
    for x in xs:
        x = unflatten(x, [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in flatten(x)])
        for i, layer in enumerate(layers):
            recorder = _RandomOpRecorder()
            try:
                with torch.no_grad(), recorder:
                    out = functional_call(layer, {n: p.to(dtype) for n, p in layer.named_parameters()
                                                  if p.requires_grad}, (x,))
            except Exception as exc:
                raise PipelineError(f"layer {i} ({type(layer).__name__}) cannot run on the meta device, which the "
                                    f"pipeline uses to size its transfers and replay random draws: {exc}") from exc
            out = out if isinstance(out, torch.Tensor) else tuple(out)
            ops[i].append(recorder.ops)
            outputs[i].append([_Spec(t.shape, t.dtype) for t in flatten(out)])
            single[i].append(isinstance(out, torch.Tensor))
            x = out
    return Trace(ops, outputs, single)


def replay(ops: list[RandomOp], device: torch.device) -> None:
    """Draw what `ops` draw, on fresh tensors of the same shapes: the generator advances as the layer's would."""
    for op in ops:
        op.func(*_real(op.args, device), **{k: _real(v, device) for k, v in op.kwargs.items()})


def _same_rng(a, b) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))


class _Waiter:
    """One thread that runs blocking waits, so that a stage can look at its deadline and the
    error slot meanwhile. close() ends it; a wait that a failure left blocked must be cancelled
    first (Links.close): a thread still inside gloo's wait() when the interpreter exits aborts
    the process (see Links.close)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="l2l-pipeline-wait", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, future = item
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the waiting thread
                future.set_exception(exc)

    def submit(self, fn) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        self._queue.put((fn, future))
        return future

    def close(self, timeout_s: float) -> bool:
        """End the thread once its waits are done; whether it ended within `timeout_s`."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


# -- point-to-point transfers with a deadline ---------------------------------------------------
class Links:
    """This stage's transfers to and from its neighbours, each wait polled against a deadline
    and the shared error slot, so no rank waits for a rank that has failed."""

    _instances = itertools.count()  # one error slot per pipeline built (the same count on every rank)

    def __init__(self, group, stage: int, stages: int, timeout_s: float):
        self.group, self.stage, self.stages, self.timeout_s = group, stage, stages, timeout_s
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")  # collectives'
        self.store = dist.distributed_c10d._get_default_store()
        self.slot = f"l2l_pipeline/{next(self._instances)}"
        self.sends: list = []
        self.failed = False  # a transfer failed or another stage reported an error: the links are done
        self._waiter: _Waiter | None = _Waiter()

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage)

    def recv(self, specs: list[_Spec], stage: int, tag: int, device) -> tuple[list[torch.Tensor], list]:
        """Post receives of tensors shaped `specs` from `stage`; (buffers, works)."""
        bufs = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs]
        works = [self._guard(f"posting a receive from stage {stage}",
                             dist.irecv, b, self._peer(stage), group=self.group, tag=tag + k)
                 for k, b in enumerate(bufs)]
        return bufs, works

    def send(self, tensors: list[torch.Tensor], stage: int, tag: int) -> None:
        for k, t in enumerate(tensors):
            t = t.detach().contiguous()
            self.sends.append((t, self._guard(f"sending to stage {stage}", dist.isend, t, self._peer(stage),
                                              group=self.group, tag=tag + k), stage))

    def receive_one(self, spec: _Spec, stage: int, tag: int) -> torch.Tensor:
        """One tensor shaped `spec` from `stage`, waited for, on the CPU."""
        (buf,), works = self.recv([spec], stage, tag, self.device)
        self.wait(works, f"receiving a checkpoint entry from stage {stage}")
        return buf.cpu()

    def gather(self, parts: list, mine, what: str) -> None:
        """Every stage's `mine` into `parts` (all_gather_object); a lost stage is a PipelineError."""
        self._guard(what, dist.all_gather_object, parts, mine, group=self.group)

    def all_reduce(self, t: torch.Tensor, op, what: str) -> torch.Tensor:
        """`t` reduced over the stages (a copy on the group's device); a lost stage is a PipelineError."""
        t = t.to(self.device, copy=True)
        self.wait([self._guard(what, dist.all_reduce, t, op=op, group=self.group, async_op=True)], what)
        return t

    def _guard(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise self.lost(what, exc) from exc

    def wait(self, works: list, what: str) -> None:
        """Wait for transfers against a deadline, the error slot and a dropped connection.
        gloo's point-to-point works report completion only through a blocking wait(), so a
        helper thread blocks in it while this thread looks at the error slot and the clock."""
        deadline = time.monotonic() + self.timeout_s
        for work in works:
            waiting = self._waiter.submit(work.wait)
            while True:
                try:
                    waiting.result(timeout=STORE_POLL_S)
                    break
                except concurrent.futures.TimeoutError:
                    self._raise_if_failed()
                    if time.monotonic() >= deadline:
                        raise self.lost(what, f"nothing within {self.timeout_s:g} s (PipelineConfig.timeout_s)")
                except Exception as exc:
                    raise self.lost(what, exc) from exc

    def finish_sends(self) -> None:
        sends, self.sends = self.sends, []
        for _, work, stage in sends:
            self.wait([work], f"sending to stage {stage}")

    def close(self) -> None:
        """Finish the sends under way (cancel them, and any wait left blocked, after a failure)
        and end the waiter thread. Idempotent.

        Why a blocked wait must not outlive the pipeline: the waiter thread sits in gloo's
        Work.wait() with the GIL released (pybind11's gil_scoped_release). When the peer's
        process goes, that wait returns, and the thread takes the GIL back in
        ~gil_scoped_release; if the interpreter is finalizing by then, CPython ends the thread
        with pthread_exit, whose forced unwind meets that noexcept destructor: std::terminate,
        "terminate called without an active exception", SIGABRT at exit."""
        if self._waiter is None:
            return
        waiter, self._waiter = self._waiter, None
        if not self.failed:
            try:
                self.finish_sends()
            except PipelineError:
                pass  # failed meanwhile: cancelled below
        if self.failed:
            self._cancel()
        self.sends = []
        waiter.close(CLOSE_JOIN_S)

    def _cancel(self) -> None:
        """Fail every transfer under way on the group: a receive of the pipeline's own tag that
        times out at once. gloo answers an application-side timeout by failing every pending
        operation of the group's context (UnboundBuffer::waitRecv -> Context::signalException),
        so the waits blocked on them return. Only after a failure: the group's point-to-point
        transfers are unusable afterwards."""
        peer = self._peer((self.stage + 1) % self.stages)
        try:
            probe = dist.irecv(torch.empty(1), peer, group=self.group, tag=CANCEL_TAG)
            probe.wait(datetime.timedelta(milliseconds=1))
        except Exception:
            pass  # the expected timeout, or the group already failed (which cancels them too)

    def _raise_if_failed(self) -> None:
        try:
            failed = self.store.check([f"{self.slot}/error"])
            message = self.store.get(f"{self.slot}/error").decode() if failed else None
        except Exception as exc:  # the store lives on rank 0's process: it has gone
            raise PipelineError(f"pipeline stage {self.stage}: rank 0's process has gone (its store does not "
                                f"answer: {short_cause(exc)})") from None
        if message is not None:
            self.failed = True
            self._seen()
            raise PipelineError(message)

    def _seen(self) -> None:
        """Count this rank as having read the error. Rank 0 holds the store: it waits (a little)
        for every rank to read it before raising, so its exit does not hide the message."""
        try:
            self.store.add(f"{self.slot}/seen", 1)
            if dist.get_rank() != 0:
                return
            deadline = time.monotonic() + ERROR_LINGER_S
            while self.store.add(f"{self.slot}/seen", 0) < dist.get_world_size() and time.monotonic() < deadline:
                time.sleep(STORE_POLL_S)
        except Exception:
            pass

    def lost(self, what: str, cause) -> PipelineError:
        """The error of a wait that failed: another stage's reported error, else a lost neighbour."""
        self.failed = True
        try:
            self._raise_if_failed()
        except PipelineError as reported:
            return reported
        cause = short_cause(cause) if isinstance(cause, BaseException) else cause
        return PipelineError(self.report(f"pipeline stage {self.stage} (rank {dist.get_rank()}): {what} failed; a "
                                         f"neighbouring stage died or stopped answering ({cause})"))

    def report(self, message: str) -> str:
        """Make `message` the pipeline's error unless another stage's came first; the one to raise."""
        self.failed = True
        try:
            if self.store.add(f"{self.slot}/failures", 1) == 1:
                self.store.set(f"{self.slot}/error", message)
            else:
                message = self.store.get(f"{self.slot}/error").decode()
        except Exception:
            return message
        self._seen()
        return message


# -- the pipeline -------------------------------------------------------------------------------
@dataclass
class _Step:
    """One optimizer step of a run: its micro-batches, and what the stage keeps of it meanwhile."""

    xs: list
    ts: list
    weights: list[float]  # each micro-batch's share of the minibatch
    n: int  # the minibatch's samples (this replica's)
    trace: Trace
    plan: tuple | None  # the generator's states (PipelineRelay._rng_plan)
    total: torch.Tensor  # the last stage's weighted sum of the micro-batches' losses
    layers: list[int]  # this stage's layers the step runs (all but those layer drop skips), ascending
    users: dict[str, list[int]]  # EPS group -> those of `layers` that use it
    posted: bool = False  # its receives are posted
    held: dict = dataclasses.field(default_factory=dict)  # micro-batch -> groups its kept graphs hold until its backward
    graphs: dict = dataclasses.field(default_factory=dict)  # micro-batch -> the last layer's (input leaf, output)
    sums: dict = dataclasses.field(default_factory=dict)  # group -> its gradient over the micro-batches so far (host)
    losses: dict = dataclasses.field(default_factory=dict)  # micro-batch -> loss (the last stage)


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
                takes = ([_Spec(t.shape, t.dtype) for t in flatten(x)], isinstance(x, torch.Tensor)) if i == 0 else \
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
        """The steps of `batches` as one 1F1B schedule over all their micro-batches; their losses
        appended to `losses`; returns the seconds this stage computed (not waiting for a neighbour)."""
        own, links, u = self.layer_stage, self.links, self.micro_batches
        first_stage, last_stage = self.stage == 0, self.stage == self.stages - 1
        try:
            steps = []
            for t, (inputs, targets) in enumerate(batches):
                xs, ts, weights, n = own.split_micro_batches(inputs, targets)
                trace = self._trace(xs)
                active = self.drop.layers(own.step + t + 1)  # the step commits as own.step + t + 1
                here = [i for i in active if self.first <= i < self.end]
                users: dict[str, list[int]] = {}
                for i in here:
                    for key in own.plans[i - self.first].groups:
                        users.setdefault(key, []).append(i)
                steps.append(_Step(xs, ts, weights, n, trace, self._rng_plan(trace, active),
                                   torch.zeros((), dtype=torch.float32, device=self.device), here, users))
        except PipelineError as exc:
            raise PipelineError(links.report(f"pipeline stage {self.stage}: {exc}")) from exc
        recv_acts, recv_grads = {}, {}
        tag_of = (lambda kind, g: (2 * g + kind) * 64)  # up to 64 tensors per activation

        def post(t: int) -> None:
            """Post the receives of step t's micro-batches: they land while this stage computes."""
            if t >= len(steps) or steps[t].posted:
                return
            steps[t].posted = True
            for g in range(t * u, (t + 1) * u):
                if not first_stage:
                    recv_acts[g] = links.recv(steps[t].trace.outputs[self.first - 1][g % u], self.stage - 1,
                                              tag_of(0, g), self.device)
                if not last_stage:
                    floating = [s for s in steps[t].trace.outputs[self.end - 1][g % u] if s.dtype.is_floating_point]
                    recv_grads[g] = links.recv(floating, self.stage + 1, tag_of(1, g), self.device)

        def sample(*held) -> None:
            """The stage's device memory now: `held`, the receives posted, the sends under way, the
            groups and graphs kept for backwards to come (and what the relay's accounting adds)."""
            if own.memory.counting:
                own.sample_memory(*held, [bufs for bufs, _ in (*recv_acts.values(), *recv_grads.values())],
                                  [t for t, _, _ in links.sends], [(s.held, s.graphs) for s in steps])

        actions = self.schedule.actions(self.stage, self.stages, u * len(steps))
        base, busy = own.eps.step, 0.0
        try:
            post(0)
            for n, action in enumerate(actions):
                g = action.mb
                t, j = divmod(g, u)
                step = steps[t]
                if action.kind == "F":
                    if j == 0:
                        own.eps.expect_step(list(step.users), sorted(step.users, key=lambda key: -step.users[key][0]))
                        post(t + 1)
                    if first_stage:
                        x = step.xs[j]
                    else:
                        bufs, works = recv_acts.pop(g)
                        links.wait(works, f"receiving micro-batch {j}'s activations from stage {self.stage - 1}")
                        x = unflatten(step.trace.like(self.first - 1, j), bufs)
                    c0 = time.perf_counter()
                    with self._weights_of(base + t):
                        x = self._forward(j, x, step, sample)
                    if not last_stage:
                        links.send(flatten(x), self.stage + 1, tag_of(0, g))
                    busy += time.perf_counter() - c0
                else:
                    if last_stage:
                        c0 = time.perf_counter()
                        loss = step.losses.pop(j)
                        (loss * (step.weights[j] * own.loss_scale)).backward()
                        step.total += loss.detach().float() * step.weights[j]
                        grads = None
                    else:
                        bufs, works = recv_grads.pop(g)
                        links.wait(works, f"receiving micro-batch {j}'s gradients from stage {self.stage + 1}")
                        c0 = time.perf_counter()
                        it = iter(bufs)
                        grads = [next(it) if s.dtype.is_floating_point else None
                                 for s in step.trace.outputs[self.end - 1][j]]
                    if j == u - 1:  # the replicas' weights of the pushes to come
                        own.start_step_over_ranks(step.n)
                    with self._weights_of(base + t):
                        grads = self._backward(j, grads, step, sample, last=j == u - 1)
                    if not first_stage:
                        links.send(grads, self.stage - 1, tag_of(1, g))
                    if j == u - 1:  # the step's every group is pushed: commit it (2bw: without waiting)
                        own.push_reduced()
                        own.keep.end_step()  # planned recompute: the first step's measure makes the plan
                        own.commit_pushed(across=self.links.all_reduce)
                        own.weights.clear()  # what is on its way was read before the commit
                    busy += time.perf_counter() - c0
                if n + 1 < len(actions):
                    self._prefetch_action(actions[n + 1], base, steps)
            links.finish_sends()
        except PipelineError as exc:
            own.abandon(exc)
            raise
        except Exception as exc:
            own.abandon(exc)
            raise PipelineError(links.report(f"pipeline stage {self.stage} (rank {dist.get_rank()}) failed: "
                                             f"{exc}")) from exc
        plans = [step.plan for step in steps if step.plan is not None]
        if plans:
            set_rng_state(self.device, plans[-1][1])
        shared = self._share_loss(torch.stack([step.total for step in steps]))
        losses += [own.mean_over_ranks(loss, step.n, "averaging the step's loss over the replicas")
                   for loss, step in zip(shared, steps)]
        return busy

    # -- one layer's weights on the device at a time ----------------------------------------
    def _weights_of(self, step: int):
        """Where the fetches of the step that commits as `step + 1` read (a context around them): under
        2bw the version one commit back, which is the newest while the step before (`step`) has not
        committed on this stage."""
        own = self.layer_stage
        if own.eps.step < step - 1:
            raise PipelineError(f"pipeline stage {self.stage}: step {step + 1} would start two commits ahead; "
                                f"2bw keeps two weight versions (micro_batches >= stages)")
        return own.weights.newest() if own.eps.step < step else contextlib.nullcontext()

    def _with_loss(self, i: int) -> bool:
        """Layer i is the model's last: its forward keeps its graph with the loss's (on the last
        stage, 1F1B runs a micro-batch's backward right after its forward)."""
        return i == len(self.layers) - 1

    def _keeps_graph(self, i: int, j: int) -> bool:
        """Whether layer i's forward on micro-batch j keeps its graph, and so its weights, until the
        backward: the model's last layer, and every layer under recompute="none"."""
        return self._with_loss(i) or not self.layer_stage.keep.recomputes((i, j))

    def _prefetch(self, i: int, j: int, live: dict) -> None:
        """Start moving layer i's weights (and, for its backward, micro-batch j's stashed input) up."""
        self.layer_stage.prefetch(i - self.first, live, (i, j))

    def _prefetch_action(self, action: Action, base: int, steps: list) -> None:
        """The first layer of the next action on its way while this stage waits for its input,
        where that action reads the version the weight stream reads by default (and its groups
        are not held for it by a kept graph)."""
        t, j = divmod(action.mb, self.micro_batches)
        if self.layer_stage.eps.step < base + t:  # it reads the newest version: its fetches start afresh
            return
        layers = steps[t].layers
        if not layers:  # every layer here dropped this step
            return
        if action.kind == "F":
            self._prefetch(layers[0], j, {})
        elif not self._with_loss(layers[-1]):  # the last layer's weights are held by its graph
            self._prefetch(layers[-1], j, steps[t].held.get(j, {}))

    def _forward(self, j: int, x, step: _Step, sample) -> object:
        """Micro-batch j's forward through the stage's layers of the step with one layer's weights
        on the device at a time: each layer fetched (the next one on its way meanwhile), run, its
        input stashed for the recompute (own.keep: the recompute policy) or its graph kept, then its
        weights released. On the last stage the last layer's graph is kept with the loss: its
        backward comes next. A stage whose layers are all dropped passes `x` on."""
        own, keep, meter, users = self.layer_stage, self.layer_stage.keep, self.layer_stage.memory, step.users
        live, held = {}, step.held.setdefault(j, {})
        for n, i in enumerate(step.layers):
            k = i - self.first
            run = partial(self._call, i, j, params=own.layer_params(k, live), plan=step.plan)
            if n + 1 < len(step.layers):
                self._prefetch(step.layers[n + 1], j, live)
            with meter.saving((i, j)):
                if self._with_loss(i):
                    x = grad_leaf(x)
                    out = run(x, own.plans[k].buffers)
                    step.graphs[j] = (x, out)
                    step.losses[j] = own.compute_loss(to_float(out), step.ts[j])
                else:
                    keep.begin_forward((i, j), [x])
                    out = keep.forward((i, j), 0, x, run, own.plans[k].buffers)
                    keep.end_forward((i, j))
            sample(live, x, out)
            frozen = f"frozen:{k}"
            if self._keeps_graph(i, j) and frozen in live:
                held[frozen] = live.pop(frozen)
            live.pop(frozen, None)
            for key in own.plans[k].groups:
                if users[key][-1] == i:  # its last use in this forward: the backward fetches it again
                    tensors = live.pop(key)
                    if any(self._keeps_graph(user, j) for user in users[key]):
                        held[key] = tensors  # a kept graph computes its gradient on these
            x = out
        return x

    def _backward(self, j: int, grads, step: _Step, sample, last: bool) -> list:
        """Micro-batch j's backward through the stage's layers of the step, last to first, one
        layer's weights on the device at a time: each fetched again and its forward recomputed (or
        its kept graph taken), backpropagated, released; a group's gradient joins the step's sum
        after its last use (on the last micro-batch: pushed). `grads`: of the stage's output (None
        on the last stage: the loss's backward ran; None where an output is not floating). Returns
        the gradients of the stage's floating inputs."""
        own, keep, meter, users = self.layer_stage, self.layer_stage.keep, self.layer_stage.memory, step.users
        live = step.held.pop(j, {})
        if not step.layers:  # every layer here dropped: the input went on as the output
            return [d for d in grads if d is not None]
        inputs = None
        for n in range(len(step.layers) - 1, -1, -1):
            i = step.layers[n]
            k = i - self.first
            run = partial(self._call, i, j, params=own.layer_params(k, live), plan=step.plan)
            if n > 0:
                self._prefetch(step.layers[n - 1], j, live)
            if self._with_loss(i):
                x, out = step.graphs.pop(j)  # its backward ran with the loss's
            else:
                keep.begin_backward((i, j))
                with meter.saving((i, j)):
                    x, out = keep.backward((i, j), 0, run)
                pairs = [(o, d) for o, d in zip(flatten(out), grads) if d is not None and o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [d for _, d in pairs])
            grads_in = own.input_grads(x) if n > 0 or self.stage > 0 else None  # stage 0's input: data
            sample(live, x, out, grads, grads_in)  # the layer's weights, their gradients, its graph: its peak
            meter.drop_saved((i, j))
            grads, inputs = grads_in, x
            live.pop(f"frozen:{k}", None)
            for key in own.plans[k].groups:
                if users[key][0] == i:  # its last use in this backward
                    self._sum_grads(step, key, live.pop(key), last)
        if self.stage == 0:
            return []
        return [d for d, t in zip(grads, flatten(inputs)) if t.is_floating_point()]

    def _sum_grads(self, step: _Step, key: str, tensors: dict, last: bool) -> None:
        """Add one micro-batch's gradient of group `key` (on its device leaves `tensors`) to the
        step's sum, which waits in host memory between the group's visits: a sum on the device for
        each of the stage's layers would grow with its depth. The micro-batches add in order, as
        autograd accumulates them in the single process; on the last one the sum comes up, takes
        its gradient and is pushed to the EPS."""
        own = self.layer_stage
        transport, pool = own.transport, own.transport.grad_pool
        grads = own.grad_sums.take(tensors)
        total = {}
        if key in step.sums:  # the micro-batches before: landed long since (a backward ago)
            total, names, moving = step.sums.pop(key)
            for name, g in zip(names, moving.landed()):
                total[name] = total[name].add_(g) if name in total else g.clone() if transport.asynchronous else g
            if transport.asynchronous:
                pool.give_back(moving.tensors)
        if not last:
            step.sums[key] = (total, list(grads), transport.down(list(grads.values()), pool=pool))
            return
        if total:
            up = dict(zip(total, transport.up(list(total.values())).wait()))
            grads = {name: up[name].add_(grads[name]) if name in grads else up[name] for name in up} | \
                {name: g for name, g in grads.items() if name not in up}
        own.push(key, grads)

    def _call(self, i: int, j: int, x, buffers, params, plan):
        """Layer i on micro-batch j, with the generator where the single process has it."""
        k = i - self.first
        if plan is not None:
            before, expected = plan[0][(i, j)]
            set_rng_state(self.device, before)
        else:
            expected = rng_state(self.device)  # no layer draws: the generator must not move
        out = self.layer_stage.call(k, x, buffers, params)
        if not _same_rng(rng_state(self.device), expected):
            raise PipelineError(f"layer {i} drew random numbers that its meta-device trace did not predict; the "
                                f"pipeline cannot replay its draws as the single process makes them")
        return out

    @torch.no_grad()
    def evaluate(self, inputs, targets) -> float:
        """Mean loss on a minibatch through the pipeline, in eval mode, on the newest committed
        weights (under 2BW too, as Relay.evaluate); no update. Every rank, the same minibatch."""
        own, links = self.layer_stage, self.links
        first_stage, last_stage = self.stage == 0, self.stage == self.stages - 1
        modes = [m.training for m in own.layers]
        for m in own.layers:
            m.train(False)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        try:
            xs, ts, weights, n = own.split_micro_batches(inputs, targets)
            trace = self._trace(xs)
            with own.weights.newest():
                for j in range(self.micro_batches):
                    if first_stage:
                        x = xs[j]
                    else:
                        bufs, works = links.recv(trace.outputs[self.first - 1][j], self.stage - 1, (2 * j) * 64,
                                                 self.device)
                        links.wait(works, f"receiving micro-batch {j}'s activations from stage {self.stage - 1}")
                        x = unflatten(trace.like(self.first - 1, j), bufs)
                    for i in range(self.first, self.end):  # one layer's weights on the device at a time
                        k = i - self.first
                        live: dict[str, dict[str, torch.Tensor]] = {}
                        params = own.layer_params(k, live)
                        if i + 1 < self.end:
                            self._prefetch(i + 1, j, live)
                        x = own.call(k, x, own.plans[k].buffers, params)
                    if last_stage:
                        total += own.compute_loss(to_float(x), ts[j]).float() * weights[j]
                    else:
                        links.send(flatten(x), self.stage + 1, (2 * j) * 64)
            links.finish_sends()
        except PipelineError:
            raise
        except Exception as exc:
            raise PipelineError(links.report(f"pipeline stage {self.stage} (rank {dist.get_rank()}) failed in "
                                             f"evaluation: {exc}")) from exc
        finally:
            for m, mode in zip(own.layers, modes):
                m.train(mode)
        return own.mean_over_ranks(self._share_loss(total)[0], n, "averaging the evaluation loss over the replicas")

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
        bufs, works = self.links.recv([_Spec(totals.reshape(-1).shape, torch.float32)], last, tag, "cpu")
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
                           partial(self.links.receive_one, _Spec(*parts[stage][name]), stage, CHECKPOINT_TAG + n))
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
