"""--measure: the step time, from one layer of each kind timed on real tensors as the relay runs
it (forward, recompute, backward per micro-batch) and the EPS's update per parameter."""
from __future__ import annotations

import copy
import math
import time

import torch
from torch import nn

from l2l_hw.estimate.trace import layer_signature, micro_sizes, run_model
from l2l_hw.relay.recompute import KeepGraphs, grad_leaf
from l2l_hw.relay.stage import flatten, layer_output, to_float
from l2l_hw.relay.stash import ActivationStash
from l2l_hw.relay.transport import Transport, torch_device


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
        key = (layer_signature(layer), last, tuple((t.shape, t.dtype) for t in flatten(x)))
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
