"""`l2l bench capacity`: host bytes per parameter of each EPS configuration, and the largest GPT this machine trains.

Bytes per parameter: in a fresh process per configuration, the resident memory (VmRSS)
after the cpu EPS is built, then after a model's groups are registered, one step of
bf16 gradients is pushed and the step committed. The gradients are generated one group
at a time and freed before the reading (excluded, as they live on the accelerator in a
real run), and glibc's mmap threshold is fixed (MALLOC_MMAP_THRESHOLD_) so freed tensors
go back to the system at once; every buffer has been written by then, so RSS counts it.

Largest model: the depth of a GPT of the given width whose EPS fits the machine's memory
(MemTotal less an allowance for the interpreter, torch and one layer's transients),
predicted from the measured bytes per parameter. With --train, that model is built on
the meta device and filled layer by layer (never a whole fp32 model beside the EPS),
registered, trained one step through the relay, checkpointed (streamed) and resumed in a
fresh process (one more step): each phase's peak RSS (VmHWM) is reported.
"""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from l2l_hw.bench import print_report
from l2l_hw.estimate import meminfo_bytes, rss_bytes


# name -> (working copy, PipeDream-2BW, optimizer state): the relay and EPS options each
# configuration stands for.
CONFIGS = {
    "exact-fp32": ("fp32", False, "fp32"),  # fp32 compute, fp32 working copy: param, m, v
    "exact-bf16": ("bf16", False, "fp32"),  # + a bf16 working copy
    "fp16-double-buffered": ("fp16", False, "fp32"),  # loss scaling: a step with an overflow is discarded whole
    "2bw-bf16": ("bf16", True, "fp32"),  # PipeDream-2BW: the previous version is read
    "bf16-state": ("bf16", False, "bf16"),  # exact-bf16 with m and v in bf16
    "8bit-state": ("bf16", False, "8bit"),  # exact-bf16 with block-wise 8-bit m and v
}
MMAP_THRESHOLD = 1 << 16  # bytes: larger allocations are mmapped, and unmapped when freed
# Left for everything but the EPS when sizing the largest model (measured: the interpreter
# with torch ~0.45 GiB; a 50 M-parameter layer's gradients, activations and checkpoint
# transients ~1 GiB), plus margin for the page cache the checkpoint's I/O needs.
OVERHEAD_BYTES = 3 << 30


