"""What the relay keeps of a layer's forward for its backward: the recompute policy.

    none       the forward's autograd graph, with every intermediate, until the backward:
               no second forward; device memory grows with depth
    full       each layer's inputs (the activation stash), and the RNG state and buffers the
               forward saw: the backward runs the forward again with grad, replaying them,
               and stops early as torch's checkpoint does: the matmuls after the last op
               whose output the backward saves give zeros instead (nothing reads them)
    selective  as full, plus the outputs of the costly ops (matmuls and attention): the
               recompute takes those from the cache and runs only the cheap ones (norms,
               activations, dropout, residual adds, views). Megatron-LM's selective
               recompute (Korthikanti et al., arXiv 2205.05198) and torch's selective
               activation checkpointing (SAC); a SAC policy function, policy(ctx, op, *args,
               **kwargs) -> CheckpointPolicy or bool, picks other ops.

The forward sweep runs every micro-batch of layer i before layer i+1, and the backward
sweep comes back down, so what is kept per layer and micro-batch goes into the stash
(l2l_hw/relay/stash.py): on the device, or to host memory and back one layer ahead of its
use with activations="host". An op that draws random numbers (dropout inside attention)
is never served from the cache: the recompute must draw it again for the RNG stream of the
ops after it to match the forward's.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from l2l_hw.relay.stash import ActivationStash

RECOMPUTE = ("none", "full", "selective")
_TENSOR = object()  # a kept op's tensor output, in the template of its outputs

aten = torch.ops.aten
ATTENTION_OPS = {aten._scaled_dot_product_flash_attention.default,
                 aten._scaled_dot_product_flash_attention_for_cpu.default,
                 aten._scaled_dot_product_efficient_attention.default,
                 aten._scaled_dot_product_cudnn_attention.default}
MATMUL_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def save_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The "selective" policy: keep what costs O(n^3) or O(T^2) to recompute."""
    return CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS or op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _draws_random(op, args, kwargs) -> bool:
    if op in ATTENTION_OPS:  # tagged random, but draws only with dropout
        return float(kwargs.get("dropout_p", args[3] if len(args) > 3 else 0.0)) > 0
    return torch.Tag.nondeterministic_seeded in op.tags


def _kept(policy: Callable, op, args, kwargs, out) -> bool:
    ctx = SelectiveCheckpointContext(is_recompute=False)
    ctx.op_output = out  # torch >= 2.13 passes it to __init__; 2.11's context has no such argument
    decision = policy(ctx, op, *args, **kwargs)
    if isinstance(decision, bool):
        return decision
    return decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


class _Keep(TorchDispatchMode):
    """Forward: the outputs of the ops `policy` keeps, in call order, with their versions."""

    def __init__(self, policy: Callable):
        super().__init__()
        self.policy = policy
        self.calls: list[tuple[object, int, object]] = []  # (op, first tensor, output with _TENSOR for tensors)
        self.tensors: list[torch.Tensor] = []
        self._versions: list[tuple[torch.Tensor, int]] = []  # the forward's own tensors: detach() counts apart

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = op(*args, **kwargs)
        if not _draws_random(op, args, kwargs) and _kept(self.policy, op, args, kwargs, out):
            items = [out] if isinstance(out, torch.Tensor) else list(out)
            tensors = [t.detach() for t in items if isinstance(t, torch.Tensor)]
            template = None if isinstance(out, torch.Tensor) else [_TENSOR if isinstance(t, torch.Tensor) else t
                                                                   for t in items]
            self.calls.append((op, len(self.tensors), template))
            self.tensors += tensors
            self._versions += [(t, t._version) for t in items if isinstance(t, torch.Tensor)]
        return out

    def check_unchanged(self, layer: int) -> None:
        """A kept output changed in place later in the forward would be replayed wrong."""
        for op, first, template in self.calls:
            count = 1 if template is None else sum(t is _TENSOR for t in template)
            if any(t._version != v for t, v in self._versions[first:first + count]):
                raise RuntimeError(f"layer {layer}'s forward changes the output of {op} in place after it ran, so "
                                   f"selective recompute cannot keep that output; use recompute='full' or a policy "
                                   f"that does not keep {op}")
        self._versions = []


