"""Hugging Face `transformers` models through the relay: split, load, save, generate.

    split(model)                  the model as relay layers, HF's own modules inside:
                                  input embedding | one layer per decoder/encoder block | head
    from_pretrained(dir, eps=)    the model's skeleton on the meta device; the safetensors
                                  shards of `dir` stream into the EPS one layer at a time
    save_pretrained(relay, dir)   config.json and sharded safetensors from the EPS masters,
                                  layer by layer, that transformers' from_pretrained loads
    save_replacing(relay, dir)    the same, written beside `dir` and renamed into its place
    load_tokenizer(dir)           the tokenizer saved in `dir`
    generate(model, tokenizer, prompt)  a greedy continuation by the materialized model

The data such a model is fine-tuned on (local files, datasets, conversations; tokenized,
cached, packed into minibatches) is read by `l2l_hw.finetune_data`.
The model folder itself (its config, weights files and tokenizer, the skeleton on the meta
device) is read by `l2l_hw.hf_folder`, whose names are this module's too.

Layer contract. A layer takes the previous layer's output: the hidden states (B, T, C),
or (hidden states, attention_mask) when the batch has a padding mask. The mask stays an
integer tensor (B, T), so the relay gives it no gradient; every block rebuilds HF's 4-D
mask and the rotary cos/sin from it with HF's own functions (create_causal_mask, the
model's rotary embedding), exactly as the model's forward does once for all layers.

Loss. HF's loss with `labels` is a mean over the tokens whose label is not -100 (after
the causal shift for a causal LM), over the whole batch. The relay weights micro-batch
j's loss by its share of the samples, n_j / B, so a per-micro-batch token mean matches
HF only when every micro-batch holds the same number of counted tokens per sample.
`loss_fn.targets(labels)` (what `batch()` and `finetune_data` build) adds to the
labels each sample's share of the batch's counted tokens, N / B; micro-batch j's loss
is then its token sum / (n_j N / B), and sum_j (n_j / B) * that = token sum / N: HF's
loss for any distribution of -100s. Plain `labels` as targets give the per-micro-batch
mean (exact when u = 1).
"""
from __future__ import annotations

import copy
import functools
import inspect
import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from l2l_hw.checkpoint import new_file_mode, temporary_beside
# the model folder's reading (hf_folder.py), under l2l_hw.hf's names too: hf.load_config, hf.skeleton, ...
from l2l_hw.hf_folder import (INDEX_FILE, SIZES, SUPPORTED, TOKENIZER_FILES, WEIGHTS_FILE, Checkpoint,
                              config_fingerprint, first_line, import_transformers, load_config, load_tokenizer,
                              masked_lm, max_positions, model_folder, shard_map, skeleton, weights_file)
from l2l_hw.inputs import path_kind

IGNORE_INDEX = -100  # HF's label for tokens that carry no loss
SHARD_BYTES = 2 * 10**9  # save_pretrained's largest shard, the one part of the saved model held in memory


# ---------------------------------------------------------------------------- layers
def _unpack(x) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (x, None) if isinstance(x, torch.Tensor) else (x[0], x[1])


def _pack(hidden: torch.Tensor, mask: torch.Tensor | None):
    return hidden if mask is None else (hidden, mask)


class Embedding(nn.Module):
    """Relay layer 0: token ids (and the padding mask) -> hidden states (B, T, C).

    kind "llama": embed_tokens(ids); "gpt2": wte(ids) + wpe(positions), dropout;
    "bert": BertEmbeddings(ids) (word + position + token type, LayerNorm, dropout)."""

    def __init__(self, kind: str, modules: dict[str, nn.Module]):
        super().__init__()
        self.kind = kind
        self.parts = nn.ModuleDict(modules)

    def forward(self, x):
        ids, mask = _unpack(x)
        p = self.parts
        if self.kind == "llama":
            hidden = p.embed_tokens(ids)
        elif self.kind == "gpt2":
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
            hidden = p.drop(p.wte(ids) + p.wpe(positions))
        else:
            hidden = p.embeddings(input_ids=ids)
        return _pack(hidden, mask)


