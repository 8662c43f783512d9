"""Will it fit? What a training run needs, worked out before anything loads: `l2l estimate`.

    estimate(cfg)       the run of a TrainConfig (the reference GPT, or the Hugging Face model
                        in cfg.model: its config.json only, no weights read): host memory,
                        disk, device memory per stage, and whether it fits this machine
    check_fits(cfg)     the same, raising one NotEnoughMemory line naming the shortfall
                        (l2l train and l2l finetune call it before they load anything)

How each figure is made (anchors: DeepSpeed's estimate_zero3_model_states_mem_needs and
`accelerate estimate-memory`, which count parameters and optimizer state; this counts what
the relay holds, step by step):

    the layers     built on the meta device (build_gpt, or hf.skeleton + hf.split), each
                   distinct layer run once per micro-batch size on fake tensors
                   (torch's FakeTensorMode: shapes and dtypes, no memory, the CPU's kernel
                   choices) through the relay's own recompute policies, under
                   saved_tensors_hooks: what its graph saves, what selective recompute
                   keeps, what aliases its input, output or weights
    device         the relay's schedule (executor.py) replayed on those storages: at each of
                   the points where the relay's accounting samples (relay/memory.py), the
                   bytes it would count; the peak is what relay.memory_report() reports
    EPS            the engine's own buffer layout (Engine.buffer_layout) per tensor; with
                   --state-dir the region files (disk_store.RegionLayout) and the images in
                   flight (memory_bound)
    host           this process as it is now (interpreter, torch, transformers: measured,
                   VmRSS), + the EPS, + the model as the run builds it, + the data, + on the
                   CPU the device's bytes, + the allocator's transients
    disk           --state-dir's regions, the checkpoint (safetensors of the EPS state,
                   written beside the previous one), finetune's model folder (fp32)
    step time      --measure: one layer of each kind timed on real tensors (forward,
                   recompute, backward per micro-batch) and the EPS update per parameter
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import math
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from l2l_hw.relay.device_share import DEVICE_BYTES_PER_PARAMETER, device_free_bytes
from l2l_hw.relay.stage import flatten, layer_output, to_float
from l2l_hw.relay.recompute import KeepGraphs, SelectiveRecompute, grad_leaf, save_matmuls_and_attention
from l2l_hw.relay.stash import ActivationStash
from l2l_hw.relay.transport import Transport, torch_device


# ---------------------------------------------------------------------------- layer traces
@dataclass
class LayerTrace:
    """One layer on one micro-batch, as storages: bytes, and what a saved storage aliases.

    A reference names a storage: ("in", k) / ("out", k) input or output k, ("param", name),
    ("buffer", name), ("kept", k) selective recompute's kept output k, ("own", k) one of the
    graph's own storages (bytes in `own` / `replay_own`)."""

    inputs: list[int]  # bytes of each input tensor
    floating: list[bool]  # which inputs are floating point (those get a gradient)
    outputs: list[int]
    output_alias: list[int | None]  # output k is input (index) itself, or None
    graph: list[tuple]  # what the forward's autograd graph saves (references)
    own: list[int]  # bytes of the graph's own storages
    kept: list[tuple] = field(default_factory=list)  # selective: the kept outputs ("out", k) or ("own", k)
    kept_own: list[int] = field(default_factory=list)
    replay: list[tuple] = field(default_factory=list)  # selective: the recompute's graph (references)
    replay_own: list[int] = field(default_factory=list)


def _storage_id(t: torch.Tensor) -> int:
    """One id per storage, fake or real (data_ptr is 0 for every fake tensor)."""
    return t.untyped_storage()._cdata


class _Namer:
    """Gives each storage met a reference: the known ones (inputs, outputs, weights) by name,
    the rest as ("own", k) in the order met, with their bytes."""

    def __init__(self, known: dict[int, tuple], own_tag: str = "own"):
        self.known, self.own_tag = dict(known), own_tag
        self.own: list[int] = []
        self.refs: list[tuple] = []

    def add(self, t: torch.Tensor) -> tuple:
        sid = _storage_id(t)
        if sid not in self.known:
            self.known[sid] = (self.own_tag, len(self.own))
            self.own.append(t.untyped_storage().nbytes())
        ref = self.known[sid]
        if ref not in self.refs:
            self.refs.append(ref)
        return ref


@contextlib.contextmanager
def _saving(saved: list):
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        yield


def trace_layer(module: nn.Module, x, dtype: torch.dtype, loss: Callable | None = None,
                selective: Callable | None = None):
    """`module` (on the meta device) run on `x` (fake tensors) in their FakeTensorMode: its
    LayerTrace and its output (fake: the next layer's input). Trainable parameters are in
    `dtype`, as the EPS's working copy the relay binds; `loss(out)`: the last layer, whose graph
    includes the loss; `selective`: also what that SAC policy keeps and its recompute's graph
    saves."""
    mode = next(t.fake_mode for t in flatten(x))
    module = copy.deepcopy(module)  # outside the mode: real buffers (rotary tables) copy as they are
    with mode, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FakeTensor data pointers (the recompute's tail search reads them)
        _make_fake(module, dtype)
        params = {_storage_id(p): ("param", n) for n, p in module.named_parameters()}
        params.update({_storage_id(b): ("buffer", n) for n, b in module.named_buffers()})
        xs = flatten(x)
        inputs = {_storage_id(t): ("in", k) for k, t in enumerate(xs)}

        def run(a, buffers=None):
            return layer_output(0, module, module(a))

        leaf = grad_leaf(x)
        saved: list = []
        with torch.enable_grad(), _saving(saved):
            out = run(leaf)
            if loss is not None:
                loss(out)
        outs = flatten(out)
        out_ids = {_storage_id(t): ("out", k) for k, t in enumerate(outs)}
        namer = _Namer({**params, **out_ids, **inputs})
        for t in saved:
            namer.add(t)
        trace = LayerTrace(inputs=[t.untyped_storage().nbytes() for t in xs],
                           floating=[t.is_floating_point() for t in xs],
                           outputs=[t.untyped_storage().nbytes() for t in outs],
                           output_alias=[inputs.get(_storage_id(t), (None, None))[1] for t in outs],
                           graph=namer.refs, own=namer.own)
        if selective is not None and loss is None:
            _trace_selective(trace, module, x, run, selective, params, inputs)
        nxt = out.detach() if isinstance(out, torch.Tensor) else tuple(t.detach() for t in out)
    return trace, nxt


def _trace_selective(trace: LayerTrace, module: nn.Module, x, run, policy: Callable, params: dict,
                     inputs: dict) -> None:
    """Selective recompute's forward (what it keeps) and recompute (what its graph saves), through
    the relay's own policy object."""
    stash = ActivationStash("device", Transport("cpu"))
    keep = SelectiveRecompute(stash, torch.device("cpu"), policy)
    buffers = dict(module.named_buffers())
    keep.begin_forward(0, [x])
    with torch.no_grad():
        out = keep.forward(0, 0, x, run, buffers)
    keep.end_forward(0)
    outs = {_storage_id(t): ("out", k) for k, t in enumerate(flatten(out))}
    kept = _Namer({**inputs, **outs}, "own")
    for held in stash.on_device():
        for item in held:
            for t in flatten(item):
                if _storage_id(t) not in inputs:
                    kept.add(t)
    trace.kept, trace.kept_own = kept.refs, kept.own
    kept_ids = {sid: ("kept", ref[1]) if ref[0] == "own" else ref for sid, ref in kept.known.items()}
    keep.begin_backward(0)
    saved: list = []
    with _saving(saved):
        keep.backward(0, 0, run)
    replay = _Namer({**params, **kept_ids, **inputs})
    for t in saved:
        replay.add(t)
    trace.replay, trace.replay_own = replay.refs, replay.own
    keep.clear()


def _make_fake(module: nn.Module, dtype: torch.dtype) -> None:
    """Replace `module`'s parameters and buffers by fake ones (made inside the active
    FakeTensorMode), trainable floating parameters in `dtype`; a tensor registered twice (tied)
    stays one tensor."""
    made: dict[int, torch.Tensor] = {}

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            trainable = isinstance(t, nn.Parameter) and t.requires_grad
            new = torch.empty(t.shape, dtype=dtype if trainable and t.is_floating_point() else t.dtype)
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)]

    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in list(table.items()):
                if t is not None:
                    table[name] = fake_of(t)