class _Replay(TorchDispatchMode):
    """Recompute: each kept op's outputs from the cache, in the forward's order; the rest runs."""

    def __init__(self, layer: int, calls: list, tensors: list):
        super().__init__()
        self.layer, self.calls, self.tensors = layer, calls, tensors
        self.next = 0

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.next < len(self.calls) and self.calls[self.next][0] is op:
            _, first, template = self.calls[self.next]
            self.next += 1
            if template is None:
                return self.tensors[first]
            kept = iter(self.tensors[first:])
            return tuple(next(kept) if t is _TENSOR else t for t in template)
        return op(*args, **kwargs)

    def finish(self) -> None:
        if self.next != len(self.calls):
            raise RuntimeError(f"the recompute of layer {self.layer} did not run the ops its forward kept (at "
                               f"{self.calls[self.next][0]}): the layer's forward must run the same ops both times; "
                               f"use recompute='full'")


VALUE_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.nonzero.default}


class _FindTail(TorchDispatchMode):
    """A layer's first recompute of an input shape, recorded: each op and the last op to write
    each storage; then (saved_by) the storages its autograd graph saves. The matmuls after the
    last write of a saved storage compute values nothing reads: the backward reads only what
    is saved, and the recompute's output is not used (torch's non-reentrant checkpoint stops
    there too)."""

    def __init__(self):
        super().__init__()
        self.ops: list = []
        self.outputs: list = []  # per op: (shape, stride, dtype, device) of its one tensor output, or None
        self.writer: dict[int, int] = {}  # storage -> the last op that returned a tensor on it
        self.saved: set[int] = set()
        self.custom = False  # the graph has a custom Function's node

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        out = op(*args, **(kwargs or {}))
        k = len(self.ops)
        self.ops.append(op)
        items = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)] \
            if isinstance(out, (tuple, list)) else []
        for t in items:
            self.writer[t.untyped_storage().data_ptr()] = k
        self.outputs.append((out.shape, out.stride(), out.dtype, out.device) if isinstance(out, torch.Tensor) else None)
        return out

    def saved_by(self, out) -> None:
        """Collect the storages the graph of `out` saves for its backward (each node's _saved_*).
        A custom autograd.Function's backward may read anything its ctx holds: none is skipped."""
        seen, nodes = set(), [o.grad_fn for o in ([out] if isinstance(out, torch.Tensor) else out)
                               if isinstance(o, torch.Tensor) and o.grad_fn is not None]
        while nodes:
            node = nodes.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if isinstance(node, torch.autograd.function.BackwardCFunction):
                self.custom = True
            for name in dir(node):
                if name.startswith("_saved_"):
                    value = getattr(node, name)
                    for t in value if isinstance(value, (tuple, list)) else [value]:
                        if isinstance(t, torch.Tensor):
                            self.saved.add(t.untyped_storage().data_ptr())
            nodes += [next_node for next_node, _ in node.next_functions]

    def skipped(self) -> dict[int, tuple]:
        """The matmuls the later recomputes of this shape may skip: op index -> output spec."""
        last = max((self.writer.get(ptr, -1) for ptr in self.saved), default=-1)
        tail = range(last + 1, len(self.ops))
        if self.custom or any(self.ops[k] in VALUE_READS for k in tail):  # a value read to Python must be real
            return {}
        return {k: (self.ops[k], self.outputs[k]) for k in tail
                if self.ops[k] in MATMUL_OPS and self.outputs[k] is not None}


class _SkipTail(TorchDispatchMode):
    """A recompute that gives the skippable matmuls (_FindTail.skipped) zeros of their output's shape."""

    def __init__(self, skipped: dict[int, tuple]):
        super().__init__()
        self.skipped, self.k = skipped, 0

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        k, self.k = self.k, self.k + 1
        skip = self.skipped.get(k)
        if skip is not None and skip[0] is op and tuple(skip[1][0]) == _matmul_shape(op, args):
            shape, stride, dtype, device = skip[1]
            return torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
        return op(*args, **(kwargs or {}))


def _matmul_shape(op, args) -> tuple:
    """The output shape of a MATMUL_OPS call: (n, m) for mm / addmm, (b, n, m) for bmm / baddbmm."""
    a, b = args[-2], args[-1]
    if op in (aten.mm.default, aten.addmm.default):
        return a.shape[0], b.shape[1]
    return a.shape[0], a.shape[1], b.shape[2]


