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

The loop is here: train() builds the run from its config (_set_up), then _run() trains it
step by step. Its parts are modules of l2l_hw/training/: the config (config.py), the
components built from it (components.py, data.py), the checkpoints (checkpoints.py),
validation (evaluation.py), the metrics and their files (metrics.py, files.py), the signals
that stop a run (signals.py) and what it prints (report.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, NoReturn

import torch

from l2l_hw.distributed import Ranks, close_all, failed_ranks, guarded, join_torchrun, rank_body, rank_shard
from l2l_hw.estimate import check_fits, eps_bytes_per_parameter
from l2l_hw.models import lm_loss
from l2l_hw.relay import init_from_state
from l2l_hw.training.checkpoints import (RESUME_MAY_CHANGE, last_checkpoint, load_for_resume, read_metrics,
                                         restore, restore_rng, resume_config, rng_tensors, save)
from l2l_hw.training.components import (build_eps, build_relay, check_state_dir, device_share_plan, own_state_dir,
                                        pipeline_groups, planned_options, relay_options, sharded)
from l2l_hw.training.config import (COMPONENTS, CONTROL_FIELDS, FINGERPRINT, ConfigError, DataOptions, RunOptions,
                                    TrainConfig)
from l2l_hw.training.data import EVAL_BATCHES, CorpusBatches, corpus_val_batches, load_corpus
from l2l_hw.training.evaluation import evaluate, validate
from l2l_hw.training.files import (CHECKPOINT, EVENT_FILES, METRICS, MODEL, PLOT, RUN_FILES, TENSORBOARD, OutputError,
                                   check_out, earlier_run, prepare_out)
from l2l_hw.training.metrics import MetricsLog, over_tokens, perplexity, plot, training_time
from l2l_hw.training.report import (SAMPLE_BYTES, SAMPLE_PROMPT, PlanAnnouncer, banner, report, state_dir_line,
                                    trained_by_stage)
from l2l_hw.training.signals import REPEAT_S, STOP_SIGNALS, StopSignals, TrainingInterrupted
from l2l_hw.training.state import TrainResult, TrainState

# What callers import from here (cli.py, finetune.py, the benches, the tests): the loop's names and
# its parts' (l2l_hw/training/), as before they moved there.
__all__ = [
    "CHECKPOINT", "COMPONENTS", "CONTROL_FIELDS", "EVAL_BATCHES", "EVENT_FILES", "FINGERPRINT", "MAX_DISCARDED",
    "METRICS", "MODEL", "PLOT", "REPEAT_S", "RESUME_MAY_CHANGE", "RUN_FILES", "SAMPLE_BYTES", "SAMPLE_PROMPT",
    "STOP_SIGNALS", "TENSORBOARD", "ConfigError", "CorpusBatches", "DataOptions", "NonFiniteLoss", "OutputError",
    "RunOptions", "StopSignals", "TrainConfig", "TrainResult", "TrainingInterrupted", "agree_to_start",
    "as_config_error", "build_eps", "build_relay", "check_out", "check_state_dir", "corpus_val_batches",
    "device_share_plan", "earlier_run", "eps_bytes_per_parameter", "leave_together", "load_corpus", "over_tokens",
    "own_state_dir", "perplexity", "pipeline_groups", "planned_options", "plot", "prepare_out", "read_metrics",
    "relay_options", "restore_rng", "resume_config", "rng_tensors", "sharded", "state_dir_line", "train",
    "training_time",
]

MAX_DISCARDED = 100  # steps discarded in a row (non-finite) before the run stops: fp16's scale needs <= 24


class NonFiniteLoss(RuntimeError):
    """A step's loss was not finite and the step was taken: the weights are no longer usable.
    The run stopped before its next checkpoint, so the last one on disk is from before."""


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
    checkpoint = load_for_resume(cfg) if cfg.resume else None
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
        state, corpus = _set_up(cfg, ranks, layers, loss_fn, data, val_data, relay, checkpoint)
        if relay is None:  # a relay built here is closed here on failure; the caller's is theirs
            owned.append(state.relay)
        state.callbacks = list(callbacks)
        if cfg.verbose:
            stages = trained_by_stage(state.relay, cfg, ranks)  # every rank: a collective in a pipeline
            if ranks.lead:
                print(banner(cfg, state.relay, ranks, corpus, stages, checkpoint, state.tokens))
                state.callbacks.append(PlanAnnouncer(state.relay))
        result = _run(state)
        if cfg.remove_state_dir and cfg.state_dir is not None:  # finished: its final checkpoint holds the state
            result.state_dir = own_state_dir(cfg)
        if cfg.verbose:  # every rank: the report gathers the weights (a collective when sharded)
            report(state, result, sample=corpus is not None)
        if ranks.world > 1:  # leave together: rank 0 may still write while a peer tears the group down
            leave_together(ranks)
        return result


def _run(state: TrainState) -> TrainResult:
    """Train to the step target (or cfg.stop_after) a chunk of minibatches at a time, each
    step's row through the non-finite policy into the outputs. A signal stops the run at the
    next step boundary, checkpointed; a finite iterable of data, where it ends."""
    cfg, relay = state.cfg, state.relay
    stop = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
    log = MetricsLog(state.out if state.files else None, cfg.tensorboard, relay.step)
    batches = _batches(state)  # before metrics.jsonl is rewritten: data that ends too soon leaves it whole
    show = cfg.verbose and state.ranks.lead
    with log.opened(state.history, stop, relay.step, show), StopSignals() as signals:
        while relay.step < stop:
            if signals.agreed(state.ranks):  # a safe point: between steps, nothing half written
                _interrupt(state, signals)
            chunk = list(itertools.islice(batches, _chunk_size(state, stop)))
            if not chunk:
                _end_of_data(state, log)
                break
            for row in _train_chunk(state, chunk):
                _apply_nonfinite_policy(state, row)
                if math.isfinite(row["loss"]):  # else a discarded step: the weights are as they were
                    _record(state, row, stop, log)
    return _result(state)


def _batches(state: TrainState) -> Iterator:
    """The data from where the checkpoint left it: without a data state of its own, the first
    `skip` batches of a fresh pass are skipped."""
    batches = iter(state.data)
    for skipped in range(state.skip):
        if next(batches, None) is None:
            raise ConfigError(f"the data ends after {skipped} batches, before the checkpoint's step {state.skip}")
    return batches


def _chunk_size(state: TrainState, stop: int) -> int:
    """How many minibatches the next call trains on: one, or where the relay runs several
    steps as one schedule (a 2BW pipeline: relay.streams), those up to the next validation."""
    step = state.relay.step
    if not state.relay.streams:
        return 1
    return min(stop, (step // state.cfg.eval_interval + 1) * state.cfg.eval_interval) - step


def _train_chunk(state: TrainState, chunk: list) -> list[dict]:
    """Train on each minibatch of `chunk` (one relay call); a metrics row per step, with
    `taken`: whether the step was taken (not discarded for a non-finite gradient)."""
    relay, first = state.relay, state.relay.step
    shards = [rank_shard(batch, *state.shard) for batch in chunk]
    t0 = time.perf_counter()
    losses = relay.train_steps(shards)
    dt = (time.perf_counter() - t0) / len(chunk)
    rows = []
    for k, (batch, loss) in enumerate(zip(chunk, losses)):
        state.elapsed += dt
        step = relay.step if len(chunk) == 1 else first + k + 1  # several: every step is taken
        targets = batch[1][0] if isinstance(batch[1], (tuple, list)) else batch[1]  # HF: (labels, counts)
        # the global minibatch's tokens (B x T targets of a language model), else its samples
        rate = ({"tokens_per_s": targets.numel() / dt} if state.tokens
                else {"samples_per_s": (targets.shape[0] if targets.dim() else 1) / dt})
        rows.append({"step": step, "loss": loss, "lr": relay.eps.lr_at(first + k + 1), **rate,
                     "elapsed": state.elapsed, "taken": step > first + k})
    return rows


def _interrupt(state: TrainState, signals: StopSignals) -> NoReturn:
    """Stop at a signal: the step reached is checkpointed (where it is not yet), then TrainingInterrupted."""
    if state.saved_step != state.relay.step:
        save(state)
    raise TrainingInterrupted(signals.received, state.relay.step, saved=state.out is not None and state.cfg.save,
                              where=signals.where)


def _apply_nonfinite_policy(state: TrainState, row: dict) -> None:
    """Stop the run (NonFiniteLoss) where a step with a non-finite loss was taken (its weights
    are lost), or MAX_DISCARDED steps in a row were discarded (skip_nonfinite, fp16's scale);
    `taken` leaves the row."""
    state.discarded = 0 if row.pop("taken") else state.discarded + 1
    if not math.isfinite(row["loss"]) and state.discarded == 0:
        raise NonFiniteLoss(
            f"the loss is {row['loss']} at step {row['step']} and the step was taken, so the weights "
            f"are not finite now; stopped before any checkpoint of them ({last_checkpoint(state)}). "
            "Lower the learning rate, or set skip_nonfinite to discard such steps")
    if state.discarded >= MAX_DISCARDED:
        raise NonFiniteLoss(f"{state.discarded} steps in a row after step {row['step']} had non-finite "
                            f"gradients and were discarded; stopped ({last_checkpoint(state)})")


def _record(state: TrainState, row: dict, stop: int, log: MetricsLog) -> None:
    """A step's outputs: at an eval point its validation, then its metrics row, then the
    checkpoint (never ahead of its metrics); the history, the callbacks, TensorBoard, the bar."""
    evaluating = row["step"] % state.cfg.eval_interval == 0 or row["step"] == stop
    if evaluating:
        state.val_loss = validate(state, row)
    log.add(row)
    if evaluating:
        save(state)
    state.history.append(row)
    for callback in state.callbacks:
        callback(row)
    log.show(row)


def _end_of_data(state: TrainState, log: MetricsLog) -> None:
    """A finite iterable of data ran out: its last step is validated (its row written again,
    with its val_loss) and checkpointed, where that is not done yet."""
    if state.history and "val_loss" not in state.history[-1]:
        state.val_loss = validate(state, state.history[-1])
        log.rewrite(state.history)
        save(state)


def _result(state: TrainState) -> TrainResult:
    """The run's result, its loss curves plotted; where it trained nothing (resumed at its end),
    the validation of the checkpoint as it is."""
    if state.val_loss is None:
        state.val_loss = evaluate(state)
    if state.files and state.history:
        title = f"l2l finetune {Path(state.cfg.model).name}" if state.cfg.model else "l2l train"
        plot(state.history, state.out / PLOT, title=title)
    return TrainResult(state.relay, state.history, state.val_loss, state.elapsed)


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
    """The state of a run, every input checked first: the output folder, the data, the EPS (its
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
            state = TrainState(cfg, relay, data, val_data, ranks, tokens)
            if checkpoint is not None:  # after building: construction draws from the RNGs restored now
                restore(state, *checkpoint)
        except Exception as e:
            raise as_config_error(e)
        if cfg.out is not None and ranks.lead:
            prepare_out(cfg)
    return state, corpus


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
