"""The training loop: one TrainConfig, the relay built from it, and train().

    cfg = TrainConfig(steps=200, out="runs/latest")
    result = train(cfg)                                  # the reference byte-level GPT
    result = train(cfg, layers=my_layers, loss_fn=my_loss, data=my_batches, val_data=my_val)
    result = train(cfg, relay=relay, data=my_batches)    # a relay built elsewhere (finetuning)

train() runs `cfg.steps` relay steps on the batches of `data` (an iterable of
(inputs, targets) global minibatches; under torchrun each rank cuts its own shard),
and every `cfg.eval_interval` steps and at the end validates on `val_data` and writes an
atomic checkpoint into `cfg.out`, after that step's metrics row. `cfg.resume`
continues from that checkpoint bit-exactly: master weights, optimizer state, every
RNG state and the data position (the data's own `state_dict()` when it has one,
else the first `step` batches of a fresh pass are skipped). It returns a TrainResult:
the relay, the metrics rows (the `history`, also handed to each callback as it is
made) and the last validation loss.

Files in `cfg.out` (rank 0 only; nothing when out is None):
  metrics.jsonl            one JSON object per step (step, loss, lr, tokens_per_s,
                           elapsed; val_loss and val_perplexity at eval points);
                           tokens_per_s and val_perplexity where the loss is a cross
                           entropy over tokens (over_tokens), else samples_per_s
  loss.png                 train and validation loss curves
  checkpoint.safetensors   relay state, config and every RNG state (l2l_hw.checkpoint)
  tensorboard/             event files, with cfg.tensorboard (torch.utils.tensorboard)
  tokens/, model/          l2l_hw.finetune.finetune() (l2l_hw/finetune.py): the tokenized
                           data (finetune_data.tokenize_text's cache), the model for
                           transformers (hf.save_replacing)
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, NoReturn

import torch

from l2l_hw import hf
from l2l_hw.checkpoint import (Checkpoint, CheckpointError, open_checkpoint, remove_stale_temporaries, run_meta,
                               save_checkpoint, temporary_beside)
from l2l_hw.distributed import (Ranks, close_all, failed_ranks, guarded, join_torchrun, rank_and_world, rank_body,
                                rank_shard, stage_groups)
from l2l_hw.eps import make_eps
from l2l_hw.eps.base import STATE_SLOTS
from l2l_hw.eps.disk_store import held_state, remove_state, state_bytes
from l2l_hw.eps.options import LAMB_LR, EpsOptions, ScheduleOptions
from l2l_hw.estimate import check_fits, eps_bytes_per_parameter, measure_step, run_model
from l2l_hw.models import Corpus, GPTConfig, build_gpt, generate, lm_loss
from l2l_hw.models.gpt import build_gpt_meta
from l2l_hw.models.gpt import ModelOptions
from l2l_hw.options import OptionError, check_options, fail, option, pick, with_default
from l2l_hw.relay import Relay, RelayOptions, init_from_state
from l2l_hw.relay.device_share import (DEVICE_BYTES_PER_PARAMETER, SharePlan, device_free_bytes,
                                       plan_device_share, share_problem, time_device_update)
from l2l_hw.relay.schedule import Schedule
from l2l_hw.relay.stage import registered_groups
from l2l_hw.relay.transport import torch_device
from l2l_hw.relay.options import PipelineConfig, PipelineOptions

CHECKPOINT, METRICS, PLOT, TENSORBOARD = "checkpoint.safetensors", "metrics.jsonl", "loss.png", "tensorboard"
MODEL = "model"  # a fine-tune's (l2l_hw/finetune.py): the Hugging Face folder it saves
EVAL_BATCHES = 4  # validation minibatches per eval point of the reference corpus; the same windows every time
RUN_FILES = (CHECKPOINT, METRICS, PLOT, TENSORBOARD)  # what a run writes into out: an earlier run is these
EVENT_FILES = "events.out.tfevents.*"  # the names SummaryWriter gives its files in out/tensorboard
MAX_DISCARDED = 100  # steps discarded in a row (non-finite) before the run stops: fp16's scale needs <= 24
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A second signal of the same kind this soon after the first is the same request: under torchrun
# a Ctrl-C reaches each rank twice, from the terminal and forwarded by the agent (milliseconds apart).
REPEAT_S = 1.0
SAMPLE_PROMPT, SAMPLE_BYTES = b"def ", 200
# What --resume may change: the step target (a longer one also stretches a cosine schedule)
# and where the run happens (the device share of the update among it: its state is checkpointed
# alike). Every other field of the run is the checkpoint's.
RESUME_MAY_CHANGE = ("steps", "device", "eps_backend", "shard_state", "model", "device_update_layers")


class ConfigError(OptionError):
    """A TrainConfig value, or a file or checkpoint the run needs, cannot be used; the message says
    which. With `field`: "field=value: what is allowed" (the CLI names the flag instead)."""

    def __init__(self, message: str, field: str | None = None, value=None):
        super().__init__(f"{field}={value!r}: {message}" if field else message, field, value, message)


class NonFiniteLoss(RuntimeError):
    """A step's loss was not finite and the step was taken: the weights are no longer usable.
    The run stopped before its next checkpoint, so the last one on disk is from before."""


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run at a step boundary, after a checkpoint of that step
    (when the run writes files). `signal` is the signal's number, `step` the step reached."""

    def __init__(self, signum: int, step: int, saved: bool, where: str = ""):
        self.signal, self.step, self.saved = signum, step, saved
        super().__init__(f"interrupted{where} at step {step}" + ("; resume with --resume" if saved else ""))


@dataclass(frozen=True)
class DataOptions:
    """What the run trains on: the text, cut into minibatches of sequences."""

    data: str | None = option(None, {"train": "the text to train on: a file or a folder (default: this Python's "
                                       "stdlib sources)",
                                       "finetune": "the text to fine-tune on: a UTF-8 text file, a JSON Lines file, a "
                                       "folder of text files (each a document) or a datasets dataset (save_to_disk's "
                                       "folder)"},
                              kind="path", metavar="PATH", required_in=("finetune",))
    val_data: str | None = option(None, "data to validate on, read as --data is (default: a tenth of --data's "
                                  "minibatches, held out)", kind="path", metavar="PATH", commands=("finetune",))
    doc_separator: str | None = option(None, "a line that separates documents in --data: each is ended by the "
                                       "end-of-text token (default: the text as one stream, as run_clm reads it)",
                                       kind="text", metavar="LINE", commands=("finetune",))
    text_field: str | None = option(None, "--data is JSON Lines (or a datasets dataset): each object's text in this "
                                    "field (column) is a document (default for a .jsonl file or a dataset: text)",
                                    kind="text", metavar="NAME", commands=("finetune",))
    chat: bool = option(False, "--data holds conversations, {\"messages\": [{\"role\": ..., \"content\": ...}]} a "
                        "line (or a datasets column messages), rendered by the tokenizer's chat template; the loss "
                        "counts the assistant's tokens only", kind="bool", commands=("finetune",))
    context: int = option(GPTConfig.block_size, {"train": "bytes per sequence (the reference GPT reads bytes)",
                                                 "finetune": "tokens per sequence"}, kind="int", low=1)
    batch_size: int = option(32, "sequences per minibatch", kind="int", low=1)
    seed: int = option(1337, "seeds the weights, dropout and batches", kind="int", low=0, high=2**63, high_open=True)

    def __post_init__(self):
        check_options(self)