def mask_call(build, config, hidden: torch.Tensor, mask, positions: torch.Tensor | None = None):
    """HF's mask function `build` (masking_utils.create_*_mask) for a forward without a cache, in
    the words of the installed transformers (mask_arguments): the names changed within 5.x."""
    return build(**mask_arguments(build, config, hidden, mask, positions))


@functools.cache
def mask_parameters(build) -> frozenset:
    return frozenset(inspect.signature(build).parameters)


def mask_arguments(build, config, hidden: torch.Tensor, mask, positions: torch.Tensor | None = None) -> dict:
    """The keyword arguments of `build` for a forward without a cache, by the names its signature
    has: 5.0 calls the embeddings `input_embeds` and takes `cache_position` (positions 0..T-1
    here), later 5.x (5.23) `inputs_embeds` without it; the cache is `past_key_values`, renamed
    `cache` by 5.25 (which warns on the old name, to be removed in 5.40). Positions only where
    `positions` is given (the causal masks)."""
    params = mask_parameters(build)
    args = {"config": config, ("inputs_embeds" if "inputs_embeds" in params else "input_embeds"): hidden,
            "attention_mask": mask}
    if positions is None:
        return args
    args["cache" if "cache" in params else "past_key_values"] = None
    args["position_ids"] = positions
    if "cache_position" in params:
        args["cache_position"] = positions[0]  # (T,): no cache, so the positions themselves
    return args


class Block(nn.Module):
    """One HF decoder (or encoder) layer. Rebuilds what the model's forward computes once for
    all layers, with the same functions: positions arange(T), HF's 4-D attention mask of
    this layer's kind ("full_attention", "sliding_attention" or "bidirectional") and, for
    rotary models, the rotary (cos, sin) (B, T, head_dim)."""

    def __init__(self, layer: nn.Module, config, attention: str, rotary_emb: nn.Module | None = None):
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.typed_rotary = rotary_emb is not None and "layer_type" in inspect.signature(rotary_emb.forward).parameters
        self.config = config
        self.attention = attention

    def _mask(self, hidden, mask, positions):
        from transformers import masking_utils as mu

        if self.attention == "bidirectional":
            return mask_call(mu.create_bidirectional_mask, self.config, hidden, mask)
        build = mu.create_sliding_window_causal_mask if self.attention == "sliding_attention" else mu.create_causal_mask
        return mask_call(build, self.config, hidden, mask, positions)

    def forward(self, x):
        hidden, mask = _unpack(x)
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # (1, T)
        extra = {}
        if self.rotary_emb is not None:  # per layer type where the model has several (Gemma-3: local and global)
            by_type = {"layer_type": self.attention} if self.typed_rotary else {}
            extra["position_embeddings"] = self.rotary_emb(hidden, position_ids=positions, **by_type)
        out = self.layer(hidden, attention_mask=self._mask(hidden, mask, positions), position_ids=positions,
                         **extra)
        return _pack(out[0] if isinstance(out, tuple) else out, mask)


class Head(nn.Module):
    """Last relay layer: hidden states -> logits (B, T, vocab), HF's modules in order
    (final norm, then the LM head)."""

    def __init__(self, modules: dict[str, nn.Module]):
        super().__init__()
        self.parts = nn.ModuleDict(modules)

    def forward(self, x):
        hidden, _ = _unpack(x)
        for module in self.parts.values():
            hidden = module(hidden)
        return hidden


