"""What a run needs, whatever the machine: host memory, disk and device memory per pipeline
stage (figures), from the layers' traces, the step's replay, the EPS's layout and the host's
parts; needs() bounds a reference GPT too deep to trace by its EPS alone."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass, field

import torch

from l2l_hw.estimate.host import (EpsBytes, checkpoint_bytes, eps_bytes, eps_bytes_per_parameter, files_bytes,
                                  host_parts, tensor_bytes, token_bytes)
from l2l_hw.estimate.ledger import StepMemory, pipeline_step, replay_evaluate, replay_step
from l2l_hw.estimate.trace import ModelTrace, micro_sizes, run_model, stage_trace, trace_model
from l2l_hw.relay.device_share import DEVICE_BYTES_PER_PARAMETER
from l2l_hw.relay.recompute import save_matmuls_and_attention


def layer_policies(cfg, model: ModelTrace) -> list[list[str]]:
    """What each layer keeps for the backward, per kind of step: one list, or with an
    activation budget the first step's (full, measuring) and the plan's (plan_recompute)."""
    L = len(model.traces)
    if cfg.activation_budget is None:
        return [[cfg.recompute if isinstance(cfg.recompute, str) else "selective"] * L]
    from l2l_hw.relay.recompute import plan_recompute

    costs = {}
    for i in range(L - 1):
        traces = model.traces[i]
        weights = sum(nbytes for _, _, nbytes in model.names[i].values())
        own = sum(sum(t.own) for t in traces)
        costs[i] = dict(input=sum(sum(t.inputs) for t in traces), graph=weights + own,
                        kept=sum(sum(t.kept_own) for t in traces),
                        # time proxies: bytes the recompute writes, and those of the ops selective keeps
                        full_s=float(own), kept_s=float(sum(sum(t.kept_own) for t in traces)))
    plan = plan_recompute(costs, cfg.activation_budget)
    return [["full"] * L, [plan.get(i, "full") for i in range(L)]]


# ---------------------------------------------------------------------------- a pipeline's stage
def stage_bounds(cfg, layers: int) -> list[int]:
    """[0, b_1, ..., L]: the layers of each pipeline stage, as PipelineRelay splits them ('auto'
    is planned from a profile at start-up: estimated here as the even split); a geometry the
    pipeline would refuse is refused here, before anything is estimated."""
    return cfg.pipeline_config().bounds(layers)


# ---------------------------------------------------------------------------- the estimate
@dataclass
class Estimate:
    """What a run needs, and whether it fits here. Bytes; `host` and `stages` break the figures
    down (host: one rank's parts; stages: each pipeline stage's device peak)."""

    model: str
    parameters: int  # the model's (trained + frozen)
    trained: int  # kept by the EPS
    device: str
    ranks: int  # processes on this machine (pipeline stages, or torchrun's data-parallel ranks)
    host_bytes: int  # peak resident memory of the run, all its ranks on this machine together
    host: dict[str, int]  # of the largest rank, by what holds it (its largest phase among them)
    host_phases: dict[str, int]  # of the largest rank: the phases that come and go (host_parts)
    disk_bytes: int
    disk: dict[str, int]
    device_bytes: int  # the largest stage's peak device memory (the relay's accounting on the CPU)
    stages: list[dict]
    available: dict[str, int | None] = field(default_factory=dict)
    fits: bool = True
    shortfall: list[str] = field(default_factory=list)
    largest: dict = field(default_factory=dict)  # context, micro_batches, optimizer_state that fit here
    ways_to_fit: list[dict] = field(default_factory=list)  # where it does not fit: the flags that would, and at what
    step_s: float | None = None  # --measure: the estimated seconds a step takes
    profile: dict | None = None  # --measure: what the step time is made of
    schedules: list = field(default_factory=list)  # per stage: its step's actions, each with the device bytes after

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "schedules"}


def world_size(cfg) -> int:
    """Ranks on this machine: torchrun's WORLD_SIZE (data-parallel ranks, or a pipeline's stages
    times its replicas); a pipeline's stages at least."""
    world = 1
    with contextlib.suppress(ValueError):
        world = max(1, int(os.environ.get("WORLD_SIZE", "1")))
    return max(world, cfg.pipeline_stages)