# ---------------------------------------------------------------------------- the model
@dataclass
class ModelTrace:
    """The relay's view of a model at one micro-batching: per layer its trace per micro-batch
    (`traces[i][j]`), its EPS groups, and the bytes of each group's working copy."""

    traces: list[list[LayerTrace]]
    groups: list[list[str]]  # layer -> the EPS groups it uses (a tied parameter: the first layer's)
    names: list[dict[str, tuple[str, str, int]]]  # layer -> trainable parameter -> (group, its name there, bytes)
    group_bytes: dict[str, int]  # working copy (= gradient) bytes of each group
    frozen: list[int]  # layer -> bytes of its frozen parameters
    shapes: dict[str, dict[str, torch.Size]]  # group -> tensor name -> shape (what the EPS registers)
    buffers: list[dict[str, tuple[torch.Size, torch.dtype]]]  # layer -> its buffers (the relay keeps a copy)


def micro_sizes(batch: int, micro_batches: int) -> list[int]:
    """The samples of each micro-batch, as torch.tensor_split cuts the batch."""
    return [len(part) for part in torch.tensor_split(torch.empty(batch, device="meta"), micro_batches)]


def _signature(module: nn.Module) -> tuple:
    """What makes two layers the same to the trace: class, tensors and (HF) attention kind."""
    return (type(module).__qualname__, getattr(module, "attention", None), getattr(module, "kind", None),
            tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in module.named_parameters()),
            tuple((n, tuple(t.shape), t.dtype) for n, t in module.named_buffers()))