class TokenLoss:
    """HF's `labels` loss: cross entropy over the tokens whose label is not -100, after the
    causal shift (`shift=True`: position t predicts label t + 1) or without it (masked LM).

    Targets are `labels` (B, T), whose loss is this micro-batch's token mean, or
    `(labels, tokens_per_sample)` from `targets()`, whose loss is the token sum over this
    micro-batch's expected count, sum(tokens_per_sample): the minibatch's token mean once
    the relay weights micro-batches by their samples (module docstring)."""

    over_tokens = True  # l2l_hw.train reports its perplexity and tokens/s

    def __init__(self, shift: bool):
        self.shift = shift

    def counted(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels that carry loss, aligned with the logits' positions."""
        if self.shift:
            return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        return labels

    def targets(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(labels, tokens_per_sample)`: the relay's loss then equals HF's for any micro-batching."""
        count = (self.counted(labels) != IGNORE_INDEX).sum()
        per_sample = count.double() / labels.shape[0]
        return labels, per_sample.expand(labels.shape[0]).clone()

    def __call__(self, logits: torch.Tensor, targets) -> torch.Tensor:
        labels, per_sample = (targets, None) if isinstance(targets, torch.Tensor) else targets
        labels = self.counted(labels)
        total = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum")
        count = (labels != IGNORE_INDEX).sum() if per_sample is None else per_sample.sum()
        return total / count.to(total.dtype)


def _llama_layout(model) -> bool:
    base = getattr(model, "model", None)
    return (isinstance(getattr(model, "lm_head", None), nn.Module) and base is not None
            and all(isinstance(getattr(base, name, None), nn.Module)
                    for name in ("embed_tokens", "layers", "norm", "rotary_emb"))
            and isinstance(base.layers, nn.ModuleList) and len(base.layers) > 0
            and "position_embeddings" in inspect.signature(base.layers[0].forward).parameters)


def _causal_attention(config, i: int) -> str:
    """Layer i's mask, as the model's forward picks it: per-layer types where the config
    lists them (Qwen2, Qwen3, ...), else sliding whenever a window is set (Mistral)."""
    types = getattr(config, "layer_types", None)
    if types:
        if types[i] not in ("full_attention", "sliding_attention"):
            raise ValueError(f"layer {i} has attention type {types[i]!r}; l2l_hw.hf supports "
                             "'full_attention' and 'sliding_attention'")
        return types[i]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def _unsupported(model) -> ValueError:
    return ValueError(f"{type(model).__name__} is not supported; l2l_hw.hf supports {SUPPORTED}")


def split(model: nn.Module) -> tuple[list[nn.Module], TokenLoss]:
    """Relay layers and loss of a transformers model; the layers share its modules and
    parameters (a tied embedding and head are one Parameter in two layers)."""
    name = type(model).__name__
    config = model.config
    for option in ("final_logit_softcapping", "logit_scale"):  # logits the head alone does not give
        if getattr(config, option, None) not in (None, 1.0):
            raise ValueError(f"{name} with {option}={getattr(config, option)} is not supported; "
                             f"l2l_hw.hf supports {SUPPORTED}")
    if name == "GPT2LMHeadModel":
        t = model.transformer
        layers = [Embedding("gpt2", {"wte": t.wte, "wpe": t.wpe, "drop": t.drop}),
                  *[Block(block, config, "full_attention") for block in t.h],
                  Head({"ln_f": t.ln_f, "lm_head": model.lm_head})]
        loss = TokenLoss(shift=True)
    elif name == "BertForMaskedLM":
        b = model.bert
        layers = [Embedding("bert", {"embeddings": b.embeddings}),
                  *[Block(layer, config, "bidirectional") for layer in b.encoder.layer],
                  Head({"cls": model.cls})]
        loss = TokenLoss(shift=False)
    elif name.endswith("ForCausalLM") and _llama_layout(model):
        m = model.model
        layers = [Embedding("llama", {"embed_tokens": m.embed_tokens}),
                  *[Block(layer, config, _causal_attention(config, i), m.rotary_emb)
                    for i, layer in enumerate(m.layers)],
                  Head({"norm": m.norm, "lm_head": model.lm_head})]
        loss = TokenLoss(shift=True)
    else:
        raise _unsupported(model)
    _name_tensors(model, layers)
    return layers, loss


def _name_tensors(model: nn.Module, layers: list[nn.Module]) -> None:
    """Give every layer `hf_keys`: its parameter/buffer name -> the model's state-dict names of
    that tensor, the one HF saves first (a tied tensor is saved once, under its first name)."""
    names: dict[int, list[str]] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(key)
    for layer in layers:
        layer.hf_keys = {n: names[id(t)] for n, t in (*layer.named_parameters(), *layer.named_buffers())
                         if id(t) in names}
        layer.config = model.config


def batch(loss_fn: TokenLoss, input_ids: torch.Tensor, labels: torch.Tensor,
          attention_mask: torch.Tensor | None = None) -> tuple:
    """`(inputs, targets)` for relay.train_step: its loss then equals
    `model(input_ids, attention_mask=..., labels=labels).loss`."""
    inputs = input_ids if attention_mask is None else (input_ids, attention_mask.long())
    return inputs, loss_fn.targets(labels)


# ---------------------------------------------------------------------------- loading
def _aliases(name: str, model: nn.Module) -> list[str]:
    """A state-dict name and its form without the base-model prefix (checkpoints of the
    bare model, such as the original GPT-2's `h.0.attn...`)."""
    prefix = getattr(model, "base_model_prefix", "") + "."
    return [name, name[len(prefix):]] if prefix != "." and name.startswith(prefix) else [name]


class LayerInit:
    """`init(i, layer)` for the relay: layer i's meta-device tensors, read from the checkpoint,
    as real CPU tensors by the layer's own names. A tensor shared with an earlier layer (a
    tied embedding and head) was given by that layer's call and is not read again."""

    def __init__(self, folder: Path, model: nn.Module, layers: list[nn.Module]):
        self.folder = folder
        self.checkpoint = Checkpoint(folder)
        # layer -> its tensor's name -> the checkpoint's name for it (None: not in the checkpoint)
        self.keys = {i: {n: self.checkpoint.find([a for key in keys for a in _aliases(key, model)])
                         for n, keys in layer.hf_keys.items()} for i, layer in enumerate(layers)}
        self.checkpoint.expect({key for names in self.keys.values() for key in names.values() if key})
        self.given: set[int] = set()

    def __call__(self, i: int, module: nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in (*module.named_parameters(), *module.named_buffers()):
            if not t.is_meta or id(t) in self.given:
                continue
            key = self.keys[i].get(name)
            if key is None:
                raise ValueError(f"{self.folder}: the weights have no tensor for layer {i}'s {name} "
                               f"({module.hf_keys.get(name, ['a tensor transformers does not save'])[0]})")
            tensor = self.checkpoint.read(key)
            if isinstance(t, nn.Parameter) and t.requires_grad and not tensor.is_floating_point():
                raise ValueError(f"{self.folder}: {key} is {tensor.dtype}; a trainable weight must be floating point "
                                 "(fp32, bf16 or fp16)")
            if tensor.shape != t.shape:
                raise ValueError(f"{self.folder}: {key} has shape {tuple(tensor.shape)}; the config's model "
                                 f"needs {tuple(t.shape)}")
            out[name] = tensor.to(t.dtype)
            self.given.add(id(t))
        if i == len(self.keys) - 1:
            self.checkpoint.close()
        return out


class RandomInit:
    """`init(i, layer)` for a folder whose weights are not wanted or not there (finetune --weights
    random): layer i's tensors drawn from a generator seeded with `seed`, as transformers'
    `_init_weights` draws a new model of the config's families: every matrix (Linear, Embedding)
    from N(0, config.initializer_range), biases 0, norm scales 1. One layer at a time, so
    nothing holds more than a layer of the model."""

    def __init__(self, model: nn.Module, seed: int = 0):
        self.std = getattr(model.config, "initializer_range", 0.02)
        self.generator = torch.Generator().manual_seed(seed)
        self.given: set[int] = set()

    def __call__(self, i: int, module: nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in module.named_parameters():
            if not t.is_meta or id(t) in self.given:
                continue
            if t.dim() >= 2:
                out[name] = torch.empty(t.shape).normal_(0.0, self.std, generator=self.generator).to(t.dtype)
            else:  # a bias, or a norm's scale
                out[name] = (torch.zeros if name.endswith("bias") else torch.ones)(t.shape, dtype=t.dtype)
            self.given.add(id(t))
        meta = [name for name, b in module.named_buffers() if b.is_meta]
        if meta:
            raise ValueError(f"layer {i}'s buffer {meta[0]} is saved with the weights, and --weights random draws "
                             "parameters only: use --weights pretrained")
        return out


WEIGHTS = ("pretrained", "random")  # where a fine-tune's first weights come from


def no_decay_rule(model: nn.Module, layers: list[nn.Module]):
    """`no_decay(i, name)` for the relay: the parameters transformers' Trainer updates without
    weight decay (its own get_decay_parameter_names: biases and norms), by relay layer and name."""
    decayed = set(import_transformers().Trainer.get_decay_parameter_names(None, model))  # uses no Trainer state
    return lambda i, name: name in layers[i].hf_keys and not decayed & set(layers[i].hf_keys[name])


def from_pretrained(path, eps, exempt_from_decay: bool = True, weights: str = "pretrained", seed: int = 0,
                    **relay_options):
    """A Relay holding the model of a local transformers folder: the skeleton on the meta device,
    the safetensors streamed into `eps` layer by layer (this holds one layer and the shard it
    reads); weights="random": drawn instead, layer by layer (RandomInit, from `seed`). The
    relay's loss_fn is the model's `TokenLoss` (`batch()` gives exact HF losses).
    exempt_from_decay: biases and norms are updated without weight decay, as transformers'
    Trainer does (False: every parameter decays, as torch.optim over model.parameters())."""
    from l2l_hw.relay import Relay

    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: must be one of {', '.join(WEIGHTS)}")
    folder = model_folder(path)
    model = skeleton(folder)
    layers, loss_fn = split(model)
    init = LayerInit(folder, model, layers) if weights == "pretrained" else RandomInit(model, seed)
    return Relay(layers, loss_fn, eps=eps, init=init,
                 no_decay=no_decay_rule(model, layers) if exempt_from_decay else None, **relay_options)


# ---------------------------------------------------------------------------- saving
def write_weights(tensors: Iterable[tuple[str, torch.Tensor]], path, max_shard_size: int | str = SHARD_BYTES) -> list[Path]:
    """Write `(name, tensor)` pairs, in order, as transformers' safetensors: one
    model.safetensors, or shards of at most `max_shard_size` (bytes or "200MB") named
    model-0000k-of-0000n.safetensors plus model.safetensors.index.json. Holds one shard."""
    from safetensors.torch import save_file
    from transformers.utils.hub import convert_file_size_to_int

    limit = convert_file_size_to_int(max_shard_size)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("model*.safetensors"), folder / INDEX_FILE]:
        old.unlink(missing_ok=True)
    shards: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush():
        if shard:
            name = folder / f"part-{len(shards):05d}.safetensors"  # renamed once the count is known
            save_file(shard, name, metadata={"format": "pt"})
            os.chmod(name, new_file_mode())  # save_file makes it 0600; the user's umask, as config.json
            shards.append((name, list(shard)))
            shard.clear()

    for key, t in tensors:
        t = t.detach().to("cpu").contiguous()
        if shard and size + t.nbytes > limit:
            flush()
            size = 0
        shard[key] = t
        size += t.nbytes
        total += t.nbytes
    flush()
    files, weight_map = [], {}
    for k, (name, keys) in enumerate(shards):
        final = folder / (WEIGHTS_FILE if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
        os.replace(name, final)
        files.append(final)
        weight_map.update({key: final.name for key in keys})
    if len(shards) > 1:
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                    indent=2, sort_keys=True))
    return files


def _relay_tensors(relay) -> Iterator[tuple[str, torch.Tensor]]:
    """The relay's tensors by HF name, layer by layer, from its export (fp32 masters read from the
    EPS one group at a time); a tied tensor once, under the first name HF saves it by."""
    written = set()
    for e in relay.export():
        keys = relay.layers[e.layer].hf_keys.get(e.name)  # None: a buffer transformers does not save
        if e.tensor is None or keys is None or keys[0] in written:
            continue
        written.add(keys[0])
        yield keys[0], e.tensor


def save_pretrained(relay, path, max_shard_size: int | str = SHARD_BYTES, tokenizer=None, files_from=None) -> Path:
    """Write the relay's model as a transformers folder: config.json and fp32 safetensors
    shards, streamed layer by layer from the EPS masters (write_weights). `tokenizer`
    (optional) is saved alongside; `files_from` (the model folder it was loaded from) gives
    every other file of that folder, copied unchanged: the tokenizer's files,
    generation_config.json, a chat template."""
    folder = Path(path)
    write_weights(_relay_tensors(relay), folder, max_shard_size)
    config = copy.deepcopy(relay.layers[0].config)
    config.dtype = torch.float32
    config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if files_from is not None:
        for source in sorted(model_folder(files_from).iterdir()):
            if path_kind(source) == "a regular file" and source.name != "config.json" and not (
                    source.name.startswith("model") and source.name.endswith((".safetensors", INDEX_FILE))):
                shutil.copyfile(source, folder / source.name)
    return folder


def foreign_files(folder, files_from=None) -> list[str]:
    """What in `folder` save_pretrained(..., files_from=files_from) does not write (its config,
    weights and index, the source folder's other files): a user's files and folders, which
    save_replacing would remove. Nothing where `folder` does not exist."""
    folder = Path(folder)
    if path_kind(folder) == "missing":
        return []
    if path_kind(folder) != "a folder":  # a file of that name: the folder would take its place
        return [folder.name]
    copied = set()
    if files_from is not None and path_kind(files_from) == "a folder":
        copied = {p.name for p in Path(files_from).iterdir() if path_kind(p) == "a regular file"}
    ours = (lambda p: path_kind(p) == "a regular file" and (
        p.name in copied or p.name in ("config.json", INDEX_FILE)
        or (p.name.startswith("model") and p.name.endswith(".safetensors"))))
    return sorted(p.name for p in folder.iterdir() if not ours(p))


def save_replacing(relay, path, files_from=None) -> Path:
    """save_pretrained into a new folder beside `path`, then renamed into its place (the folder it
    replaces is removed): `path` holds a whole model at every moment, the previous one or the new
    one. A kill while writing leaves a hidden temporary folder beside it (the next run in that
    output folder removes it: train.prepare_out); a kill between the two renames leaves no
    `path` and the previous model in the hidden `.NAME.l2l-old-PID` folder.
    A `path` holding anything save_pretrained does not write (foreign_files) is refused
    (FileExistsError), unchanged."""
    target = Path(path)
    foreign = foreign_files(target, files_from)
    if foreign:
        raise FileExistsError(f"{target}: holds what replacing it with the model would remove "
                              f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); move it away")
    target.parent.mkdir(parents=True, exist_ok=True)
    written = temporary_beside(target, folder=True)
    try:
        save_pretrained(relay, written, files_from=files_from)
        if path_kind(target) == "a folder":
            previous = target.with_name(f".{target.name}.l2l-old-{os.getpid()}")
            shutil.rmtree(previous, ignore_errors=True)
            os.replace(target, previous)
            os.replace(written, target)
            shutil.rmtree(previous)
        else:
            os.replace(written, target)
    finally:
        shutil.rmtree(written, ignore_errors=True)  # gone once renamed
    return target


# ---------------------------------------------------------------------------- samples
SAMPLE_TOKENS = 32  # new tokens of a sample: a line or two of text, quick on the CPU


@torch.no_grad()
def generate(model: nn.Module, tokenizer, prompt: str, new_tokens: int = SAMPLE_TOKENS) -> str:
    """The greedy continuation of `prompt` by `model`, the relay's layers materialized
    (relay.materialize()), as transformers' generate(do_sample=False) makes it: `new_tokens` at
    most, ending at the end-of-text token; the text of the new tokens. The whole sequence (its
    last max_positions tokens, for learned positions) goes through the model for each new
    token, in eval mode."""
    limit = max_positions(model[0].config)
    training = model.training
    model.eval()
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]], dtype=torch.long)  # (1, T)
    start = ids.shape[1]
    try:
        for _ in range(new_tokens):
            logits = model(ids[:, -limit:] if limit else ids)  # (1, T, vocab)
            token = logits[0, -1].argmax().view(1, 1)
            ids = torch.cat([ids, token], dim=1)
            if token.item() == tokenizer.eos_token_id:
                break
    finally:
        model.train(training)
    return tokenizer.decode(ids[0, start:])
