"""One rank of a pipeline test run (tests/test_pipeline.py starts S of these).

    python -m tests.pipe_worker '<json>'    with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set

The json: model (a key of tests.test_pipeline.MODELS), optimizer, steps, batch, micro_batches,
schedule (flush | 2bw), boundaries, start (first step index), load (a whole-model relay state to
resume from), save (rank 0 writes the whole model's relay state there at the end), out (rank 0
writes the trained parameters and per-step losses there), fail_at_step (the last stage's last
layer raises in that step), die_at_step (the last rank exits abruptly), timeout (seconds), stream (steps per
train_steps call: one schedule over their micro-batches; default one train_step a step), precision,
record (each rank writes the gradients its EPS received in the first step to "{record}.{rank}", by
the whole model's group names), precision / recompute / activations / device (RelayOptions), memory (a list
of layer counts per stage: each rank trains a pipeline of that many identical blocks a stage for each and
writes its stage's peak device memory to "{out}.{rank}"), inf_at_step (rank 0's gradients overflow in
that step), layer_drop / layer_drop_seed / droppable (the Relay's layer drop), activation_budget (out's
"kept": per rank the kept activations' peak bytes, -1 without account_memory, and the layers planned to keep more
than their input), replicas (data parallel replicas of each stage:
the world is stages x replicas, rank = replica * stages + stage, each replica trains its shard of the minibatch).
A PipelineError is printed as one line on stderr, exit code 2 (the pipeline closed, the interpreter's own exit).
"""
import datetime
import json
import os
import signal
import sys

import safetensors.torch
import torch
import torch.distributed as dist

import l2l_hw
from l2l_hw.distributed import rank_shard, stage_groups
from l2l_hw.eps.base import tensor_of
from l2l_hw.relay.options import PipelineConfig

RELAY_OPTIONS = ("precision", "recompute", "activations", "device", "clip_grad_norm", "clip_mode", "skip_nonfinite",
                 "layer_drop", "activation_budget", "account_memory")
from l2l_hw.relay.pipeline import PipelineError, PipelineRelay
from tests.helpers import record_pushes
from tests.test_pipeline import EPS_BACKEND, MODELS, OPTIMIZERS, RNG_SEED


class Boom(torch.nn.Module):
    def __init__(self, layer, step_of):
        super().__init__()
        self.layer, self.step_of = layer, step_of

    def forward(self, x):
        if self.step_of():
            raise RuntimeError("boom: this layer fails on purpose")
        return self.layer(x)


def finetune_hf(cfg: dict) -> None:
    """A Hugging Face model (cfg["hf"], a local folder) fine-tuned by the pipeline; rank 0 saves it
    as a transformers folder (cfg["save_hf"])."""
    from l2l_hw import hf
    from tests.test_pipeline import hf_batches

    folder = hf.model_folder(cfg["hf"])
    model = hf.skeleton(folder)
    layers, loss_fn = hf.split(model)
    relay = PipelineRelay(layers, loss_fn, l2l_hw.make_eps(EPS_BACKEND, **OPTIMIZERS["adamw"][0]),
                          pipeline=PipelineConfig(stages=dist.get_world_size(), schedule=cfg.get("schedule", "flush")),
                          init=hf.LayerInit(folder, model, layers), no_decay=hf.no_decay_rule(model, layers),
                          micro_batches=2)
    with relay:
        for inputs, targets in hf_batches(loss_fn, cfg["steps"]):
            relay.train_step(inputs, targets)
        whole = relay.gather()
        if dist.get_rank() == 0:
            hf.save_pretrained(whole, cfg["save_hf"])


def peak_memory(cfg: dict) -> None:
    """Per layer count of cfg["memory"]: a pipeline of identical blocks, that many a stage, trained for
    cfg["steps"] steps; this stage's peak device memory (relay accounting) for each, in "{out}.{rank}"."""
    from tests.test_pipeline import block_batches, blocks

    peaks = {}
    for per_stage in cfg["memory"]:
        relay = PipelineRelay(blocks(per_stage * dist.get_world_size()), torch.nn.functional.mse_loss,
                              l2l_hw.make_eps(EPS_BACKEND, **OPTIMIZERS["adamw"][0]),
                              pipeline=PipelineConfig(stages=dist.get_world_size(), schedule=cfg["schedule"]),
                              micro_batches=cfg["micro_batches"], activations=cfg.get("activations", "device"),
                              account_memory=True)
        with relay:
            for x, y in block_batches(cfg["steps"], cfg["batch"]):
                relay.train_step(x, y)
            peaks[per_stage] = relay.memory_report()["peak_bytes"]
    with open(f"{cfg['out']}.{dist.get_rank()}", "w") as f:
        json.dump(peaks, f)


