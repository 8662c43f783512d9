"""The peers a user would pick instead of the relay, each in its documented best configuration.

Every peer trains transformers' LlamaForCausalLM built from the same config.json as the
relay's folder, on the same minibatches (finetune_data.finetune_batches with the same seed,
batch and context, the tenth `l2l finetune` holds out left out), with the same micro-batches
and AdamW settings, bf16 compute with fp32 master weights and optimizer state, and
transformers' activation checkpointing (gradient_checkpointing_enable, non-reentrant: every
decoder layer's input kept, its inside recomputed), as the relay recomputes every layer.
Each peer runs in its own process (`python -m l2l_hw.bench.gpu_peers '{json}'`) under
l2l_hw.bench.gpu_watch, as `l2l finetune` does, and appends one row per step to a JSON
Lines file: its step time, tokens/s and loss.

  zero3_offload  DeepSpeed ZeRO-3, offload_param and offload_optimizer to the CPU, pinned:
                 the model built partitioned (transformers' from_config under
                 HfDeepSpeedConfig: deepspeed.zero.Init), DeepSpeedCPUAdam (the optimizer
                 section's AdamW with offload), overlap_comm, contiguous_gradients, buckets
                 and prefetch sized from the hidden size as transformers' "auto" values do
                 (reduce_bucket_size h^2, stage3_prefetch_bucket_size 0.9 h^2,
                 stage3_param_persistence_threshold 10 h), stage3_max_live_parameters and
                 stage3_max_reuse_distance 1e9 and sub_group_size 1e9 (DeepSpeed's defaults,
                 its docs' offload examples)
  zero2_offload  DeepSpeed ZeRO-2 with offload_optimizer to the CPU, pinned (ZeRO-Offload):
                 bf16 weights and gradients on the GPU, fp32 master and AdamW state on the host,
                 DeepSpeedCPUAdam, overlap_comm, contiguous_gradients, reduce_scatter,
                 allgather and reduce buckets 2e8 (DeepSpeed's ZeRO-Offload tutorial)
  fsdp2_offload  PyTorch FSDP2 on one rank: fully_shard on every decoder layer and the root
                 with CPUOffloadPolicy(pin_memory=True) and MixedPrecisionPolicy(param_dtype
                 bf16, reduce_dtype fp32); AdamW on the host's fp32 shards (fused, torch's CPU
                 kernel); gradient sync only on the last micro-batch (set_requires_gradient_sync)
  torch_resident plain PyTorch on the GPU where the model fits: fp32 weights, bf16 autocast,
                 fused AdamW, the same checkpointing; where it cannot fit (16 B per parameter
                 before activations, more than the device has) it is not started and says so

The dry run runs each on the CPU: DeepSpeed on its CPU accelerator (DS_ACCELERATOR=cpu,
the gloo backend), FSDP2 on one gloo rank without pinning, DeepSpeedCPUAdam as on the GPU.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

PEERS = ("zero3_offload", "zero2_offload", "fsdp2_offload", "torch_resident")
# Host bytes per parameter each peer keeps (DeepSpeed's estimate_zero3/zero2_model_states_mem_needs,
# before their buffer factor; FSDP2: fp32 shard, fp32 gradient, m, v); torch_resident keeps none.
HOST_BYTES_PER_PARAMETER = {"zero3_offload": 18, "zero2_offload": 16, "fsdp2_offload": 16, "torch_resident": 0}
DEEPSPEED_BUFFER_FACTOR = 1.5  # the additional_buffer_factor of DeepSpeed's own estimators
RESIDENT_DEVICE_BYTES_PER_PARAMETER = 16  # fp32 weights and gradients, AdamW's m and v


def _pinned(nbytes: float) -> int:
    """A block of PyTorch's pinned host allocator: the request rounded up to a power of two."""
    return 1 << max(0, math.ceil(math.log2(nbytes)))


def host_bytes(peer: str, parameters: int) -> float:
    """The host memory a peer needs for a model of `parameters`, the larger of DeepSpeed's estimate
    (bytes per parameter x its buffer factor 1.5; FSDP2 the same rule) and, for ZeRO-2 offload, its
    buffers as stage_1_and_2.py allocates them, which the estimate leaves short: three flat buffers
    over the whole model pinned whole (the fp32 master and its fp32 gradient, 4 B a parameter each,
    the bf16 copy, 2 B), each a power of two in the pinned allocator; a pinned bf16 gradient
    accumulator per parameter (2 B); AdamW's m and v (8 B); the unpinned fp32 clone the master is
    pinned from (4 B). On the H200 machine (125 GiB) ZeRO-2 offload was killed by the OOM killer
    before its first step at 4.76 B parameters, inside DeepSpeed's estimate (106 GiB)."""
    estimate = HOST_BYTES_PER_PARAMETER[peer] * DEEPSPEED_BUFFER_FACTOR * parameters
    if peer != "zero2_offload":
        return estimate
    buffers = 2 * _pinned(4 * parameters) + _pinned(2 * parameters) + (2 + 8 + 4) * parameters
    return max(estimate, buffers)


