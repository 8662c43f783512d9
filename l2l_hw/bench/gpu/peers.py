"""The peers a user would pick instead of the relay, each with its documented knobs, its grid and its own estimator.

Every side of a comparison (the relay and each peer) is a `kind` below. Each starts from the
same saved model (the regime's GPT state file, or its Llama folder through transformers'
from_pretrained), trains on the same minibatches with the same loss (the minibatch's mean
token loss) and the same AdamW, bf16 compute with fp32 master weights and fp32 optimizer state,
and picks its own batch shape: `micro_batch` sequences a micro-batch, accumulated over
batch / micro_batch micro-batches, the same tokens a step for all.

    relay              the relay (l2l_hw.Relay, or hf.from_pretrained as `l2l finetune` builds it),
                       the CPU EPS; knobs: micro_batch, recompute, activations
    torch_compiled     (GPT) PyTorch resident in the relay's own recipe (partners.py's "recipe"),
                       every block compiled (Inductor); knobs: micro_batch, checkpointed
    torch_checkpointed (Llama) PyTorch resident: fp32 weights, bf16 autocast, fused AdamW,
                       transformers' activation checkpointing (non-reentrant); knob: micro_batch
    zero2_offload      DeepSpeed ZeRO-2, offload_optimizer to the CPU (ZeRO-Offload): bf16
                       weights and gradients on the device, fp32 master and AdamW on the host
                       (DeepSpeedCPUAdam); knobs: reduce_bucket_size, allgather_bucket_size,
                       overlap_comm, pin_memory, checkpointed
    zero3_offload      DeepSpeed ZeRO-3, offload_param and offload_optimizer to the CPU, the model
                       loaded partitioned (HfDeepSpeedConfig: zero.Init); knobs:
                       stage3_prefetch_bucket_size, stage3_param_persistence_threshold,
                       reduce_bucket_size, overlap_comm, pin_memory, sub_group_size, checkpointed
    fsdp2_offload      PyTorch FSDP2 on one rank, fully_shard on every decoder layer and the root,
                       CPUOffloadPolicy (the sharded fp32 parameters, their gradients and AdamW on
                       the host), MixedPrecisionPolicy(bf16, reduce fp32); knobs:
                       reshard_after_forward (False keeps the gathered bf16 weights on the device
                       from forward to backward: the optimizer-offload shape), prefetch (layers
                       gathered ahead, explicitly: set_modules_to_forward/backward_prefetch),
                       pin_memory, checkpointed

A grid (GRIDS) is tried in a short pre-run at the size compared: first the batch shapes with
the documented defaults (`base`), then each variation alone on the fastest shape; the fastest
point that ran wins. DeepSpeed's config dicts are validated by DeepSpeed's own DeepSpeedConfig
(validate_deepspeed), which rejects an unknown or ill-typed key, before anything runs.

Sizes: each side's host and device needs at a depth (`needs`) come from its own estimator:
DeepSpeed's estimate_zero2_model_states_mem_needs and estimate_zero3_model_states_mem_needs
(deepspeed.runtime.zero), the relay's EPS layout (l2l_hw.train.eps_bytes_per_parameter, what
`l2l finetune`'s banner reports), the plain byte counts for PyTorch and FSDP2 (which have
none); plus margins, each named in the JSON ("how"): the activations of the side's micro-batch
(activation_bytes), its buckets and prefetch, and ZeRO-2 offload's pinned buffers as its
stage_1_and_2.py allocates them (rounded to powers of two by the pinned allocator), which
DeepSpeed's estimate leaves short (the H200 host's OOM killer ended it inside the estimate).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

SIDES = ("relay", "torch_compiled", "torch_checkpointed", "zero2_offload", "zero3_offload", "fsdp2_offload")
PEERS = SIDES[1:]
FAMILY = {"relay": "relay", "torch_compiled": "torch", "torch_checkpointed": "torch", "zero2_offload": "deepspeed",
          "zero3_offload": "deepspeed", "fsdp2_offload": "fsdp2"}  # one process per family (sides.py)
PYTORCH = ("torch_compiled", "torch_checkpointed", "fsdp2_offload")  # the drift's reference: PyTorch itself
DEEPSPEED_BUFFER_FACTOR = 1.5  # the additional_buffer_factor of DeepSpeed's own estimators
FSDP2_HOST_BYTES_PER_PARAMETER = 16  # fp32 shard, its fp32 gradient, AdamW's m and v
RESIDENT_DEVICE_BYTES_PER_PARAMETER = {"torch_checkpointed": 16, "torch_compiled": 18}  # partners.py
HOST_PROCESS_BYTES = 3 * 2**30  # a side's process outside its model: torch, CUDA's context, DeepSpeed's ops


def _pinned(nbytes: float) -> int:
    """A block of PyTorch's pinned host allocator: the request rounded up to a power of two."""
    return 1 << max(0, math.ceil(math.log2(max(nbytes, 1))))


