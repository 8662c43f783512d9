"""The layers, as the estimate sees them: the model a config trains built on the meta device
(run_model: the reference GPT, or a Hugging Face model from its config.json alone), and each
distinct layer run once per micro-batch size on fake tensors (torch's FakeTensorMode: shapes and
dtypes, no memory, the CPU's kernel choices) through the relay's own recompute policies, under
saved_tensors_hooks: what its graph saves, what selective recompute keeps, what aliases its input,
output or weights (LayerTrace, ModelTrace)."""
from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from l2l_hw.relay.recompute import SelectiveRecompute, grad_leaf
from l2l_hw.relay.stage import flatten, layer_output, to_float
from l2l_hw.relay.stash import ActivationStash
from l2l_hw.relay.transport import Transport


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


def layer_signature(module: nn.Module) -> tuple:
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
            key = (layer_signature(layer), last, tuple((tuple(t.shape), t.dtype) for t in flatten(x)))
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


def stage_trace(model: ModelTrace, first: int, end: int) -> ModelTrace:
    """The part of `model` a pipeline stage (layers [first, end)) relays."""
    groups = model.groups[first:end]
    keys = {k for g in groups for k in g}
    return ModelTrace(model.traces[first:end], groups, model.names[first:end],
                      {k: v for k, v in model.group_bytes.items() if k in keys}, model.frozen[first:end],
                      {k: v for k, v in model.shapes.items() if k in keys}, model.buffers[first:end])


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