def figures(cfg, baseline: int) -> Estimate:
    """The run's needs (host, disk, device per stage), independent of this machine's free memory."""
    from l2l_hw.relay.precision import compute_dtype

    run = run_model(cfg)
    ranks = world_size(cfg)
    replicas = max(1, ranks // max(1, cfg.pipeline_stages))  # each trains its shard of the minibatch
    per_rank = len(torch.tensor_split(torch.empty(cfg.batch_size, device="meta"), replicas)[0])
    sizes = micro_sizes(per_rank, min(cfg.micro_batches, per_rank))
    budget = cfg.activation_budget is not None
    selective = cfg.recompute if callable(cfg.recompute) else (
        save_matmuls_and_attention if cfg.recompute == "selective" or budget else None)
    model = trace_model(run.layers, run.loss_fn, lambda m: run.inputs(m, cfg.context), sizes,
                        compute_dtype(cfg.precision), selective)
    on_host = not cfg.device.startswith("cuda")
    bounds = stage_bounds(cfg, len(run.layers)) if cfg.pipeline_stages > 1 else [0, len(run.layers)]
    whole_fp32 = (sum(math.prod(s) for t in model.shapes.values() for s in t.values()) * 4 + sum(model.frozen)
                  + sum(tensor_bytes(s, d) for layer in model.buffers for s, d in layer.values()))
    widening = 2 if cfg.precision != "fp32" and cfg.grad_sums == "fp32" else 1  # the gradients' fp32 sums
    stages, hosts, state_dir, schedules = [], [], 0, []
    for s, (first, end) in enumerate(zip(bounds, bounds[1:])):
        sub = stage_trace(model, first, end)
        if len(bounds) > 2:
            policies = ["full" if cfg.activation_budget is not None else
                        cfg.recompute if isinstance(cfg.recompute, str) else "selective"] * (end - first)
            steps = [pipeline_step(sub, s, len(bounds) - 1, policies, on_host, widening, cfg.activations, first)]
            if cfg.activation_budget is not None:  # the plan keeps within its budget, and never less than full
                more = max(0, cfg.activation_budget - steps[0].kept_peak)
                steps = [dataclasses.replace(steps[0], peak=steps[0].peak + more, kept_peak=steps[0].kept_peak + more,
                                             own_peak=steps[0].own_peak + more)]
        else:
            steps = [replay_step(sub, policies, cfg.activations, on_host, widening)
                     for policies in layer_policies(cfg, sub)]
        steps.append(replay_evaluate(sub, on_host, s, len(bounds) - 1, first))  # a validation minibatch
        step = StepMemory(*(max(getattr(st, f.name) for st in steps) for f in dataclasses.fields(StepMemory)
                            if f.name != "actions"), actions=steps[-2].actions)  # the training step's, as planned
        shared = [f"layer{i}" for i in range(cfg.device_update_layers or 0)]  # the device share's groups
        eps = eps_bytes(cfg, {k: v for k, v in sub.shapes.items() if k not in shared})
        shared_bytes = DEVICE_BYTES_PER_PARAMETER * sum(math.prod(s) for k in shared
                                                         for s in sub.shapes.get(k, {}).values())
        if on_host:  # the device is this host: the share's state lives as long as the EPS's
            eps = EpsBytes(eps.memory + shared_bytes, eps.fetched, eps.disk)
        else:
            step = dataclasses.replace(step, peak=step.peak + shared_bytes)
        if cfg.shard_state and replicas > 1:
            eps = EpsBytes(eps.memory // replicas, eps.fetched, eps.disk)
        state_dir += eps.disk * replicas  # state_dir/rankR for each rank
        stages.append({"layers": [first, end], "device_bytes": step.peak, "kept_activation_bytes": step.kept_peak})
        schedules.append(step.actions)
        parts, phases = host_parts(cfg, run, sub, eps, step, baseline=baseline, on_host=on_host,
                                   whole_model=whole_fp32)
        largest_phase = max(phases, key=phases.get)
        hosts.append(({**parts, largest_phase: phases[largest_phase]}, phases))
    host, phases = max(hosts, key=lambda h: sum(h[0].values()))
    saves = cfg.out is not None and cfg.save  # --no-save: no checkpoint, no model folder
    disk = {"checkpoint": checkpoint_bytes(cfg, model)} if saves else {}
    if disk:  # written beside the previous one, which stays until the new one is complete
        disk["checkpoints"] = 2 * disk["checkpoint"]
    if state_dir:
        disk["state_dir"] = state_dir
    if run.folder is not None and saves:  # out/model (fp32 safetensors) beside the one it replaces
        copied = files_bytes(p for p in run.folder.iterdir() if not p.name.startswith("model"))  # tokenizer, config
        disk["model"] = 2 * (whole_fp32 + copied)
    if run.folder is not None and cfg.out is not None:
        disk["tokens"] = token_bytes(cfg)
    trained = sum(math.prod(s) for t in model.shapes.values() for s in t.values())
    frozen = sum(p.numel() for layer in run.layers for p in layer.parameters() if not p.requires_grad)
    every_rank = sum(sum(h.values()) for h, _ in hosts) * replicas
    return Estimate(model=run.name, parameters=trained + frozen, trained=trained, device=cfg.device, ranks=ranks,
                    host_bytes=every_rank, host=host, host_phases=phases,
                    disk_bytes=sum(v for k, v in disk.items() if k != "checkpoint"), disk=disk,
                    device_bytes=max(s["device_bytes"] for s in stages), stages=stages, schedules=schedules)


MAX_TRACED_LAYERS = 10_000  # deeper reference GPTs are not built even on the meta device: the EPS alone is weighed


def deep_model_bound(cfg, baseline: int) -> Estimate:
    """A reference GPT too deep to build on the meta device: its parameters counted from one and
    two blocks, the EPS's bytes for them, the baseline: a lower bound of the host memory."""
    from l2l_hw.models import count_parameters

    one, two = (count_parameters(dataclasses.replace(cfg.model_config(), n_layer=n)) for n in (1, 2))
    trained = one + (cfg.layers - 1) * (two - one)
    host = {"baseline": baseline, "eps": int(trained * eps_bytes_per_parameter(cfg))}
    return Estimate(model=f"the reference GPT, {cfg.layers} layers x {cfg.width} wide (its EPS alone)",
                    parameters=trained, trained=trained, device=cfg.device, ranks=world_size(cfg),
                    host_bytes=sum(host.values()) * world_size(cfg), host=host, host_phases={}, disk_bytes=0, disk={},
                    device_bytes=0, stages=[])


def needs(cfg, baseline: int) -> Estimate:
    """figures(), or for a reference GPT too deep to build, deep_model_bound()."""
    if cfg.model is None and cfg.layers > MAX_TRACED_LAYERS:
        return deep_model_bound(cfg, baseline)
    return figures(cfg, baseline)