def rng_state(device: torch.device):
    """The generators' states a layer's random ops draw from (the CPU's, and the device's)."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def set_rng_state(device: torch.device, state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def grad_leaf(x):
    """x (a tensor or a tuple of them) detached, floating tensors requiring grad."""
    leaf = lambda t: t.detach().requires_grad_(t.is_floating_point())
    return leaf(x) if isinstance(x, torch.Tensor) else tuple(leaf(t) for t in x)


Run = Callable[[object, dict], object]  # run(x, buffers) -> out: the layer on one micro-batch


class KeepGraphs:
    """recompute="none": each layer-micro-batch's forward graph is kept until its backward."""

    measuring = False  # the first step of a planned policy, which measures what each layer keeps

    def __init__(self):
        self._graphs: dict[tuple[int, int], tuple] = {}

    def describe(self) -> str:
        """The policy in a few words, for the run's banner."""
        return "none"

    def recomputes(self, i: int) -> bool:
        """Whether layer i's forward runs again in the backward (else its graph holds its weights)."""
        return False

    def begin_forward(self, i: int, acts: list) -> None:
        pass

    def forward(self, i: int, j: int, x, run: Run, buffers: dict):
        """Layer i on micro-batch j in the forward sweep (with the live `buffers`); its output."""
        x = grad_leaf(x)
        with torch.enable_grad():
            out = run(x, buffers)
        self._graphs[(i, j)] = (x, out)
        return out.detach() if isinstance(out, torch.Tensor) else tuple(t.detach() for t in out)

    def end_forward(self, i: int) -> None:
        pass

    def prefetch(self, i: int) -> None:
        pass

    def begin_backward(self, i: int) -> None:
        pass

    def backward(self, i: int, j: int, run: Run) -> tuple:
        """(x, out): micro-batch j's input leaf and output graph, ready for autograd."""
        return self._graphs.pop((i, j))

    def held(self) -> list:
        """What this holds on the device for the layer in its backward (for the accounting)."""
        return []

    def end_step(self) -> None:
        pass

    def clear(self) -> None:
        self._graphs.clear()


class Recompute(KeepGraphs):
    """recompute="full": layer inputs in the stash; the backward runs the forward again."""

    def __init__(self, stash: ActivationStash, device: torch.device):
        super().__init__()
        self.stash, self.device = stash, device
        self._replay: dict[tuple[int, int], tuple] = {}  # (RNG state, buffer snapshot) per layer-micro-batch
        self._inputs: list | None = None
        self._tails: dict[tuple, dict[int, tuple]] = {}  # (layer, input shapes) -> the matmuls it may skip

    def describe(self) -> str:
        return "full"

    def recomputes(self, i: int) -> bool:
        return True

    def begin_forward(self, i: int, acts: list) -> None:
        self.stash.put(i, acts)

    def forward(self, i: int, j: int, x, run: Run, buffers: dict):
        self._replay[(i, j)] = (rng_state(self.device), {n: b.clone() for n, b in buffers.items()})
        with torch.no_grad():
            return self._run_forward(i, j, x, run, buffers)

    def _run_forward(self, i: int, j: int, x, run: Run, buffers: dict):
        return run(x, buffers)

    def prefetch(self, i: int) -> None:
        self.stash.prefetch(i)

    def begin_backward(self, i: int) -> None:
        self._inputs = self.stash.take(i)

    def backward(self, i: int, j: int, run: Run) -> tuple:
        x = grad_leaf(self._inputs[j])
        self._inputs[j] = None  # micro-batch j's input is done with
        rng, buffers = self._replay.pop((i, j))
        saved = rng_state(self.device)
        set_rng_state(self.device, rng)
        try:
            with torch.enable_grad():
                return x, self._run_recompute(i, j, x, run, buffers)
        finally:
            set_rng_state(self.device, saved)

    def _run_recompute(self, i: int, j: int, x, run: Run, buffers):
        key = (i, tuple((t.shape, t.dtype) for t in ([x] if isinstance(x, torch.Tensor) else x)))
        if key in self._tails:
            with _SkipTail(self._tails[key]):
                return run(x, buffers)
        with _FindTail() as finder:
            out = run(x, buffers)
        finder.saved_by(out)
        self._tails[key] = finder.skipped()
        return out

    def held(self) -> list:
        return [self._inputs]

    def clear(self) -> None:
        super().clear()
        self._replay.clear()
        self._inputs = None