def trace_model(layers: list[nn.Module], loss_fn: Callable, inputs: Callable[[int], tuple], sizes: list[int],
                dtype: torch.dtype, selective: Callable | None = None) -> ModelTrace:
    """Each layer traced at each micro-batch size (a layer equal to one traced before, on an input
    of the same shapes, is not run again). `inputs(m)`: (x, targets) of m samples, fake."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    cache: dict[tuple, tuple] = {}
    by_size = {}
    for m in sorted(set(sizes)):
        with mode:
            x, targets = inputs(m)
        per_layer = []
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            key = (_signature(layer), last, tuple((tuple(t.shape), t.dtype) for t in flatten(x)))
            if key not in cache:
                loss = (lambda out, t=targets: loss_fn(to_float(out), t)) if last else None
                cache[key] = trace_layer(layer, x, dtype, loss, selective)
            trace, x = cache[key]
            per_layer.append(trace)
        by_size[m] = per_layer
    owner: dict[int, str] = {}
    groups, names, group_bytes, frozen, shapes, buffers = [], [], {}, [], {}, []
    itemsize = dtype.itemsize
    for i, layer in enumerate(layers):
        mine, keys = {}, set()
        frozen.append(sum(p.numel() * p.element_size() for p in layer.parameters() if not p.requires_grad))
        for name, p in layer.named_parameters():
            if not p.requires_grad:
                continue
            nbytes = p.numel() * (itemsize if p.is_floating_point() else p.element_size())
            if id(p) not in owner:
                owner[id(p)] = (f"layer{i}", name)
                shapes.setdefault(f"layer{i}", {})[name] = p.shape
                group_bytes[f"layer{i}"] = group_bytes.get(f"layer{i}", 0) + nbytes
            mine[name] = (*owner[id(p)], nbytes)
            keys.add(owner[id(p)][0])
        groups.append(sorted(keys))
        names.append(mine)
        buffers.append({n: (b.shape, b.dtype) for n, b in layer.named_buffers()})
    return ModelTrace([[by_size[m][i] for m in sizes] for i in range(len(layers))], groups, names, group_bytes,
                      frozen, shapes, buffers)


# ---------------------------------------------------------------------------- the relay's step, replayed
class _Ledger:
    """What the relay's accounting would count: named holders of storages (id -> bytes), each
    storage counted once however many hold it; `kept` holders are the activations kept for the
    backward (DeviceMemory's kept peak), the rest is everything else it samples."""

    def __init__(self, shared: tuple[str, ...] = ()):
        self.holders: dict[object, tuple[dict, bool]] = {}
        self.refs: dict[object, int] = {}
        self.kept_refs: dict[object, int] = {}
        self.size: dict[object, int] = {}
        self.total = self.kept_total = self.shared_total = 0
        self.peak = self.kept_peak = self.own_peak = 0
        self.shared = shared  # kinds of storage that are not the device's own (the EPS's buffers, on the CPU)

    def put(self, name, storages: dict, kept: bool = False) -> None:
        self.drop(name)
        self.holders[name] = (storages, kept)
        for sid, nbytes in storages.items():
            self.size[sid] = nbytes
            if not self.refs.get(sid):
                self.total += nbytes
                self.shared_total += nbytes if sid[0] in self.shared else 0
            self.refs[sid] = self.refs.get(sid, 0) + 1
            if kept:
                if not self.kept_refs.get(sid):
                    self.kept_total += nbytes
                self.kept_refs[sid] = self.kept_refs.get(sid, 0) + 1

    def drop(self, name) -> None:
        if name not in self.holders:
            return
        storages, kept = self.holders.pop(name)
        for sid in storages:
            self.refs[sid] -= 1
            if not self.refs[sid]:
                self.total -= self.size[sid]
                self.shared_total -= self.size[sid] if sid[0] in self.shared else 0
            if kept:
                self.kept_refs[sid] -= 1
                if not self.kept_refs[sid]:
                    self.kept_total -= self.size[sid]

    def drop_all(self, match: Callable[[object], bool]) -> None:
        for name in [n for n in self.holders if match(n)]:
            self.drop(name)

    def sample(self) -> None:
        self.peak = max(self.peak, self.total)
        self.kept_peak = max(self.kept_peak, self.kept_total)
        self.own_peak = max(self.own_peak, self.total - self.shared_total)


@dataclass
class StepMemory:
    """The device bytes of one relay step: the peak the relay's accounting reports
    (memory_report()'s peak_bytes, kept_activation_peak_bytes), the peak of what is not the
    EPS's own buffers (the CPU fetches the working copy without copying it), and what the step
    holds at most in host memory of its own (activations="host": the stash)."""

    peak: int
    kept_peak: int
    own_peak: int
    host_stash: int = 0


def replay_step(model: ModelTrace, policies: list[str], activations: str = "device",
                on_host: bool = True, sum_widening: int = 1) -> StepMemory:
    """The relay's train_step (relay/executor.py) on `model`'s storages, each layer keeping for
    the backward what its policy keeps ("none", "full", "selective"), sampled where the relay
    samples. on_host: the device is the CPU (the micro-batches are views of the minibatch, the
    working copies the EPS's own buffers). sum_widening: a gradient sum's bytes per byte of the
    working copy (2 where bf16 / fp16 gradients are summed in fp32, relay/precision.py)."""
    L, u = len(model.traces), len(model.traces[0])
    shared_input = on_host
    book = _Ledger(shared=("w", "frozen") if on_host else ())
    users: dict[str, list[int]] = {}
    for i in range(L):
        for key in model.groups[i]:
            users.setdefault(key, []).append(i)
    alias: dict[tuple, tuple] = {}  # an output that is the layer's input (a mask passed on)
    host = {"now": 0, "peak": 0}  # activations="host": the stash's bytes in host memory
    stashed: dict = {}  # activations="host": what went down, by stash key

    def act(i, j, k):  # input k of layer i, micro-batch j
        if i == 0 and shared_input:
            return ("batch", k)
        ref = ("a", i, j, k)
        while ref in alias:
            ref = alias[ref]
        return ref

    def inputs(i, j, floating_only=False) -> dict:
        t = model.traces[i][j]
        return {act(i, j, k): (sum(model.traces[0][jj].inputs[k] for jj in range(u)) if act(i, j, k)[0] == "batch"
                               else b) for k, b in enumerate(t.inputs) if t.floating[k] or not floating_only}

    def outputs(i, j) -> dict:
        t = model.traces[i][j]
        for k, a in enumerate(t.output_alias):
            if a is not None:
                alias[("a", i + 1, j, k)] = act(i, j, a)
        return {act(i + 1, j, k): b for k, b in enumerate(t.outputs)}

    def graph(i, j, refs, own, phase) -> dict:
        """The storages a graph saves; phase "forward" (the forward sweep's, or the last layer's),
        "recompute" (the backward's second forward: its own output, its input from the stash)."""
        t, out = model.traces[i][j], {}
        from_host = phase == "recompute" and activations == "host"
        for kind, what in refs:
            if kind == "in":
                ref = act(i, j, what)
                out[("h",) + ref if from_host else ref] = inputs(i, j)[ref]
            elif kind == "out":
                fresh = phase == "recompute" or i == L - 1
                out[("o", i, j, what) if fresh else act(i + 1, j, what)] = t.outputs[what]
            elif kind == "param":
                key = model.names[i].get(what, (None,))[0]
                out[("w", key) if key else ("frozen", i)] = model.group_bytes[key] if key else model.frozen[i]
            elif kind == "kept":
                out[("h", "k", i, j, what) if from_host else ("k", i, j, what)] = t.kept_own[what]
            elif kind == "own":
                out[(phase, i, j, what)] = own[what]
        return {k: v for k, v in out.items() if v}

    def kept_outputs(i, j) -> dict:
        t = model.traces[i][j]
        return {(("k", i, j, what) if kind == "own" else act(i + 1, j, what)):
                (t.kept_own[what] if kind == "own" else t.outputs[what]) for kind, what in t.kept}

    def fetch(i) -> None:  # _params: the groups come off the weight stream and are live
        for key in model.groups[i]:
            book.drop(("inflight", key))
            if ("live", key) not in book.holders:
                book.put(("live", key), {("w", key): model.group_bytes[key]})
        if model.frozen[i]:
            book.put(("frozen", i), {("frozen", i): model.frozen[i]})

    def prefetch(i) -> None:  # the weight stream, and the stash one layer ahead (activations="host")
        for key in model.groups[i]:
            if ("live", key) not in book.holders:
                book.put(("inflight", key), {("w", key): model.group_bytes[key]})
        for name in (("stash", i), ("stash-kept", i)):
            if name in stashed:
                book.put(("coming", name), stashed.pop(name), kept=True)

    def release(i, backward: bool) -> None:
        if policies[i] != "none" or backward:
            book.drop(("frozen", i))
        for key in model.groups[i]:
            if backward and i == users[key][0]:
                book.drop(("live", key))
                book.drop_all(lambda name: name[:2] == ("grad", key))
            elif not backward and len(users[key]) == 1:
                book.drop(("live", key))

    def stash_put(name, held: dict) -> None:
        if activations == "device":
            book.put(name, held, kept=True)
            return
        stashed[name] = {("h",) + k: v for k, v in held.items()}  # copies in host memory
        host["now"] += sum(held.values())
        host["peak"] = max(host["peak"], host["now"])

    def stash_take(name) -> dict:
        if activations == "device":
            held = book.holders.get(name, ({}, True))[0]
            book.drop(name)
            return held
        prefetch_name = ("coming", name)
        held = stashed.pop(name, None) or book.holders.get(prefetch_name, ({}, True))[0]
        book.drop(prefetch_name)
        host["now"] -= sum(held.values())
        return held

    def push_grads(i) -> None:  # the layer's backward made (or added to) its parameters' gradients
        for key, name, nbytes in model.names[i].values():
            book.put(("grad", key, name), {("g", key, name): nbytes * sum_widening})

    # forward, layer-major
    for i in range(L - 1):
        p = policies[i]
        fetch(i)
        prefetch(i + 1)
        acts = {k: v for j in range(u) for k, v in inputs(i, j).items()}
        book.put(("acts",), acts)
        if p != "none":
            stash_put(("stash", i), acts)
        kept = {}
        for j in range(u):
            t = model.traces[i][j]
            if p == "none":
                book.put(("saved", i, j), graph(i, j, t.graph, t.own, "forward"), kept=True)
            elif p == "selective":
                kept.update(kept_outputs(i, j))
            book.put(("outs", j), outputs(i, j))
            book.sample()
        if kept:
            stash_put(("stash-kept", i), kept)
        if p != "none":
            release(i, backward=False)
        outs = {k: v for j in range(u) for k, v in book.holders[("outs", j)][0].items()}
        book.drop_all(lambda name: name[0] == "outs")
        book.put(("acts",), outs)

    # the last layer: forward, loss and backward per micro-batch
    last = L - 1
    fetch(last)
    if L > 1:
        prefetch(last - 1)
    book.put(("acts",), {k: v for j in range(u) for k, v in inputs(last, j).items()})
    for j in range(u):
        t = model.traces[last][j]
        book.put(("saved", last, j), graph(last, j, t.graph, t.own, "forward"), kept=True)
        book.sample()
        push_grads(last)
        book.put(("grads_in", j), {("gi",) + k: v for k, v in inputs(last, j, floating_only=True).items()})
        book.drop(("saved", last, j))
    book.drop(("acts",))
    release(last, backward=True)

    # backward, reverse layer order
    for i in range(L - 2, -1, -1):
        p = policies[i]
        fetch(i)
        if i > 0:
            prefetch(i - 1)
        inputs_left = stash_take(("stash", i)) if p != "none" else {}
        cache = stash_take(("stash-kept", i)) if p == "selective" else {}
        for j in range(u):
            book.put(("grads_out", j), book.holders[("grads_in", j)][0])
            book.drop(("grads_in", j))
        for j in range(u):
            t = model.traces[i][j]
            if p != "none":  # what the policy still holds of the layer: the later micro-batches'
                mine = {("h",) + k if activations == "host" else k for k in inputs(i, j)}
                if j == u - 1 or not (i == 0 and shared_input):
                    inputs_left = {k: v for k, v in inputs_left.items() if k not in mine}
                cache = {k: v for k, v in cache.items() if k[-3:-1] != (i, j)}
                book.put(("held",), {**inputs_left, **cache}, kept=True)
                refs, own = (t.graph, t.own) if p == "full" else (t.replay, t.replay_own)
                book.put(("saved", i, j), graph(i, j, refs, own, "recompute"), kept=True)
            book.sample()
            push_grads(i)
            book.put(("grads_in", j), {("gi",) + k: v for k, v in inputs(i, j, floating_only=True).items()})
            book.drop(("grads_out", j))
            if p != "none":
                book.drop(("saved", i, j))
        book.drop_all(lambda name: name[0] == "saved" and name[1] == i)
        book.drop(("held",))
        release(i, backward=True)
    return StepMemory(book.peak, book.kept_peak, book.own_peak, host["peak"])


def replay_evaluate(model: ModelTrace, on_host: bool = True) -> StepMemory:
    """The relay's evaluate (a validation minibatch, layer-major, no graph) on `model`'s storages:
    each layer's weights and its outputs for every micro-batch at once (the head's logits too)."""
    L, u = len(model.traces), len(model.traces[0])
    book = _Ledger(shared=("w", "frozen") if on_host else ())
    last_use = {key: i for i in range(L) for key in model.groups[i]}
    for i in range(L):
        for key in model.groups[i]:
            book.drop(("inflight", key))
            book.put(("live", key), {("w", key): model.group_bytes[key]})
        if i + 1 < L:
            book.put(("inflight", i + 1), {("w", k): model.group_bytes[k] for k in model.groups[i + 1]
                                           if ("live", k) not in book.holders})
        outs = {("a", i + 1, j, k): b for j in range(u) for k, b in enumerate(model.traces[i][j].outputs)}
        book.put(("acts",), outs)
        book.sample()
        book.drop(("inflight", i + 1))
        for key in model.groups[i]:
            if last_use[key] == i:
                book.drop(("live", key))
    return StepMemory(book.peak, book.kept_peak, book.own_peak)


# ---------------------------------------------------------------------------- what a config runs
@dataclass
class RunModel:
    """The model a config trains, on the meta device, and how to make its inputs."""

    layers: list[nn.Module]
    loss_fn: Callable
    inputs: Callable[[int, int], tuple]  # (samples, context) -> (x, targets), made in the active fake mode
    name: str
    folder: Path | None = None  # a Hugging Face model's
    max_context: int | None = None  # learned positions: the longest sequence the model takes


def run_model(cfg) -> RunModel:
    """The reference GPT of cfg's model options, or the Hugging Face model in cfg.model (its
    config.json: hf.skeleton builds it on the meta device; no weight is read)."""
    if cfg.model is None:
        from l2l_hw.models import build_gpt, lm_loss

        with torch.device("meta"):
            layers = list(build_gpt(cfg.model_config()))
        ids = lambda m, t: (torch.empty(m, t, dtype=torch.long), torch.empty(m, t, dtype=torch.long))
        return RunModel(layers, lm_loss, ids, f"the reference GPT, {cfg.layers} layers x {cfg.width} wide",
                        max_context=None)
    from l2l_hw import hf

    model = hf.skeleton(cfg.model)
    layers, loss_fn = hf.split(model)
    labelled = lambda m, t: (torch.empty(m, t, dtype=torch.long),
                             (torch.empty(m, t, dtype=torch.long), torch.empty(m, dtype=torch.float64)))
    config = model.config
    name = f"{config.model_type} ({type(model).__name__}), {len(layers) - 2} layers x {config.hidden_size} wide"
    return RunModel(layers, loss_fn, labelled, name, Path(cfg.model), hf.max_positions(config))


def layer_policies(cfg, model: ModelTrace) -> list[list[str]]:
    """What each layer keeps for the backward, per kind of step: one list, or with an
    activation budget the first step's (full, measuring) and the plan's (plan_recompute)."""
    L = len(model.traces)
    if cfg.activation_budget is None:
        return [[cfg.recompute if isinstance(cfg.recompute, str) else "selective"] * L]
    from l2l_hw.relay.recompute import plan_recompute

    costs = {}
    for i in range(L - 1):
        traces = model.traces[i]
        weights = sum(nbytes for _, _, nbytes in model.names[i].values())
        own = sum(sum(t.own) for t in traces)
        costs[i] = dict(input=sum(sum(t.inputs) for t in traces), graph=weights + own,
                        kept=sum(sum(t.kept_own) for t in traces),
                        # time proxies: bytes the recompute writes, and those of the ops selective keeps
                        full_s=float(own), kept_s=float(sum(sum(t.kept_own) for t in traces)))
    plan = plan_recompute(costs, cfg.activation_budget)
    return [["full"] * L, [plan.get(i, "full") for i in range(L)]]


# ---------------------------------------------------------------------------- the EPS, the checkpoint
def eps_oracle(cfg):
    """A cpu EPS of cfg's optimizer and state format, configured as the relay configures the
    run's (working copy, double buffers): it registers nothing; its buffer_layout and
    stored_slots give the bytes of every tensor the run's EPS keeps."""
    from l2l_hw.eps import make_eps

    eps = make_eps("cpu", optimizer=cfg.optimizer, momentum=cfg.momentum, state=cfg.optimizer_state,
                   delay_compensation=cfg.delay_compensation)  # predict: a working copy of its own
    eps.configure(working_dtype=cfg.precision, double_buffer=_double_buffered(cfg))
    return eps


def _double_buffered(cfg) -> bool:
    """As the relay decides: a step can be discarded whole (fp16, skip_nonfinite) or the previous
    version is read (PipeDream-2BW, a 2bw pipeline)."""
    return cfg.precision == "fp16" or cfg.skip_nonfinite or cfg.stale_weights


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass
class EpsBytes:
    memory: int  # host bytes of the state (in RAM), or of the images in flight (state_dir)
    fetched: int  # of which the working copy (pinned where the device is CUDA)
    disk: int  # the region files under state_dir (0 without)


def eps_bytes(cfg, shapes: dict[str, dict[str, torch.Size]]) -> EpsBytes:
    """The bytes the run's EPS keeps for the groups `shapes`, as its engine lays them out."""
    from l2l_hw.eps.disk import GROUPS_IN_FLIGHT
    from l2l_hw.eps.disk_store import RegionLayout

    eps = eps_oracle(cfg)
    try:
        memory = fetched = 0
        regions = []
        for key, tensors in shapes.items():
            layout = RegionLayout(key)
            for shape in tensors.values():
                for _, _, spec in eps.buffer_layout(torch.Size(shape)):
                    memory += _nbytes(spec.shape, spec.dtype)
                    fetched += _nbytes(spec.shape, spec.dtype) if spec.fetched else 0
                    layout.add(spec.shape, spec.dtype, "fetched" if spec.fetched else "state")
            regions.append(sum(layout.sizes().values()))
    finally:
        eps.close()
    if cfg.state_dir is None:
        return EpsBytes(memory, fetched, 0)
    return EpsBytes(sum(sorted(regions)[-GROUPS_IN_FLIGHT:]), fetched, sum(regions))


def checkpoint_bytes(cfg, model: ModelTrace) -> int:
    """checkpoint.safetensors as the training loop writes it: the relay's state (the EPS's stored
    slots, the previous version where double buffered, its step, the layers' buffers), the RNG
    and data states, and the run's config in its header (checkpoint.file_bytes)."""
    from l2l_hw.checkpoint import file_bytes, run_meta
    from l2l_hw.eps.base import StateEntry

    eps = eps_oracle(cfg)
    try:
        entries = {"relay.eps/step": StateEntry(torch.Size([]), torch.int64, None)}
        for key, tensors in model.shapes.items():
            for name, shape in tensors.items():
                for slot, (s, dtype) in eps.stored_slots(torch.Size(shape)).items():
                    entries[f"relay.eps/{key}/{name}/{slot}"] = StateEntry(torch.Size(s), dtype, None)
                if eps.double_buffer:
                    entries[f"relay.eps/{key}/{name}/previous"] = StateEntry(torch.Size(shape), torch.float32, None)
    finally:
        eps.close()
    for i, buffers in enumerate(model.buffers):
        entries.update({f"relay.buffers/{i}/{n}": StateEntry(torch.Size(s), dtype, None)
                        for n, (s, dtype) in buffers.items()})
    rng = torch.get_rng_state()
    entries["rng.torch"] = StateEntry(rng.shape, rng.dtype, None)
    if cfg.model is None:  # the reference corpus's sampler (train.CorpusBatches)
        entries["data.generator"] = StateEntry(rng.shape, rng.dtype, None)
    elapsed = 1e4 + 1 / 3  # seconds trained, as long a float as the header writes (its only unknown: a few bytes)
    return file_bytes(entries, run_meta(cfg, cfg.steps, elapsed))


# ---------------------------------------------------------------------------- this machine
def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (or its peak, VmHWM), from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def meminfo_bytes(field: str = "MemTotal") -> int | None:
    """A /proc/meminfo figure (MemTotal, MemAvailable) in bytes; None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def free_disk_bytes(path) -> int | None:
    """Free bytes of the file system that holds `path` (or its nearest existing parent); None
    where it has no blocks (/proc, /sys: nothing is written there; the run says so itself)."""
    path = Path(path).expanduser().resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return usage.free if usage.total else None


def device_memory_bytes(device: str) -> int | None:
    """Memory free for the run on `device`: CUDA's free memory (the process's share of it
    where a fraction is set elsewhere); None for the CPU (the device is host memory)."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return device_free_bytes(torch.device(device))