@dataclass(frozen=True)
class Grid:
    """A side's documented defaults, the batch shapes tried with them, and each variation
    tried alone on the fastest shape."""

    base: dict
    shapes: tuple[int, ...]  # sequences a micro-batch
    variations: tuple[dict, ...] = ()

    def first_points(self) -> list[dict]:
        return [{**self.base, "micro_batch": m} for m in self.shapes]

    def second_points(self, best: dict) -> list[dict]:
        return [{**best, **v} for v in self.variations if any(best.get(k) != x for k, x in v.items())]


def grid(kind: str, hidden: int, shapes: tuple[int, ...], variations: bool = True) -> Grid:
    """The grid of `kind` on a model of width `hidden` (the buckets' "auto" values scale with it,
    as transformers' DeepSpeed integration sets them: reduce_bucket_size h^2, prefetch 0.9 h^2,
    persistence threshold 10 h). `variations` False: the shapes only."""
    h2 = hidden * hidden
    grids = {
        "relay": Grid({"recompute": "full", "activations": "device"}, shapes,
                      ({"recompute": "selective"}, {"activations": "host"})),
        "torch_compiled": Grid({"checkpointed": False}, shapes, ({"checkpointed": True},)),
        "torch_checkpointed": Grid({}, shapes),
        "zero2_offload": Grid({"overlap_comm": True, "reduce_bucket_size": int(2e8), "allgather_bucket_size": int(2e8),
                               "pin_memory": True, "checkpointed": True}, shapes,
                              ({"reduce_bucket_size": int(5e8), "allgather_bucket_size": int(5e8)},
                               {"reduce_bucket_size": int(5e7), "allgather_bucket_size": int(5e7)},
                               {"overlap_comm": False}, {"pin_memory": False}, {"checkpointed": False})),
        "zero3_offload": Grid({"overlap_comm": True, "reduce_bucket_size": h2,
                               "stage3_prefetch_bucket_size": int(0.9 * h2),
                               "stage3_param_persistence_threshold": 10 * hidden, "sub_group_size": int(1e9),
                               "pin_memory": True, "checkpointed": True}, shapes,
                              ({"stage3_prefetch_bucket_size": int(5e8)}, {"reduce_bucket_size": int(5e8)},
                               {"stage3_param_persistence_threshold": int(1e7)}, {"overlap_comm": False},
                               {"pin_memory": False}, {"sub_group_size": int(1e8)}, {"checkpointed": False})),
        "fsdp2_offload": Grid({"reshard_after_forward": True, "prefetch": 0, "pin_memory": True, "checkpointed": True},
                              shapes, ({"reshard_after_forward": False}, {"prefetch": 1}, {"prefetch": 2},
                                       {"pin_memory": False}, {"checkpointed": False})),
    }
    g = grids[kind]
    return g if variations else Grid(g.base, g.shapes)


def deepspeed_config(kind: str, knobs: dict, batch: int, adamw: dict, pin: bool = True) -> dict:
    """The DeepSpeed config of a ZeRO peer at a grid point: `knobs` (its micro_batch among them)
    over the documented defaults; `pin` False where there is nothing to pin to (the CPU)."""
    m = knobs["micro_batch"]
    if batch % m:
        raise ValueError(f"micro_batch {m} must divide the {batch} sequences of a step")
    pinned = knobs.get("pin_memory", True) and pin
    zero = {"overlap_comm": knobs["overlap_comm"], "contiguous_gradients": True,
            "reduce_bucket_size": knobs["reduce_bucket_size"],
            "offload_optimizer": {"device": "cpu", "pin_memory": pinned}}
    if kind == "zero3_offload":
        zero.update(stage=3, offload_param={"device": "cpu", "pin_memory": pinned},
                    stage3_prefetch_bucket_size=knobs["stage3_prefetch_bucket_size"],
                    stage3_param_persistence_threshold=knobs["stage3_param_persistence_threshold"],
                    stage3_max_live_parameters=int(1e9), stage3_max_reuse_distance=int(1e9),
                    sub_group_size=knobs["sub_group_size"])
    elif kind == "zero2_offload":
        zero.update(stage=2, reduce_scatter=True, allgather_partitions=True,
                    allgather_bucket_size=knobs["allgather_bucket_size"])
    else:
        raise ValueError(f"{kind!r} is not a DeepSpeed peer (zero2_offload, zero3_offload)")
    return {"train_micro_batch_size_per_gpu": m, "gradient_accumulation_steps": batch // m,
            "train_batch_size": batch, "bf16": {"enabled": True}, "gradient_clipping": 0.0,
            "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
            "optimizer": {"type": "AdamW", "params": {"lr": adamw["lr"], "betas": list(adamw["betas"]),
                                                      "eps": adamw["eps"], "weight_decay": adamw["weight_decay"]}},
            "zero_optimization": zero}