def deepspeed_config(peer: str, hidden: int, micro_batch: int, micro_batches: int, adamw: dict, pin: bool) -> dict:
    """The DeepSpeed config of a ZeRO peer (docs/BENCHMARKS.md shows both)."""
    zero = {"overlap_comm": True, "contiguous_gradients": True,
            "offload_optimizer": {"device": "cpu", "pin_memory": pin}}
    if peer == "zero3_offload":
        zero.update(stage=3, offload_param={"device": "cpu", "pin_memory": pin}, reduce_bucket_size=hidden * hidden,
                    stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
                    stage3_param_persistence_threshold=10 * hidden, stage3_max_live_parameters=int(1e9),
                    stage3_max_reuse_distance=int(1e9), sub_group_size=int(1e9))
    else:
        zero.update(stage=2, reduce_scatter=True, allgather_partitions=True, allgather_bucket_size=int(2e8),
                    reduce_bucket_size=int(2e8))
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": micro_batches,
            "bf16": {"enabled": True}, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
            "optimizer": {"type": "AdamW", "params": {"lr": adamw["lr"], "betas": list(adamw["betas"]),
                                                      "eps": adamw["eps"], "weight_decay": adamw["weight_decay"]}},
            "zero_optimization": zero}


def _minibatches(spec: dict):
    """The minibatches `l2l finetune` trains on: the same function, seed and held-out tenth."""
    from l2l_hw import finetune_data

    batches = finetune_data.finetune_batches(spec["model"], spec["data"], spec["batch"], spec["context"],
                                             seed=spec["seed"], cache=Path(spec["cache"]))
    held = len(batches) // 10 or (1 if len(batches) > 1 else 0)
    return batches[held:]


def _deepspeed(spec: dict, config, device):
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    u = spec["micro_batches"]
    ds = deepspeed_config(spec["peer"], config.hidden_size, spec["batch"] // u, u, spec["adamw"],
                          pin=device.type == "cuda")
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    keep = HfDeepSpeedConfig(ds) if spec["peer"] == "zero3_offload" else None  # from_config then builds under zero.Init
    if keep is None:
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)

    def step(micro) -> float:
        total = 0.0
        for x, y in micro:
            loss = engine(input_ids=x.to(device), labels=y.to(device)).loss
            engine.backward(loss)
            engine.step()  # the optimizer steps at the last micro-batch (gradient_accumulation_steps)
            total += loss.item() / u
        return total

    return step, (keep, engine)


def _fsdp2(spec: dict, config, device):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    with device:  # initialized where it is fast; fully_shard moves the shards to the host
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                  offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda"))
    for layer in model.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    before = lambda j: model.set_requires_gradient_sync(j == spec["micro_batches"] - 1)  # noqa: E731  sync once
    return _torch_step(spec, model, device, fused=True, before=before), model


def _resident(spec: dict, config, device):
    import torch
    from transformers import AutoModelForCausalLM

    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return _torch_step(spec, model, device, fused=device.type == "cuda", autocast=True), model


def _torch_step(spec: dict, model, device, fused: bool, autocast: bool = False, before=lambda j: None):
    """A PyTorch step over the micro-batches: gradients summed, then AdamW (FSDP2, resident)."""
    import contextlib

    import torch

    a, u = spec["adamw"], spec["micro_batches"]
    opt = torch.optim.AdamW(model.parameters(), lr=a["lr"], betas=tuple(a["betas"]), eps=a["eps"],
                            weight_decay=a["weight_decay"], **({"fused": True} if fused else {}))
    cast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

    def step(micro) -> float:
        total = 0.0
        for j, (x, y) in enumerate(micro):
            before(j)
            with cast():
                loss = model(input_ids=x.to(device), labels=y.to(device)).loss / u
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    step.optimizer = opt  # kept alive with the step
    return step


BUILDERS = {"zero3_offload": _deepspeed, "zero2_offload": _deepspeed, "fsdp2_offload": _fsdp2,
            "torch_resident": _resident}


def peer_main(spec: dict) -> None:
    """Build the peer, train warmup + timed steps, one row per step into spec["rows"]."""
    import torch
    from transformers import AutoConfig

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
    config = AutoConfig.from_pretrained(spec["model"])
    batches = _minibatches(spec)
    step, keep = BUILDERS[spec["peer"]](spec, config, device)
    u = spec["micro_batches"]
    with open(spec["rows"], "a") as rows:
        for k in range(spec["steps"]):
            inputs, (labels, _) = batches[k % len(batches)]
            micro = list(zip(inputs.tensor_split(u), labels.tensor_split(u)))
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step(micro)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            rows.write(json.dumps({"step": k + 1, "loss": loss, "seconds": seconds,
                                   "tokens_per_s": labels.numel() / seconds}) + "\n")
            rows.flush()
    del keep


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(spec["port"]))
    peer_main(spec)
