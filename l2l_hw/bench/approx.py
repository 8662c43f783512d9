"""Approximate backwards (l2l_hw.approx): activation memory saved per MLP, and accuracy.

memory: bytes the autograd graph keeps for backward in one MLP of the `l2l train`
  default GPT on one minibatch (32 x 128 tokens, width 128), counted with
  torch.autograd.graph.saved_tensors_hooks: every saved tensor's storage once,
  parameters excluded (every variant keeps the weights anyway).
accuracy: validation loss after `l2l train` with its defaults (200 steps, seed 1337)
  for each variant; the same seed, so the same init, batches and evaluation windows.
"""
import argparse
import json
import tempfile
from pathlib import Path

import torch

from l2l_hw.models.gpt import MLP, GPTConfig

# name -> (GPTConfig fields, `l2l train` flags)
VARIANTS = {
    "exact": dict(gelu="exact", linear_projection=0.0),
    "fewbit": dict(gelu="fewbit", linear_projection=0.0),
    "projection_0.5": dict(gelu="exact", linear_projection=0.5),
    "projection_0.25": dict(gelu="exact", linear_projection=0.25),
    "fewbit_projection_0.5": dict(gelu="fewbit", linear_projection=0.5),
}
BATCH_SIZE, SEED = 32, 1337  # as l2l_hw.cli.TRAIN_DEFAULTS


def saved_bytes(module: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes saved for backward by one forward of `module`, each storage once, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return sum(storages.values())


def mlp_memory(cfg: GPTConfig | None = None, batch_size: int = BATCH_SIZE) -> dict:
    cfg = cfg or GPTConfig()
    x = torch.randn(batch_size, cfg.block_size, cfg.n_embd, requires_grad=True)  # (B, T, C)
    report = {"input_bytes": x.numel() * x.element_size()}
    for name, fields in VARIANTS.items():
        torch.manual_seed(SEED)
        report[name] = saved_bytes(MLP(GPTConfig(**{**cfg.__dict__, **fields})), x)
    return report


def val_loss(variant: str, steps: int = 200, out: str | None = None, extra: tuple = ()) -> dict:
    """Train with `l2l train` defaults plus the variant's flags; the final validation loss."""
    from l2l_hw.cli import main

    fields = VARIANTS[variant]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(out or tmp) / variant
        argv = ["train", "--steps", str(steps), "--out", str(run_dir), "--gelu", fields["gelu"],
                "--linear-projection", str(fields["linear_projection"]), *extra]
        if main(argv) != 0:
            raise RuntimeError(f"l2l {' '.join(argv)} failed")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"argv": argv[:3] + argv[5:], "val_loss": rows[-1]["val_loss"], "train_loss": rows[-1]["loss"],
            "seconds": rows[-1]["elapsed"]}


def run(steps: int = 200, variants: tuple = ("exact", "fewbit", "projection_0.5"), out: str | None = None) -> dict:
    report = {"memory": mlp_memory(), "accuracy": {}}
    for name in variants:
        report["accuracy"][name] = val_loss(name, steps, out)
    exact = report["accuracy"].get("exact")
    for r in report["accuracy"].values():
        if exact:
            r["delta_vs_exact"] = r["val_loss"] - exact["val_loss"]
    return report


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--variants", nargs="*", default=["exact", "fewbit", "projection_0.5"], choices=list(VARIANTS))
    p.add_argument("--memory-only", action="store_true")
    p.add_argument("--out", help="keep each variant's run folder under OUT (default: a temporary folder)")
    a = p.parse_args()
    rep = {"memory": mlp_memory()} if a.memory_only else run(a.steps, tuple(a.variants), a.out)
    print(json.dumps(rep, indent=2))
