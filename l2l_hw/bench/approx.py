"""Approximate backwards (l2l_hw.approx): activation memory saved per MLP, and accuracy.

memory: bytes the autograd graph keeps for backward in one MLP of the `l2l train`
  default GPT on one minibatch (32 x 128 tokens, width 128), counted with
  torch.autograd.graph.saved_tensors_hooks: every saved tensor's storage once,
  parameters excluded (every variant keeps the weights anyway).
accuracy: validation loss after `l2l train` with its defaults (200 steps, seed 1337)
  for each variant; the same seed, so the same init, batches and evaluation windows.
"""
import torch

from l2l_hw.bench import print_report
from l2l_hw.models.gpt import MLP, GPTConfig
from l2l_hw.train import TrainConfig, train

# name -> the GPTConfig fields (also TrainConfig's) of each variant
VARIANTS = {
    "exact": dict(gelu="exact", linear_projection=0.0),
    "fewbit": dict(gelu="fewbit", linear_projection=0.0),
    "projection_0.5": dict(gelu="exact", linear_projection=0.5),
    "projection_0.25": dict(gelu="exact", linear_projection=0.25),
    "fewbit_projection_0.5": dict(gelu="fewbit", linear_projection=0.5),
}


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


def mlp_memory(cfg: GPTConfig | None = None, batch_size: int = TrainConfig.batch_size) -> dict:
    cfg = cfg or TrainConfig().model_config()
    x = torch.randn(batch_size, cfg.block_size, cfg.n_embd, requires_grad=True)  # (B, T, C)
    report = {"input_bytes": x.numel() * x.element_size()}
    for name, fields in VARIANTS.items():
        torch.manual_seed(TrainConfig.seed)
        report[name] = saved_bytes(MLP(GPTConfig(**{**cfg.__dict__, **fields})), x)
    return report


def val_loss(variant: str, steps: int = 200, out: str | None = None, **fields) -> dict:
    """The `l2l train` default run with the variant's fields (and `fields`), through
    l2l_hw.train: its final validation and training loss."""
    config = {**VARIANTS[variant], **fields}
    result = train(TrainConfig(steps=steps, out=out and f"{out}/{variant}", verbose=False, **config))
    return {"config": config, "val_loss": result.val_loss, "train_loss": result.history[-1]["loss"],
            "seconds": result.elapsed}


def run(steps: int = 200, variants: tuple = ("exact", "fewbit", "projection_0.5"), out: str | None = None) -> dict:
    report = {"memory": mlp_memory(), "steps": steps, "accuracy": {}}
    for name in variants:
        report["accuracy"][name] = val_loss(name, steps, out)
    exact = report["accuracy"].get("exact")
    for r in report["accuracy"].values():
        if exact:
            r["delta_vs_exact"] = r["val_loss"] - exact["val_loss"]
    return report


def format_report(r: dict) -> str:
    m = r["memory"]
    lines = [f"bytes saved for backward by one MLP (input {m['input_bytes']:,} B)"]
    lines += [f"  {name:<24}{m[name]:>12,}  {m[name] / m['exact']:.2f} of exact" for name in VARIANTS if name in m]
    if r.get("accuracy"):
        lines.append(f"validation loss after {r['steps']} steps")
        for name, v in r["accuracy"].items():
            lines.append(f"  {name:<24}{v['val_loss']:>8.4f}{v.get('delta_vs_exact', 0):>+9.4f}  {v['seconds']:.0f} s")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--steps", type=int, default=200, help="training steps per variant (default 200)")
    p.add_argument("--variants", nargs="*", default=["exact", "fewbit", "projection_0.5"], choices=list(VARIANTS),
                   help="variants to train (default exact fewbit projection_0.5)")
    p.add_argument("--memory-only", action="store_true", help="only the activation memory, no training")
    p.add_argument("--out", help="keep each variant's run folder under OUT (default: none written)")


def run_from_args(args) -> int:
    report = ({"memory": mlp_memory()} if args.memory_only else run(args.steps, tuple(args.variants), args.out))
    return print_report(report, args.json, format_report)
