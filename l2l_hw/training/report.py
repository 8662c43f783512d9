"""What a run says on the terminal: the banner before the first step (the model, the data per
step, the optimizer, the EPS and its memory, the pipeline's stages, where a resumed run picks up),
the recompute plan once the first step has made it, and the end lines (the final validation,
the files written, a sample of the reference GPT, the state_dir)."""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from l2l_hw.distributed import Ranks
from l2l_hw.eps.base import STATE_SLOTS
from l2l_hw.eps.disk_store import state_bytes
from l2l_hw.eps.options import LAMB_LR
from l2l_hw.estimate import eps_bytes_per_parameter
from l2l_hw.models import Corpus, generate
from l2l_hw.relay.device_share import DEVICE_BYTES_PER_PARAMETER
from l2l_hw.training.components import sharded
from l2l_hw.training.config import TrainConfig
from l2l_hw.training.files import CHECKPOINT, METRICS, PLOT
from l2l_hw.training.metrics import perplexity, training_time
from l2l_hw.training.state import TrainResult, TrainState

SAMPLE_PROMPT, SAMPLE_BYTES = b"def ", 200


def trained_by_stage(relay, cfg: TrainConfig, ranks: Ranks) -> list[int]:
    """The parameters each pipeline stage's EPS trains (one entry without a pipeline)."""
    trained = sum(math.prod(shape) for names in relay.eps.shapes.values() for shape in names.values())
    if cfg.pipeline_stages == 1 or ranks.world == 1:
        return [trained]
    import torch.distributed as dist

    counts = [0] * ranks.world
    dist.all_gather_object(counts, trained)
    return counts[:cfg.pipeline_stages]  # the first replica's stages (rank = replica * stages + stage)


class PlanAnnouncer:
    """A training-loop callback that prints the planned recompute once the first step has made it."""

    def __init__(self, relay):
        self.relay, self.said = relay, relay.keep.describe()

    def __call__(self, row: dict) -> None:
        now = self.relay.keep.describe()
        if now != self.said:
            print(f"recompute {now}")
            self.said = now


def banner(cfg: TrainConfig, relay, ranks: Ranks, corpus: Corpus | None, stages: list[int],
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


def report(state: TrainState, result: TrainResult, sample: bool) -> None:
    """The end lines, on rank 0: the step reached, the final validation, the training time, the
    files written; `sample`: the reference GPT's continuation of SAMPLE_PROMPT."""
    # The reference GPT's sample needs the whole model: every rank (a sharded EPS gathers it)
    model = result.relay.materialize() if sample else None
    if not state.ranks.lead:
        return
    cfg = state.cfg
    val = ("" if result.val_loss is None else f"  final val loss {result.val_loss:.4f}"
           + (f" (perplexity {perplexity(result.val_loss):.4g})" if state.tokens else ""))
    print(f"step {result.relay.step}/{cfg.steps}{val}  ({training_time(result.elapsed, state.resumed_elapsed)})")
    if state.files:
        written = [state.out / name for name in (METRICS, PLOT, CHECKPOINT) if (state.out / name).exists()]
        print(f"wrote {', '.join(map(str, written))}")
    if sample and not all(torch.isfinite(p).all() for p in model.parameters()):
        print("no sample: the weights are not finite")
    elif sample:
        text = generate(model, SAMPLE_PROMPT, SAMPLE_BYTES, temperature=0.8, top_k=40, block_size=cfg.context,
                        generator=torch.Generator().manual_seed(cfg.seed))
        print("sample:\n" + (SAMPLE_PROMPT + text).decode("utf-8", errors="replace"))
    if cfg.state_dir is not None:
        print(state_dir_line(cfg))


def state_dir_line(cfg: TrainConfig) -> str:
    """The end line about --state-dir: where it is, its size, whether it may go."""
    size = _size(state_bytes(cfg.state_dir))
    if cfg.remove_state_dir:
        return f"state dir {cfg.state_dir}: {size} on disk, removed as the run closes (--remove-state-dir)"
    why = ("the final checkpoint holds all of it" if cfg.save and cfg.out is not None else
           "no checkpoint was written, so no run resumes from it")
    return (f"state dir {cfg.state_dir}: {size} on disk, scratch space of the EPS; {why}: it may be deleted "
            "(--remove-state-dir removes it at the end)")


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n < 2**50 else f"{n / 2**30:.3g} GiB"


def _size(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else _gib(n)