# ---------------------------------------------------------------------------- host memory
# Measured on this project's 2-core CPU machine (glibc malloc, torch's CPU allocator on it),
# `l2l train` and `l2l finetune` at 1.5 to 160 M parameters (tests/test_estimate.py; the two
# allocator figures were set from those runs' peaks, and are what this estimate knows least):
CORPUS_RSS_PER_BYTE = 2.0  # the reference corpus: its bytes as tensors, and what reading them left (1.9)
TOKENIZER_RSS_PER_BYTE = 4.0  # a fast tokenizer in memory, per byte of its files
ALLOCATOR_SLACK = 1.0  # freed activations glibc keeps resident: RSS grows 1.5 to 3.1x the step's live bytes
LIBRARY_BUFFERS = 24 << 20  # MKL's packing buffers, oneDNN's caches, the plot's figure: on first use (~24 MiB)
TOKEN_BYTES = 4  # finetune's token cache: uint32 ids (finetune_data), mapped
TEXT_BYTES_PER_TOKEN = 4.0  # where the tokens are not counted yet: about 4 bytes of text a token (BPE, English)


@functools.lru_cache(maxsize=8)
def corpus_bytes(data) -> int:
    """The bytes of the reference corpus l2l train reads (models.corpus: the files it takes, by
    their sizes, up to its cap), without reading them (Corpus.load caches the corpus too)."""
    from l2l_hw.models.corpus import SIZE_CAP_BYTES, sorted_files, stdlib_root

    root = stdlib_root() if data is None else Path(data).expanduser()
    if root.is_file():
        return min(root.stat().st_size, SIZE_CAP_BYTES)
    total = 0
    for rel in sorted_files(root, ".py" if data is None else None):
        with contextlib.suppress(OSError):
            total += (root / rel).stat().st_size
        if total >= SIZE_CAP_BYTES:
            return SIZE_CAP_BYTES
    return total


def _files_bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def token_bytes(cfg) -> int:
    """finetune's tokens in memory (the cache's mapped files): the cache's size where a run of the
    same data left it in --out, else TEXT_BYTES_PER_TOKEN bytes of --data a token."""
    total = 0
    for role, data in (("train", cfg.data), ("val", cfg.val_data)):
        if data is None:
            continue
        cache = Path(cfg.out) / "tokens" / f"{role}.bin" if cfg.out is not None else None
        if cache is not None and cache.is_file():
            total += cache.stat().st_size * (TOKEN_BYTES + 1) // TOKEN_BYTES if cfg.chat else cache.stat().st_size
            continue
        path = Path(data).expanduser()
        text = _files_bytes(path.rglob("*")) if path.is_dir() else (path.stat().st_size if path.is_file() else 0)
        total += int(text / TEXT_BYTES_PER_TOKEN * (TOKEN_BYTES + (1 if cfg.chat else 0)))
    return total


def tokenizer_bytes(folder: Path) -> int:
    from l2l_hw.finetune_data import TOKENIZER_STATE

    return int(TOKENIZER_RSS_PER_BYTE * _files_bytes(folder / name for name in TOKENIZER_STATE))


HUB_SHARD_BYTES = 5 * 10**9  # the shards of a model as the Hugging Face Hub holds them (save_pretrained of 4.x)