class SelectiveRecompute(Recompute):
    """recompute="selective" (or a SAC policy): also the kept ops' outputs, per micro-batch."""

    def __init__(self, stash: ActivationStash, device: torch.device, policy: Callable = save_matmuls_and_attention):
        super().__init__(stash, device)
        self.policy = policy
        self._calls: dict[tuple[int, int], list] = {}  # which ops were kept, per layer-micro-batch
        self._kept: dict[int, list] = {}  # the forward sweep's outputs of layer i, per micro-batch
        self._cache: dict[int, list] = {}  # layer i's in the backward

    def describe(self) -> str:
        return "selective" if self.policy is save_matmuls_and_attention else "selective, by a policy function"

    def _run_forward(self, i: int, j: int, x, run: Run, buffers: dict):
        with _Keep(self.policy) as keep:
            out = run(x, buffers)
        keep.check_unchanged(i)
        self._calls[(i, j)] = keep.calls
        self._kept.setdefault(i, []).append(tuple(keep.tensors))
        return out

    def end_forward(self, i: int) -> None:
        kept = self._kept.pop(i)
        if any(kept):
            self.stash.put(("kept", i), kept)

    def prefetch(self, i: int) -> None:
        super().prefetch(i)
        self.stash.prefetch(("kept", i))

    def begin_backward(self, i: int) -> None:
        super().begin_backward(i)
        self._cache[i] = self.stash.take(("kept", i)) if self.stash.holds(("kept", i)) else None

    def _run_recompute(self, i: int, j: int, x, run: Run, buffers):
        cache = self._cache[i]
        replay = _Replay(i, self._calls.pop((i, j)), list(cache[j]) if cache is not None else [])
        if cache is not None:
            cache[j] = None
            if j == len(cache) - 1:
                del self._cache[i]
        with replay:
            out = run(x, buffers)
        replay.finish()
        return out

    def held(self) -> list:
        return [self._inputs, list(self._cache.values())]

    def clear(self) -> None:
        super().clear()
        self._calls.clear()
        self._kept.clear()
        self._cache.clear()


class PlannedRecompute(KeepGraphs):
    """activation_budget: each layer the policy that recomputes least while what every layer keeps
    for the backward fits the budget, in the spirit of checkmate and rotor's optimal checkpointing
    (the survey's planned recompute). The first step runs "full" and measures each layer: the
    bytes its graph saves (its weights once, its intermediates per micro-batch), its input, its
    matmul and attention outputs, the time of its recompute and of the ops selective keeps.
    Every later step runs the plan (plan_recompute).

    A key is a layer (the Relay: each call covers the micro-batches) or a (layer, micro-batch)
    (a pipeline stage, which keeps at most `in_flight` micro-batches at once under 1F1B: a
    layer's bytes are measured over that many)."""

    def __init__(self, stash: ActivationStash, device: torch.device, budget: int, in_flight: int | None = None):
        super().__init__()
        self.budget = budget
        self.policies = {"none": KeepGraphs(), "selective": SelectiveRecompute(stash, device),
                         "full": _MeasuringRecompute(stash, device, in_flight)}
        self.plan: dict[int, str] | None = None  # layer -> the policy it runs

    @property
    def measuring(self) -> bool:
        return self.plan is None

    def describe(self) -> str:
        within = f"planned within {self.budget / 2**20:,.1f} MiB of kept activations"
        if self.plan is None:
            return within + " (the first step runs full and measures each layer)"
        by_policy: dict[str, list[int]] = {}
        for i, name in sorted(self.plan.items()):
            by_policy.setdefault(name, []).append(i)
        return within + ": " + "; ".join(f"{name} at layers {_ranges(layers)}" for name, layers in by_policy.items())

    def _of(self, key) -> KeepGraphs:
        return self.policies["full" if self.plan is None else self.plan.get(_layer(key), "full")]

    def recomputes(self, i):
        return self._of(i).recomputes(i)

    def begin_forward(self, i, acts):
        self._of(i).begin_forward(i, acts)

    def forward(self, i, j, x, run, buffers):
        return self._of(i).forward(i, j, x, run, buffers)

    def end_forward(self, i):
        self._of(i).end_forward(i)

    def prefetch(self, i):
        self._of(i).prefetch(i)

    def begin_backward(self, i):
        self._of(i).begin_backward(i)

    def backward(self, i, j, run):
        return self._of(i).backward(i, j, run)

    def held(self):
        return [p.held() for p in self.policies.values()]

    def end_step(self) -> None:
        measured = self.policies["full"]
        if self.plan is None:
            measured.end_step()
            self.plan = plan_recompute(measured.costs, self.budget)
            self.policies["full"] = Recompute(measured.stash, measured.device)

    def clear(self):
        for p in self.policies.values():
            p.clear()


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def _layer(key) -> int:
    """The layer of a policy's key: a layer, or a (layer, micro-batch)."""
    return key if isinstance(key, int) else key[0]


