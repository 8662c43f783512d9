"""Will it fit? What a training run needs, worked out before anything loads: `l2l estimate`.

    estimate(cfg)       the run of a TrainConfig (the reference GPT, or the Hugging Face model
                        in cfg.model: its config.json only, no weights read): host memory,
                        disk, device memory per stage, and whether it fits this machine
    check_fits(cfg)     the same, raising one NotEnoughMemory line naming the shortfall
                        (l2l train and l2l finetune call it before they load anything)

How each figure is made (anchors: DeepSpeed's estimate_zero3_model_states_mem_needs and
`accelerate estimate-memory`, which count parameters and optimizer state; this counts what
the relay holds, step by step):

    the layers     built on the meta device (build_gpt, or hf.skeleton + hf.split), each
                   distinct layer run once per micro-batch size on fake tensors
                   (torch's FakeTensorMode: shapes and dtypes, no memory, the CPU's kernel
                   choices) through the relay's own recompute policies, under
                   saved_tensors_hooks: what its graph saves, what selective recompute
                   keeps, what aliases its input, output or weights
    device         the relay's schedule (executor.py) replayed on those storages: at each of
                   the points where the relay's accounting samples (relay/memory.py), the
                   bytes it would count; the peak is what relay.memory_report() reports
    EPS            the engine's own buffer layout (Engine.buffer_layout) per tensor; with
                   --state-dir the region files (disk_store.RegionLayout) and the images in
                   flight (memory_bound)
    host           this process as it is now (interpreter, torch, transformers: measured,
                   VmRSS), + the EPS, + the model as the run builds it, + the data, + on the
                   CPU the device's bytes, + the allocator's transients
    disk           --state-dir's regions, the checkpoint (safetensors of the EPS state,
                   written beside the previous one), finetune's model folder (fp32)
    step time      --measure: one layer of each kind timed on real tensors (forward,
                   recompute, backward per micro-batch) and the EPS update per parameter

The modules (each imports only those above it):

    trace.py       the layers: run_model (the config's model on the meta device), trace_model
    ledger.py      the device: the action list the relay or a 1F1B stage runs (relay/actions.py)
                   replayed on a ledger of bytes (replay_step, replay_evaluate, pipeline_step)
    host.py        the EPS's bytes, the checkpoint's, one rank's host memory (host_parts)
    machine.py     this machine: resident, free host, disk and device memory (available)
    footprint.py   the run's figures, whatever the machine (Estimate, figures, needs)
    step_time.py   --measure (measure_step)
    report.py      the verdict, the largest that fits, the flags that make it fit, in words
                   (estimate, check_fits, describe)
"""
from l2l_hw.estimate.footprint import Estimate, figures, needs
from l2l_hw.estimate.host import eps_bytes, eps_bytes_per_parameter, weights_files
from l2l_hw.estimate.machine import free_disk_bytes, meminfo_bytes, rss_bytes
from l2l_hw.estimate.report import (STATE_FORMATS_BY_PRECISION, NotEnoughMemory, check_fits, describe, estimate,
                                    largest, memory_fits)
from l2l_hw.estimate.step_time import measure_step, muon_flops
from l2l_hw.estimate.trace import run_model

__all__ = ["STATE_FORMATS_BY_PRECISION", "Estimate", "NotEnoughMemory", "check_fits", "describe", "eps_bytes",
           "eps_bytes_per_parameter", "estimate", "figures", "free_disk_bytes", "largest", "measure_step",
           "meminfo_bytes", "memory_fits", "muon_flops", "needs", "rss_bytes", "run_model", "weights_files"]