@dataclass(frozen=True)
class RunOptions:
    """Validation, checkpoints, the output folder and the run's control."""

    eval_every: int | None = option(None, "steps between validation and checkpoint (default: a tenth of --steps)",
                                    kind="int", low=1)
    model: str | None = option(None, "the Hugging Face model folder (config, safetensors, tokenizer)", kind="path",
                               metavar="DIR", commands=("finetune",), required_in=("finetune",))
    weights: str = option("pretrained", "where the model's weights start: pretrained (--model's safetensors), or "
                          "random (drawn from its config.json as transformers initializes a new model, one layer at a "
                          "time: a folder without weights, to try a model's shape on this machine)", kind="choice",
                          choices=hf.WEIGHTS, commands=("finetune",))
    out: str | None = option("runs/latest", "output folder (Python: None writes nothing)", kind="path",
                             optional=True, command_defaults={"finetune": "runs/finetune"})
    resume: bool = option(False, "continue exactly from --out's checkpoint and metrics", kind="bool")
    overwrite: bool = option(False, "replace the run already in --out (its checkpoint, metrics, plot); without it, "
                             "or --resume, an --out that holds a run is refused", kind="bool")
    stop_after: int | None = option(None, "checkpoint and stop at this step, keeping --steps as the schedule's length",
                                    kind="int", low=1, metavar="STEP")
    save_every: int | None = option(None, "steps between saves of the Hugging Face folder --out/model during training "
                                    "(each replaces the last whole; it is always saved at the end)", kind="int", low=1,
                                    metavar="STEPS", commands=("finetune",))
    prompt: str | None = option(None, "at each evaluation and at the end, print the model's greedy continuation of "
                                f"this text ({hf.SAMPLE_TOKENS} tokens; the weights are gathered on the CPU for it)",
                                kind="text", metavar="TEXT", commands=("finetune",),
                                check=lambda text: "must not be empty" if not text.strip() else None)
    tensorboard: bool = option(False, "also write the metrics as TensorBoard event files into --out/tensorboard",
                               kind="bool")
    save: bool = option(True, "write no checkpoint and no --out/model (save=False from Python), only metrics.jsonl, "
                        "loss.png and TensorBoard: a trial of speed or memory, which needs no disk for the state and "
                        "cannot be resumed", kind="bool", flag="--no-save")
    remove_state_dir: bool = option(False, "remove --state-dir's files once the run has finished and written its final "
                                    "checkpoint, which holds all of the state (without it the end line says where "
                                    "the folder is, its size, and that it may be deleted)", kind="bool")
    dist_timeout: float = option(300.0, "under torchrun: how long a rank waits for the others (a pipeline stage for its "
                                 "neighbours) before failing",
                                 kind="float", low=0.0, low_open=True, metavar="SECONDS")
    verbose: bool = option(True, "banner, progress bar, summary (and a sample of the reference GPT)", kind="bool",
                           cli=False)  # the command line always reports

    def __post_init__(self):
        check_options(self)
        if self.resume and self.overwrite:
            fail("overwrite", True, "replaces the run in out, resume continues it: give one of them")
        if not self.save:
            for name in ("resume", "stop_after", "save_every"):
                if getattr(self, name):
                    fail("save", False, f"writes no checkpoint or model, which {name} needs: give one of them")


COMPONENTS = (ModelOptions, DataOptions, ScheduleOptions, EpsOptions, RelayOptions, PipelineOptions, RunOptions)


