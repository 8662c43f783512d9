"""The pipeline's trace of the whole model on the meta device: per layer and micro-batch, the
shapes of what it returns (the stages size their receive buffers from it: no shape handshake)
and the random ops it runs.

Dropout: the single process draws its random numbers layer-major (layer 0 on every
micro-batch, then layer 1, ...). Every stage traces the random ops of the whole model once
per input shape (op, shape, dtype; no compute), replays the other layers' draws on its own
generator, and so sets the generator to the single process's state before each of its own
(layer, micro-batch) calls; after each call the state is checked against the trace's
prediction, so a layer drawing numbers the trace missed fails loudly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from l2l_hw.relay.links import PipelineError, Spec
from l2l_hw.relay.stage import flatten, unflatten


class RandomOp(NamedTuple):
    func: object  # an aten OpOverload tagged nondeterministic_seeded
    args: tuple  # tensors as (shape, dtype) specs
    kwargs: dict


def _specs(x):
    if isinstance(x, torch.Tensor):
        return Spec(x.shape, x.dtype)
    if isinstance(x, (tuple, list)):
        return type(x)(_specs(t) for t in x)
    return x


def _real(x, device):
    if isinstance(x, Spec):
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
    outputs: list[list[list[Spec]]]
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
            outputs[i].append([Spec(t.shape, t.dtype) for t in flatten(out)])
            single[i].append(isinstance(out, torch.Tensor))
            x = out
    return Trace(ops, outputs, single)


def replay(ops: list[RandomOp], device: torch.device) -> None:
    """Draw what `ops` draw, on fresh tensors of the same shapes: the generator advances as the layer's would."""
    for op in ops:
        op.func(*_real(op.args, device), **{k: _real(v, device) for k, v in op.kwargs.items()})


def same_rng(a, b) -> bool:
    return torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))