def gpt_config(width: int, depth: int, context: int = 32):
    from l2l_hw.models import GPTConfig

    return GPTConfig(n_layer=depth, n_embd=width, n_head=max(1, width // 128), block_size=context)


def gpt_params(width: int, depth: int) -> int:
    """Parameters of the reference GPT."""
    from l2l_hw.models import count_parameters

    return count_parameters(gpt_config(width, depth))


def fill_layer(i: int, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`init` for a meta-device layer: its own tensors, made now (N(0, 0.02) weights, unit
    LayerNorm scales, zero biases), so no layer exists in fp32 before it is registered."""
    real = copy.deepcopy(module).to_empty(device="cpu")
    g = torch.Generator().manual_seed(i)
    with torch.no_grad():
        for name, p in real.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
    return dict(real.named_parameters())


def measure_bytes_per_param(config: str, width: int, depth: int) -> dict:
    """In this process: RSS around registering a GPT's groups in a cpu EPS and one step."""
    import l2l_hw

    working, pipedream, state = CONFIGS[config]
    from l2l_hw.models import build_gpt

    with torch.device("meta"):
        layers = build_gpt(gpt_config(width, depth))
    eps = l2l_hw.make_eps("cpu", working_dtype=working, double_buffer=working == "fp16" or pipedream, state=state)
    base = rss_bytes()
    n = 0
    for i, layer in enumerate(layers):
        params = fill_layer(i, layer)
        eps.register(f"layer{i}", {k: p.detach() for k, p in params.items()})
        n += sum(p.numel() for p in params.values())
        del params
    registered = rss_bytes()
    for key, shapes in eps.shapes.items():
        grads = {name: torch.full(shape, 1e-3, dtype=torch.bfloat16) for name, shape in shapes.items()}
        eps.push_grads(key, grads)
        eps.wait()  # the gradients are freed before the next group's are made
        del grads
    eps.commit_step()
    stepped = rss_bytes()
    return {"config": config, "params": n, "bytes_per_param_registered": (registered - base) / n,
            "bytes_per_param": (stepped - base) / n, "rss_base_bytes": base}


def mem_total_bytes() -> int:
    total = meminfo_bytes("MemTotal")
    if total is None:
        raise RuntimeError("/proc/meminfo has no MemTotal")
    return total


def largest_depth(bytes_per_param: float, width: int, memory_bytes: int) -> int:
    """The deepest GPT at `width` whose EPS fits in memory_bytes - OVERHEAD_BYTES."""
    per_block = gpt_params(width, 2) - gpt_params(width, 1)
    fixed = gpt_params(width, 1) - per_block
    return max(0, math.floor(((memory_bytes - OVERHEAD_BYTES) / bytes_per_param - fixed) / per_block))


def train_and_checkpoint(config: str, width: int, depth: int, out: str, resume: bool) -> dict:
    """In this process: build on meta, fill and register layer by layer, one relay step, then
    a streamed checkpoint; or (resume) rebuild from that checkpoint and take one more step."""
    import l2l_hw
    from l2l_hw.checkpoint import open_checkpoint, save_checkpoint
    from l2l_hw.models import build_gpt, lm_loss
    from l2l_hw.relay import init_from_state

    working, pipedream, state = CONFIGS[config]
    cfg = gpt_config(width, depth)
    with torch.device("meta"):
        layers = build_gpt(cfg)
    eps = l2l_hw.make_eps("cpu", lr=1e-4, state=state)
    path = Path(out) / "checkpoint.safetensors"
    t0 = time.perf_counter()
    ckpt = open_checkpoint(path) if resume else None
    init = init_from_state(ckpt.view("relay.")) if resume else fill_layer
    relay = l2l_hw.Relay(layers, lm_loss, eps=eps, precision=working, pipedream_2bw=pipedream, init=init)
    if resume:
        relay.load_state_dict(ckpt.view("relay."))
    built = time.perf_counter()
    rss_built = rss_bytes()
    g = torch.Generator().manual_seed(relay.step)
    x = torch.randint(0, 256, (2, cfg.block_size), generator=g)
    loss = relay.train_step(x, torch.roll(x, -1, 1))
    stepped = time.perf_counter()
    if not resume:
        save_checkpoint(path, {f"relay.{k}": v for k, v in relay.state_entries().items()}, {"step": relay.step})
    n = sum(sum(s.numel() for s in group.values()) for group in eps.shapes.values())
    return {"config": config, "width": width, "depth": depth, "params": n, "phase": "resume" if resume else "train",
            "loss": loss, "step": relay.step, "build_s": built - t0, "step_s": stepped - built,
            "checkpoint_s": time.perf_counter() - stepped, "rss_after_build_bytes": rss_built,
            "peak_rss_bytes": rss_bytes("VmHWM"), "checkpoint_bytes": path.stat().st_size}


def in_fresh_process(module: str, function: str, *args) -> dict:
    """`module.function(*args)` in a fresh interpreter, its JSON result: RSS figures must not see
    another measurement's memory (glibc's mmap threshold fixed, see the module docstring)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), OMP_NUM_THREADS=os.environ.get(
        "OMP_NUM_THREADS", str(len(os.sched_getaffinity(0)))))
    code = f"import json, {module}; print(json.dumps({module}.{function}(*{args!r})))"
    res = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{function}{args} failed (exit {res.returncode}): {res.stderr.strip()[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def run(configs=tuple(CONFIGS), width: int = 2048, measure_depth: int = 6, train: tuple[str, ...] = (),
        memory_bytes: int | None = None, train_depth: int | None = None) -> dict:
    """Bytes per parameter of each configuration (a GPT of `measure_depth` blocks at `width`:
    about 300 M parameters at the defaults), the largest depth that fits, and for the
    configurations in `train` that model (or one of `train_depth` blocks) trained,
    checkpointed and resumed."""
    memory_bytes = memory_bytes or mem_total_bytes()
    rows = []
    for config in configs:
        row = in_fresh_process(__name__, "measure_bytes_per_param", config, width, measure_depth)
        depth = largest_depth(row["bytes_per_param"], width, memory_bytes)
        row.update(largest_depth=depth, largest_params=gpt_params(width, depth))
        if config in train:
            depth = train_depth or depth
            with tempfile.TemporaryDirectory(prefix="l2l-capacity-", dir=os.environ.get("TMPDIR", "/var/tmp")) as out:
                row["train"] = in_fresh_process(__name__, "train_and_checkpoint", config, width, depth, out, False)
                row["resume"] = in_fresh_process(__name__, "train_and_checkpoint", config, width, depth, out, True)
        rows.append(row)
    return {"width": width, "memory_bytes": memory_bytes, "overhead_bytes": OVERHEAD_BYTES, "configs": rows}


def format_report(report: dict) -> str:
    gib = 1 << 30
    lines = [f"host bytes per parameter (cpu EPS, RSS, gradients excluded), GPT width {report['width']}; "
             f"largest model in {report['memory_bytes'] / gib:.1f} GiB less {report['overhead_bytes'] / gib:.0f} GiB",
             f"{'configuration':<22} {'B/param':>8} {'largest':>16}"]
    for r in report["configs"]:
        lines.append(f"{r['config']:<22} {r['bytes_per_param']:>8.2f} "
                     f"{r['largest_params'] / 1e9:>7.2f} B ({r['largest_depth']} blocks)")
        for phase in ("train", "resume"):
            if phase in r:
                t = r[phase]
                lines.append(f"  {phase}: {t['params'] / 1e9:.3f} B parameters, loss {t['loss']:.4f} at step "
                             f"{t['step']}, peak RSS {t['peak_rss_bytes'] / gib:.2f} GiB, build {t['build_s']:.0f} s, "
                             f"step {t['step_s']:.0f} s, checkpoint {t['checkpoint_s']:.0f} s "
                             f"({t['checkpoint_bytes'] / gib:.1f} GiB)")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--width", type=int, default=2048, help="GPT width (default 2048: 50 M parameters a block)")
    parser.add_argument("--measure-depth", type=int, default=6, help="blocks of the model measured (default 6)")
    parser.add_argument("--train", nargs="*", choices=list(CONFIGS), default=[],
                        help="configurations whose largest model is trained one step, checkpointed and resumed")
    parser.add_argument("--train-depth", type=int, default=None,
                        help="train a model of this many blocks instead of the largest that fits")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run_from_args(args) -> int:
    report = run(tuple(args.configs), args.width, args.measure_depth, tuple(args.train), train_depth=args.train_depth)
    return print_report(report, args.json, format_report)