def weights_files(folder: Path, parameters: int) -> list[int]:
    """The sizes of a Hugging Face folder's safetensors files (its shards), from the file system;
    a folder of config.json alone (weights elsewhere, or not yet fetched): the `parameters` in the
    config's dtype, in the Hub's 5 GB shards."""
    from l2l_hw import hf

    try:
        index = hf.weights_file(folder)
    except FileNotFoundError:
        dtype = getattr(hf.load_config(folder), "dtype", None)
        whole = parameters * (dtype.itemsize if isinstance(dtype, torch.dtype) else 4)
        full, rest = divmod(whole, HUB_SHARD_BYTES)
        return [HUB_SHARD_BYTES] * full + ([rest] if rest else [])
    if index.name == hf.WEIGHTS_FILE:
        return [index.stat().st_size]
    shards = sorted(set(hf.shard_map(index).values()))
    if not shards:
        raise ValueError(f"{index} names no weights (its weight_map is empty): give the folder as save_pretrained "
                         "wrote it, or config.json alone")
    return [shard.stat().st_size for shard in shards]


def import_what_the_run_imports(cfg) -> None:
    """What l2l train / finetune import on their way (this estimate's fake tensors: check_fits runs
    it in the run's process; transformers' Trainer for its weight-decay rule; matplotlib for
    loss.png), so that this process's resident memory is the run's baseline."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode()  # its first construction imports torch's tracing stack (~70 MB)
    if cfg.model is not None:
        import transformers

        transformers.Trainer  # noqa: B018 (a lazy module: the attribute imports it)
    if cfg.out is not None:
        with contextlib.suppress(ImportError):
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot  # noqa: F401


def host_parts(cfg, run: RunModel, model: ModelTrace, eps: EpsBytes, step: StepMemory, *, baseline: int,
               on_host: bool, whole_model: int) -> tuple[dict[str, int], dict[str, int]]:
    """The host memory of one rank: what stays for the whole run, by what holds it (the baseline:
    this process now; the EPS; the relay's buffers; the data; the libraries' working buffers),
    and the phases that come and go, of which the largest counts:

        build  the reference GPT is made one layer at a time in fp32 as the EPS takes it
               (build_gpt_meta; a pipeline's stages build it whole); a Hugging Face model's
               weights file is mapped while its layers stream in
        step   the steps' (and validations') own bytes on the CPU, and what glibc's allocator
               keeps of them (ALLOCATOR_SLACK); on CUDA the pinned gradient staging
        end    the model gathered in fp32 for the reference GPT's sample or a fine-tune's --prompt
               (a fine-tune's save holds one shard of it), beside the heap the steps grew"""
    buffers = sum(_nbytes(s, d) for layer in model.buffers for s, d in layer.values())
    parts = {"baseline": baseline, "eps": eps.memory if cfg.eps_backend in ("cpu", "golden") else 0,
             "buffers": buffers + sum(model.frozen), "libraries": LIBRARY_BUFFERS}
    largest_layer = max(sum(math.prod(s) for s in t.values()) for t in model.shapes.values()) * 4
    if run.folder is None:
        parts["data"] = int(CORPUS_RSS_PER_BYTE * corpus_bytes(cfg.data))
        build = whole_model if cfg.pipeline_stages > 1 else 2 * largest_layer  # made, then registered (build_relay)
    else:
        parts["data"] = token_bytes(cfg)
        parts["tokenizer"] = tokenizer_bytes(run.folder)
        # a layer read from its shard (the largest one mapped), or drawn from the config and copied in
        build = (max(weights_files(run.folder, whole_model // 4)) + largest_layer if cfg.weights == "pretrained"
                 else 2 * largest_layer)
    if on_host:  # the device is this host: the step's own bytes (not the EPS's) and what the allocator keeps
        stepping, kept = int(step.own_peak * (1 + ALLOCATOR_SLACK)) + step.host_stash, step.own_peak
        if cfg.state_dir is not None:  # the disk tier's fetch copies the working copy out of its image
            stepping += step.peak - step.own_peak
    else:  # pinned: the gradients' staging buffers (two groups in flight), the stash sent down
        stepping = kept = 2 * max(model.group_bytes.values()) + step.host_stash
    if run.folder is None:  # the reference GPT: the report gathers the model for its sample
        end = whole_model if cfg.verbose else 0
    else:  # a fine-tune: --prompt gathers the model; the save holds one shard of it at a time
        from l2l_hw import hf

        saved = min(whole_model, hf.SHARD_BYTES) if cfg.save and cfg.out is not None else 0
        end = whole_model if cfg.prompt is not None else saved
    phases = {"build": build, "step": stepping, "end": end + kept if end else 0}
    return parts, phases


# ---------------------------------------------------------------------------- a pipeline's stage
def stage_bounds(cfg, layers: int) -> list[int]:
    """[0, b_1, ..., L]: the layers of each pipeline stage, as PipelineRelay splits them ('auto'
    is planned from a profile at start-up: estimated here as the even split); a geometry the
    pipeline would refuse is refused here, before anything is estimated."""
    return cfg.pipeline_config().bounds(layers)


def stage_trace(model: ModelTrace, first: int, end: int) -> ModelTrace:
    """The part of `model` a pipeline stage (layers [first, end)) relays."""
    groups = model.groups[first:end]
    keys = {k for g in groups for k in g}
    return ModelTrace(model.traces[first:end], groups, model.names[first:end],
                      {k: v for k, v in model.group_bytes.items() if k in keys}, model.frozen[first:end],
                      {k: v for k, v in model.shapes.items() if k in keys}, model.buffers[first:end])


def pipeline_step(model: ModelTrace, stage: int, stages: int, on_host: bool, sum_widening: int = 1,
                  recompute: str = "full", activations: str = "device") -> StepMemory:
    """A 1F1B stage's device bytes (relay/pipeline.py), its layers relayed one at a time: the
    layer computing and the next on its way, the computing layer's gradient (its fp32 sum where
    widened; the sum over micro-batches waits in host memory), each layer's stashed input for the
    micro-batches in flight (at most stages - stage of them; none with host activations) and one
    layer-micro-batch's graph (the recompute's, or the last layer's kept with the loss). Under
    recompute="none" every layer's graph, and so its weights, stays for the micro-batches in flight.
    A model of the schedule, not a replay."""
    u = len(model.traces[0])
    in_flight = min(stages - stage, u)
    layer = [sum(model.group_bytes[k] for k in keys) + frozen for keys, frozen in zip(model.groups, model.frozen)]
    weights = sum(model.group_bytes.values()) + sum(model.frozen)
    graph = max(sum(t.own) + sum(t.outputs) + sum(t.inputs) for traces in model.traces for t in traces)
    if recompute == "none":
        per_micro = max(sum(sum(t.own) + sum(t.outputs) + sum(t.inputs) for t in (traces[j] for traces in model.traces))
                        for j in range(u))
        activations_kept = in_flight * per_micro
        device = weights + sum(model.group_bytes.values()) * sum_widening + activations_kept
        return StepMemory(device, activations_kept, device - (weights if on_host else 0))
    stash = 0 if activations == "host" else in_flight * max(sum(sum(traces[j].inputs) for traces in model.traces)
                                                            for j in range(u))
    resident = max(a + b for a, b in zip(layer, [*layer[1:], 0]))
    device = resident + max(layer) * sum_widening + stash + graph
    return StepMemory(device, stash + graph, device - (resident if on_host else 0))


# ---------------------------------------------------------------------------- the estimate
@dataclass
class Estimate:
    """What a run needs, and whether it fits here. Bytes; `host` and `stages` break the figures
    down (host: one rank's parts; stages: each pipeline stage's device peak)."""

    model: str
    parameters: int  # the model's (trained + frozen)
    trained: int  # kept by the EPS
    device: str
    ranks: int  # processes on this machine (pipeline stages, or torchrun's data-parallel ranks)
    host_bytes: int  # peak resident memory of the run, all its ranks on this machine together
    host: dict[str, int]  # of the largest rank, by what holds it (its largest phase among them)
    host_phases: dict[str, int]  # of the largest rank: the phases that come and go (host_parts)
    disk_bytes: int
    disk: dict[str, int]
    device_bytes: int  # the largest stage's peak device memory (the relay's accounting on the CPU)
    stages: list[dict]
    available: dict[str, int | None] = field(default_factory=dict)
    fits: bool = True
    shortfall: list[str] = field(default_factory=list)
    largest: dict = field(default_factory=dict)  # context, micro_batches, optimizer_state that fit here
    ways_to_fit: list[dict] = field(default_factory=list)  # where it does not fit: the flags that would, and at what
    step_s: float | None = None  # --measure: the estimated seconds a step takes
    profile: dict | None = None  # --measure: what the step time is made of

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def world_size(cfg) -> int:
    """Ranks on this machine: torchrun's WORLD_SIZE (data-parallel ranks, or a pipeline's stages
    times its replicas); a pipeline's stages at least."""
    world = 1
    with contextlib.suppress(ValueError):
        world = max(1, int(os.environ.get("WORLD_SIZE", "1")))
    return max(world, cfg.pipeline_stages)


def figures(cfg, baseline: int) -> Estimate:
    """The run's needs (host, disk, device per stage), independent of this machine's free memory."""
    from l2l_hw.relay.precision import compute_dtype

    run = run_model(cfg)
    ranks = world_size(cfg)
    replicas = max(1, ranks // max(1, cfg.pipeline_stages))  # each trains its shard of the minibatch
    per_rank = len(torch.tensor_split(torch.empty(cfg.batch_size, device="meta"), replicas)[0])
    sizes = micro_sizes(per_rank, min(cfg.micro_batches, per_rank))
    budget = cfg.activation_budget is not None
    selective = cfg.recompute if callable(cfg.recompute) else (
        save_matmuls_and_attention if cfg.recompute == "selective" or budget else None)
    model = trace_model(run.layers, run.loss_fn, lambda m: run.inputs(m, cfg.context), sizes,
                        compute_dtype(cfg.precision), selective)
    on_host = not cfg.device.startswith("cuda")
    bounds = stage_bounds(cfg, len(run.layers)) if cfg.pipeline_stages > 1 else [0, len(run.layers)]
    whole_fp32 = (sum(math.prod(s) for t in model.shapes.values() for s in t.values()) * 4 + sum(model.frozen)
                  + sum(_nbytes(s, d) for layer in model.buffers for s, d in layer.values()))
    widening = 2 if cfg.precision != "fp32" and cfg.grad_sums == "fp32" else 1  # the gradients' fp32 sums
    stages, hosts, state_dir = [], [], 0
    for s, (first, end) in enumerate(zip(bounds, bounds[1:])):
        sub = stage_trace(model, first, end)
        if len(bounds) > 2:
            step = pipeline_step(sub, s, len(bounds) - 1, on_host, widening, cfg.recompute, cfg.activations)
            if cfg.activation_budget is not None:  # the plan keeps within its budget, and never less than full
                more = max(0, cfg.activation_budget - step.kept_peak)
                step = StepMemory(step.peak + more, step.kept_peak + more, step.own_peak + more)
        else:
            steps = [replay_step(sub, policies, cfg.activations, on_host, widening)
                     for policies in layer_policies(cfg, sub)]
            steps.append(replay_evaluate(sub, on_host))  # a validation minibatch: every micro-batch's output at once
            step = StepMemory(*(max(getattr(st, f.name) for st in steps) for f in dataclasses.fields(StepMemory)))
        shared = [f"layer{i}" for i in range(cfg.device_update_layers or 0)]  # the device share's groups
        eps = eps_bytes(cfg, {k: v for k, v in sub.shapes.items() if k not in shared})
        shared_bytes = DEVICE_BYTES_PER_PARAMETER * sum(math.prod(s) for k in shared
                                                         for s in sub.shapes.get(k, {}).values())
        if on_host:  # the device is this host: the share's state lives as long as the EPS's
            eps = EpsBytes(eps.memory + shared_bytes, eps.fetched, eps.disk)
        else:
            step = dataclasses.replace(step, peak=step.peak + shared_bytes)
        if cfg.shard_state and replicas > 1:
            eps = EpsBytes(eps.memory // replicas, eps.fetched, eps.disk)
        state_dir += eps.disk * replicas  # state_dir/rankR for each rank
        stages.append({"layers": [first, end], "device_bytes": step.peak, "kept_activation_bytes": step.kept_peak})
        parts, phases = host_parts(cfg, run, sub, eps, step, baseline=baseline, on_host=on_host,
                                   whole_model=whole_fp32)
        largest_phase = max(phases, key=phases.get)
        hosts.append(({**parts, largest_phase: phases[largest_phase]}, phases))
    host, phases = max(hosts, key=lambda h: sum(h[0].values()))
    saves = cfg.out is not None and cfg.save  # --no-save: no checkpoint, no model folder
    disk = {"checkpoint": checkpoint_bytes(cfg, model)} if saves else {}
    if disk:  # written beside the previous one, which stays until the new one is complete
        disk["checkpoints"] = 2 * disk["checkpoint"]
    if state_dir:
        disk["state_dir"] = state_dir
    if run.folder is not None and saves:  # out/model (fp32 safetensors) beside the one it replaces
        copied = _files_bytes(p for p in run.folder.iterdir() if not p.name.startswith("model"))  # tokenizer, config
        disk["model"] = 2 * (whole_fp32 + copied)
    if run.folder is not None and cfg.out is not None:
        disk["tokens"] = token_bytes(cfg)
    trained = sum(math.prod(s) for t in model.shapes.values() for s in t.values())
    frozen = sum(p.numel() for layer in run.layers for p in layer.parameters() if not p.requires_grad)
    every_rank = sum(sum(h.values()) for h, _ in hosts) * replicas
    return Estimate(model=run.name, parameters=trained + frozen, trained=trained, device=cfg.device, ranks=ranks,
                    host_bytes=every_rank, host=host, host_phases=phases,
                    disk_bytes=sum(v for k, v in disk.items() if k != "checkpoint"), disk=disk,
                    device_bytes=max(s["device_bytes"] for s in stages), stages=stages)


class NotEnoughMemory(ValueError):
    """A run this machine cannot hold; the message names what is short (one line)."""


STATE_FORMATS_BY_PRECISION = ("fp32", "bf16", "8bit")  # the optimizer state's formats, most exact first


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:,.1f} MiB"


def available(cfg, baseline: int, host_memory: int | None = None, disk: int | None = None) -> dict[str, int | None]:
    """What this machine has for the run: host memory (MemAvailable, plus what this process holds
    now, which the run's baseline counts), free disk where it writes, free device memory; or, asked
    about another machine, its `host_memory` and `disk` (free bytes where the run writes)."""
    from l2l_hw.memory_limit import limits

    free_host = meminfo_bytes("MemAvailable")
    host = free_host + baseline if free_host is not None else None
    limited = limits()  # a cgroup's memory limit over this process: what is left under it, never more than it
    if limited is not None:
        host = min(limited[0], limited[1] + baseline, *([host] if host is not None else []))
    out = {"host": host_memory if host_memory is not None else host}
    if cfg.out is not None:
        out["disk"] = disk if disk is not None else free_disk_bytes(cfg.out)
    if cfg.state_dir is not None:
        out["state_dir_disk"] = disk if disk is not None else free_disk_bytes(cfg.state_dir)
    out["device"] = device_memory_bytes(cfg.device)
    return out


def shortfalls(e: Estimate, have: dict[str, int | None], cfg) -> list[str]:
    """What does not fit, one phrase each ("host memory: 31.2 GiB needed, 23.1 GiB available")."""
    short = []
    if have.get("host") is not None and e.host_bytes > have["host"]:
        short.append(f"host memory: {_gib(e.host_bytes)} needed, {_gib(have['host'])} available")
    if have.get("device") is not None and e.device_bytes > have["device"]:
        short.append(f"device memory ({cfg.device}): {_gib(e.device_bytes)} needed, {_gib(have['device'])} free")
    state_dir = e.disk.get("state_dir", 0)
    same_disk = cfg.state_dir is not None and cfg.out is not None and _same_fs(cfg.state_dir, cfg.out)
    out_need = e.disk_bytes - (0 if not cfg.state_dir or same_disk else state_dir)
    if have.get("disk") is not None and out_need > have["disk"]:
        short.append(f"disk at {cfg.out}: {_gib(out_need)} needed, {_gib(have['disk'])} free")
    if cfg.state_dir is not None and not same_disk and have.get("state_dir_disk") is not None \
            and state_dir > have["state_dir_disk"]:
        short.append(f"disk at {cfg.state_dir}: {_gib(state_dir)} needed, {_gib(have['state_dir_disk'])} free")
    return short


def _same_fs(a, b) -> bool:
    def device(p):
        p = Path(p).expanduser().resolve()
        while not p.exists() and p != p.parent:
            p = p.parent
        return p.stat().st_dev
    return device(a) == device(b)


def memory_fits(cfg, baseline: int, have: dict) -> bool:
    e = needs(cfg, baseline)
    return not [s for s in shortfalls(e, have, cfg) if not s.startswith("disk")]


def largest(cfg, baseline: int, have: dict, run_limit: int | None) -> dict:
    """The largest context, micro-batch (fewest micro-batches) and most exact optimizer state
    format that fit this machine's memory, each with the run's other options as given (None:
    not even the smallest fits)."""
    out = {}
    fits = lambda **change: memory_fits(dataclasses.replace(cfg, **change), baseline, have)
    low, high = 0, run_limit or 1 << 20  # largest fitting context: a bisection
    while low < high:
        mid = (low + high + 1) // 2
        if fits(context=mid):
            low = mid
        else:
            high = mid - 1
    out["context"] = low or None
    out["micro_batches"] = next((u for u in range(1, cfg.batch_size + 1) if cfg.batch_size % u == 0
                                 and fits(micro_batches=u)), None)
    allowed = [f for f in STATE_FORMATS_BY_PRECISION if not (cfg.shard_state and f != "fp32")]
    out["optimizer_state"] = next((f for f in allowed if fits(optimizer_state=f)), None)
    return out


def fit_options(cfg) -> list[tuple[str, dict]]:
    """The flags that lower what a run needs, each with its change to cfg, cheapest first: 8-bit
    optimizer state (7.9 B less a parameter, a quantised m and v), a bf16 working copy, the state on
    disk (host memory for groups in flight only; disk traffic each step), activations on the host
    (device memory; transfers each step), no checkpoint (no disk for one; no resume)."""
    options = []
    if cfg.optimizer_state != "8bit" and not cfg.shard_state:
        options.append(("--optimizer-state 8bit", {"optimizer_state": "8bit"}))
    if cfg.precision == "fp32":
        options.append(("--precision bf16", {"precision": "bf16"}))
    if cfg.state_dir is None and cfg.eps_backend in ("cpu", "golden") and not cfg.shard_state:
        options.append(("--state-dir DIR", {"state_dir": str(Path(cfg.out or ".") / "state")}))
    if cfg.device.startswith("cuda") and cfg.activations == "device":
        options.append(("--activations host", {"activations": "host"}))
    if cfg.save and cfg.out is not None:
        options.append(("--no-save", {"save": False}))
    return options


def ways_to_fit(cfg, baseline: int, have: dict) -> list[dict]:
    """Where the run does not fit: the fewest of fit_options' flags that make it fit (host, device
    and disk), each way with what it needs, cheapest first; [] where none does."""
    options = fit_options(cfg)
    for n in range(1, len(options) + 1):
        ways = []
        for chosen in itertools.combinations(options, n):
            change = {k: v for _, c in chosen for k, v in c.items()}
            changed = dataclasses.replace(cfg, **change)
            e = needs(changed, baseline)
            if not shortfalls(e, {**have, **available_disk(changed, have)}, changed):
                ways.append({"flags": [flag for flag, _ in chosen], "host_bytes": e.host_bytes,
                             "disk_bytes": e.disk_bytes, "device_bytes": e.device_bytes})
        if ways:
            return ways
    return []


def available_disk(cfg, have: dict) -> dict:
    """The free disk at a state dir a way to fit adds (as where the run writes, if asked about
    another machine's disk)."""
    if cfg.state_dir is None or "state_dir_disk" in have:
        return {}
    return {"state_dir_disk": have["disk"] if have.get("disk") is not None else free_disk_bytes(cfg.state_dir)}


MAX_TRACED_LAYERS = 10_000  # deeper reference GPTs are not built even on the meta device: the EPS alone is weighed


def deep_model_bound(cfg, baseline: int) -> Estimate:
    """A reference GPT too deep to build on the meta device: its parameters counted from one and
    two blocks, the EPS's bytes for them, the baseline: a lower bound of the host memory."""
    from l2l_hw.models import count_parameters

    one, two = (count_parameters(dataclasses.replace(cfg.model_config(), n_layer=n)) for n in (1, 2))
    trained = one + (cfg.layers - 1) * (two - one)
    host = {"baseline": baseline, "eps": int(trained * eps_bytes_per_parameter(cfg))}
    return Estimate(model=f"the reference GPT, {cfg.layers} layers x {cfg.width} wide (its EPS alone)",
                    parameters=trained, trained=trained, device=cfg.device, ranks=world_size(cfg),
                    host_bytes=sum(host.values()) * world_size(cfg), host=host, host_phases={}, disk_bytes=0, disk={},
                    device_bytes=0, stages=[])


def needs(cfg, baseline: int) -> Estimate:
    """figures(), or for a reference GPT too deep to build, deep_model_bound()."""
    if cfg.model is None and cfg.layers > MAX_TRACED_LAYERS:
        return deep_model_bound(cfg, baseline)
    return figures(cfg, baseline)


def estimate(cfg, *, measure: bool = False, search: bool = False, host_memory: int | None = None,
             disk: int | None = None) -> Estimate:
    """What the run of `cfg` needs, and whether it fits this machine (module docstring), or one
    with `host_memory` and `disk` free. search: also the largest context, micro-batch and state
    format that fit, and where the run does not fit, the flags that would make it; measure: the
    step time, from a profile of one layer of each kind."""
    import_what_the_run_imports(cfg)
    have = available(cfg, 0)  # the device's context exists before the baseline is read
    baseline = rss_bytes()
    have = available(cfg, baseline, host_memory, disk)
    e = needs(cfg, baseline)
    e.available = have
    e.shortfall = shortfalls(e, have, cfg)
    e.fits = not e.shortfall
    if search:
        limit = run_model(cfg).max_context
        e.largest = largest(cfg, baseline, have, limit)
        if not e.fits:
            e.ways_to_fit = ways_to_fit(cfg, baseline, have)
    if measure:
        e.step_s, e.profile = measure_step(cfg)
    return e


def check_fits(cfg) -> None:
    """Refuse a run that this machine cannot hold, before anything is loaded: NotEnoughMemory, one
    line naming each shortfall and what the run needs (l2l estimate says more)."""
    e = estimate(cfg)
    if e.fits:
        return
    raise NotEnoughMemory(f"the run does not fit this machine: {'; '.join(e.shortfall)} (l2l estimate with the "
                          "same flags breaks it down, and names the options that would make it fit)")


# ---------------------------------------------------------------------------- --measure: the step time
PROFILE_REPEATS = 3  # timed passes of each layer kind (the fastest counts: the others met a busy machine)
UPDATE_ELEMENTS = 1 << 22  # the EPS update timed on this many parameters


def measure_step(cfg) -> tuple[float, dict]:
    """An estimated step time: one layer of each kind built with random weights on cfg.device and
    run on a micro-batch of real data as the relay runs it (forward sweep, the last layer's loss,
    recompute and backward, through the run's recompute policy), times its layers and micro-
    batches; plus the EPS's update of every parameter (the host kernel on UPDATE_ELEMENTS, and
    Muon's Newton-Schulz iterations: _time_muon_matrices), which runs between layers on the CPU and beside the device's compute elsewhere. The
    transfers are left out (they overlap the compute: docs/BENCHMARKS.md)."""
    from l2l_hw.relay.precision import compute_dtype

    run = run_model(cfg)
    device = torch_device(cfg.device)
    dtype = compute_dtype(cfg.precision)
    sizes = micro_sizes(cfg.batch_size, cfg.micro_batches)
    m = max(sizes)
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    vocab = 256 if cfg.model is None else run.layers[0].config.vocab_size
    ids = torch.randint(0, vocab, (m, cfg.context), generator=generator, device="cpu").to(device)
    x, kinds, seconds = ids, {}, 0.0
    policy = cfg.recompute if cfg.activation_budget is None else "full"
    for i, layer in enumerate(run.layers):
        last = i == len(run.layers) - 1
        key = (_signature(layer), last, tuple((t.shape, t.dtype) for t in flatten(x)))
        if key not in kinds:
            real = _real_layer(layer, device, dtype)
            kinds[key] = _time_layer(real, x, policy, device, last, run.loss_fn, ids, cfg.micro_batches)
            with torch.no_grad():
                out = layer_output(i, real, real(x))
            kinds[key]["next"] = out.detach() if isinstance(out, torch.Tensor) else tuple(t.detach() for t in out)
            del real
        x = kinds[key]["next"]
        seconds += kinds[key]["seconds"]
    trained = [p.shape for layer in run.layers for p in layer.parameters() if p.requires_grad]
    update = _time_update(cfg) * sum(math.prod(s) for s in trained) + _time_muon_matrices(cfg, trained)
    on_host = device.type == "cpu"
    total = seconds + update if on_host else max(seconds, update)
    return total, {"compute_s": seconds, "update_s": update, "layer_kinds": len(kinds),
                   "updates": "between layers (the CPU computes both)" if on_host else "beside the device's compute"}


def _real_layer(module: nn.Module, device, dtype) -> nn.Module:
    """`module` (meta) with random weights on `device`, trainable ones in the compute dtype."""
    real = copy.deepcopy(module).to_empty(device=device)
    with torch.no_grad():
        for p in real.parameters():
            if p.is_floating_point():
                p.normal_(0.0, 0.02)
        for name, b in real.named_buffers():  # rotary tables and position ids: as the model makes them
            src = dict(module.named_buffers())[name]
            if not src.is_meta:
                b.copy_(src)
    for p in real.parameters():
        if p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)
    return real


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_layer(layer: nn.Module, x, recompute, device, last: bool, loss_fn, ids, u: int) -> dict:
    """Seconds one layer takes in a step of u micro-batches like x: the fastest of PROFILE_REPEATS."""
    from l2l_hw.relay.recompute import recompute_policy

    stash = ActivationStash("device", Transport(str(device)))
    buffers = dict(layer.named_buffers())

    def run(a, b=None):
        return layer_output(0, layer, layer(a))

    def once() -> float:
        keep = KeepGraphs() if last else recompute_policy(recompute, stash, device)
        _sync(device)
        start = time.perf_counter()
        if last:
            for _ in range(u):
                leaf = grad_leaf(x)
                with torch.enable_grad():
                    loss = loss_fn(to_float(run(leaf)), _targets(ids, loss_fn))
                loss.backward()
        else:
            keep.begin_forward(0, [x] * u)
            outs = [keep.forward(0, j, x, run, buffers) for j in range(u)]
            keep.end_forward(0)
            keep.begin_backward(0)
            for j in range(u):
                leaf, out = keep.backward(0, j, run)
                pairs = [(o, torch.ones_like(o)) for o in flatten(out) if o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            keep.clear()
            del outs
        _sync(device)
        for p in layer.parameters():
            p.grad = None
        return time.perf_counter() - start

    return {"seconds": min(once() for _ in range(PROFILE_REPEATS))}


def _targets(ids: torch.Tensor, loss_fn):
    """Targets of the run's loss for inputs `ids`: the next bytes (the reference GPT), or HF labels."""
    labels = torch.roll(ids, -1, 1)
    if hasattr(loss_fn, "targets"):
        return loss_fn.targets(labels)
    return labels


MUON_PROFILE_SIDE = 512  # Muon's Newton-Schulz iterations are timed on a square matrix this wide


def muon_flops(shape, steps: int) -> int:
    """Floating-point operations of Muon's Newton-Schulz iterations on a (rows, cols) matrix
    (golden.orthogonalize), s <= l its sides: per iteration A = X X^T (2 s^2 l), b A + c A A
    (2 s^3) and that times X (2 s^2 l)."""
    s, l = sorted(shape)
    return steps * (4 * s * s * l + 2 * s ** 3)


def _time_muon_matrices(cfg, shapes: list) -> float:
    """Seconds Muon's matrix work takes in a step, on the host: the Newton-Schulz flops of the run's
    matrices at the rate measured on one MUON_PROFILE_SIDE square matrix (its bf16 products on
    torch's threads); their element-wise work is _time_update's. 0 for the other optimizers."""
    from l2l_hw.eps.base import tensor_rule
    from l2l_hw.eps.golden import orthogonalize

    matrices = [s for s in shapes if tensor_rule(cfg.optimizer, s) == "muon"]
    if not matrices:
        return 0.0
    x = torch.randn(MUON_PROFILE_SIDE, MUON_PROFILE_SIDE)
    best = math.inf
    for _ in range(PROFILE_REPEATS):
        start = time.perf_counter()
        orthogonalize(x, cfg.muon_ns_steps)
        best = min(best, time.perf_counter() - start)
    return best * sum(muon_flops(s, cfg.muon_ns_steps) for s in matrices) / muon_flops(x.shape, cfg.muon_ns_steps)


def _time_update(cfg) -> float:
    """Seconds the run's EPS takes to update one parameter (the host kernel, cfg's optimizer and state)."""
    from l2l_hw.eps import make_eps
    from l2l_hw.relay.precision import compute_dtype

    eps = make_eps("cpu", optimizer=cfg.optimizer, momentum=cfg.momentum, state=cfg.optimizer_state,
                   working_dtype=cfg.precision, threads=cfg.threads)
    try:
        eps.register("timed", {"w": torch.zeros(UPDATE_ELEMENTS)})
        grad = {"w": torch.full((UPDATE_ELEMENTS,), 1e-3, dtype=compute_dtype(cfg.precision))}
        best = math.inf
        for _ in range(PROFILE_REPEATS):
            start = time.perf_counter()
            eps.push_grads("timed", grad)
            eps.commit_step()
            best = min(best, time.perf_counter() - start)
    finally:
        eps.close()
    return best / UPDATE_ELEMENTS


# ---------------------------------------------------------------------------- in words
HOST_PARTS = {"baseline": "this process (Python, torch, transformers)", "eps": "EPS state",
              "buffers": "layer buffers", "libraries": "libraries' buffers", "data": "data", "tokenizer": "tokenizer",
              "build": "building the model", "step": "the steps' activations and gradients",
              "end": "the model gathered or saved at the end"}


def describe(e: Estimate, cfg) -> str:
    """The estimate as `l2l estimate` prints it."""
    millions = lambda n: f"{n / 1e6:,.1f} M" if n < 1e9 else f"{n / 1e9:,.2f} B"
    lines = [f"{e.model}: {millions(e.parameters)} parameters ({millions(e.trained)} trained), device {e.device}"
             + (f", {e.ranks} ranks" if e.ranks > 1 else "")]
    parts = ", ".join(f"{HOST_PARTS.get(k, k)} {_gib(v)}" for k, v in e.host.items() if v)
    each = f" ({_gib(sum(e.host.values()))} the largest rank)" if e.ranks > 1 else ""
    lines.append(f"host memory   {_gib(e.host_bytes)} at the peak{each}: {parts}")
    disk = []
    if "state_dir" in e.disk:
        disk.append(f"--state-dir {cfg.state_dir} {_gib(e.disk['state_dir'])}")
    if "checkpoint" in e.disk:
        disk.append(f"each checkpoint {_gib(e.disk['checkpoint'])} (two while one replaces the other)")
    if "model" in e.disk:
        disk.append(f"the saved model {_gib(e.disk['model'] // 2)} (two while one replaces the other)")
    if e.disk.get("tokens"):
        disk.append(f"tokens {_gib(e.disk['tokens'])}")
    lines.append(f"disk          {_gib(e.disk_bytes)}" + (f": {', '.join(disk)}" if disk else " (nothing written)"))
    source = ("the relay's accounting" if len(e.stages) == 1 else "a model of the 1F1B schedule") + (
        "" if not e.device.startswith("cuda") else ", without the allocator's transients")
    for s, stage in enumerate(e.stages):
        name = "device" if len(e.stages) == 1 else f"stage {s}"
        first, end = stage["layers"]
        lines.append(f"{name:<13} {_gib(stage['device_bytes'])} peak on {e.device} ({source}; activations kept "
                     f"{_gib(stage['kept_activation_bytes'])}), layers {first} to {end - 1}")
    have = e.available
    machine = [f"host {_gib(have['host'])} available" if have.get("host") is not None else None,
               f"disk {_gib(have['disk'])} free at {cfg.out}" if have.get("disk") is not None else None,
               f"device {_gib(have['device'])} free" if have.get("device") is not None else None]
    verdict = "fits" if e.fits else "does not fit: " + "; ".join(e.shortfall)
    lines.append(f"this machine  {', '.join(m for m in machine if m)}: {verdict}")
    if e.largest:
        big = e.largest
        lines.append("largest that fits this machine's memory (the rest as given): "
                     f"context {big['context'] or 'none'}, micro-batches "
                     f"{big['micro_batches'] or 'none'} (of batch {cfg.batch_size}), optimizer state "
                     f"{big['optimizer_state'] or 'none'}")
    if e.ways_to_fit:
        lines.append("fits with     " + "; or ".join(
            f"{' '.join(w['flags'])} (host {_gib(w['host_bytes'])}, disk {_gib(w['disk_bytes'])}"
            + ("; no checkpoint and no saved model: a trial only" if "--no-save" in w["flags"] else "")
            + (f", device {_gib(w['device_bytes'])}" if e.device.startswith("cuda") else "") + ")"
            for w in e.ways_to_fit))
    elif not e.fits and e.largest:
        tried = ", ".join(flag for flag, _ in fit_options(cfg))
        lines.append(f"fits with     {'none of ' + tried if tried else 'no option'}: a smaller model, context or batch")
    if e.step_s is not None:
        p = e.profile
        lines.append(f"step time     {e.step_s:.3g} s (measured profile: compute {p['compute_s']:.3g} s, EPS updates "
                     f"{p['update_s']:.3g} s {p['updates']})")
    return "\n".join(lines)


def eps_bytes_per_parameter(cfg) -> float:
    """The EPS's host bytes per trained parameter of cfg's run, from the engine's own layout (the
    fp32 master, the moments in their format, the working copy, the double buffers where a step
    can be discarded whole or computes one version back): what the banner reports."""
    n = 1 << 20
    return eps_bytes(dataclasses.replace(cfg, state_dir=None), {"g": {"w": torch.Size([n])}}).memory / n
