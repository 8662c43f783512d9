"""`l2l bench hf-load`: peak host memory while loading a Hugging Face checkpoint into the EPS.

A random Llama-layout model (336 M parameters by default: hidden 1024, 24 layers, 16
heads, 4 KV heads, MLP 2816, vocabulary 32000, untied head) is written as sharded fp32
safetensors in a temporary folder, tensor by tensor from a meta-device skeleton (the
writer holds one shard, never the model). Each way of loading it then runs in a fresh
process, which reports its resident memory (/proc/self/status) before loading (the
baseline, after imports) and its peak while loading (VmHWM, reset to the baseline
through /proc/self/clear_refs), both after the baseline. As in `l2l bench capacity`,
glibc's mmap threshold is fixed (MALLOC_MMAP_THRESHOLD_) so that freed tensors leave the
resident set at once:

  l2l                  l2l_hw.hf.from_pretrained(dir, eps=cpu EPS): meta skeleton, shards
                       streamed into the EPS layer by layer
  transformers         AutoModelForCausalLM.from_pretrained(dir): the model alone, no EPS
  transformers+relay   the obvious way without l2l_hw.hf's loader: transformers loads the
                       model, l2l_hw.hf.split cuts it, a Relay registers it in the EPS

The EPS's measured size is the l2l process's resident memory once loading is over (the
EPS and a meta skeleton); the bytes of its state (param, m, v) are reported beside it.
Target: l2l's peak <= (EPS size + largest shard) * 1.15.
"""
from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

import torch

from l2l_hw.bench import print_report
from l2l_hw.bench.capacity import in_fresh_process
from l2l_hw.estimate import rss_bytes

MARGIN = 1.15  # the acceptance's allowance over the EPS plus one shard
MODES = ("l2l", "transformers", "transformers+relay")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LLAMA = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
             intermediate_size=2816, vocab_size=32000, tie_word_embeddings=False)