@dataclass(frozen=True)
class TrainConfig(RunOptions, PipelineOptions, RelayOptions, EpsOptions, ScheduleOptions, DataOptions, ModelOptions):
    """One training run: the options of each component (COMPONENTS), each declared once in its own
    dataclass, with `l2l train`'s defaults: the reference GPT on the stdlib corpus.

    The default run: 0.9 M parameters, 4096 tokens a step, 200 steps. Measured with the
    relay on 2 CPU cores shared with other jobs: 250 steps took 147 s (val loss 2.22); 300
    steps at batch 16 reached 2.39 (lr 3e-3) and 2.52 (lr 6e-3). 200 steps keep the run
    inside 1 to 3 minutes with room for a slower machine.
    """

    micro_batches: int = with_default(RelayOptions, "micro_batches", 4)  # the relay's own default is 1

    def __post_init__(self):
        try:
            for component in COMPONENTS:
                component.__post_init__(self)
            if self.micro_batches > self.batch_size:
                fail("micro_batches", self.micro_batches, f"must be at most batch_size ({self.batch_size})")
            if self.min_lr is not None and self.min_lr > self.lr:
                fail("min_lr", self.min_lr, f"must be at most lr ({self.lr})")
            if self.delay_compensation != "none" and not self.stale_weights:
                fail("delay_compensation", self.delay_compensation, "corrects the weights PipeDream-2BW computes on, "
                     "one step stale; this run computes on the newest (flush, or no pipeline): give --pipeline-stages 2 "
                     "or more with --pipeline-schedule 2bw (or --pipedream-2bw), or drop it")
            if self.device_update_layers and (self.pipeline_stages > 1 or self.stale_weights):
                fail("device_update_layers", self.device_update_layers, "is the relay's, on the newest weights: a "
                     "pipeline's stages and PipeDream-2BW keep every update on the host; give 0 or drop it")
            if self.pipeline_stages > 1 and self.grad_compression != "none":
                fail("grad_compression", self.grad_compression, "compresses the gradient all-reduce of data "
                     f"parallelism, and a pipeline (pipeline_stages {self.pipeline_stages}) has none: drop it")
        except OptionError as e:
            raise ConfigError(e.rule, e.field, e.value) from None

    def run_config(self) -> dict:
        """The fields that define the run's numbers: saved in the checkpoint, compared on resume.
        A fine-tuning run also records its model's config fingerprint."""
        cfg = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in CONTROL_FIELDS}
        cfg["warmup"] = self.warmup_steps
        for name in ("data", "model", "val_data"):
            cfg[name] = str(Path(cfg[name]).expanduser().resolve()) if cfg[name] else None
        if self.model is not None:
            from l2l_hw.hf import config_fingerprint

            cfg[FINGERPRINT] = config_fingerprint(self.model)
        return cfg

    def model_config(self) -> GPTConfig:
        return self.gpt_config(self.context)

    @property
    def stale_weights(self) -> bool:
        """Each step computes on the weights one step stale: PipeDream-2BW, as a pipeline's schedule or
        the single process's mode."""
        return self.pipedream_2bw or (self.pipeline_stages > 1 and self.pipeline_schedule == "2bw")

    @property
    def eval_interval(self) -> int:
        """Steps between validations and checkpoints: eval_every, or a tenth of the run."""
        return self.eval_every or max(1, self.steps // 10)

    def pipeline_config(self) -> PipelineConfig:
        """The pipeline of the run (--pipeline-*): a stage waits for a neighbour as long as a rank
        waits for the others (--dist-timeout)."""
        return self.unprefixed(timeout_s=self.dist_timeout)


CONTROL_FIELDS = ("out", "resume", "overwrite", "stop_after", "tensorboard", "save", "verbose", "overlay", "kernel",
                  "state_dir", "remove_state_dir", "dist_timeout", "save_every", "prompt")
FINGERPRINT = "model_fingerprint"  # in a fine-tuning run's saved config: l2l_hw.hf.config_fingerprint


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def resume_config(out: str | os.PathLike, **given) -> TrainConfig:
    """The config of the run checkpointed in `out`, with `given` fields: those of
    RESUME_MAY_CHANGE and the control fields may differ, any other must agree."""
    meta = open_checkpoint(Path(out) / CHECKPOINT).meta
    saved = _saved_config(meta, Path(out) / CHECKPOINT)
    for name in ("data", "model", "val_data"):  # as the checkpoint holds them
        if given.get(name):
            given[name] = str(Path(given[name]).expanduser().resolve())
    clash = {k: v for k, v in given.items() if k in saved and k not in RESUME_MAY_CHANGE and v != saved[k]}
    if clash:
        raise ConfigError("--resume: the checkpoint's run differs from what is given: " + ", ".join(
            _clash(k, saved, given) for k in clash))
    saved = {k: v for k, v in saved.items() if k != FINGERPRINT}  # compared when the run resumes (_load_for_resume)
    if given.get("state_dir") is None and isinstance(meta.get("state_dir"), str):  # the state stays where it was
        given["state_dir"] = meta["state_dir"]
    return TrainConfig(**{**saved, **given, "out": str(out), "resume": True})


def _clash(name: str, saved: dict, given: dict) -> str:
    if name == FINGERPRINT:
        return (f"the checkpoint was trained from the model in {saved.get('model')} (config fingerprint "
                f"{saved[name]}), and the model in {given.get('model')} has another config ({given.get(name)})")
    return f"{name} is {saved[name]!r} in the checkpoint, {given.get(name)!r} given"


def _saved_config(meta: dict, path: Path) -> dict:
    """The checkpoint's run config, checked as a TrainConfig (a checkpoint of another version may differ)."""
    known = {f.name for f in dataclasses.fields(TrainConfig)} - set(CONTROL_FIELDS) | {FINGERPRINT}
    saved = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(saved, dict) or not set(saved) <= known or not _is_int(meta.get("step")) \
            or meta["step"] < 0 or not _is_real(meta.get("elapsed")) or not meta["elapsed"] >= 0:
        raise ConfigError(f"{path}: its metadata is not what this l2l-hw writes (config, a step >= 0, elapsed)")
    try:  # wherever it resumes
        TrainConfig(**{**{k: v for k, v in saved.items() if k != FINGERPRINT}, "device": "cpu", "eps_backend": "cpu",
                       "out": None})
    except ConfigError as e:
        raise ConfigError(f"{path}: its config is not usable: {e}") from e
    return saved


def build_eps(cfg: TrainConfig, shard_state: bool | None = None, process_group=None):
    """The EPS of `cfg`: optimizer, schedule and backend. Under torchrun each rank keeps its state
    (a pipeline stage's layers, or a data-parallel replica) in a state_dir of its own, state_dir/rankR.
    A sharded one shards over `process_group` (a pipeline stage's replicas; default every rank)."""
    arguments = pick(EpsOptions, cfg).make_eps_arguments(pick(ScheduleOptions, cfg))
    if shard_state is not None:
        arguments["shard_state"] = shard_state
    if arguments.get("shard_state") and process_group is not None:
        arguments["process_group"] = process_group
    if arguments.get("state_dir") is not None:
        arguments["state_dir"] = str(own_state_dir(cfg))
    return make_eps(**arguments)


def own_state_dir(cfg: TrainConfig) -> Path:
    """This process's folder of cfg.state_dir: the folder itself, or under torchrun state_dir/rankR."""
    rank, world = rank_and_world()
    return Path(cfg.state_dir) / f"rank{rank}" if world > 1 else Path(cfg.state_dir)


def check_state_dir(cfg: TrainConfig) -> None:
    """A --state-dir holding an earlier run's state is continued (resume), replaced (overwrite),
    or the run is refused, before anything in it changes."""
    if cfg.state_dir is None or cfg.resume or cfg.overwrite:
        return
    if held_state(cfg.state_dir):
        raise ConfigError("holds the state of another run, an earlier one; continue that run with --resume (and its "
                          "--out), replace the state with --overwrite, or give another folder (nothing in it was "
                          "changed)", "state_dir", cfg.state_dir)


def state_dir_line(cfg: TrainConfig) -> str:
    """The end line about --state-dir: where it is, its size, whether it may go."""
    size = _size(state_bytes(cfg.state_dir))
    if cfg.remove_state_dir:
        return f"state dir {cfg.state_dir}: {size} on disk, removed as the run closes (--remove-state-dir)"
    why = ("the final checkpoint holds all of it" if cfg.save and cfg.out is not None else
           "no checkpoint was written, so no run resumes from it")
    return (f"state dir {cfg.state_dir}: {size} on disk, scratch space of the EPS; {why}: it may be deleted "
            "(--remove-state-dir removes it at the end)")


def relay_options(cfg: TrainConfig, device: str | None = None) -> RelayOptions:
    """The relay's options of `cfg` (on `device` where given: a rank's own GPU)."""
    options = pick(RelayOptions, cfg)
    return dataclasses.replace(options, device=device) if device else options


def pipeline_groups(cfg: TrainConfig) -> tuple:
    """A pipeline's process groups on torchrun's ranks (distributed.stage_groups: every rank, one
    order): this rank's replica's stages and its stage's replicas; (None, None) without replicas."""
    _, world = rank_and_world()
    if world > 1 and world % cfg.pipeline_stages:
        raise ConfigError(f"must divide the {world} ranks (a pipeline of that many stages on each data-parallel "
                          "replica)", "pipeline_stages", cfg.pipeline_stages)
    return stage_groups(cfg.pipeline_stages) if world > cfg.pipeline_stages else (None, None)


def build_relay(cfg: TrainConfig, layers=None, loss_fn: Callable | None = None, *, device: str | None = None,
                shard_state: bool | None = None, eps=None, init: Callable | None = None,
                groups: tuple | None = None) -> Schedule:
    """The relay of `cfg`: its EPS (`eps`, else built here) around `layers` and `loss_fn`, the
    reference GPT and its loss when not given. Seeds torch with cfg.seed first. `init` fills
    layers on the meta device (Relay's init=); `groups`: a pipeline's (pipeline_groups, else made here)."""
    torch.manual_seed(cfg.seed)
    reference, drawn = layers is None, None
    if reference and cfg.pipeline_stages == 1:  # never held whole: made layer by layer as the EPS takes it
        if init is None:  # as build_gpt draws it
            (layers, drawn), loss_fn = build_gpt_meta(cfg.model_config()), lm_loss
            init = drawn
        else:  # resuming: the checkpoint's values
            with torch.device("meta"):
                layers, loss_fn = build_gpt(cfg.model_config()), lm_loss
    elif reference:
        layers, loss_fn = build_gpt(cfg.model_config()), lm_loss
    if cfg.pipeline_stages > 1:  # stages on the ranks (docs/PIPELINE.md); each replica trains its shard of the minibatch
        from l2l_hw.relay.pipeline import PipelineRelay

        group, replicas = groups or pipeline_groups(cfg)

        plan = None
        if cfg.pipeline_boundaries == "auto":  # the planner times the layers on random bytes of the batch's shape
            from l2l_hw.relay.planner import plan_on_ranks

            if not reference:
                raise ConfigError("--pipeline-boundaries auto profiles the reference GPT of l2l train; give the "
                                  "boundaries of other models (e.g. --pipeline-boundaries 3)")
            x = torch.randint(0, 256, (cfg.batch_size, cfg.context), generator=torch.Generator().manual_seed(cfg.seed))
            plan = plan_on_ranks(list(layers), loss_fn, x, torch.roll(x, -1, 1), cfg.pipeline_stages,
                                 cfg.micro_batches, threads=cfg.threads or 1)
        return PipelineRelay(layers, loss_fn, eps or build_eps(cfg, shard_state, replicas), relay_options(cfg, device),
                             pipeline=cfg.pipeline_config(), group=group, replicas=replicas, init=init, plan=plan)
    eps = eps or build_eps(cfg, shard_state)
    options, share = planned_options(cfg, eps, device)
    relay = Relay(layers, loss_fn, eps=eps, options=options, init=init, plan=share)
    if drawn is not None:
        drawn.finish()  # torch's RNG where build_gpt leaves it
    return relay


def device_share_plan(cfg: TrainConfig, options: RelayOptions, eps) -> SharePlan:
    """How many of the first layers the relay updates on the device: --device-update-layers, else
    the planner's choice from the measured host update and device compute (CUDA only: on the CPU
    the device's cores are the host's); a pipeline's stages keep every update on the host."""
    if cfg.device_update_layers is not None:
        return SharePlan(cfg.device_update_layers, "--device-update-layers")
    device = torch_device(options.device)
    if device.type != "cuda":
        return SharePlan(0, "the device is this machine's CPU: an update there takes the cores the host's would")
    layers = run_model(cfg).layers
    problem = share_problem(eps, len(layers), 1, stale=options.pipedream_2bw)
    if problem:
        return SharePlan(0, f"a device share {problem.removesuffix(' (give 0)')}")
    _, measured = measure_step(cfg)
    params = [sum(math.prod(s) for s in group.values()) for group in registered_groups(layers).values()]
    return plan_device_share(params, measured["compute_s"], measured["update_s"] / sum(params),
                             time_device_update(device), device_free_bytes(device))


def planned_options(cfg: TrainConfig, eps, device: str | None = None) -> tuple[RelayOptions, SharePlan]:
    """The relay's options of `cfg` with the device share decided, and how it was."""
    options = relay_options(cfg, device)
    share = device_share_plan(cfg, options, eps)
    return dataclasses.replace(options, device_update_layers=share.layers), share


class OutputError(OSError):
    """A file of the run could not be written (read-only, missing, full); the message names it."""


class CorpusBatches:
    """The reference corpus as an endless iterable of random (x, y) training windows,
    drawn from a generator seeded with `seed`; its state resumes exactly."""

    def __init__(self, corpus: Corpus, batch_size: int, context: int, seed: int):
        self.corpus, self.batch_size, self.context = corpus, batch_size, context
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        while True:
            yield self.corpus.batch("train", self.batch_size, self.context, self.generator)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])


