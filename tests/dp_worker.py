"""One rank of a data-parallel test run (tests/test_data_parallel.py starts N of these).

    python -m tests.dp_worker '<json>'    with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set

The json: model (gpt | mlp | mlp4 | coherent), optimizer, steps, batch, micro_batches, shard_state,
clip_grad_norm, clip_mode, precision, pipedream_2bw, grad_compression and powersgd_rank
(Relay's), inf_at_step (rank 0's gradient of layer1 overflows in that step; the worker
records whether the step left the state unchanged and halved the loss scale), start (first
step index, for resumed runs), load (a state file to resume from), save (write
relay.state_dict() there at the end), out (rank 0 writes the trained parameters, the
per-step losses and every rank's share of the EPS there), die_before_step (this rank exits
abruptly), timeout (seconds, the process group's), record (each rank writes the gradients its
EPS received in the first step to "{record}.{rank}", as received).
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
from l2l_hw.distributed import rank_shard
from tests.helpers import coherent_batches, coherent_layers, mlp_layers, record_pushes
from tests.test_relay_equivalence import MODELS, OPTIMIZERS

MODELS = {**MODELS, "coherent": (coherent_layers, coherent_batches, torch.nn.functional.mse_loss),
          "mlp4": (lambda: mlp_layers(depth=4), MODELS["mlp"][1], torch.nn.functional.mse_loss)}  # the pipeline tests'


def main(cfg: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.get("timeout", 60)))
    rank, world = dist.get_rank(), dist.get_world_size()
    make_model, make_batches, loss_fn = MODELS[cfg["model"]]
    eps = l2l_hw.make_eps("cpu", shard_state=cfg.get("shard_state", False), **OPTIMIZERS[cfg["optimizer"]][0])
    relay = l2l_hw.Relay(make_model(), loss_fn, eps=eps, micro_batches=cfg.get("micro_batches", 2),
                         precision=cfg.get("precision", "fp32"),
                         clip_grad_norm=cfg.get("clip_grad_norm"), clip_mode=cfg.get("clip_mode", "layer"),
                         pipedream_2bw=cfg.get("pipedream_2bw", False), device=cfg.get("device", "cpu"),
                         grad_compression=cfg.get("grad_compression", "none"),
                         powersgd_rank=cfg.get("powersgd_rank", 4),
                         device_update_layers=cfg.get("device_update_layers", 0))
    if cfg.get("load"):
        relay.load_state_dict(safetensors.torch.load_file(cfg["load"]))
    pushed = {}
    if cfg.get("record"):
        record_pushes(eps, pushed)
    batches = make_batches(cfg["steps"], batch=cfg["batch"])
    losses, report = [], {}
    for step, (x, y) in enumerate(batches[cfg.get("start", 0):], start=cfg.get("start", 0)):
        if step == cfg.get("die_before_step") and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no clean-up, no goodbye
        x, y = rank_shard((x, y), rank, world)
        if step == cfg.get("inf_at_step"):  # rank 0's own gradient of layer1 overflows
            before, scale = eps.state_dict(), relay.loss_scale
            launch = relay.dp.launch

            def overflow(key, grads):
                if key == "layer1" and rank == 0:
                    grads = {n: g.clone() for n, g in grads.items()}
                    next(iter(grads.values())).view(-1)[-1] = float("inf")
                return launch(key, grads)

            relay.dp.launch = overflow
            losses.append(relay.train_step(x, y))
            relay.dp.launch = launch
            after = eps.state_dict()  # gathered on rank 0
            report["unchanged"] = torch.tensor([all(torch.equal(v, after[k]) for k, v in before.items())])
            report["scale_halved"] = torch.tensor([relay.loss_scale == scale / 2])
            continue
        losses.append(relay.train_step(x, y))
        if cfg.get("record") and step == cfg.get("start", 0):
            safetensors.torch.save_file({f"{k}/{n}": g.contiguous() for k, group in pushed.items()
                                         for n, g in group.items()}, f"{cfg['record']}.{rank}")
    state = relay.state_dict()  # a collective with a sharded EPS: every rank calls it
    params = {f"{i}.{n}": p for i, layer in enumerate(relay.materialize()) for n, p in layer.state_dict().items()}
    flags = torch.stack([report.get(k, torch.tensor([True])).int() for k in ("unchanged", "scale_halved")]).view(-1)
    flags_all = [torch.zeros(2, dtype=torch.int32) for _ in range(world)]
    dist.all_gather(flags_all, flags.int())
    held = torch.tensor([sum(s.numel() for g in (eps.inner if cfg.get("shard_state") else eps).shapes.values()
                             for s in g.values())])
    everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(everyone, held)
    if rank == 0:
        if cfg.get("save"):
            safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, cfg["save"])
        if cfg.get("out"):
            safetensors.torch.save_file({**params, "losses": torch.tensor(losses, dtype=torch.float64),
                                         "held": torch.cat(everyone), "flags": torch.stack(flags_all),
                                         "step": torch.tensor([eps.step])}, cfg["out"])
    dist.barrier()  # rank 0 writes while the others would tear the group down: gloo can abort on that
    relay.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
