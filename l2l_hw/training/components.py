"""A run's components, built from its config: the EPS (this rank's state_dir), the relay (or this
rank's pipeline stage, with its process groups) around the layers, and the device share of the
update planned for it."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

import torch

from l2l_hw.distributed import Ranks, rank_and_world, stage_groups
from l2l_hw.eps import make_eps
from l2l_hw.eps.disk_store import held_state
from l2l_hw.eps.options import EpsOptions, ScheduleOptions
from l2l_hw.estimate import measure_step, run_model
from l2l_hw.models import build_gpt, lm_loss
from l2l_hw.models.gpt import build_gpt_meta
from l2l_hw.options import pick
from l2l_hw.relay import Relay, RelayOptions
from l2l_hw.relay.device_share import (SharePlan, device_free_bytes, plan_device_share, share_problem,
                                       time_device_update)
from l2l_hw.relay.schedule import Schedule
from l2l_hw.relay.stage import registered_groups
from l2l_hw.relay.transport import torch_device
from l2l_hw.training.config import ConfigError, TrainConfig


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


def sharded(cfg: TrainConfig, ranks: Ranks) -> bool:
    """Sharding needs ranks to share with (a pipeline stage's replicas): a sharded run resumed on
    one process (or as one pipeline) is replicated."""
    return cfg.shard_state and ranks.world > max(1, cfg.pipeline_stages)