def corpus_val_batches(corpus: Corpus, cfg: TrainConfig) -> list:
    """The validation windows of the reference corpus: EVAL_BATCHES minibatches from their
    own generator (seed + 1), the same at every eval point; training RNG never moves."""
    rng = torch.Generator().manual_seed(cfg.seed + 1)
    return [corpus.batch("val", cfg.batch_size, cfg.context, rng) for _ in range(EVAL_BATCHES)]


@dataclass
class TrainResult:
    relay: Schedule  # a Relay, or this rank's PipelineRelay
    history: list[dict] = field(default_factory=list)  # the metrics rows, resumed ones included
    val_loss: float | None = None  # the last validation
    elapsed: float = 0.0  # seconds in train steps, over every resumed segment
    state_dir: Path | None = None  # removed by close() (--remove-state-dir, once the run has finished)

    def close(self) -> None:
        """Close the relay (its EPS's updates finished, its files released); then, with
        --remove-state-dir, remove this process's state folder (and the parent of torchrun's
        rankR folders, once empty)."""
        self.relay.close()
        if self.state_dir is not None:
            remove_state(self.state_dir)
            if self.state_dir.name.startswith("rank"):
                with contextlib.suppress(OSError):
                    self.state_dir.parent.rmdir()


def train(cfg: TrainConfig | None = None, *, layers=None, loss_fn: Callable | None = None,
          data: Iterable | None = None, val_data: Iterable | None = None, relay=None,
          callbacks: Iterable[Callable[[dict], None]] = ()) -> TrainResult:
    """Train per `cfg` (see the module docstring); every callback gets each metrics row."""
    cfg = cfg or TrainConfig()
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"train() takes a TrainConfig, not a {type(cfg).__name__}")
    if (layers is not None or relay is not None) and data is None:
        raise ConfigError("train() with your own layers or relay needs data= (an iterable of (inputs, targets))")
    if layers is not None and (loss_fn is None or relay is not None):
        raise ConfigError("train(layers=...) needs loss_fn= and no relay=")
    checkpoint = _load_for_resume(cfg) if cfg.resume else None
    if relay is not None and checkpoint is None:  # a relay built elsewhere: the seed still rules dropout
        torch.manual_seed(cfg.seed)
    if checkpoint is not None and cfg.warmup is None:  # "a tenth of steps" was settled when the run began
        cfg = dataclasses.replace(cfg, warmup=checkpoint[1]["config"]["warmup"])
    ranks = join_torchrun(cfg.device, cfg.dist_timeout)
    with rank_body(ranks) as owned:
        if cfg.pipeline_stages > 1 and ranks.world == 1 and relay is None:
            raise ConfigError(f"runs one stage per process: start {cfg.pipeline_stages} (l2l train --nproc-per-node "
                              f"{cfg.pipeline_stages} ..., or under torchrun); this is one process", "pipeline_stages",
                              cfg.pipeline_stages)
        if cfg.shard_state and not sharded(cfg, ranks) and not cfg.resume:  # a resumed sharded run may go on whole
            if cfg.pipeline_stages > 1:
                raise ConfigError(f"shards each stage's optimizer state over its data-parallel replicas: run the "
                                  f"{cfg.pipeline_stages} stages on a multiple of {cfg.pipeline_stages} ranks, "
                                  f"{2 * cfg.pipeline_stages} or more; this is {ranks.world}", "shard_state", True)
            raise ConfigError("shards the optimizer state across ranks: run under torchrun with 2 or more "
                              "processes (torchrun --nproc-per-node N); this is one process", "shard_state", True)
        loop, corpus = _set_up(cfg, ranks, layers, loss_fn, data, val_data, relay, checkpoint)
        if relay is None:  # a relay built here is closed here on failure; the caller's is theirs
            owned.append(loop.relay)
        loop.callbacks = list(callbacks)
        if cfg.verbose:
            stages = _trained_by_stage(loop.relay, cfg, ranks)  # every rank: a collective in a pipeline
            if ranks.lead:
                print(_banner(cfg, loop.relay, ranks, corpus, stages, checkpoint, loop.tokens))
                loop.callbacks.append(_PlanAnnouncer(loop.relay))
        result = loop.run()
        if cfg.remove_state_dir and cfg.state_dir is not None:  # finished: its final checkpoint holds the state
            result.state_dir = own_state_dir(cfg)
        if cfg.verbose:  # every rank: the report gathers the weights (a collective when sharded)
            loop.report(result, sample=corpus is not None)
        if ranks.world > 1:  # leave together: rank 0 may still write while a peer tears the group down
            leave_together(ranks)
        return result


@contextlib.contextmanager
def _closed_on_failure(owned):
    """`owned` (a relay or an EPS built by the training loop, or None) is closed if the block fails: its
    update thread joined, its state_dir released. On success it goes to the caller (TrainResult.relay),
    whose to close."""
    try:
        yield
    except BaseException as e:
        close_all([owned] if owned is not None else [], e)
        raise


def _set_up(cfg: TrainConfig, ranks: Ranks, layers, loss_fn, data, val_data, relay, checkpoint):
    """The loop of a run, every input checked first: the output folder, the data, the EPS (its
    state_dir) on every rank, then the relay and the checkpoint it resumes. Only then is an
    earlier run in the output folder removed (overwrite). A pipeline's groups are made first, on
    every rank, before anything may refuse on one rank alone (a sharded EPS shards over them)."""
    corpus = eps = None
    tokens = over_tokens(loss_fn if layers is not None else lm_loss if relay is None
                         else getattr(relay, "loss_fn", None))  # a Relay's; a PipelineRelay's is its stages'
    groups = pipeline_groups(cfg) if cfg.pipeline_stages > 1 and relay is None else (None, None)
    try:  # what may refuse the run on one rank alone, before the ranks' first collective
        if layers is None and relay is None:
            check_fits(cfg)
        if cfg.out is not None and ranks.lead:
            check_out(cfg)
        if relay is None:
            check_state_dir(cfg)
        if layers is None and relay is None:  # the reference GPT on the reference corpus
            corpus = load_corpus(cfg)
            data = CorpusBatches(corpus, cfg.batch_size, cfg.context, cfg.seed)
            val_data = corpus_val_batches(corpus, cfg)
        if relay is None:
            eps = build_eps(cfg, sharded(cfg, ranks), groups[1])
        failure = None
    except Exception as e:
        failure = as_config_error(e)
    with _closed_on_failure(eps):
        agree_to_start(ranks, failure)
        try:
            if relay is None:  # resuming, layers on the meta device (or a relay's: only structure) are filled
                init = init_from_state(checkpoint[0].view("relay.")) if checkpoint is not None else None  # the file's
                relay = build_relay(cfg, layers, loss_fn, device=ranks.device, eps=eps, init=init, groups=groups)
            loop = _Loop(cfg, relay, data, val_data, ranks, tokens)
            if checkpoint is not None:  # after building: construction draws from the RNGs restored now
                loop.restore(*checkpoint)
        except Exception as e:
            raise as_config_error(e)
        if cfg.out is not None and ranks.lead:
            prepare_out(cfg)
    return loop, corpus


def leave_together(ranks: Ranks) -> None:
    """Every rank waits for the others at the end of a run (a barrier): rank 0 may still be
    writing while a peer that left first would tear the group down."""
    import torch.distributed as dist

    guarded(None, "waiting for every rank at the end", dist.barrier)


def agree_to_start(ranks: Ranks, failure: Exception | None) -> None:
    """Every rank learns whether another could not start (a collective): `failure` is raised on
    its rank, and on each of the others a ConfigError naming the rank and its reason."""
    if ranks.world > 1:
        failed = failed_ranks(str(failure) if failure else None, "agreeing that every rank can start")
        if failure is None and failed:
            rank, why = next(iter(failed.items()))
            raise ConfigError(f"rank {ranks.rank} of {ranks.world}: stopped before training: rank {rank} cannot "
                              f"start: {why}")
    if failure is not None:
        raise failure


