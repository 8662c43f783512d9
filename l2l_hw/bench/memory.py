"""`l2l bench memory`: peak device memory against depth.

Four ways to train the same GPT (fixed width and batch) at depths 6, 12, 24, 48:
plain PyTorch, PyTorch with activation checkpointing of every block, and the relay
with "device" and "host" activations. On CUDA every figure is the caching
allocator's peak. On the CPU there is no device, so every figure counts the bytes a
device would hold, storage by storage (`relay.memory.DeviceMemory`): for PyTorch the
parameters, their gradients, AdamW's m and v, the batch and every tensor autograd
saves (checkpointing: each block's input, plus one block's saved tensors during its
recompute); for the relay its own accounting (the EPS keeps weights and state in host
memory).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

import l2l_hw
from l2l_hw.bench import print_report, train_steps
from l2l_hw.models import GPTConfig, build_gpt, lm_loss
from l2l_hw.relay.memory import DeviceMemory

DEPTHS = (6, 12, 24, 48)
WIDTH, HEADS, CONTEXT, BATCH, MICRO_BATCHES = 128, 4, 128, 16, 4


def _batch(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (BATCH, CONTEXT), generator=g)
    return x.to(device), torch.randint(0, 256, (BATCH, CONTEXT), generator=g).to(device)


def _model(depth, device):
    torch.manual_seed(0)
    return build_gpt(GPTConfig(n_layer=depth, n_embd=WIDTH, n_head=HEADS, block_size=CONTEXT)).to(device)


def torch_peak(depth: int, device: torch.device, use_checkpoint: bool) -> int:
    model = _model(depth, device)
    x, y = _batch(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = DeviceMemory(device, account=True)
    params = list(model.parameters())
    blocks = list(model)[1:-1]

    def state():
        return [opt.state[p] for p in params if p in opt.state]

    for _ in range(2):  # the second step runs with AdamW's state allocated
        meter.reset()
        opt.zero_grad(set_to_none=True)
        block_inputs = []
        with meter.saving():
            h = model[0](x)
            for block in blocks:
                if use_checkpoint:
                    block_inputs.append(h)
                    h = checkpoint(block, h, use_reentrant=False)
                else:
                    h = block(h)
            loss = lm_loss(model[-1](h), y)
        meter.sample(params, state(), x, y, block_inputs)
        if use_checkpoint:  # the backward recomputes one block at a time
            with meter.saving():
                blocks[-1](block_inputs[-1])
            meter.sample(params, state(), x, y, block_inputs)
        meter.drop_saved()
        loss.backward()
        meter.sample(params, state(), x, y, [p.grad for p in params])
        opt.step()
        meter.sample(params, state(), x, y, [p.grad for p in params])
    return meter.report()["peak_bytes"]


def relay_peak(depth: int, device: torch.device, activations: str) -> int:
    relay = l2l_hw.Relay(_model(depth, "cpu"), lm_loss, eps=l2l_hw.make_eps("cpu"), device=str(device),
                         micro_batches=MICRO_BATCHES, activations=activations, account_memory=True)
    batch = _batch(device)
    train_steps(relay, [batch], 1)
    relay.reset_memory()  # the second step runs with the EPS state allocated
    train_steps(relay, [batch], 1)
    return relay.memory_report()["peak_bytes"]


def run(device: str = "cpu", depths=None) -> dict:
    dev, depths = torch.device(device), depths or DEPTHS
    rows = {}
    for depth in depths:
        rows[depth] = {
            "pytorch": torch_peak(depth, dev, use_checkpoint=False),
            "pytorch_checkpoint": torch_peak(depth, dev, use_checkpoint=True),
            "relay_device": relay_peak(depth, dev, "device"),
            "relay_host": relay_peak(depth, dev, "host"),
        }
    lo, hi = min(depths), max(depths)
    return {
        "device": str(dev), "source": "cuda allocator" if dev.type == "cuda" else "device-byte accounting",
        "model": {"width": WIDTH, "heads": HEADS, "context": CONTEXT, "batch": BATCH, "micro_batches": MICRO_BATCHES},
        "peak_bytes": {str(d): r for d, r in rows.items()},
        "host_growth": rows[hi]["relay_host"] / rows[lo]["relay_host"],
        "reduction_vs_pytorch": 1 - rows[hi]["relay_host"] / rows[hi]["pytorch"],
    }


def format_report(r: dict) -> str:
    names = ["pytorch", "pytorch_checkpoint", "relay_device", "relay_host"]
    lines = [f"peak device memory (MiB) on {r['device']} ({r['source']})",
             f"  {'depth':>5}" + "".join(f"{n:>20}" for n in names)]
    for depth, row in r["peak_bytes"].items():
        lines.append(f"  {depth:>5}" + "".join(f"{row[n] / 2**20:>20.1f}" for n in names))
    lines.append(f"host_growth {r['host_growth']:.3f}   reduction_vs_pytorch {r['reduction_vs_pytorch']:.3f}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")


def run_from_args(args) -> int:
    return print_report(run(device=args.device), args.json, format_report)
