"""A layer stage: layers [first, end) of a model, relayed from an EPS one layer at a time.

A stage holds what running its layers needs, whatever the order a schedule runs them in:

    plans        each layer's structure (meta parameters), its EPS bindings, frozen
                 parameters and device buffers; the EPS groups are named by the whole
                 model's layer indices (layer{first + k}), so a stage's state, export and
                 checkpoint entries are under the whole model's names
    weights      the weight stream (fetch ahead, the 2BW version), the transport
    keep, stash  the recompute policy and where the activations it keeps live
    gradients    the fp32 sums over micro-batches, the data-parallel reduction over the
                 stage's replicas, clipping (per layer, or the global norm's share),
                 the push down to the EPS, and the commit

A schedule orders the calls: the Relay (executor.py) runs one stage over the whole model
layer-major; the pipeline (pipeline.py) runs 1F1B / 2BW over one stage per rank. The
calls a schedule makes: split_micro_batches, layer_params / prefetch, visit /
call (layer k on one micro-batch), compute_loss, input_grads, push, commit_pushed,
abandon; state_entries / export / materialize for checkpoints and the trained model.
Layer indices k passed to a stage are its own (0 .. len(layers) - 1).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, NamedTuple, Sequence

import torch
from torch import distributed as dist
from torch import nn
from torch.func import functional_call

from l2l_hw.eps.base import EPS, Landing, StateEntry, tensor_of
from l2l_hw.relay.data_parallel import GradReducer, check_compression
from l2l_hw.relay.device_share import DEVICE_BYTES_PER_PARAMETER, DeviceShare, device_free_bytes, share_problem
from l2l_hw.relay.memory import DeviceMemory
from l2l_hw.relay.options import RelayOptions
from l2l_hw.relay.precision import GradSums, LossScaler, compute_dtype
from l2l_hw.relay.prefetch import WeightStream
from l2l_hw.relay.recompute import recompute_policy
from l2l_hw.relay.stash import ActivationStash
from l2l_hw.relay.transport import Transport, torch_device

# Beside a device, the threads that launch its kernels (the relay's and autograd's device
# thread) keep a core each: the host kernel's threads beside them left the H200's compute
# stream idle 7.3% of a capped step with one core left, 3.5% with two.
LAUNCH_THREADS = 2

Activation = torch.Tensor | tuple  # what a layer takes and returns


class RelayError(RuntimeError):
    """A layer or the loss failed inside the relay; the message names the layer and shapes."""


class Exported(NamedTuple):
    """One tensor of the trained model (Relay.export)."""

    layer: int
    name: str  # the layer's own name for it
    tensor: torch.Tensor | None  # None: a parameter shared with an earlier layer, given there
    first: tuple[int, str]  # the (layer, name) that gave its values


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


def flatten(x: Activation) -> list[torch.Tensor]:
    """An activation (a tensor or a tuple of tensors) as a list of tensors."""
    return [x] if isinstance(x, torch.Tensor) else list(x)


def unflatten(like: Activation, items: list) -> Activation:
    """`items` in the structure of `like`: one tensor, or a tuple."""
    return items[0] if isinstance(like, torch.Tensor) else tuple(items)


def to_float(x: Activation) -> Activation:
    """Low-precision outputs go to the loss in fp32."""
    return unflatten(x, [t.float() if t.is_floating_point() else t for t in flatten(x)])


def registered_groups(layers, first: int = 0) -> dict[str, dict[str, torch.Size]]:
    """The EPS groups LayerStage._plan registers, in order: layer i's trainable parameters that no
    earlier layer holds (a tied one is its first layer's), by name, with their shapes; layers[0]
    is the model's layer `first`."""
    seen: set[int] = set()
    groups = {}
    for i, module in enumerate(layers):
        own = {name: p.shape for name, p in module.named_parameters() if p.requires_grad and id(p) not in seen}
        seen.update(id(p) for p in module.parameters())
        if own:
            groups[f"layer{first + i}"] = own
    return groups


def _replace_tensors(module: nn.Module, make: Callable[[str, torch.Tensor], torch.Tensor],
                     which: Callable[[torch.Tensor], bool]) -> None:
    """Swap every parameter and buffer of `module` that `which` selects for `make(name, old)`,
    at every place it is registered (a tied tensor in two submodules)."""
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for table in (sub._parameters, sub._buffers):
            for name, t in list(table.items()):
                if t is not None and which(t):
                    table[name] = make(f"{prefix}.{name}" if prefix else name, t)


def _filled(i: int, name: str, meta: torch.Tensor, values: dict | None) -> torch.Tensor:
    """The real tensor for meta tensor `name` of layer i, from init's `values`, checked."""
    if values is None or name not in values:
        raise ValueError(f"init(i={i}, module) gave no tensor for {name!r}, which is on the meta device; "
                         f"it gave {sorted(values or {})}")
    t = torch.as_tensor(tensor_of(values[name]))
    if t.shape != meta.shape:
        raise ValueError(f"init(i={i}, module) gave {name!r} the shape {tuple(t.shape)}; "
                         f"the module has {tuple(meta.shape)}")
    t = t.to("cpu", meta.dtype)
    return nn.Parameter(t, requires_grad=meta.requires_grad) if isinstance(meta, nn.Parameter) else t


def init_from_state(state) -> Callable[[int, nn.Module], dict[str, torch.Tensor]]:
    """An `init` for Relay that fills meta-device layers from a relay state (`Relay.state_dict()`,
    or a checkpoint opened lazily): EPS masters `eps/layer{i}/{name}/param` and buffers
    `buffers/{i}/{name}`. A tied parameter takes its values from the first layer that uses it."""
    def init(i: int, module: nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for name, _ in (*module.named_parameters(), *module.named_buffers()):
            for key in (f"eps/layer{i}/{name}/param", f"buffers/{i}/{name}"):
                if key in state:
                    out[name] = state[key]
        return out
    return init


def layer_output(i: int, module: nn.Module, out):
    """Layer i's output as the relay carries it: a tensor, or a tuple of tensors (anything else:
    one RelayError naming the layer)."""
    if not (isinstance(out, torch.Tensor) or
            (isinstance(out, (tuple, list)) and out and all(isinstance(t, torch.Tensor) for t in out))):
        raise RelayError(f"layer {i} ({type(module).__name__}) returned {_describe(out)}; "
                         f"a layer must return a tensor or a tuple of tensors")
    return out if isinstance(out, torch.Tensor) else tuple(out)


class LayerStage:
    """Layers [first, first + len(layers)) of a model with their weights in `eps`, one layer at a
    time on the device: everything but the order of the calls (module docstring)."""

    def __init__(self, layers: nn.Sequential | Sequence[nn.Module], loss_fn: Callable, eps: EPS,
                 options: RelayOptions | None = None, *, first: int = 0, process_group=None,
                 in_flight: int | None = None, device_share: bool = False,
                 init: Callable[[int, nn.Module], dict[str, torch.Tensor]] | None = None,
                 no_decay: Callable[[int, str], bool] | None = None, **option_values):
        """`options` (RelayOptions), or its fields as keyword arguments (over `options` where
        both are given): device, micro_batches, recompute, activations, precision, grad_sums,
        pipedream_2bw, clip_grad_norm, clip_mode, skip_nonfinite (layer_drop is the Relay's).
        `init(i, module)` and `no_decay(i, name)` take the whole model's layer index i.
        `device_share`: whether options.device_update_layers may keep the first layers' update on
        the device (the Relay's stage; a pipeline's refuses it).
        `in_flight`: the micro-batches whose activations a layer keeps at once (a pipeline stage's
        under 1F1B; None: all of them, layer-major), what planned recompute budgets for.
        `no_decay(i, name)`: whether layer i's parameter `name` is updated without weight decay
        (transformers' Trainer exempts biases and norms; hf.from_pretrained passes its rule)."""
        unknown = sorted(set(option_values) - {f.name for f in dataclasses.fields(RelayOptions)})
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown option(s) {', '.join(unknown)}; its options are "
                            f"{', '.join(f.name for f in dataclasses.fields(RelayOptions))}")
        if isinstance(option_values.get("device"), torch.device):
            option_values["device"] = str(option_values["device"])
        options = dataclasses.replace(options or RelayOptions(), **option_values)
        self.options = options
        self.layers = list(layers)
        self.first = first  # the whole model's index of layers[0]
        if not self.layers:
            raise ValueError(f"{type(self).__name__} needs at least one layer")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"layer {i} is a {type(layer).__name__}; layers must be torch.nn.Module instances")
        if not isinstance(eps, EPS):
            raise TypeError(f"eps must be an EPS from l2l_hw.make_eps(...), got {type(eps).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be a callable loss_fn(output, targets), got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        self.eps = eps = self._share_update(eps, options, device_share)
        self.transport = Transport(options.device)  # every host <-> device movement
        self.device = self.transport.device
        self.micro_batches = options.micro_batches
        self.recompute = options.recompute
        self.stash = ActivationStash(options.activations, self.transport)
        self.keep = recompute_policy(options.recompute, self.stash, self.device, options.activation_budget,
                                     in_flight)
        self.memory = DeviceMemory(self.device, options.account_memory)
        self.clip_norm = options.clip_grad_norm
        self.clip_mode = options.clip_mode if options.clip_grad_norm is not None else None
        self.precision = precision = options.precision
        self.compute_dtype = compute_dtype(precision)
        if eps.shapes and eps.working_dtype != precision:
            raise ValueError(f"precision={precision!r} needs an EPS whose working copy is {precision}; this "
                             f"one already holds groups with working_dtype={eps.working_dtype!r}")
        self.scaler = LossScaler() if precision == "fp16" else None
        self.grad_sums = GradSums(self.compute_dtype, in_fp32=options.grad_sums == "fp32")  # until a group leaves
        # PipeDream-2BW: step t+1 computes on the weights without step t's update (the EPS's
        # previous buffer), so no layer waits for its update: W(t+1) = W(t) - lr * grad(W(t-1)).
        self.pipedream_2bw = options.pipedream_2bw
        if eps.delay_compensation != "none" and not self.pipedream_2bw:  # before any weight loads
            raise ValueError(f"the EPS's delay_compensation={eps.delay_compensation!r} corrects the weights "
                             "PipeDream-2BW computes on, one step stale; this relay computes on the newest (a flush "
                             "pipeline, or pipedream_2bw=False): give schedule '2bw' (pipedream_2bw=True) or an EPS "
                             "without it")
        # A step with a non-finite gradient is discarded whole: always for fp16 (the loss scale
        # overflowed), on request otherwise (torch.optim lets non-finite values propagate).
        self.skip_nonfinite = self.scaler is not None or options.skip_nonfinite
        # The EPS rounds its fp32 masters to what the layers compute in; discarding a step after
        # eager updates ran, or reading the version one step back, needs its double buffers.
        eps.configure(working_dtype=precision, double_buffer=self.skip_nonfinite or self.pipedream_2bw,
                      defer_updates=self.clip_mode == "global", device=self.device,
                      threads=self._thread_policy(options.threads), inline=not self.transport.asynchronous)
        self.dp = self._data_parallel(process_group)
        self._sq_norm = self._zero_norm()  # global-norm clipping: the step's squared norm so far
        self._pending = []  # gradient reductions under way, oldest first
        self.plans = self._plan(init, no_decay or (lambda i, name: False))
        self.weights = WeightStream(eps, self.transport, previous=self.pipedream_2bw)
        self.groups = sorted({key for plan in self.plans for key in plan.groups})

    # -- set-up ---------------------------------------------------------------
    def _share_update(self, eps: EPS, options: RelayOptions, allowed: bool) -> EPS:
        """The EPS this stage updates through: `eps`, or, with options.device_update_layers = k > 0
        where `allowed` (the Relay's stage, the whole model), `eps` with the groups of layers 0..k-1
        kept and updated on the device (l2l_hw/relay/device_share.py); a pipeline's stages keep
        every update on the host. A k the EPS, the schedule or the device's free memory cannot
        give is one ValueError, before any weight loads."""
        k = options.device_update_layers or 0
        if not allowed and k:
            raise ValueError(f"device_update_layers={k} is the relay's: a pipeline's stages keep every update on "
                             "the host; give 0")
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

    def _thread_policy(self, threads: int | None) -> int | None:
        """Never more busy threads than cores: on the CPU the layers compute on `threads` of torch's
        and the EPS updates run between layers on as many of the host kernel's (an update beside
        the layers would only slow both); with a device computing, the updates run beside it on
        the cores left to the threads that launch its kernels (LAUNCH_THREADS; docs/BENCHMARKS.md,
        `l2l bench gpu`). The host kernel's threads (None: the EPS's own)."""
        if threads is not None:
            torch.set_num_threads(threads)
        self.threads = threads or len(os.sched_getaffinity(0))
        if self.transport.asynchronous:
            return max(1, self.threads - LAUNCH_THREADS)
        return threads

    def _data_parallel(self, group) -> GradReducer | None:
        """The gradient reducer when running data parallel; every rank starts from rank 0's weights."""
        import torch.distributed as dist

        if self.eps.sharded:
            if group is not None and group is not self.eps.process_group:
                raise ValueError("process_group differs from the sharded EPS's; pass the same group to both")
            group = self.eps.process_group
        elif group is None:
            if not (dist.is_available() and dist.is_initialized()):
                check_compression(self.options, self.precision, data_parallel=False)
                return None
        check_compression(self.options, self.precision, data_parallel=True)
        if not self.eps.sharded and self.options.grad_compression == "none" and dist.get_world_size(group) == 1:
            return None  # a group of one rank (a pipeline stage without replicas): nothing to average
        dp = GradReducer(group, self.eps, self.device, options=self.options)
        if dp.world > 1:
            dp.broadcast_([t for m in self.layers for t in (*m.parameters(), *m.buffers()) if not t.is_meta],
                          "broadcasting rank 0's initial weights")
        return dp

    def _plan(self, init, no_decay: Callable[[int, str], bool]) -> list[LayerPlan]:
        """Register each layer's own trainable parameters in the EPS, one layer at a time, then
        keep only the modules' structure: their trainable parameters move to the meta device,
        so the EPS holds the only copy of the weights. A layer built on the meta device gets
        its values from `init(i, module)` just before its registration; its trainable
        parameters stay on meta, and only frozen parameters and buffers are filled in. The EPS is
        told every group first (EPS.expect). Groups, `init` and `no_decay` take the whole model's
        layer indices."""
        self.eps.expect(registered_groups(self.layers, self.first))
        owner: dict[int, tuple[str, str]] = {}  # id(parameter) -> (EPS group, name); ids of the modules' own
        released: dict[int, nn.Parameter] = {}  # id(parameter) -> its meta stand-in (one for a tied one)
        trainable = (lambda t: isinstance(t, nn.Parameter) and t.requires_grad)
        plans = []
        for k, module in enumerate(self.layers):
            i, values = self.first + k, None
            if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
                if init is None:
                    raise ValueError(f"layer {i} ({type(module).__name__}) has tensors on the meta device; "
                                     f"pass init=fn, fn(i, module) -> {{name: tensor}}, to fill them")
                values = init(i, module)
            _replace_tensors(module, lambda name, t: _filled(i, name, t, values),
                             lambda t: t.is_meta and not trainable(t))
            plan = LayerPlan(module)
            own: dict[str, torch.Tensor] = {}
            for name, p in module.named_parameters():
                if not p.requires_grad:
                    plan.frozen[name] = p.detach()
                    continue
                if id(p) not in owner:
                    owner[id(p)] = (f"layer{i}", name)
                    own[name] = _filled(i, name, p, values) if p.is_meta else p
                plan.bindings[name] = owner[id(p)]
            # Buffers (norm statistics, rotary tables) live on the device for the whole run: no
            # copy per micro-batch; checkpoints and export read them back. Always a copy, on the
            # CPU too, so that nothing reads the module's own (stale) buffers by mistake.
            plan.buffers = {name: b.to(self.device, copy=True) for name, b in module.named_buffers()}
            if own:
                self.eps.register(f"layer{i}", own, frozenset(n for n in own if no_decay(i, n)))
            del own
            _replace_tensors(module, lambda name, p: released.setdefault(id(p), nn.Parameter(
                torch.empty_like(p, device="meta"))), lambda t: trainable(t) and not t.is_meta)
            plans.append(plan)
        return plans

    @property
    def step(self) -> int:
        return self.eps.step

    def close(self) -> None:
        """Close the stage's EPS (its update thread, a state_dir's files): the stage owns it."""
        self.eps.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one layer on one micro-batch -------------------------------------------
    @contextlib.contextmanager
    def visit(self, i: int, params: dict[str, torch.Tensor]):
        """Layer i's module holding its device parameters and buffers in place of its meta
        parameters, for one visit of the layer (every micro-batch calls it as it is)."""
        module, bound = self.plans[i].module, {**params, **self.plans[i].buffers}
        device = {id(t): bound[name] for name, t in (*module.named_parameters(), *module.named_buffers())
                  if name in bound}  # a tied tensor: one id, every place it is registered
        slots = [(table, name, t) for _, sub in module.named_modules(remove_duplicate=False)
                 for table in (sub._parameters, sub._buffers) for name, t in table.items() if id(t) in device]
        for table, name, t in slots:
            table[name] = device[id(t)]
        try:
            yield
        finally:
            for table, name, t in slots:
                table[name] = t

    def call(self, i: int, x: Activation, buffers: dict[str, torch.Tensor],
             params: dict[str, torch.Tensor] | None = None):
        """Layer i on one micro-batch: inside its visit, or with `params` (its device parameters,
        layer_params) bound for this call alone; `buffers`: its live ones, or a snapshot."""
        plan = self.plans[i]
        try:
            if params is not None:
                out = functional_call(plan.module, {**params, **buffers}, (x,))
            elif buffers is plan.buffers or not buffers:
                out = plan.module(x)
            else:  # the buffers the forward saw, for its recompute
                out = functional_call(plan.module, buffers, (x,))
        except Exception as exc:
            raise RelayError(f"layer {self.first + i} ({type(plan.module).__name__}) failed on an input of "
                             f"{_describe(x)}: {exc}") from exc
        return layer_output(self.first + i, plan.module, out)

    def compute_loss(self, out, target) -> torch.Tensor:
        try:
            loss = self.loss_fn(out, target)
        except Exception as exc:
            raise RelayError(f"loss_fn failed on output {_describe(out)} and targets {_describe(target)}: {exc}") from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise RelayError(f"loss_fn returned {_describe(loss)}; it must return the mean loss of the "
                             f"micro-batch as a scalar tensor")
        return loss.reshape(())

    def layer_params(self, i: int, live: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Layer i's device parameters by module name, bound once per visit of the layer: groups
        not yet on the device are fetched, frozen parameters go up with them."""
        plan = self.plans[i]
        for key in plan.groups:
            if key not in live:
                live[key] = {n: self.grad_sums.watch(t.detach().requires_grad_(t.is_floating_point()))
                             for n, t in self.weights.get(key).items()}
        frozen = f"frozen:{i}"
        if plan.frozen and frozen not in live:
            live[frozen] = dict(zip(plan.frozen, self.transport.up(list(plan.frozen.values())).wait()))
        return {**{name: live[key][gname] for name, (key, gname) in plan.bindings.items()}, **live.get(frozen, {})}

    # -- the batch --------------------------------------------------------------
    def split_micro_batches(self, inputs, targets):
        """Split into micro-batches along dim 0; weights n_j / B make the loss the minibatch mean."""
        def batch_size(x, what):
            items = flatten(x) if isinstance(x, (torch.Tensor, tuple, list)) else None
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

        def split(x, dtype=None):
            """Micro-batches of `x` on the device: one transfer up for all of them."""
            items = flatten(x)
            parts = [p for t in items for p in torch.tensor_split(t, self.micro_batches)]
            moved = self.transport.up(parts, dtype=dtype).wait()
            return [unflatten(x, moved[j::self.micro_batches]) for j in range(self.micro_batches)]

        xs, ts = split(inputs, self.compute_dtype), split(targets)
        weights = [flatten(t)[0].shape[0] / n for t in ts]
        return xs, ts, weights, n


    def abandon(self, exc: BaseException) -> None:
        """A step that failed leaves nothing behind: what is in flight is dropped, scheduled
        updates finish and the step is forgotten; the first error stays the one raised."""
        self.discard_reductions()
        self._sq_norm = self._zero_norm()
        self.weights.clear()
        self.stash.clear()
        self.keep.clear()
        self.memory.drop_saved()
        try:
            self.eps.wait()
            self.eps.discard_step()
        except Exception as cleanup:
            exc.add_note(f"while abandoning the step: {cleanup}")

    def commit_pushed(self, across: Callable | None = None) -> None:
        """The EPS finishes the step's pushed updates: scaled by the global clip factor, discarded
        whole where a gradient was not finite (skip_nonfinite; fp16's loss scale learns of it).
        `across(tensor, op, what)`: the tensor all-reduced over the ranks that hold the rest of
        the model (a pipeline's stages), so the norm is the whole model's and every stage skips
        the same steps. No barrier: the step's updates finish in the background, each layer's next
        fetch waiting for its own group only (PipeDream-2BW computes on the version they replace);
        only a step that may be discarded (skip_nonfinite) waits to learn of an overflow."""
        agree = None
        if across is not None and self.skip_nonfinite:
            agree = lambda found: bool(across(torch.tensor([float(found)]), dist.ReduceOp.MAX,  # noqa: E731
                                              "agreeing on non-finite gradients at commit").item())
        found = self.eps.commit_step(grad_scale=self._global_clip_factor(across), skip_nonfinite=self.skip_nonfinite,
                                     wait=self.skip_nonfinite, agree=agree)
        if self.scaler is not None:
            self.scaler.update(found)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def prefetch(self, i: int, live: dict, key=None) -> None:
        """Start moving layer i's weights (the groups not on the device yet) up, and, for a
        backward, what the recompute policy stashed under `key` (default i; a no-op until the
        layer's forward has stashed something)."""
        self.weights.prefetch([group for group in self.plans[i].groups if group not in live])
        self.keep.prefetch(i if key is None else key)

    def sample_memory(self, *held) -> None:
        """Account what is on the device now: `held` plus what is kept for the backward and weights in flight."""
        if self.memory.counting:
            self.memory.sample(*held, self.weights.on_device(), self.grad_sums.held(),
                               kept=[self.stash.on_device(), self.keep.held()])

    @staticmethod
    def input_grads(x: Activation) -> list[torch.Tensor | None]:
        return [t.grad if t.grad is not None or not t.requires_grad else torch.zeros_like(t)
                for t in flatten(x)]

    def push(self, key: str, grads: dict[str, torch.Tensor]) -> None:
        """Hand a group's gradients to the EPS; data parallel, first start averaging them across
        ranks and push the group reduced during this layer's backward (push_reduced pushes the
        last ones before the commit)."""
        if self.dp is None or not grads:
            self.push_group(key, grads)
            return
        self.push_reduced()
        self._pending.append(self.dp.launch(key, grads))

    def push_reduced(self) -> None:
        """Wait for the gradient reductions under way and push them, oldest first."""
        while self._pending:
            reduction = self._pending.pop(0)
            grads = self.dp.finish(reduction)
            self.push_group(reduction.key, grads)

    def start_step_over_ranks(self, local_n: int) -> None:
        """Data parallel: agree on the step's minibatch size (this rank's gradient weight)."""
        if self.dp is not None:
            self.dp.start_step(local_n)

    def mean_over_ranks(self, local_mean: float, local_n: int, what: str) -> float:
        """This rank's mean over its `local_n` samples; data parallel, the mean over every rank's."""
        return self.dp.mean(local_mean, local_n, what) if self.dp is not None else local_mean

    def discard_reductions(self) -> None:
        """Forget the gradient reductions under way (an abandoned step's)."""
        self._pending.clear()

    def push_group(self, key: str, grads: dict[str, torch.Tensor]) -> None:
        """Group `key`'s gradients, summed over the micro-batches (and reduced across ranks),
        clipped, sent down and handed to the EPS's update (a group of the device share's keeps
        them on the device)."""
        grads = self._clip(grads)
        grads = self.grad_sums.rounded(grads) if self.eps.on_device(key) else self._to_host(grads)
        self.eps.push_grads(key, grads, inv_scale=1.0 / self.loss_scale)

    def _to_host(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A group's gradients on their way down, right after its backward (and its reduction
        and clipping): the fp32 sums rounded once to the working dtype, then a Landing the EPS's
        update waits for, in reused staging buffers it gives back (on the CPU, the gradients)."""
        grads = self.grad_sums.rounded(grads)
        if not self.transport.asynchronous or not grads:
            return grads
        pool = self.transport.grad_pool
        moving = self.transport.down(list(grads.values()), pool=pool)
        return Landing(dict(zip(grads, moving.tensors)), moving.landed, lambda: pool.give_back(moving.tensors))

    def _clip(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-layer clipping scales the group's gradients as torch.nn.utils.clip_grad_norm_
        does; global clipping only accumulates the squared norm (applied at commit)."""
        if self.clip_mode is None or not grads:
            return grads
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads.values()]))
        if self._sharded and self.clip_mode == "layer":  # this rank holds slices: the norm is over all ranks
            norm = self.dp.sum(norm ** 2, "summing a gradient norm over ranks").sqrt()
        norm = norm / self.loss_scale
        if self.clip_mode == "global":
            self._sq_norm += norm.float() ** 2  # on the device: read once, at commit
            return grads
        coef = torch.clamp(self.clip_norm / (norm + 1e-6), max=1.0)
        return {n: g.mul_(coef.to(g.dtype)) for n, g in grads.items()}

    def _global_clip_factor(self, across: Callable | None = None) -> float:
        """Global-norm clipping: the factor every deferred update's gradient is scaled by."""
        if self.clip_mode != "global":
            return 1.0
        sq, self._sq_norm = self._sq_norm, self._zero_norm()
        if self._sharded:
            sq = self.dp.sum(sq, "summing the global gradient norm over ranks")
        if across is not None:
            sq = across(sq, dist.ReduceOp.SUM, "summing the global gradient norm over the stages")
        total = sq.sqrt()
        return self.transport.read(torch.clamp(self.clip_norm / (total + 1e-6), max=1.0))

    def _zero_norm(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32, device=self.device)

    @property
    def _sharded(self) -> bool:
        return self.dp is not None and self.dp.sharded

    def memory_report(self) -> dict:
        """Peak device memory since the relay was built (or the last reset_memory())."""
        return self.memory.report()

    def reset_memory(self) -> None:
        self.memory.reset()

    # -- evaluation and export -------------------------------------------------
    def export(self) -> Iterator[Exported]:
        """The model's tensors, layer by layer, by each layer's own names (its parameters, then its
        buffers): the trainable ones as fp32 master weights read from the EPS one group at a time
        (so this holds one group, however large the model), frozen parameters and buffers as the
        relay holds them. A parameter shared with an earlier layer (a tied embedding and head)
        comes with tensor None and `first` naming the (layer, name) that gave its values. Layers
        by the whole model's indices."""
        first: dict[tuple[str, str], tuple[int, str]] = {}  # EPS (group, name) -> its first (layer, name)
        key, group = None, {}
        for i, plan in enumerate(self.plans, self.first):
            for name, _ in plan.module.named_parameters():
                if name not in plan.bindings:
                    yield Exported(i, name, plan.frozen[name], (i, name))
                    continue
                binding = plan.bindings[name]
                if binding in first:
                    yield Exported(i, name, None, first[binding])
                    continue
                if binding[0] != key:
                    key, group = binding[0], self.eps.master(binding[0])
                first[binding] = (i, name)
                yield Exported(i, name, group[binding[1]], (i, name))
            for name, b in plan.buffers.items():
                yield Exported(i, name, b.detach().cpu(), (i, name))

    def materialize(self) -> nn.Sequential:
        """The trained model as an nn.Sequential on the CPU with the fp32 master weights (a new
        model: the relay's own modules hold no weights, only the structure); from export()."""
        model = copy.deepcopy(nn.Sequential(*self.layers))  # trainable parameters are on meta: cheap
        trained: dict[tuple[int, str], nn.Parameter] = {}
        for e in self.export():
            k = e.layer - self.first
            if e.name in self.plans[k].bindings:
                trained[(e.layer, e.name)] = trained[e.first] if e.tensor is None else nn.Parameter(e.tensor)
            elif e.name in self.plans[k].buffers:  # the relay's buffers, not the module's stale ones
                owner, _, leaf = e.name.rpartition(".")
                model[k].get_submodule(owner)._buffers[leaf] = e.tensor
        # by the meta tensor: a tensor under two names gets one Parameter
        made = {id(p): trained[(i, name)] for i, layer in enumerate(model, self.first)
                for name, p in layer.named_parameters() if (i, name) in trained}
        for layer in model:
            _replace_tensors(layer, lambda name, meta: made[id(meta)], lambda t: t.is_meta)
        return model

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The relay's state (EPS masters and optimizer state, module buffers) as copies."""
        return {name: tensor_of(e).clone() for name, e in self.state_entries().items()}

    def state_entries(self) -> dict[str, StateEntry]:
        """The same, read one tensor at a time: what a checkpoint streams to its file
        (`save_checkpoint(path, relay.state_entries(), meta)`) without a copy of the state."""
        state = {f"eps/{k}": v for k, v in self.eps.state_entries().items()}
        if self.dp is not None:  # gradient compression's state (a collective, as the sharded EPS's)
            state.update({f"dp/{k}": v for k, v in self.dp.state_entries().items()})
        for i, plan in enumerate(self.plans, self.first):
            state.update({f"buffers/{i}/{n}": StateEntry(b.shape, b.dtype, lambda b=b: b.detach().cpu())
                          for n, b in plan.buffers.items()})
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor | StateEntry]) -> None:
        """Load a state_dict, or a checkpoint's mapping (open_checkpoint(...).view(prefix)),
        one tensor at a time. Every name, shape and dtype is checked before anything is written."""
        if not isinstance(state, Mapping):
            raise TypeError(f"a relay state must be a mapping of name -> tensor (relay.state_dict()), "
                            f"got {type(state).__name__}")
        buffers = {f"buffers/{i}/{n}": b for i, plan in enumerate(self.plans, self.first)
                   for n, b in plan.buffers.items()}
        strays = sorted(k for k in state if not k.startswith(("eps/", "dp/")) and k not in buffers)
        strays += sorted(k for k in state if k.startswith("dp/") and self.dp is None)
        if strays:
            raise ValueError(f"the relay state has {len(strays)} entries this relay does not hold, e.g. "
                             f"{strays[:3]}; was it saved from another model?")
        for name, b in buffers.items():
            if name not in state:
                raise ValueError(f"the relay state has no buffer {name}; was it saved from another model?")
            if state[name].shape != b.shape or state[name].dtype != b.dtype:
                raise ValueError(f"the relay state's buffer {name} is {state[name].dtype} {tuple(state[name].shape)}; "
                                 f"this relay's is {b.dtype} {tuple(b.shape)}")
        if self.dp is not None:
            self.dp.load_state_dict({k[3:]: v for k, v in state.items() if k.startswith("dp/")})
        self.eps.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("eps/")})
        for name, b in buffers.items():
            b.copy_(tensor_of(state[name]))