def as_config_error(e: Exception) -> Exception:
    """Set-up's errors: a value or a file of the config, named in the message (a ConfigError);
    anything else as it is."""
    if isinstance(e, ConfigError) or not isinstance(e, (ValueError, TypeError, OSError)):
        return e
    error = ConfigError(str(e))
    error.__cause__ = e
    return error


def earlier_run(out: Path) -> list[str]:
    """The files of a run already in `out`, by the names in RUN_FILES (an empty metrics file is
    none: a run that failed to start; tensorboard counts where it holds event files)."""
    found = [name for name in RUN_FILES if (out / name).is_file()]  # a folder of that name is not the run's
    if METRICS in found and (out / METRICS).stat().st_size == 0:
        found.remove(METRICS)
    return found + ([TENSORBOARD] if _event_files(out) else [])


def _event_files(out: Path) -> list[Path]:
    folder = out / TENSORBOARD
    return sorted(p for p in folder.glob(EVENT_FILES) if p.is_file()) if folder.is_dir() else []


def check_out(cfg: TrainConfig) -> None:
    """Everything about the output folder that can refuse the run, before anything in it changes
    (what is made to try it is removed again): it is a folder, or can be made, that takes files;
    a run already there is continued (resume), replaced (overwrite: prepare_out, once every input
    was checked), or the run is refused; the model folder a fine-tune saves holds nothing that
    saving would remove."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError("is a file, not a folder", "out", str(cfg.out))
    found = earlier_run(out) if out.is_dir() else []
    if found and not cfg.resume and not cfg.overwrite:
        raise ConfigError(f"already holds a run ({', '.join(found)}); continue it with --resume, replace it with "
                          "--overwrite, or give another --out", "out", str(cfg.out))
    if cfg.model is not None:
        foreign = hf.foreign_files(out / MODEL, cfg.model)
        if foreign:
            raise ConfigError(f"{out / MODEL} holds what saving the fine-tuned model there would remove "
                              f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}): move it, or give "
                              "another --out", "out", str(cfg.out))
    if cfg.tensorboard:
        _summary_writer()
    made = [p for p in (*reversed(out.absolute().parents), out.absolute(), out.absolute() / METRICS)
            if not p.exists()]
    try:  # the metrics file opened as the run opens it; what this made is removed again
        out.mkdir(parents=True, exist_ok=True)
        with open(out / METRICS, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"cannot write there ({e.strerror or e})", "out", str(cfg.out)) from e
    finally:
        for path in reversed(made):
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() else path.unlink()


def prepare_out(cfg: TrainConfig) -> None:
    """Once every input of the run was checked: the output folder is made; with overwrite, the
    earlier run's files go (the names in RUN_FILES; of tensorboard/, its event files: nothing
    this program did not write); and the temporaries an interrupted checkpoint write of this
    program left."""
    out = Path(cfg.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if cfg.overwrite:
            for name in earlier_run(out):
                if name == TENSORBOARD:
                    for events in _event_files(out):
                        events.unlink()
                    with contextlib.suppress(OSError):  # kept where it holds anything else
                        (out / TENSORBOARD).rmdir()
                else:
                    (out / name).unlink()
        for name in (CHECKPOINT, PLOT, MODEL):  # what a killed run was writing when it died
            remove_stale_temporaries(out / name)
        with open(out / METRICS, "a"):
            pass
    except OSError as e:
        raise OutputError(f"{out}: cannot prepare the output folder ({e.strerror or e})") from e


def load_corpus(cfg: TrainConfig) -> Corpus:
    """The reference corpus of cfg.data, with room for a context window in each split."""
    try:
        corpus = Corpus.load(cfg.data)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e), "data", cfg.data) from e
    for split in ("train", "val"):
        size = len(getattr(corpus, split))
        if size < cfg.context + 1:
            raise ConfigError(f"its {split} split has {size} bytes, fewer than context + 1 = {cfg.context + 1} "
                              "(a file's last tenth is validation)", "data", cfg.data)
    return corpus


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n < 2**50 else f"{n / 2**30:.3g} GiB"


def _size(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else _gib(n)


def sharded(cfg: TrainConfig, ranks: Ranks) -> bool:
    """Sharding needs ranks to share with (a pipeline stage's replicas): a sharded run resumed on
    one process (or as one pipeline) is replicated."""
    return cfg.shard_state and ranks.world > max(1, cfg.pipeline_stages)


def _load_for_resume(cfg: TrainConfig):
    if cfg.out is None:
        raise ConfigError("resume needs out= (the folder holding the checkpoint)")
    checkpoint = open_checkpoint(Path(cfg.out) / CHECKPOINT)  # checked whole, read lazily: no copy of the state
    tensors, meta = checkpoint, checkpoint.meta
    saved, run = _saved_config(meta, Path(cfg.out) / CHECKPOINT), cfg.run_config()
    if cfg.warmup is None:  # as train() takes it
        run["warmup"] = saved["warmup"]
    clash = [k for k in saved if k not in RESUME_MAY_CHANGE and saved[k] != run.get(k)]
    if clash:
        raise ConfigError(f"resume: {cfg.out}/{CHECKPOINT} is a different run: " + ", ".join(
            _clash(k, saved, run) for k in clash))
    if cfg.steps < meta["step"]:
        raise ConfigError(f"is below the checkpoint's step {meta['step']}; give at least that many", "steps",
                          cfg.steps)
    return tensors, meta


def _trained_by_stage(relay, cfg: TrainConfig, ranks: Ranks) -> list[int]:
    """The parameters each pipeline stage's EPS trains (one entry without a pipeline)."""
    trained = sum(math.prod(shape) for names in relay.eps.shapes.values() for shape in names.values())
    if cfg.pipeline_stages == 1 or ranks.world == 1:
        return [trained]
    import torch.distributed as dist

    counts = [0] * ranks.world
    dist.all_gather_object(counts, trained)
    return counts[:cfg.pipeline_stages]  # the first replica's stages (rank = replica * stages + stage)


class _PlanAnnouncer:
    """A training-loop callback that prints the planned recompute once the first step has made it."""

    def __init__(self, relay):
        self.relay, self.said = relay, relay.keep.describe()

    def __call__(self, row: dict) -> None:
        now = self.relay.keep.describe()
        if now != self.said:
            print(f"recompute {now}")
            self.said = now


def _banner(cfg: TrainConfig, relay, ranks: Ranks, corpus: Corpus | None, stages: list[int],
            checkpoint=None, tokens: bool = True) -> str:
    """What the run is: the model, the data per step and in all (tokens where the loss is over
    tokens, else samples), the optimizer's settings, the EPS, the pipeline's stages, and where a
    resumed run picks up."""
    trained = sum(stages)
    total = sum(p.numel() for p in {id(p): p for layer in relay.layers for p in layer.parameters()}.values())
    config = getattr(relay.layers[0], "config", None)  # a Hugging Face model's
    if corpus is not None:
        model = f"the reference GPT, {cfg.layers} layers x {cfg.width} wide"
    elif config is not None:
        model = f"{config.model_type}, {getattr(config, 'num_hidden_layers', len(relay.layers) - 2)} layers"
    else:
        model = f"{len(relay.layers)} relay layers"
    # what a step trains on: B x T tokens of a language model, else the minibatch's samples
    per_step, unit = (cfg.batch_size * cfg.context, "tokens") if tokens else (cfg.batch_size, "samples")
    pipeline = cfg.pipeline_stages > 1
    if pipeline:  # every replica runs its shard of the minibatch through its stages, one a rank
        replicas = ranks.world // len(stages)
        where = f" through {len(stages)} pipeline stages, one a rank" + (
            f", a shard on each of {replicas} data-parallel replicas of the pipeline" if replicas > 1 else "")
        split = ", ".join(f"stage {s} layers {a}-{b - 1} {n:,}" for s, (a, b, n) in
                          enumerate(zip(relay.bounds, relay.bounds[1:], stages)))
        held = f"{trained:,} trained: {split}"
    else:
        where = f", a shard on each of {ranks.world} data-parallel ranks" if ranks.world > 1 else ""
        held = f"{trained:,} trained"
    run = (f"l2l {'finetune' if cfg.model else 'train'}: {model}, {total:,} parameters ({held}), "
           + (f"context {cfg.context}, " if tokens else "")
           + f"batch {cfg.batch_size} in {cfg.micro_batches} micro-batches{where}, "
           + (f"{per_step:,} tokens a step, " if tokens else "")
           + f"{cfg.steps * per_step:,} {unit} in {cfg.steps} steps")
    if checkpoint is not None:
        step = checkpoint[1]["step"]
        run += (f"\nresumed from {Path(cfg.out) / CHECKPOINT} at step {step} ({step * per_step:,} {unit} "
                f"trained), on to step {cfg.steps}")
        if cfg.pipeline_stages > 1 and cfg.pipeline_schedule == "2bw":  # a run of the days 2bw was the default
            run += ", as PipeDream-2BW: the schedule its checkpoint saved (a new run's default is flush)"
    if cfg.stale_weights:
        from l2l_hw.relay.pipeline import staleness_trade

        run += "\n" + staleness_trade(cfg.delay_compensation, "--pipeline-schedule flush (the default)"
                                       if cfg.pipeline_stages > 1 else "a run without --pipedream-2bw")
    rule = (f"betas ({cfg.adam_beta1:g}, {cfg.adam_beta2:g}), eps {cfg.adam_eps:g}" if "v" in STATE_SLOTS[cfg.optimizer]
            else f"momentum {cfg.momentum:g}")
    if cfg.optimizer == "muon":  # torch.optim.Muon on the matrices, AdamW on the rest
        rule = (f"2-D weights: {'Nesterov ' if cfg.muon_nesterov else ''}momentum {cfg.muon_momentum:g} orthogonalised "
                f"by {cfg.muon_ns_steps} Newton-Schulz steps on the host, lr scaled {cfg.muon_adjust_lr}; the rest "
                f"AdamW, {rule}")
    schedule = "constant" if cfg.schedule == "constant" else f"{cfg.schedule} to {cfg.floor(cfg.lr):g}"
    optimizer = (f"optimizer: {cfg.optimizer}, lr {cfg.lr:g}, {schedule}, warm-up {cfg.warmup_steps} steps, "
                 f"weight decay {cfg.weight_decay:g}, {rule}")
    if cfg.optimizer == "lamb" and cfg.lr < LAMB_LR:  # AdamW's lr barely moves a trust-ratio update
        optimizer += (f" (a low lr for lamb: its trust ratio scales each layer's step to lr x the layer's norm; "
                      f"{LAMB_LR:g} trains the reference GPT at batch 32, docs/BENCHMARKS.md)")
    per_parameter = eps_bytes_per_parameter(cfg)
    on_device = sum(math.prod(s) for key, names in relay.eps.shapes.items() if relay.eps.on_device(key)
                    for s in names.values())  # the device share's
    eps = (f"EPS {cfg.eps_backend}{' (state sharded)' if sharded(cfg, ranks) else ''}: about "
           f"{_size((trained - on_device) * per_parameter)} of host memory ({per_parameter:.3g} B a trained parameter"
           f"{', 1/N a rank' if sharded(cfg, ranks) else ''}), device {ranks.device or cfg.device}"
           + (f" ({on_device:,} parameters' weights and state on it, {_size(on_device * DEVICE_BYTES_PER_PARAMETER)})"
              if on_device else ""))
    if cfg.state_dir is not None:  # the state is in files; host memory holds the groups in flight
        storage = relay.eps.storage
        eps = (f"EPS {cfg.eps_backend}: state in {cfg.state_dir}, {_size(storage.disk_bytes())} on disk, at most "
               f"{_size(storage.memory_bound())} of it in host memory, device {ranks.device or cfg.device}")
    data = f"corpus {corpus.source} ({len(corpus.train):,} train bytes), " if corpus is not None else ""
    if corpus is not None and corpus.skipped:
        data += (f"skipped {len(corpus.skipped)} path(s) that are not regular files "
                 f"({', '.join(corpus.skipped[:3])}{', ...' if len(corpus.skipped) > 3 else ''}), ")
    if cfg.shard_state and not sharded(cfg, ranks):
        data += "optimizer state whole in this one process (the checkpoint's run was sharded), "
    updates = "between layers" if not relay.transport.asynchronous else "beside the device's compute"
    threads = (f"threads: {relay.threads} (torch intra-op {torch.get_num_threads()}; EPS updates {updates}), "
               f"recompute {relay.keep.describe()}, "
               f"OpenMP waits {os.environ.get('OMP_WAIT_POLICY', 'default').lower()}")
    plan = relay.plan  # a pipeline's, with --pipeline-boundaries auto
    return "\n".join((run, optimizer, f"{eps}, {data}out {cfg.out}", threads, *([plan.describe()] if plan else [])))


class _Loop:
    """The state of one train() call between steps: the relay, the data position, the rows."""

    def __init__(self, cfg: TrainConfig, relay, data: Iterable, val_data: Iterable | None, ranks: Ranks,
                 tokens: bool = True):
        self.cfg, self.relay, self.data, self.val_data, self.ranks = cfg, relay, data, val_data, ranks
        self.tokens = tokens  # the loss is a cross entropy over tokens: perplexity and tokens/s mean something
        self.callbacks: list[Callable[[dict], None]] = []
        self.out = Path(cfg.out) if cfg.out is not None else None
        self.files = self.out is not None and ranks.lead  # rank 0 alone writes files
        self.history: list[dict] = []
        self.elapsed = 0.0
        self.resumed_elapsed: float | None = None  # the training seconds of the run's earlier segments, if resumed
        self.skip = 0  # batches of a fresh pass over `data` already trained on (resume without a data state)
        self.saved_step: int | None = None  # the step of the newest checkpoint in out
        self.val_loss: float | None = None  # the last validation of this call
        self.discarded = 0  # steps discarded in a row (non-finite): MAX_DISCARDED stops the run
        # Where each rank's part of a minibatch comes from: its shard (data parallel), its replica's (a pipeline
        # replicated over the ranks, rank = replica * stages + stage)
        stages = cfg.pipeline_stages if ranks.world > 1 else 1
        self.shard = (ranks.rank // stages, ranks.world // stages)

    def restore(self, checkpoint: Checkpoint, meta: dict) -> None:
        """The run as the checkpoint left it. Every entry is checked (names, dtypes, shapes, the step)
        before the first is loaded; a fault is one CheckpointError naming the file and the entry."""
        try:
            data_state = self._check_entries(checkpoint)
            self.relay.load_state_dict(checkpoint.view("relay."))  # streamed, one tensor at a time
            if self.relay.step != meta["step"]:
                raise ValueError(f"its relay state is at step {self.relay.step}, its metadata at step {meta['step']}")
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(f"{checkpoint.path}: {e}") from None
        restore_rng({k: checkpoint[k].read() for k in checkpoint if k.startswith("rng.")})
        if hasattr(self.data, "load_state_dict"):
            self.data.load_state_dict(data_state)
        else:
            self.skip = self.relay.step
        self.elapsed = self.resumed_elapsed = meta["elapsed"]
        self.saved_step = meta["step"]
        if self.out is not None:
            self.history = read_metrics(self.out / METRICS, self.relay.step)

    def _check_entries(self, checkpoint: Checkpoint) -> dict:
        """The checkpoint's entries outside the relay: the RNG states this process restores and
        the data position the data takes (read and returned); nothing more, nothing less."""
        rng = torch.get_rng_state()
        expected = {"rng.torch": (rng.shape, rng.dtype)}
        if hasattr(self.data, "state_dict"):
            expected.update({f"data.{k}": (v.shape, v.dtype) for k, v in self.data.state_dict().items()})
        for name, (shape, dtype) in expected.items():
            if name not in checkpoint:
                raise ValueError(f"it has no entry {name!r} (the {'RNG' if name.startswith('rng.') else 'data'} "
                                 "state a resume restores)")
            if checkpoint[name].shape != shape or checkpoint[name].dtype != dtype:
                raise ValueError(f"its entry {name!r} is {checkpoint[name].dtype} {tuple(checkpoint[name].shape)}; "
                                 f"a resume needs {dtype} {tuple(shape)}")
        extra = sorted(k for k in checkpoint if not k.startswith(("relay.", "rng.cuda.")) and k not in expected)
        if extra:
            raise ValueError(f"it has entries this run does not restore: {', '.join(extra[:3])}")
        return {name[len("data."):]: checkpoint[name].read() for name in expected if name.startswith("data.")}

    def validate(self, row: dict) -> float | None:
        """Validate now; the loss and its perplexity go into the step's metrics row."""
        row["val_loss"] = self.evaluate()
        if row["val_loss"] is not None and self.tokens:
            row["val_perplexity"] = perplexity(row["val_loss"])
        return row["val_loss"]

    def evaluate(self) -> float | None:
        if self.val_data is None:
            return None
        losses = [self.relay.evaluate(*rank_shard(batch, *self.shard))
                  for batch in self.val_data]
        return sum(losses) / len(losses)

    def save(self) -> None:
        if self.out is None or not self.cfg.save:  # the same on every rank
            return
        # Streamed to the file, read one tensor at a time; every rank: a collective if sharded.
        tensors = {f"relay.{k}": v for k, v in self.relay.state_entries().items()}
        if not self.files:  # saved by rank 0: every rank knows the step, so none gathers it twice
            self.saved_step = self.relay.step
            return
        tensors.update(rng_tensors())
        if hasattr(self.data, "state_dict"):
            tensors.update({f"data.{k}": v for k, v in self.data.state_dict().items()})
        try:
            save_checkpoint(self.out / CHECKPOINT, tensors, run_meta(self.cfg, self.relay.step, self.elapsed))
        except OSError as e:
            raise OutputError(f"{self.out / CHECKPOINT}: cannot write the checkpoint ({e}); the previous "
                              "checkpoint is unchanged") from e
        self.saved_step = self.relay.step

    def run(self) -> TrainResult:
        """Train to the step target (or cfg.stop_after) a chunk of minibatches at a time, each
        step's row through the non-finite policy into the outputs. A signal stops the run at the
        next step boundary, checkpointed; a finite iterable of data, where it ends."""
        stop = min(self.cfg.steps, self.cfg.stop_after) if self.cfg.stop_after else self.cfg.steps
        outputs = _Outputs(self.out if self.files else None, self.cfg.tensorboard, self.relay.step)
        batches = self.batches()  # before metrics.jsonl is rewritten: data that ends too soon leaves it whole
        show = self.cfg.verbose and self.ranks.lead
        with outputs.opened(self.history, stop, self.relay.step, show), StopSignals() as signals:
            while self.relay.step < stop:
                if signals.agreed(self.ranks):  # a safe point: between steps, nothing half written
                    self.interrupt(signals)
                chunk = list(itertools.islice(batches, self.chunk(stop)))
                if not chunk:
                    self.end_of_data(outputs)
                    break
                for row in self.steps(chunk):
                    self.apply_nonfinite_policy(row)
                    if math.isfinite(row["loss"]):  # else a discarded step: the weights are as they were
                        self.record(row, stop, outputs)
        return self.result()

    def batches(self) -> Iterator:
        """The data from where the checkpoint left it: without a data state of its own, the first
        `skip` batches of a fresh pass are skipped."""
        batches = iter(self.data)
        for skipped in range(self.skip):
            if next(batches, None) is None:
                raise ConfigError(f"the data ends after {skipped} batches, before the checkpoint's step {self.skip}")
        return batches

    def interrupt(self, signals: StopSignals) -> NoReturn:
        """Stop at a signal: the step reached is checkpointed (where it is not yet), then TrainingInterrupted."""
        if self.saved_step != self.relay.step:
            self.save()
        raise TrainingInterrupted(signals.received, self.relay.step, saved=self.out is not None and self.cfg.save,
                                  where=signals.where)

    def apply_nonfinite_policy(self, row: dict) -> None:
        """Stop the run (NonFiniteLoss) where a step with a non-finite loss was taken (its weights
        are lost), or MAX_DISCARDED steps in a row were discarded (skip_nonfinite, fp16's scale);
        `taken` leaves the row."""
        self.discarded = 0 if row.pop("taken") else self.discarded + 1
        if not math.isfinite(row["loss"]) and self.discarded == 0:
            raise NonFiniteLoss(
                f"the loss is {row['loss']} at step {row['step']} and the step was taken, so the weights "
                f"are not finite now; stopped before any checkpoint of them ({self._last_checkpoint()}). "
                "Lower the learning rate, or set skip_nonfinite to discard such steps")
        if self.discarded >= MAX_DISCARDED:
            raise NonFiniteLoss(f"{self.discarded} steps in a row after step {row['step']} had non-finite "
                                f"gradients and were discarded; stopped ({self._last_checkpoint()})")

    def record(self, row: dict, stop: int, outputs: _Outputs) -> None:
        """A step's outputs: at an eval point its validation, then its metrics row, then the
        checkpoint (never ahead of its metrics); the history, the callbacks, TensorBoard, the bar."""
        evaluate = row["step"] % self.cfg.eval_interval == 0 or row["step"] == stop
        if evaluate:
            self.val_loss = self.validate(row)
        outputs.add(row)
        if evaluate:
            self.save()
        self.history.append(row)
        for callback in self.callbacks:
            callback(row)
        outputs.show(row)

    def end_of_data(self, outputs: _Outputs) -> None:
        """A finite iterable of data ran out: its last step is validated (its row written again,
        with its val_loss) and checkpointed, where that is not done yet."""
        if self.history and "val_loss" not in self.history[-1]:
            self.val_loss = self.validate(self.history[-1])
            outputs.rewrite(self.history)
            self.save()

    def result(self) -> TrainResult:
        """The run's result, its loss curves plotted; where it trained nothing (resumed at its end),
        the validation of the checkpoint as it is."""
        if self.val_loss is None:
            self.val_loss = self.evaluate()
        if self.files and self.history:
            title = f"l2l finetune {Path(self.cfg.model).name}" if self.cfg.model else "l2l train"
            plot(self.history, self.out / PLOT, title=title)
        return TrainResult(self.relay, self.history, self.val_loss, self.elapsed)

    def _last_checkpoint(self) -> str:
        if self.out is None or not self.cfg.save:
            return "this run writes no checkpoint"
        if self.saved_step is None:
            return "no checkpoint was written yet"
        return f"{self.out / CHECKPOINT} keeps step {self.saved_step}"

    def chunk(self, stop: int) -> int:
        """How many minibatches the next call trains on: one, or where the relay runs several
        steps as one schedule (a 2BW pipeline: relay.streams), those up to the next validation."""
        step = self.relay.step
        if not self.relay.streams:
            return 1
        return min(stop, (step // self.cfg.eval_interval + 1) * self.cfg.eval_interval) - step

    def steps(self, chunk: list) -> list[dict]:
        """Train on each minibatch of `chunk` (one relay call); a metrics row per step, with
        `taken`: whether the step was taken (not discarded for a non-finite gradient)."""
        relay, first = self.relay, self.relay.step
        shards = [rank_shard(batch, *self.shard) for batch in chunk]
        t0 = time.perf_counter()
        losses = relay.train_steps(shards)
        dt = (time.perf_counter() - t0) / len(chunk)
        rows = []
        for k, (batch, loss) in enumerate(zip(chunk, losses)):
            self.elapsed += dt
            step = relay.step if len(chunk) == 1 else first + k + 1  # several: every step is taken
            targets = batch[1][0] if isinstance(batch[1], (tuple, list)) else batch[1]  # HF: (labels, counts)
            # the global minibatch's tokens (B x T targets of a language model), else its samples
            rate = ({"tokens_per_s": targets.numel() / dt} if self.tokens
                    else {"samples_per_s": (targets.shape[0] if targets.dim() else 1) / dt})
            rows.append({"step": step, "loss": loss, "lr": relay.eps.lr_at(first + k + 1), **rate,
                         "elapsed": self.elapsed, "taken": step > first + k})
        return rows

    def report(self, result: TrainResult, sample: bool) -> None:
        # The reference GPT's sample needs the whole model: every rank (a sharded EPS gathers it)
        model = result.relay.materialize() if sample else None
        if not self.ranks.lead:
            return
        cfg = self.cfg
        val = ("" if result.val_loss is None else f"  final val loss {result.val_loss:.4f}"
               + (f" (perplexity {perplexity(result.val_loss):.4g})" if self.tokens else ""))
        print(f"step {result.relay.step}/{cfg.steps}{val}  ({training_time(result.elapsed, self.resumed_elapsed)})")
        if self.files:
            written = [self.out / name for name in (METRICS, PLOT, CHECKPOINT) if (self.out / name).exists()]
            print(f"wrote {', '.join(map(str, written))}")
        if sample and not all(torch.isfinite(p).all() for p in model.parameters()):
            print("no sample: the weights are not finite")
        elif sample:
            text = generate(model, SAMPLE_PROMPT, SAMPLE_BYTES, temperature=0.8, top_k=40, block_size=cfg.context,
                            generator=torch.Generator().manual_seed(cfg.seed))
            print("sample:\n" + (SAMPLE_PROMPT + text).decode("utf-8", errors="replace"))
        if cfg.state_dir is not None:
            print(state_dir_line(cfg))


class _Outputs:
    """What a run writes and shows as it trains: the rows of metrics.jsonl, TensorBoard's events
    and the progress bar. `out` None: no files (no out, or a rank other than 0)."""

    def __init__(self, out: Path | None, tensorboard: bool, step: int):
        """The folder made and, with `tensorboard`, its writer opened (events past `step` purged)."""
        self.out = out
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
        self.board = _tensorboard(out, step) if tensorboard and out is not None else None
        self.metrics = self.bar = None

    @contextlib.contextmanager
    def opened(self, rows: list[dict], stop: int, step: int, show: bool) -> Iterator[_Outputs]:
        """While the run trains: metrics.jsonl rewritten with `rows` (rows past the checkpoint are
        dropped) and the progress bar from `step` to `stop`, which closes (ends its line) before
        an error is reported. TensorBoard's writer is closed when the run ends well."""
        from tqdm import tqdm

        self.bar = tqdm(total=stop, initial=step, unit="step", desc="train", dynamic_ncols=True,
                        disable=True if not show else None)  # None: off unless a terminal
        with self.bar, open(self.out / METRICS if self.out is not None else os.devnull, "w") as self.metrics:
            self.write(rows)
            yield self
        if self.board is not None:
            self.board.close()

    def add(self, row: dict) -> None:
        if self.out is not None:
            self.write([row])

    def rewrite(self, rows: list[dict]) -> None:
        """Every row again (the last one has changed: its val_loss)."""
        if self.out is not None:
            self.write(rows, rewrite=True)

    def write(self, rows: list[dict], rewrite: bool = False) -> None:
        try:
            if rewrite:
                self.metrics.seek(0)
                self.metrics.truncate()
            self.metrics.writelines(json.dumps(r) + "\n" for r in rows)
            self.metrics.flush()
        except OSError as e:
            raise OutputError(f"{self.out / METRICS}: cannot write the metrics ({e.strerror or e})") from e

    def show(self, row: dict) -> None:
        """A step on TensorBoard and the progress bar."""
        if self.board is not None:
            for name, value in row.items():
                if name != "step" and value is not None:
                    self.board.add_scalar(name, value, row["step"])
        self.bar.update(1)
        rate = {"tok_s": row["tokens_per_s"]} if "tokens_per_s" in row else {"samples_s": row["samples_per_s"]}
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", **{k: f"{v:,.0f}" for k, v in rate.items()})


class StopSignals:
    """SIGINT and SIGTERM, while training, ask the loop to stop at the next step boundary (where
    it checkpoints and raises TrainingInterrupted) instead of killing it mid-step. A second
    signal of the same kind, REPEAT_S after the first or later, acts as it did before (Ctrl-C
    twice raises KeyboardInterrupt). Only the main thread can take signals; elsewhere this does
    nothing."""

    def __init__(self):
        self.received: int | None = None
        self.at = 0.0  # when it was received (time.monotonic)
        self.where = ""  # under torchrun: which rank it reached first, for the ranks' lines
        self.previous: dict[int, object] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received is None:
            self.received, self.at = signum, time.monotonic()
        elif signum == self.received and time.monotonic() - self.at >= REPEAT_S:
            previous = self.previous[signum]
            signal.signal(signum, previous)
            if callable(previous):
                previous(signum, frame)
            else:  # the default action (SIGTERM: the end), or nothing where it was ignored
                signal.raise_signal(signum)

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def agreed(self, ranks: Ranks) -> bool:
        """Whether to stop now: on every rank alike (each rank may see the signal at another step)."""
        if ranks.world == 1:
            return self.received is not None
        import torch.distributed as dist

        flags = torch.zeros(ranks.world, dtype=torch.int64, device=ranks.device or "cpu")
        flags[ranks.rank] = self.received or 0
        guarded(None, "agreeing whether to stop at a signal", dist.all_reduce, flags)
        got = [(rank, int(signum)) for rank, signum in enumerate(flags.tolist()) if signum]
        if got and self.received is None:
            self.received = got[0][1]
        if got:
            self.where = f" by {signal.Signals(got[0][1]).name} to rank {got[0][0]}"
        return bool(got)


def over_tokens(loss_fn) -> bool:
    """Whether `loss_fn` is a mean cross entropy over tokens (a language model's), which a loss
    says with an attribute `over_tokens = True` (lm_loss, hf.TokenLoss): then perplexity and
    tokens/s are figures of the run; of any other loss (an MSE, say) samples/s are."""
    return getattr(loss_fn, "over_tokens", False) is True


def training_time(elapsed: float, resumed_elapsed: float | None) -> str:
    """The end line's time: the seconds in train steps, of the run in all and of this process
    where it resumed (the checkpoint's figure counts every earlier segment)."""
    if resumed_elapsed is None:
        return f"{elapsed:.1f} s training"
    return f"{elapsed:.1f} s training in all, {elapsed - resumed_elapsed:.1f} s this run"


def perplexity(loss: float) -> float:
    """exp(mean token loss), inf where that overflows a float."""
    return math.exp(loss) if loss < 700 else math.inf


def rng_tensors() -> dict[str, torch.Tensor]:
    """Every global RNG state that a step draws from (dropout, layer drop), for a checkpoint."""
    rng = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"rng.cuda.{i}"] = state
    return rng


def restore_rng(tensors: dict) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    cuda = sorted((k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda[: torch.cuda.device_count()]])


def read_metrics(path: Path, up_to_step: int | None = None) -> list[dict]:
    """The rows of a metrics.jsonl up to a step. A torn last line (a kill during its write) is
    dropped; any other line that is not a metrics row is an error naming the file and line."""
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not _is_int(row.get("step")):
                raise ValueError("no step")
        except ValueError:
            if number == len(lines):
                break
            raise ConfigError(f"{path}: line {number} is not a metrics row; move the file away to resume") from None
        rows.append(row)
    return [r for r in rows if up_to_step is None or r["step"] <= up_to_step]


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError("--tensorboard needs the tensorboard package (pip install tensorboard)") from e
    return SummaryWriter


def _tensorboard(out: Path, step: int):
    """A SummaryWriter in out/tensorboard; events past `step` (a run resumed from there) are purged."""
    try:
        return _summary_writer()(str(out / TENSORBOARD), purge_step=step + 1 if step else None)
    except OSError as e:
        raise OutputError(f"{out / TENSORBOARD}: cannot write the TensorBoard events ({e.strerror or e})") from e


def plot(rows: list[dict], path: Path, title: str = "l2l train") -> None:
    """The loss curves as a PNG; nothing without matplotlib (the `plot` extra; the metrics hold it all)."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    val = [r for r in rows if r.get("val_loss") is not None]
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        written = temporary_beside(path)  # renamed into place once whole: the last plot survives a full disk
        try:
            fig.savefig(written, dpi=100, format="png")
            os.replace(written, path)
        finally:
            written.unlink(missing_ok=True)
    except OSError as e:
        raise OutputError(f"{path}: cannot write the plot ({e.strerror or e})") from e
    finally:
        plt.close(fig)

