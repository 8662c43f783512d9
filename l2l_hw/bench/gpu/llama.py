"""Llama-shaped model folders made on the spot, and `l2l finetune` on them as a user runs it.

A folder is what a user downloads: config.json, sharded bf16 safetensors with their index,
a tokenizer, made here from a config with no hub:

  LLAMA_3_8B   Llama-3-8B's shape: hidden 4096, 32 layers, 32 heads with 8 KV heads, MLP
               14336, vocabulary 128,256, RoPE theta 500,000, untied head: 8.03 B parameters
  weights      random, N(0, 0.02) as transformers initializes Llama's Linears and embedding,
               norms 1; written tensor by tensor, one safetensors file per decoder layer (plus
               one for the embedding, one for the final norm and head) in a shared folder, so
               a deeper model of the same shape reuses the layers already written and a model
               is never whole in memory; each model folder's index names the files it uses
  tokenizer    a word-level tokenizer (tokenizers' WordLevel) whose vocabulary fills the
               model's: <unk>, <|end_of_text|> and the words w2 ... w128255
  text         lines of words drawn from that vocabulary (Zipf-like, seeded), enough for the
               run's minibatches and the tenth that `l2l finetune` holds out

finetune() runs `python -m l2l_hw.cli finetune` (the `l2l finetune` a user runs) on such a
folder under l2l_hw.bench.gpu.watch, and stops it once the timed steps are in.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from l2l_hw.bench.gpu.figures import ATTENTION, flops_per_token, mfu, rate_spread, spread
from l2l_hw.bench.gpu.watch import idle_share, log_tail, watch

LLAMA_3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=1)
EOS, UNK = "<|end_of_text|>", "<unk>"
INIT_STD = 0.02  # transformers' LlamaConfig.initializer_range
WORDS_PER_LINE = 24


def config(shape: dict, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(**{**shape, "num_hidden_layers": layers})


def layer_parameters(shape: dict) -> int:
    """Parameters of one decoder layer: q, k, v, o projections, the gated MLP, two norms."""
    d, kv = shape["hidden_size"], shape["hidden_size"] // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return 2 * d * d + 2 * d * kv + 3 * d * shape["intermediate_size"] + 2 * d


def parameters(shape: dict, layers: int) -> dict:
    """{"total", "matmul"} parameters of a model of `layers` layers (matmul: all but the input
    embedding, the N of gpu_figures.flops_per_token)."""
    embed = shape["vocab_size"] * shape["hidden_size"]
    head = 0 if shape["tie_word_embeddings"] else embed
    total = embed + layers * layer_parameters(shape) + shape["hidden_size"] + head
    return {"total": total, "matmul": total - embed + (embed if shape["tie_word_embeddings"] else 0)}


def deepest(shape: dict, budget_bytes: float, bytes_per_parameter: float) -> int:
    """The most layers whose parameters, at `bytes_per_parameter`, fit in `budget_bytes`."""
    fixed = parameters(shape, 0)["total"] * bytes_per_parameter
    return max(0, int((budget_bytes - fixed) // (layer_parameters(shape) * bytes_per_parameter)))


class DoesNotFit(RuntimeError):
    """`l2l finetune` refused the run before loading it: this machine cannot hold it (its line)."""


class Folders:
    """Model folders of one shape under `root`: shards/ holds the tensors, written once each."""

    def __init__(self, root: Path, shape: dict, device: str, seed: int = 0):
        self.root, self.shape, self.device, self.seed = Path(root), shape, device, seed
        (self.root / "shards").mkdir(parents=True, exist_ok=True)

    def _tensors(self, model, names: list[str], number: int) -> dict[str, torch.Tensor]:
        """Random bf16 tensors for `names` (drawn on `device`, from seed and the file's number)."""
        g = torch.Generator(self.device).manual_seed(self.seed * 100_003 + number)
        params = dict(model.named_parameters())
        out = {}
        for name in names:
            shape = params[name].shape
            if name.endswith("norm.weight"):
                out[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = torch.empty(shape, dtype=torch.bfloat16, device=self.device).normal_(0, INIT_STD, generator=g)
                out[name] = t.cpu()
        return out

    def _file(self, model, name: str, names: list[str], number: int) -> str:
        from safetensors.torch import save_file

        path = self.root / "shards" / f"{name}.safetensors"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            save_file(self._tensors(model, names, number), str(tmp), metadata={"format": "pt"})
            tmp.rename(path)
        return f"../shards/{path.name}"

    def folder(self, layers: int) -> Path:
        """The folder of the model with `layers` layers (its shards written where missing)."""
        from transformers import LlamaForCausalLM

        cfg = config(self.shape, layers)
        folder = self.root / f"llama-{layers}"
        folder.mkdir(exist_ok=True)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        names = [n for n, _ in model.named_parameters()]
        groups = [("embed", [n for n in names if "embed_tokens" in n])]
        groups += [(f"layer-{i:03d}", [n for n in names if f".layers.{i}." in n]) for i in range(layers)]
        groups += [("head", [n for n in names if n in ("model.norm.weight", "lm_head.weight")])]
        weight_map = {}
        for number, (name, group) in enumerate(groups):
            number = {"embed": 0, "head": 1}.get(name, number + 1)  # the same draw for layer i in every depth
            file = self._file(model, name, group, number)
            weight_map.update({n: file for n in group})
        total = sum(math.prod(p.shape) * 2 for p in model.parameters())
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        cfg.dtype, cfg.architectures = "bfloat16", ["LlamaForCausalLM"]
        cfg.save_pretrained(folder)
        self._tokenizer(folder)
        return folder

    def _tokenizer(self, folder: Path) -> None:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {UNK: 0, EOS: 1, **{f"w{i}": i for i in range(2, self.shape["vocab_size"])}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, eos_token=EOS).save_pretrained(folder)

    def text(self, words: int) -> Path:
        """A text file of about `words` words of the vocabulary (Zipf-like ranks, seeded)."""
        path = self.root / f"text-{words}.txt"
        if not path.exists():
            rng = np.random.default_rng(self.seed)
            ids = (rng.zipf(1.2, words) - 1) % (self.shape["vocab_size"] - 2) + 2  # w2 ... w(vocab-1)
            lines = [" ".join(f"w{i}" for i in ids[k:k + WORDS_PER_LINE]) for k in range(0, words, WORDS_PER_LINE)]
            path.write_text("\n".join(lines) + "\n")
        return path


def words_for(minibatches: int, batch: int, context: int) -> int:
    """Words of text for `minibatches` minibatches after `l2l finetune` holds a tenth out (each
    word is one token; every line's newline is dropped by the whitespace pre-tokenizer)."""
    return int(math.ceil(minibatches * 10 / 9 + 1) * batch * context * 1.02)


def finetune(folder: Path, text: Path, out: Path, *, device: str, context: int, batch: int, micro_batches: int,
             warmup: int, timed: int, optimizer_state: str, precision: str, adamw: dict, seed: int,
             timeout: float) -> dict:
    """`l2l finetune` on `folder` until `warmup` + `timed` steps are in, watched: its figures."""
    cmd = [sys.executable, "-m", "l2l_hw.cli", "finetune", "--model", str(folder), "--data", str(text),
           "--out", str(out), "--overwrite", "--device", device, "--context", str(context),
           "--batch-size", str(batch), "--micro-batches", str(micro_batches), "--precision", precision,
           "--optimizer-state", optimizer_state, "--steps", str(warmup + timed + 2), "--eval-every", "1000000",
           "--schedule", "constant", "--seed", str(seed), "--lr", str(adamw["lr"]),
           "--adam-beta1", str(adamw["betas"][0]), "--adam-beta2", str(adamw["betas"][1]),
           "--adam-eps", str(adamw["eps"]), "--weight-decay", str(adamw["weight_decay"]),
           "--no-save"]  # timed steps, then stopped: no checkpoint or model folder needs the disk
    out.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    seen = watch(cmd, metrics, log, stop_after_rows=warmup + timed, timeout=timeout)
    rows = seen["rows"]
    if not rows and seen["returncode"] == 2 and "does not fit this machine" in log_tail(log):
        raise DoesNotFit(f"l2l finetune: {log_tail(log).strip()}")
    if len(rows) < warmup + timed:
        raise RuntimeError(f"l2l finetune stopped after {len(rows)} of {warmup + timed} steps (exit "
                           f"{seen['returncode']}, {seen['killed'] or 'not killed'}): {log_tail(log)}")
    cfg = json.loads((folder / "config.json").read_text())
    return {"command": " ".join(cmd[1:]), **step_figures(rows[warmup:warmup + timed], rows[warmup - 1]["seen_at"],
                                                         seen, cfg, context, batch)}


def step_figures(timed: list[dict], start: float, seen: dict, cfg: dict, context: int, batch: int) -> dict:
    """Tokens/s, TFLOPS (attention counted) and the watched figures of a run's timed steps."""
    layers = cfg["num_hidden_layers"]
    shape = {k: cfg[k] for k in LLAMA_3_8B if k in cfg}
    n = parameters(shape, layers)
    per_token = flops_per_token(n["matmul"], layers, cfg["hidden_size"], context)
    tokens = batch * context
    rate = rate_spread(tokens, [tokens / r["tokens_per_s"] for r in timed])
    return {"layers": layers, "parameters": n["total"], "tokens_per_step": tokens, "context": context,
            "tokens_per_s": rate, "tflops": spread(rate[k] * per_token / 1e12 for k in ("min", "median", "max")),
            "flops_per_token": per_token, "attention_counted": ATTENTION,
            "peak_device_bytes": seen["peak_device_bytes"],
            "peak_host_rss_bytes": seen["peak_rss_bytes"], **idle_share(seen, start, timed[-1]["seen_at"]),
            "losses": [r.get("loss") for r in timed]}


def with_mfu(figures: dict, measured_peak: float | None, dense_peak: float | None) -> dict:
    return {**figures, **{f"{k}": v for k, v in mfu(figures["tokens_per_s"]["median"], figures["flops_per_token"],
                                                     measured_peak, dense_peak).items() if k != "tflops"}}
