"""The relay's PyTorch partners on the reference GPT, each a training step on the device.

    autocast   fp32 weights, bf16 autocast, gradients summed in fp32 in .grad, fused AdamW on
               the fp32 weights (the usual mixed-precision loop: a cast of every weight in
               every micro-batch)
    recipe     the relay's own recipe, resident: bf16 weights computed on directly, each
               parameter's bf16 micro-batch gradient added into an fp32 sum as soon as it is
               made (a post-accumulate-grad hook, which frees the bf16 one), fp32 master
               weights with fused AdamW on the sums, the bf16 copy refreshed from the masters
               after the step (rounded to nearest even, as the EPS rounds its working copy)

Either may checkpoint every block (torch.utils.checkpoint, non-reentrant) and be compiled
(torch.compile of each block: identical blocks share one compiled graph). The minibatch is cut
into `micro_batches` equal micro-batches, as the relay cuts it, and each micro-batch's loss is
divided by their count: the step's gradient is the minibatch's mean, as the relay's.

On the CPU (the dry run) the same recipes run in bf16 on the host, with foreach AdamW (fused
AdamW is a device kernel) and torch.compile's aot_eager backend (no code generation).
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint

from l2l_hw.models import GPTConfig, build_gpt, lm_loss

RECIPES = ("autocast", "recipe")
DTYPE = torch.bfloat16  # the compute dtype of both recipes, and of the relay beside them


class GPTPartner:
    """One PyTorch partner: `step(x, y)` trains on one minibatch and returns its mean loss (a
    float, so the step has ended on the device when it returns)."""

    def __init__(self, cfg: GPTConfig, device: torch.device, recipe: str, micro_batches: int, *,
                 checkpointed: bool = False, compiled: bool = False, lr: float = 1e-4, seed: int = 0,
                 state: dict | None = None, adamw: dict | None = None):
        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
        self.device, self.recipe, self.micro_batches = device, recipe, micro_batches
        self.checkpointed = checkpointed
        torch.manual_seed(seed)  # drawn on the host, as the relay draws its model: the same initial weights
        model = build_gpt(cfg)  # (built under `with device:`, CUDA's generator would draw others)
        if state is not None:  # a saved model: the one the relay starts from
            model.load_state_dict(state)
        self.model = model.to(device)
        kernel = {"fused": True} if device.type == "cuda" else {"foreach": True}
        a = {"lr": lr} if adamw is None else {"lr": adamw["lr"], "betas": tuple(adamw["betas"]), "eps": adamw["eps"],
                                               "weight_decay": adamw["weight_decay"]}
        if recipe == "autocast":
            self.opt = torch.optim.AdamW(self.model.parameters(), **a, **kernel)
        else:
            self.masters = [p.detach() for p in self.model.parameters()]  # the fp32 tensors, kept
            self.model.to(DTYPE)  # the parameters now hold bf16 copies of them
            self.params = list(self.model.parameters())
            self.sums = [torch.zeros_like(m) for m in self.masters]
            for p, s in zip(self.params, self.sums):
                p.register_post_accumulate_grad_hook(_summer(s))
            for m, s in zip(self.masters, self.sums):
                m.grad = s  # AdamW reads the fp32 sums where it reads gradients
            self.opt = torch.optim.AdamW(self.masters, **a, **kernel)
        if compiled:
            backend = "inductor" if device.type == "cuda" else "aot_eager"
            for layer in self.model:
                layer.compile(backend=backend)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.checkpointed:
            return self.model(x)
        h = self.model[0](x)
        for block in self.model[1:-1]:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return self.model[-1](h)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        u = self.micro_batches
        autocast = (torch.autocast(self.device.type, dtype=DTYPE) if self.recipe == "autocast"
                    else contextlib.nullcontext())
        if self.recipe == "autocast":
            self.opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for xj, yj in zip(x.tensor_split(u), y.tensor_split(u)):
            with autocast:
                loss = lm_loss(self._forward(xj), yj) / u
            loss.backward()
            total += loss.detach().float()
        self.opt.step()
        if self.recipe == "recipe":
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)  # the bf16 copy, rounded to nearest even
                torch._foreach_zero_(self.sums)
        return total.item()


def _summer(total: torch.Tensor):
    """The hook that adds a parameter's fresh bf16 gradient into its fp32 sum and frees it."""

    def hook(p: torch.Tensor) -> None:
        total.add_(p.grad)
        p.grad = None

    return hook


def state_bytes_per_parameter(recipe: str) -> int:
    """Device bytes per parameter a partner keeps between steps (weights, gradients, AdamW's m
    and v): autocast 4 + 4 + 8; recipe 2 (bf16) + 4 (master) + 4 (sums) + 8."""
    return {"autocast": 16, "recipe": 18}[recipe]