def main(cfg: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.get("timeout", 60)))
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.get("hf") or cfg.get("memory"):
        (finetune_hf if cfg.get("hf") else peak_memory)(cfg)
        dist.barrier()
        dist.destroy_process_group()
        return
    make_model, make_batches, loss_fn = MODELS[cfg["model"]]
    layers = list(make_model())
    current = {"step": -1}
    if cfg.get("fail_at_step") is not None:
        layers[-1] = Boom(layers[-1], lambda: current["step"] == cfg["fail_at_step"])
    replicas = cfg.get("replicas", 1)
    stages = world // replicas
    replica = rank // stages
    group, replica_group = stage_groups(stages)
    shard = (lambda batch: rank_shard(batch, replica, replicas))
    sharded = cfg.get("shard_state", False)  # over the stage's replicas
    eps = l2l_hw.make_eps(EPS_BACKEND, **OPTIMIZERS[cfg["optimizer"]][0], shard_state=sharded,
                          process_group=replica_group if sharded else None)
    pipeline = PipelineConfig(stages=stages, schedule=cfg.get("schedule", "flush"), boundaries=cfg.get("boundaries"),
                              timeout_s=cfg.get("timeout", 60))
    relay = PipelineRelay(layers, loss_fn, eps, pipeline=pipeline, group=group, replicas=replica_group,
                          micro_batches=cfg.get("micro_batches", 4), layer_drop_seed=cfg.get("layer_drop_seed", 0),
                          droppable=cfg.get("droppable"), **{k: cfg[k] for k in RELAY_OPTIONS if k in cfg})
    if cfg.get("inf_at_step") is not None and rank == 0:  # stage 0's own gradient overflows at that step
        push = relay.layer_stage.push
        relay.layer_stage.push = lambda key, grads: push(key, {n: g.fill_(float("inf")) if current["step"] == cfg["inf_at_step"]
                                                           else g for n, g in grads.items()})
    pushed = {}
    if cfg.get("record"):
        record_pushes(eps, pushed)
    if cfg.get("load"):
        relay.load_state_dict(safetensors.torch.load_file(cfg["load"]))
    start = cfg.get("start", 0)
    torch.manual_seed(RNG_SEED + start)
    losses = []
    batches = make_batches(cfg["steps"], batch=cfg["batch"])[start:]
    try:
        if cfg.get("stream"):
            for k in range(0, len(batches), cfg["stream"]):
                losses += relay.train_steps([shard(batch) for batch in batches[k:k + cfg["stream"]]])
        for step, (x, y) in enumerate(batches if not cfg.get("stream") else [], start=start):
            current["step"] = step
            if step == cfg.get("die_at_step") and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: no clean-up, no goodbye
            losses.append(relay.train_step(*shard((x, y))))
            if cfg.get("record") and step == start:  # a stage's groups: the whole model's layer{i}
                safetensors.torch.save_file({f"{k}/{n}": g.contiguous()
                                             for k, group in pushed.items() for n, g in group.items()},
                                            f"{cfg['record']}.{rank}")
    except PipelineError as exc:
        print(f"rank {rank}: PipelineError: {exc}", file=sys.stderr, flush=True)
        relay.close()  # before the group goes: a transfer the failure left waiting is cancelled
        dist.destroy_process_group()
        sys.exit(2)
    x, y = make_batches(1, batch=cfg["batch"])[0]
    evaluated = relay.evaluate(*shard((x, y)))
    state = relay.full_state_dict() if cfg.get("save") else None
    if cfg.get("entries"):  # what a checkpoint streams: on rank 0, another stage's entries come when read
        received = []
        receive_one = relay.links.receive_one
        relay.links.receive_one = lambda *a: received.append(a) or receive_one(*a)
        entries = relay.state_entries()
        lazy, read = [], {}
        if received:
            raise AssertionError(f"rank {rank} received {len(received)} entries before reading any")
        for n, e in entries.items():
            read[n] = tensor_of(e).clone()
            if received:  # this read received it from its stage
                lazy.append(n)
                received.clear()
        whole = relay.full_state_dict()
        if rank == 0:
            safetensors.torch.save_file({**{f"read.{n}": t for n, t in read.items()},
                                         **{f"whole.{n}": t.contiguous() for n, t in whole.items()}}, cfg["entries"])
            with open(cfg["entries"] + ".json", "w") as f:
                json.dump({"lazy": sorted(lazy)}, f)
        elif entries:
            raise AssertionError(f"rank {rank} kept {len(entries)} entries of a checkpoint rank 0 writes")
    model = relay.materialize()
    mine = torch.tensor([relay.layer_stage.eps.step, relay.layer_stage.loss_scale], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    plan = getattr(relay.keep, "plan", None) or {}  # planned recompute's: layer -> policy
    kept = torch.tensor([relay.memory_report()["kept_activation_peak_bytes"] if cfg.get("account_memory") else -1,
                         sum(policy != "full" for policy in plan.values())], dtype=torch.float64)
    kept_by_rank = [torch.zeros_like(kept) for _ in range(world)]
    dist.all_gather(kept_by_rank, kept)
    if rank == 0:
        if cfg.get("save"):
            safetensors.torch.save_file(state, cfg["save"])
        if cfg.get("out"):
            out = {f"{i}.{n}": t.detach().contiguous() for i, layer in enumerate(model)
                   for n, t in layer.state_dict().items()}
            out["losses"] = torch.tensor(losses, dtype=torch.float64)
            out["eval"] = torch.tensor([evaluated], dtype=torch.float64)
            out["steps_and_scales"] = torch.stack(every)  # per rank: its EPS's step and its loss scale
            out["kept"] = torch.stack(kept_by_rank)  # per rank: kept activations' peak, layers planned past full
            safetensors.torch.save_file(out, cfg["out"])
    dist.barrier()  # rank 0 writes while the others would tear the group down: gloo can abort on that
    relay.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
