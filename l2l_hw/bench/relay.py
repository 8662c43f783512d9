"""`l2l bench relay`: time per step of the relay against plain PyTorch.

Both train the same GPT (built with the same seed) on the same minibatch with
AdamW. PyTorch runs the whole minibatch at once with torch.optim.AdamW
(fused on CUDA, foreach on the CPU); the relay runs it layer by layer in
u = 1, 4, 8 micro-batches with recompute (the constant-memory default), and at
u = 4 without recompute (each layer's forward graph kept). Warm-up steps are not timed; the variants take
turns step by step, and each figure is the median of its timed steps.
ratio = relay step time / PyTorch step time.
"""
import statistics
import time

import torch

import l2l_hw
from l2l_hw.bench import print_report, train_steps
from l2l_hw.bench.timer import round_robin
from l2l_hw.models import Corpus, GPTConfig, build_gpt, lm_loss

# Big enough that compute, not Python overhead, dominates a step; small enough
# that the whole bench stays under ~2 minutes on 2 CPU cores.
MODEL = GPTConfig(n_layer=6, n_embd=256, n_head=8, block_size=128)
BATCH_SIZE = 32
MICRO_BATCHES = (1, 4, 8)
NO_RECOMPUTE = "u4_no_recompute"
WARMUP_STEPS = 1
LR, SEED = 1e-3, 0


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _torch_trainer(x, y, device: torch.device):
    torch.manual_seed(SEED)
    model = build_gpt(MODEL).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    x, y = x.to(device), y.to(device)

    def step() -> float:
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        opt.step()
        _sync(device)
        return time.perf_counter() - t0

    return step


def _relay_trainer(x, y, micro_batches: int, device: torch.device, recompute: bool = True):
    torch.manual_seed(SEED)
    eps = l2l_hw.make_eps("cpu", optimizer="adamw", lr=LR)
    relay = l2l_hw.Relay(build_gpt(MODEL), lm_loss, eps=eps, device=str(device), micro_batches=micro_batches,
                         recompute=recompute)
    return lambda: train_steps(relay, [(x, y)], 1)[0]  # the float loss waits for the device


def run(steps: int = 5, device: str = "cpu") -> dict:
    dev = torch.device(device)
    x, y = Corpus.load().batch("train", BATCH_SIZE, MODEL.block_size, torch.Generator().manual_seed(SEED))
    tokens = BATCH_SIZE * MODEL.block_size
    trainers = {"torch": _torch_trainer(x, y, dev)}
    trainers.update({f"u{u}": _relay_trainer(x, y, u, dev) for u in MICRO_BATCHES})
    trainers[NO_RECOMPUTE] = _relay_trainer(x, y, 4, dev, recompute=False)
    # each trainer returns its step's own seconds (train()'s, or synchronized with the device)
    times = round_robin(trainers, steps, WARMUP_STEPS, self_timed=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    torch.manual_seed(SEED)
    report = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "model": {"n_layer": MODEL.n_layer, "n_embd": MODEL.n_embd, "n_head": MODEL.n_head,
                  "block_size": MODEL.block_size, "batch_size": BATCH_SIZE,
                  "params": sum(p.numel() for p in build_gpt(MODEL).parameters())},
        "steps": steps, "warmup_steps": WARMUP_STEPS,
        "torch_step_s": median["torch"], "torch_tokens_per_s": tokens / median["torch"],
    }
    for name in [f"u{u}" for u in MICRO_BATCHES] + [NO_RECOMPUTE]:
        s = median[name]
        report[name] = {"step_s": s, "tokens_per_s": tokens / s, "ratio": s / median["torch"]}
    return report


def format_report(r: dict) -> str:
    m = r["model"]
    lines = [f"relay vs PyTorch on {r['device']}: {m['n_layer']} layers x {m['n_embd']}, context {m['block_size']}, "
             f"batch {m['batch_size']} ({m['params'] / 1e6:.1f} M params), median of {r['steps']} steps",
             f"  {'':<24}{'step s':>10}{'tokens/s':>12}{'ratio':>8}",
             f"  {'pytorch':<24}{r['torch_step_s']:>10.3f}{r['torch_tokens_per_s']:>12,.0f}{1.0:>8.2f}"]
    for name, label in [(f"u{u}", f"relay u={u}") for u in MICRO_BATCHES] + [(NO_RECOMPUTE, "relay u=4, no recompute")]:
        v = r[name]
        lines.append(f"  {label:<24}{v['step_s']:>10.3f}{v['tokens_per_s']:>12,.0f}{v['ratio']:>8.2f}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant, after warm-up (default 5)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")


def run_from_args(args) -> int:
    return print_report(run(steps=args.steps, device=args.device), args.json, format_report)
