"""`l2l bench relay`: time per step and peak memory of the relay against PyTorch, policy by policy.

Each recompute policy of the relay meets the PyTorch training that keeps the same things
for its backward, on the same GPT (built with the same seed), minibatch and AdamW:

    none       the relay keeps each layer's forward graph   vs plain PyTorch
    full       it runs each layer's forward again           vs PyTorch checkpointing every block
    selective  it runs again all but matmuls and attention  vs PyTorch's selective activation
                                                              checkpointing of every block, same policy

PyTorch runs the whole minibatch at once with torch.optim.AdamW (fused on CUDA, foreach on
the CPU); the relay runs it in 4 micro-batches (--micro-batches) with its CPU EPS, through
l2l_hw.train as a user would. With more than one micro-batch, plain PyTorch also runs in the
relay's micro-batches (gradient accumulation): the cost of the smaller GEMMs by themselves.
--precision bf16 runs the relay in bf16 (its EPS keeps fp32 masters and writes the bf16 working
copy) and PyTorch under bf16 autocast (fp32 weights: PyTorch's own recipe). The relay sums each
layer's gradient over its micro-batches in fp32; beside it, taking turns in the same run, the
same relay summing in bf16 (grad_sums="compute"): fp32_sums_cost = the first's step time over
the second's.
Warm-up steps are not timed; the six take turns step by step
(l2l_hw/bench/timer.py), and each figure is the median of its timed steps. ratio = relay
step time / its PyTorch partner's.

Peak memory: the most bytes torch's allocator held above the step's start during one
more step of each (torch.profiler's memory events): activations, and the weights and
gradients a step allocates (all of PyTorch's gradients; the relay's one or two layers).

--contention runs the same turns again with one busy process beside them (a Python loop
on one core) and reports each one's slowdown, and each policy's relay slowdown over its
partner's.

--budgets times the relay with an activation budget (planned recompute) at 30, 60 and 90%
of the way from what "full" keeps for the backward to what "none" keeps (the relay's
accounting of kept activations, measured in a first step of each), beside "full" and
"none", taking turns; with each, its plan and the kept activations' peak.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from functools import partial

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import l2l_hw
from l2l_hw.bench import print_report, train_steps
from l2l_hw.bench.timer import round_robin
from l2l_hw.models import Corpus, GPTConfig, build_gpt, lm_loss
from l2l_hw.relay.recompute import save_matmuls_and_attention

# Big enough that compute, not Python overhead, dominates a step; small enough that the
# bench stays within a few minutes on 2 CPU cores.
MODEL = GPTConfig(n_layer=6, n_embd=256, n_head=8, block_size=128)
BATCH_SIZE, MICRO_BATCHES = 32, 4
PAIRS = {"none": "plain", "full": "checkpointed", "selective": "selective"}  # relay policy -> PyTorch partner
WARMUP_STEPS = 1
LR, SEED = 1e-3, 0


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _torch_trainer(x, y, device: torch.device, keeps: str, micro_batches: int = 1, precision: str = "fp32"):
    """A PyTorch step: `keeps` plain, checkpointed (every block) or selective (every block, SAC);
    over `micro_batches` with gradient accumulation (the relay's GEMM sizes), or the whole minibatch;
    bf16: forward and loss under bf16 autocast."""
    torch.manual_seed(SEED)
    model = build_gpt(MODEL).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    x, y = x.to(device), y.to(device)
    embedding, blocks, head = model[0], list(model)[1:-1], model[-1]
    contexts = partial(create_selective_checkpoint_contexts, save_matmuls_and_attention)
    autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def block(b, h):
        if keeps == "plain":
            return b(h)
        if keeps == "checkpointed":
            return checkpoint(b, h, use_reentrant=False)
        return checkpoint(b, h, use_reentrant=False, context_fn=contexts)

    def step() -> float:
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            with autocast():
                h = embedding(xs)
                for b in blocks:
                    h = block(b, h)
                loss = lm_loss(head(h), ys) * (len(xs) / len(x))
            loss.backward()
        opt.step()
        _sync(device)
        return time.perf_counter() - t0

    return step


def _relay(device: torch.device, micro_batches: int = MICRO_BATCHES, **options) -> l2l_hw.Relay:
    torch.manual_seed(SEED)
    eps = l2l_hw.make_eps("cpu", optimizer="adamw", lr=LR)
    return l2l_hw.Relay(build_gpt(MODEL), lm_loss, eps=eps, device=str(device), micro_batches=micro_batches, **options)


def _relay_trainer(x, y, device: torch.device, recompute: str, micro_batches: int, precision: str = "fp32",
                   **options):
    relay = _relay(device, micro_batches, recompute=recompute, precision=precision, **options)
    return lambda: train_steps(relay, [(x, y)], 1)[0]  # the float loss waits for the device


def planned(x, y, device: torch.device, steps: int, precision: str = "fp32") -> dict:
    """Step time and kept activations under three activation budgets, with full and none."""
    relays = {policy: _relay(device, recompute=policy, precision=precision, account_memory=True)
              for policy in ("full", "none")}
    kept = {}
    for policy, relay in relays.items():
        train_steps(relay, [(x, y)], 1)
        kept[policy] = relay.memory_report()["kept_activation_peak_bytes"]
    for share in (0.3, 0.6, 0.9):
        budget = int(kept["full"] + share * (kept["none"] - kept["full"]))
        relays[f"budget_{budget}"] = relay = _relay(device, activation_budget=budget, precision=precision,
                                                      account_memory=True)
        train_steps(relay, [(x, y)], 1)  # the plan is made in the first step
    for relay in relays.values():
        relay.reset_memory()
    times = round_robin({name: lambda r=r: train_steps(r, [(x, y)], 1)[0] for name, r in relays.items()}, steps, 0,
                        self_timed=True)
    return {name: {"step_s": statistics.median(times[name]), "budget_bytes": r.options.activation_budget,
                   "kept_peak_bytes": r.memory_report()["kept_activation_peak_bytes"],
                   "plan": r.keep.plan if r.options.activation_budget else None}
            for name, r in relays.items()}


def _peak_bytes(step, device: torch.device) -> int:
    """The most bytes the allocator held above the start of one `step`."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        return torch.cuda.max_memory_allocated(device) - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


class _BusyNeighbour:
    """One process spinning on a core while the block runs."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)  # let it reach the scheduler's steady state
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def run(steps: int = 5, device: str = "cpu", contention: bool = False, budgets: bool = False,
        micro_batches: int = MICRO_BATCHES, precision: str = "fp32") -> dict:
    dev = torch.device(device)
    x, y = Corpus.load().batch("train", BATCH_SIZE, MODEL.block_size, torch.Generator().manual_seed(SEED))
    tokens = BATCH_SIZE * MODEL.block_size
    trainers = {}
    for policy, keeps in PAIRS.items():
        trainers[f"torch_{keeps}"] = _torch_trainer(x, y, dev, keeps, precision=precision)
        trainers[f"relay_{policy}"] = _relay_trainer(x, y, dev, policy, micro_batches, precision)
        if micro_batches > 1:  # the partner at the relay's GEMM sizes: what the micro-batches cost by themselves
            trainers[f"torch_{keeps}_accumulating"] = _torch_trainer(x, y, dev, keeps, micro_batches, precision)
        if precision != "fp32":  # the same relay summing its gradients in bf16: what the fp32 sums cost
            trainers[f"relay_{policy}_compute_sums"] = _relay_trainer(x, y, dev, policy, micro_batches, precision,
                                                                      grad_sums="compute")
    # each trainer returns its step's own seconds (train()'s, or synchronized with the device)
    quiet = round_robin(trainers, steps, WARMUP_STEPS, self_timed=True)
    median = {name: statistics.median(t) for name, t in quiet.items()}
    report = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "model": {"n_layer": MODEL.n_layer, "n_embd": MODEL.n_embd, "n_head": MODEL.n_head,
                  "block_size": MODEL.block_size, "batch_size": BATCH_SIZE, "micro_batches": micro_batches,
                  "precision": precision,
                  "params": sum(p.numel() for p in build_gpt(MODEL).parameters())},
        "steps": steps, "warmup_steps": WARMUP_STEPS, "pairs": {},
    }
    peak = {name: _peak_bytes(step, dev) for name, step in trainers.items()}
    if contention:
        with _BusyNeighbour():
            busy = round_robin(trainers, steps, 0, self_timed=True)
        slowed = {name: statistics.median(t) / median[name] for name, t in busy.items()}
    for policy, keeps in PAIRS.items():
        relay, partner = f"relay_{policy}", f"torch_{keeps}"
        pair = {"partner": keeps, "relay_step_s": median[relay], "torch_step_s": median[partner],
                "relay_tokens_per_s": tokens / median[relay], "torch_tokens_per_s": tokens / median[partner],
                "ratio": median[relay] / median[partner], "relay_peak_bytes": peak[relay],
                "torch_peak_bytes": peak[partner], "ratio_to_plain": median[relay] / median["torch_plain"]}
        if contention:
            pair.update(relay_slowdown=slowed[relay], torch_slowdown=slowed[partner],
                        slowdown_ratio=slowed[relay] / slowed[partner])
        report["pairs"][policy] = pair
        if micro_batches > 1:
            pair.update(torch_accumulating_step_s=median[f"{partner}_accumulating"],
                        ratio_to_accumulating=median[relay] / median[f"{partner}_accumulating"])
        if precision != "fp32":
            pair.update(compute_sums_step_s=median[f"{relay}_compute_sums"],
                        fp32_sums_cost=median[relay] / median[f"{relay}_compute_sums"])
    report["torch_plain_peak_bytes"] = peak["torch_plain"]
    if budgets:
        report["planned"] = planned(x, y, dev, steps, precision)
    return report


def format_report(r: dict) -> str:
    m = r["model"]
    lines = [f"relay vs PyTorch on {r['device']}: {m['n_layer']} layers x {m['n_embd']}, context {m['block_size']}, "
             f"batch {m['batch_size']}, relay in {m['micro_batches']} micro-batches ({m['params'] / 1e6:.1f} M params), "
             f"{m['precision']}, median of {r['steps']} steps",
             f"  {'relay':<12}{'PyTorch':<14}{'relay s':>9}{'torch s':>9}{'ratio':>7}{'/plain':>8}"
             f"{'relay MB':>10}{'torch MB':>10}"]
    contention = "slowdown_ratio" in next(iter(r["pairs"].values()))
    if contention:
        lines[-1] += f"{'slowed':>8}{'torch':>7}{'ratio':>7}"
    for policy, p in r["pairs"].items():
        line = (f"  {policy:<12}{p['partner']:<14}{p['relay_step_s']:>9.3f}{p['torch_step_s']:>9.3f}{p['ratio']:>7.2f}"
                f"{p['ratio_to_plain']:>8.2f}{p['relay_peak_bytes'] / 1e6:>10.1f}{p['torch_peak_bytes'] / 1e6:>10.1f}")
        if contention:
            line += f"{p['relay_slowdown']:>8.2f}{p['torch_slowdown']:>7.2f}{p['slowdown_ratio']:>7.2f}"
        lines.append(line)
    for policy, p in r["pairs"].items():
        if "ratio_to_accumulating" in p:
            lines.append(f"  {policy:<12}{p['partner'] + ', in ' + str(m['micro_batches']) + ' micro-batches':<28}"
                         f"torch {p['torch_accumulating_step_s']:.3f} s, ratio {p['ratio_to_accumulating']:.2f}")
    for policy, p in r["pairs"].items():
        if "fp32_sums_cost" in p:
            lines.append(f"  {policy:<12}gradients summed in fp32 {p['relay_step_s']:.3f} s, in {m['precision']} "
                         f"{p['compute_sums_step_s']:.3f} s: {p['fp32_sums_cost']:.3f}x")
    for name, p in r.get("planned", {}).items():
        plan = "" if p["plan"] is None else " ".join(f"{i}:{v}" for i, v in p["plan"].items())
        lines.append(f"  planned {name:<18}{p['step_s']:>9.3f} s, kept {p['kept_peak_bytes'] / 1e6:.1f} MB  {plan}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant, after warm-up (default 5)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--contention", action="store_true",
                   help="also run every variant beside one busy process and report the slowdowns")
    p.add_argument("--budgets", action="store_true",
                   help="also time the relay under three activation budgets (planned recompute)")
    p.add_argument("--micro-batches", type=int, default=MICRO_BATCHES,
                   help=f"the relay's micro-batches (default {MICRO_BATCHES}; PyTorch runs the whole minibatch)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="the relay's precision; PyTorch runs bf16 under autocast (default fp32)")


def run_from_args(args) -> int:
    if args.micro_batches < 1 or BATCH_SIZE % args.micro_batches:
        raise SystemExit(f"l2l bench relay: --micro-batches {args.micro_batches}: must divide the batch of {BATCH_SIZE}")
    return print_report(run(steps=args.steps, device=args.device, contention=args.contention, budgets=args.budgets,
                            micro_batches=args.micro_batches, precision=args.precision), args.json, format_report)