def validate_deepspeed(config: dict) -> dict:
    """`config` read by DeepSpeed's own DeepSpeedConfig (pydantic: an unknown or ill-typed key, or
    batch sizes that do not multiply, is refused); what it read back, for the record."""
    from deepspeed.runtime.config import DeepSpeedConfig

    read = DeepSpeedConfig(config)
    z = read.zero_config
    return {"stage": int(z.stage), "train_batch_size": read.train_batch_size,
            "micro_batch": read.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": read.gradient_accumulation_steps,
            "reduce_bucket_size": int(z.reduce_bucket_size), "overlap_comm": bool(z.overlap_comm),
            "offload_optimizer": str(z.offload_optimizer.device) if z.offload_optimizer else None,
            **({"offload_param": str(z.offload_param.device) if z.offload_param else None,
                "stage3_prefetch_bucket_size": int(z.prefetch_bucket_size),
                "stage3_param_persistence_threshold": int(z.param_persistence_threshold),
                "sub_group_size": int(z.sub_group_size)} if int(z.stage) == 3 else {})}


def side_config(kind: str, knobs: dict, batch: int, adamw: dict, device: str) -> dict:
    """What a side is built from at a grid point (a DeepSpeed peer: its validated config)."""
    if kind in ("zero2_offload", "zero3_offload"):
        config = deepspeed_config(kind, knobs, batch, adamw, pin=device == "cuda")
        return {"deepspeed": config, "deepspeed_read": validate_deepspeed(config)}
    if batch % knobs["micro_batch"]:
        raise ValueError(f"micro_batch {knobs['micro_batch']} must divide the {batch} sequences of a step")
    return {}


# ----------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Model:
    """What the estimators need of a model: parameters, its largest layer's, width, depth, vocabulary."""

    parameters: int
    largest_layer: int
    hidden: int
    layers: int
    vocab: int
    intermediate: int
    kv_projection: int  # elements of one k (or v) projection (GQA: smaller than h x h); 0 for the GPT


@dataclass
class Needs:
    host_bytes: int
    device_bytes: int
    how: str  # the estimator and the margins, in words
    parts: dict = field(default_factory=dict)


def activation_bytes(model: Model, micro_batch: int, context: int, checkpointed: bool = True) -> int:
    """A micro-batch's activations on the device, estimated: the layer inputs kept by checkpointing
    (bf16), one layer's inside while it is recomputed, the logits in bf16 and fp32 (the loss
    upcasts) with their gradient; without checkpointing every layer's inside."""
    tokens = micro_batch * context
    inside = tokens * (10 * model.hidden + 3 * model.intermediate) * 2
    kept = model.layers * tokens * model.hidden * 2 if checkpointed else model.layers * inside
    logits = tokens * model.vocab * (2 + 4 + 4)
    return kept + inside + logits