def write_checkpoint(folder: Path, layers: int, max_shard_size: str, dtype: str = "fp32", seed: int = 0) -> int:
    """A random Llama-layout model as a transformers folder; returns its parameter count.
    Weights N(0, 0.02), norms 1, stored as `dtype`: generated one tensor at a time into
    the shard writer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from l2l_hw.hf import write_weights

    stored = DTYPES[dtype]
    config = LlamaConfig(**{**LLAMA, "num_hidden_layers": layers}, architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(seed)

    def tensors():
        for name, p in skeleton.named_parameters():
            value = torch.ones(p.shape) if p.dim() == 1 else torch.randn(p.shape, generator=g) * 0.02
            yield name, value.to(stored)

    write_weights(tensors(), folder, max_shard_size)
    config.dtype = stored
    config.save_pretrained(folder)
    return sum(p.numel() for p in skeleton.parameters())


def load_peak(mode: str, folder: str, eps_options: dict) -> dict:
    """In a fresh process: bytes resident above the baseline at the peak of loading and after it."""
    import l2l_hw
    from l2l_hw import hf
    from transformers import AutoModelForCausalLM

    gc.collect()
    baseline = rss_bytes()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    state_bytes = None
    if mode == "l2l":
        held = hf.from_pretrained(folder, eps=l2l_hw.make_eps("cpu", **eps_options))
        state_bytes = sum(e.shape.numel() * e.dtype.itemsize for name, e in held.eps.state_entries().items()
                          if name != "step")
    elif mode == "transformers":
        held = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        layers, loss_fn = hf.split(model)
        held = (model, l2l_hw.Relay(layers, loss_fn, eps=l2l_hw.make_eps("cpu", **eps_options)))
    gc.collect()
    return {"baseline_bytes": baseline, "peak_bytes": rss_bytes("VmHWM") - baseline,
            "held_bytes": rss_bytes() - baseline, "eps_state_bytes": state_bytes}


def run(layers: int = LLAMA["num_hidden_layers"], max_shard_size: str = "200MB", optimizer: str = "adamw",
        checkpoint_dtype: str = "fp32", modes=MODES, folder: str | None = None) -> dict:
    eps_options = {"optimizer": optimizer, "lr": 1e-4}
    with tempfile.TemporaryDirectory(prefix="l2l-hf-load-", dir=folder) as tmp:
        n_params = write_checkpoint(Path(tmp), layers, max_shard_size, checkpoint_dtype)
        shards = sorted(Path(tmp).glob("*.safetensors"))
        report = {"params": n_params, "model": {**LLAMA, "num_hidden_layers": layers}, "optimizer": optimizer,
                  "checkpoint_dtype": checkpoint_dtype, "shards": len(shards),
                  "checkpoint_bytes": sum(f.stat().st_size for f in shards),
                  "largest_shard_bytes": max(f.stat().st_size for f in shards), "margin": MARGIN}
        for mode in modes:
            report[mode] = in_fresh_process(__name__, "load_peak", mode, tmp, eps_options)  # its peak its own
    if "l2l" in report:
        eps = report["l2l"]["held_bytes"]
        report["eps_bytes"] = eps
        report["eps_state_bytes"] = report["l2l"]["eps_state_bytes"]
        report["eps_bytes_per_param"] = round(eps / n_params, 2)
        allowed = eps + report["largest_shard_bytes"]
        report["limit_bytes"] = int(allowed * MARGIN)
        report["peak_over_eps_plus_shard"] = round(report["l2l"]["peak_bytes"] / allowed, 3)
        report["within_limit"] = report["l2l"]["peak_bytes"] <= report["limit_bytes"]
        if "transformers+relay" in report:
            report["transformers_relay_over_l2l"] = round(
                report["transformers+relay"]["peak_bytes"] / report["l2l"]["peak_bytes"], 2)
    return report


def format_report(r: dict) -> str:
    gb = 1e9
    lines = [f"hf-load: Llama layout, {r['params'] / 1e6:.0f} M params, {r['shards']} {r['checkpoint_dtype']} shards "
             f"(largest {r['largest_shard_bytes'] / gb:.3f} GB, all {r['checkpoint_bytes'] / gb:.2f} GB), "
             f"EPS optimizer {r['optimizer']}"]
    for mode in MODES:
        if mode in r:
            lines.append(f"  {mode:19s} peak {r[mode]['peak_bytes'] / gb:6.2f} GB   "
                         f"held after loading {r[mode]['held_bytes'] / gb:6.2f} GB")
    if "eps_bytes" in r:
        lines.append(f"  EPS measured {r['eps_bytes'] / gb:.2f} GB ({r['eps_bytes_per_param']} B/param; its state "
                     f"{r['eps_state_bytes'] / gb:.2f} GB); l2l peak / "
                     f"(EPS + largest shard) = {r['peak_over_eps_plus_shard']} (limit {r['margin']}): "
                     f"{'within' if r['within_limit'] else 'OVER'}")
    if "transformers_relay_over_l2l" in r:
        lines.append(f"  transformers+relay peak / l2l peak = {r['transformers_relay_over_l2l']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--layers", type=int, default=LLAMA["num_hidden_layers"],
                   help=f"decoder layers (default {LLAMA['num_hidden_layers']}: 336 M parameters)")
    p.add_argument("--max-shard-size", default="200MB", help="shard size of the checkpoint (default 200MB)")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), default="adamw",
                   help="the EPS's optimizer: its state is most of the EPS's size (default adamw)")
    p.add_argument("--checkpoint-dtype", choices=tuple(DTYPES), default="fp32",
                   help="how the checkpoint stores the weights (default fp32; bf16 as most published models)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="ways of loading to measure")
    p.add_argument("--dir", default=None, help="where the temporary checkpoint goes (default: the system's temp)")


def run_from_args(args) -> int:
    report = run(layers=args.layers, max_shard_size=args.max_shard_size, optimizer=args.optimizer,
                 checkpoint_dtype=args.checkpoint_dtype, modes=tuple(args.modes), folder=args.dir)
    return print_report(report, args.json, format_report)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="l2l bench hf-load", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
