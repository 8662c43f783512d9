"""A Hugging Face model folder, as transformers' save_pretrained writes it: its config (checked
for what the relay needs; a fingerprint of it), its safetensors weights (one file or shards and
their index, read tensor by tensor: Checkpoint), its tokenizer, and the model's skeleton on the
meta device. l2l_hw/hf.py builds the relay from it and saves into one.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from l2l_hw.inputs import path_kind, regular_file

SUPPORTED = ("GPT2LMHeadModel, BertForMaskedLM, and decoder-only causal LMs laid out as Llama "
             "(model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head: Llama, Mistral, "
             "Qwen2, Qwen3, Gemma-3, ...)")
WEIGHTS_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
SIZES = ("num_hidden_layers", "n_layer", "num_attention_heads", "n_head", "hidden_size", "n_embd", "vocab_size",
         "n_positions", "max_position_embeddings")  # config.json's sizes, each a whole number >= 1 where given
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model")


def import_transformers():
    """The transformers package (optional: l2l_hw.hf's models need it)."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("l2l_hw.hf needs the optional dependency transformers: "
                          "pip install transformers (requirements.txt pins the tested version)") from exc
    return transformers


def model_folder(path) -> Path:
    folder = Path(path)
    kind = path_kind(folder)
    if kind != "a folder":
        raise FileNotFoundError(f"model folder {folder} {'does not exist' if kind == 'missing' else 'is ' + kind}; "
                                "give a local folder written by transformers' save_pretrained (config.json and "
                                "*.safetensors)")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json; give a local folder written by transformers' "
                                "save_pretrained")
    return folder


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_config(path):
    """The transformers config of a local model folder, checked for what the relay needs; a
    config.json that is not valid, or describes no trainable model, is a ValueError naming it."""
    folder = model_folder(path)
    file = folder / "config.json"
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
        config = import_transformers().AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, OSError, KeyError, TypeError, AttributeError) as e:  # transformers' own, or bad JSON
        raise ValueError(f"{file} is not a valid transformers config: {first_line(e)}") from None
    for name in SIZES:
        value = raw.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{file}: {name} is {value!r}; it must be a whole number >= 1")
    return config


def config_fingerprint(path) -> str:
    """16 hex digits of sha256 over the model folder's config.json as JSON (keys sorted): what a
    checkpoint records of the model it was trained from, so another model's is told apart."""
    load_config(path)
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def weights_file(folder: Path) -> Path:
    """The folder's shard index, or its one weights file."""
    for name in (INDEX_FILE, WEIGHTS_FILE):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{folder} has no weights: expected {WEIGHTS_FILE} or {INDEX_FILE} "
                            "(safetensors, as transformers' save_pretrained writes them; l2l finetune --weights "
                            "random draws them from config.json)")


def shard_map(index: Path) -> dict[str, Path]:
    """A safetensors index (model.safetensors.index.json): each tensor's shard, every shard checked
    to be a regular file; a bad index is one ValueError naming it."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = {key: index.parent / file for key, file in weight_map.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map of "
                         f"tensor name -> file): {first_line(e)}") from None
    for shard in set(shards.values()):
        regular_file(shard, f"the weights file named in {index},")
    return shards


def _model_class(config):
    transformers = import_transformers()
    architectures = getattr(config, "architectures", None) or []
    for name in architectures:
        if name in ("GPT2LMHeadModel", "BertForMaskedLM") or name.endswith("ForCausalLM"):
            cls = getattr(transformers, name, None)
            if cls is not None:
                return cls
    raise ValueError(f"architecture {', '.join(architectures) or 'unknown (config.json lists none)'} "
                     f"is not supported; l2l_hw.hf supports {SUPPORTED}")


def masked_lm(config) -> bool:
    """Whether a model config describes a masked LM (BERT), trained on masked tokens, rather than a
    causal LM (GPT-2, the Llama family) that continues text."""
    return _model_class(config).__name__ == "BertForMaskedLM"


def load_tokenizer(path):
    """The tokenizer saved in a local model folder (nothing is downloaded)."""
    folder = model_folder(path)
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{folder} has no tokenizer (one of {', '.join(TOKENIZER_FILES)}); save it "
                                "there with tokenizer.save_pretrained")
    try:
        return import_transformers().AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # a corrupt tokenizer.json or tokenizer_config.json: transformers' many errors
        files = ", ".join(f for f in TOKENIZER_FILES if (folder / f).is_file())
        raise ValueError(f"the tokenizer in {folder} ({files}) cannot be loaded: {first_line(e)}") from None


def max_positions(config) -> int | None:
    """The longest sequence a model with learned positions takes (GPT-2's n_positions, BERT's
    max_position_embeddings); None for rotary models, whose positions are computed."""
    if getattr(config, "model_type", None) == "gpt2":
        return config.n_positions
    if getattr(config, "model_type", None) == "bert":
        return config.max_position_embeddings
    return None


def skeleton(path) -> nn.Module:
    """The model of a local folder with every parameter on the meta device (no weights
    allocated) and real non-persistent buffers (rotary inv_freq, BERT's position ids),
    computed by the model's own initialization, as transformers' from_pretrained does."""
    folder = model_folder(path)
    config = load_config(folder)
    cls = _model_class(config)
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as e:  # a config transformers accepts but cannot build a model from
        raise ValueError(f"{folder / 'config.json'}: {cls.__name__} cannot be built from it: {first_line(e)}") from None
    for name, buffer in list(model.named_non_persistent_buffers()):
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.empty_like(buffer, device="cpu"))
    model.initialize_weights()  # meta parameters: nothing is allocated; buffers get their values
    model.tie_weights()  # transformers 5.0 builds a meta model untied (later 5.x tie it when built)
    return model


class Checkpoint:
    """The safetensors weights of a local folder, read tensor by tensor. A shard is opened
    when a tensor in it is first read and closed once every tensor `expect`ed from it is
    read, so about one shard is mapped while the model streams in layer by layer."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self._open = safe_open
        weights = weights_file(folder)
        if weights.name == INDEX_FILE:
            self.shard_of = shard_map(weights)
        else:
            with self._opened(weights) as f:
                self.shard_of = {key: weights for key in f.keys()}
        self.left: dict[Path, set[str]] = {}  # per shard, the tensors still to read
        self.handles: dict[Path, object] = {}

    def _opened(self, shard: Path):
        try:
            return self._open(shard, framework="pt")
        except Exception as e:  # safetensors' SafetensorError: a truncated or foreign file
            raise ValueError(f"{shard} is not a readable safetensors file: {first_line(e)}") from None

    def expect(self, keys: set[str]) -> None:
        for key in keys:
            self.left.setdefault(self.shard_of[key], set()).add(key)

    def find(self, names: list[str]) -> str | None:
        return next((n for n in names if n in self.shard_of), None)

    def read(self, key: str) -> torch.Tensor:
        shard = self.shard_of[key]
        if shard not in self.handles:
            self.handles[shard] = self._opened(shard)
        try:
            tensor = self.handles[shard].get_tensor(key)
        except Exception as e:  # data past the end of a truncated file, a dtype torch lacks
            raise ValueError(f"{shard}: tensor {key} cannot be read: {first_line(e)}") from None
        left = self.left.get(shard, set())
        left.discard(key)
        if not left:
            self.handles.pop(shard).__exit__(None, None, None)
        return tensor

    def close(self) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles.clear()