def needs(kind: str, model: Model, knobs: dict, context: int, batch: int) -> Needs:
    """Host and device bytes of `kind` at a grid point, from its own estimator plus margins."""
    p, m = model.parameters, knobs.get("micro_batch", 1)
    act = activation_bytes(model, m, context, knobs.get("checkpointed", True))
    if kind == "relay":
        bpp = _relay_bytes_per_parameter()
        tokens = batch * context
        stash = model.layers * tokens * model.hidden * 2  # every layer's input, the whole minibatch, bf16
        inside = m * context * (10 * model.hidden + 3 * model.intermediate) * 2
        held = batch // m if knobs["recompute"] == "selective" else 1  # selective keeps each micro-batch's
        logits = m * context * model.vocab * (2 + 4 + 4)
        host = bpp * p + 4 * model.largest_layer * (2 + 2) + HOST_PROCESS_BYTES
        return Needs(int(host + (stash if knobs["activations"] == "host" else 0)),
                     3 * model.largest_layer * (2 + 4) + (stash if knobs["activations"] == "device" else 0)
                     + held * inside + logits,
                     f"the EPS's {bpp:.2f} B per parameter (l2l_hw.train.eps_bytes_per_parameter, its layout), "
                     "pinned staging for a few layers; device: three layers' bf16 weights and fp32 gradient sums, "
                     "the stash where it lives, one layer's inside (each micro-batch's under selective recompute), "
                     "a micro-batch's logits", {"eps_bytes_per_parameter": bpp, "stash": stash})
    if kind == "zero2_offload":
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(p, 1, 1, cpu_offload=True,
                                                         additional_buffer_factor=DEEPSPEED_BUFFER_FACTOR)
        # stage_1_and_2.py pins three flat buffers over the whole model (fp32 master and gradient, bf16
        # copy), each a power of two in the pinned allocator, beside the bf16 accumulators, m, v and the
        # unpinned fp32 clone: killed by the OOM killer inside the estimate at 4.76 B on the H200 host
        pinned = 2 * _pinned(4 * p) + _pinned(2 * p) + (2 + 8 + 4) * p if knobs.get("pin_memory", True) else 0
        buckets = 2 * 2 * min(p, knobs["reduce_bucket_size"] + knobs["allgather_bucket_size"])
        return Needs(max(cpu, pinned) + HOST_PROCESS_BYTES, gpu + 2 * p + buckets + act,
                     "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs (offload), host "
                     "at least its pinned flat buffers as allocated (powers of two); device + bf16 gradients, "
                     "its buckets and the micro-batch's activations",
                     {"estimator_host": cpu, "estimator_device": gpu, "pinned_rule": pinned, "activations": act})
    if kind == "zero3_offload":
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(p, model.largest_layer, 1, 1, cpu_offload=True,
                                                            cpu_offload_params=True, zero_init=True,
                                                            additional_buffer_factor=DEEPSPEED_BUFFER_FACTOR)
        live = 2 * min(p, knobs["stage3_prefetch_bucket_size"] + knobs["reduce_bucket_size"])
        persistent = 2 * model.layers * _persistent(model, knobs["stage3_param_persistence_threshold"])
        return Needs(cpu + HOST_PROCESS_BYTES, gpu + live + persistent + act,
                     "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs (offload_param, "
                     "offload_optimizer, zero_init); device + its prefetch and reduce buckets, the parameters "
                     "under the persistence threshold and the micro-batch's activations",
                     {"estimator_host": cpu, "estimator_device": gpu, "activations": act})
    if kind == "fsdp2_offload":
        gathered = 2 * (model.largest_layer * (2 + knobs.get("prefetch", 0)))
        resident = 2 * p if not knobs.get("reshard_after_forward", True) else 0
        host = FSDP2_HOST_BYTES_PER_PARAMETER * p * (DEEPSPEED_BUFFER_FACTOR if knobs.get("pin_memory") else 1)
        return Needs(int(host) + HOST_PROCESS_BYTES, gathered + resident + act,
                     "16 B per parameter on the host (fp32 shard, gradient, m, v; x1.5 pinned, as DeepSpeed's "
                     "buffer factor); device: the layers gathered (2 + prefetch), every bf16 weight when "
                     "reshard_after_forward is off, the micro-batch's activations",
                     {"activations": act})
    if kind in RESIDENT_DEVICE_BYTES_PER_PARAMETER:
        state = RESIDENT_DEVICE_BYTES_PER_PARAMETER[kind] * p
        return Needs(HOST_PROCESS_BYTES + 2 * p, state + act,
                     f"{RESIDENT_DEVICE_BYTES_PER_PARAMETER[kind]} B per parameter on the device (weights, "
                     "gradients, AdamW's m and v) and the micro-batch's activations", {"activations": act})
    raise ValueError(f"unknown side {kind!r}; one of {', '.join(SIDES)}")


@functools.lru_cache(maxsize=1)
def _relay_bytes_per_parameter() -> float:
    """The EPS's host bytes per parameter with bf16 compute and fp32 state (the engine's layout)."""
    from l2l_hw.train import TrainConfig, eps_bytes_per_parameter

    return eps_bytes_per_parameter(TrainConfig(precision="bf16", optimizer_state="fp32"))


def _persistent(model: Model, threshold: int) -> int:
    """Parameters a Llama layer keeps resident under ZeRO-3's persistence threshold (its norms;
    its k and v projections where the threshold reaches them)."""
    kv = model.kv_projection
    return 2 * model.hidden + (2 * kv if kv and threshold >= kv else 0)