def _bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


class _MeasuringRecompute(Recompute):
    """Full recompute that measures, per layer, what each policy would keep and recompute (over
    the first `in_flight` micro-batches of a (layer, micro-batch) key; a layer key's all)."""

    def __init__(self, stash, device, in_flight: int | None = None):
        super().__init__(stash, device)
        self.costs: dict[int, dict] = {}
        self.in_flight = in_flight

    def _counted(self, key) -> bool:
        return isinstance(key, int) or self.in_flight is None or key[1] < self.in_flight

    def begin_forward(self, i, acts):
        super().begin_forward(i, acts)
        if self._counted(i):
            flat = [t for a in acts for t in ([a] if isinstance(a, torch.Tensor) else a)]
            cost = self.costs.setdefault(_layer(i), dict(input=0, graph=[], kept=[], full_s=0.0, kept_s=0.0))
            cost["input"] += _bytes(flat)

    def _run_recompute(self, i, j, x, run, buffers):
        if not self._counted(i):
            return super()._run_recompute(i, j, x, run, buffers)
        cost, saved = self.costs[_layer(i)], []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), \
                _TimedKeep(save_matmuls_and_attention, self.device) as keep:
            start = time.perf_counter()
            out = run(x, buffers)
            _sync(self.device)
            cost["full_s"] += time.perf_counter() - start
        cost["kept_s"] += keep.seconds
        cost["graph"] += saved
        cost["kept"] += keep.tensors
        return out

    def end_step(self):
        for cost in self.costs.values():  # bytes of the union of storages, over the micro-batches
            cost["graph"], cost["kept"] = _bytes(cost["graph"]), _bytes(cost["kept"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _TimedKeep(_Keep):
    """_Keep that also times the ops it keeps."""

    def __init__(self, policy, device):
        super().__init__(policy)
        self.device, self.seconds = device, 0.0

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        start = time.perf_counter()
        kept = len(self.calls)
        out = super().__torch_dispatch__(op, types, args, kwargs)
        if len(self.calls) > kept:
            _sync(self.device)
            self.seconds += time.perf_counter() - start
        return out


def plan_recompute(costs: dict[int, dict], budget: int, steps: int = 1024) -> dict[int, str]:
    """Each layer's policy, minimising the recompute's time with the bytes kept within `budget`:
    a multiple-choice knapsack by dynamic programming over the budget in `steps` buckets
    (each layer's bytes rounded up, so the plan never exceeds the budget). The bytes of a
    layer: none its graph, selective its input and kept outputs, full its input; the transient
    graph of one layer-micro-batch's recompute is taken off the budget first."""
    options = {i: {"none": (c["graph"], 0.0), "selective": (c["input"] + c["kept"], c["full_s"] - c["kept_s"]),
                   "full": (c["input"], c["full_s"])} for i, c in costs.items()}
    floor = sum(o["full"][0] for o in options.values())
    room = budget - max(c["graph"] for c in costs.values())  # one layer's recompute graph, at most
    if room < floor:
        return {i: "full" for i in costs}
    unit = max(1, -(-room // steps))
    best = {0: (0.0, ())}  # bytes used (in units) -> (recompute seconds, the policies so far)
    for choice in options.values():
        grown = {}
        for used, (seconds, plan) in best.items():
            for name, (size, cost) in choice.items():
                total = used + -(-size // unit)
                if total * unit <= room and (total not in grown or seconds + cost < grown[total][0]):
                    grown[total] = (seconds + cost, plan + (name,))
        best = grown
    return dict(zip(options, min(best.values(), key=lambda v: v[0])[1]))


def recompute_policy(recompute: str | Callable, stash: ActivationStash, device: torch.device,
                     activation_budget: int | None = None, in_flight: int | None = None) -> KeepGraphs:
    """The strategy object for RelayOptions.recompute (and activation_budget; `in_flight`: the
    micro-batches a pipeline stage keeps at once, PlannedRecompute)."""
    if activation_budget is not None:
        return PlannedRecompute(stash, device, activation_budget, in_flight)
    if callable(recompute):
        return SelectiveRecompute(stash, device, recompute)
    return {"none": lambda: KeepGraphs(), "full": lambda: Recompute(stash, device),
            "selective": lambda: SelectiveRecompute(stash, device)}[recompute]()
