"""Fine-tuning data for a Hugging Face model: local data read as transformers' run_clm reads
it, tokenized by the tokenizer in the model folder, cached beside the run, packed into minibatches.

    finetune_batches(dir, data)   one epoch of `(inputs, targets)` minibatches for relay.train_step
    tokenize_text(tokenizer, data)  the tokens of `data`: ids, and which of them carry loss
    chat_pieces(tokenizer, messages)  a conversation through the tokenizer's chat template

Reading (data_kind). A UTF-8 text file as written (newlines kept; with `doc_separator`, a line
that is exactly it ends a document), JSON Lines (each object's `text_field` a document), a
folder that datasets' save_to_disk wrote (its train split, from the memory-mapped Arrow files)
or a folder of files (each file a document). The end-of-text token ends each record and each
file of a folder, and stands in a separator's place. The texts are tokenized TOKENIZE_BATCH at a
time and the ids written as uint32 as they come, never held as Python ints.

Packing, as run_clm's group_texts: the tokens concatenated and cut into blocks of `seq_len`
(the shorter last block dropped), the blocks shuffled with `seed`, `batch_size` a minibatch (the
shorter last group dropped), each minibatch made when it is read. A causal LM's labels are the
input ids (the loss shifts); a masked LM's are the masked tokens only, drawn per minibatch.
The targets carry the token count (`hf.TokenLoss.targets`): the relay's loss is HF's for any
micro-batching.

Cache. `cache` (a path stem, e.g. out/tokens/train): the ids in cache.bin, the counted mask in
cache.counted.bin, the key in cache.json: the data's path, size and modification time (each
file's, for a folder), the tokenizer's files (tokenizer_fingerprint), the reading options and
CACHE_FORMAT. A later call with the same key maps those files instead of tokenizing; each is
written under a temporary name and renamed, the key last, so a killed run leaves no key that
describes a partial file.

Chat. Each record (a JSON object or a dataset row) is a conversation, {"messages": [{"role",
"content"}, ...]}, rendered by the tokenizer's chat template turn by turn (chat_pieces): only
what each assistant message adds after the generation prompt carries loss (-100 elsewhere),
and a block with no counted target is left out.

The model side (the folder, its config and tokenizer, the loss) is `l2l_hw.hf`.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import torch

from l2l_hw.checkpoint import remove_stale_temporaries, temporary_beside
from l2l_hw.hf import (IGNORE_INDEX, TOKENIZER_FILES, TokenLoss, batch, first_line, load_config, load_tokenizer,
                       masked_lm, max_positions, model_folder)
from l2l_hw.inputs import path_kind, regular_file

TOKENIZER_STATE = (*TOKENIZER_FILES, "merges.txt", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")  # the files a tokenizer's ids depend on
DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")  # what datasets' save_to_disk writes
TOKENIZE_BATCH = 1024  # texts per tokenizer call: a fast tokenizer encodes a batch in parallel
CACHE_FORMAT = 1  # the token cache's layout: a cache of another layout is tokenized anew


def tokenizer_fingerprint(path) -> str:
    """16 hex digits of sha256 over the tokenizer's files in a model folder: what a token cache
    records of the tokenizer that made it, so another tokenizer's ids are never reused."""
    folder = model_folder(path)
    digest = hashlib.sha256()
    for name in TOKENIZER_STATE:
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return digest.hexdigest()[:16]


class Tokens(NamedTuple):
    """A data source's tokens: `ids` (N,) uint32 in order, and `counted` (N,) bool, which of them
    carry loss (chat: the assistant's), or None: every one. Memory-mapped when read from a cache."""

    ids: np.ndarray
    counted: np.ndarray | None = None


def data_kind(data, text_field: str | None = None, chat: bool = False) -> str:
    """How `data` is read: "text" (a UTF-8 file as written), "json lines" (one JSON object a
    line: a .jsonl file, or any file with text_field or chat), "dataset" (a folder that
    datasets' save_to_disk wrote) or "folder" (its files, each a text document)."""
    path = Path(data)
    if path_kind(path) == "a folder":
        return "dataset" if any((path / name).is_file() for name in DATASET_FILES) else "folder"
    regular_file(path, "data file")
    return "json lines" if chat or text_field is not None or path.suffix == ".jsonl" else "text"


def tokenize_text(tokenizer, data, doc_separator: str | None = None, text_field: str | None = None,
                  chat: bool = False, cache: Path | None = None, fingerprint: str = "") -> Tokens:
    """The tokens of `data` as transformers' run_clm reads it: the text as written (newlines
    kept), concatenated. A text file streams line by line; with `doc_separator`, a line that is
    exactly it ends a document: the end-of-text token stands in its place. JSON Lines: each
    object's `text_field` (default "text") is a document, followed by the end-of-text token;
    a `datasets` folder (load_from_disk; its train split) the same by its column `text_field`;
    a folder of files: each file a document. `chat`: each object (or row) is a conversation,
    {"messages": [{"role", "content"}, ...]}, rendered by the tokenizer's chat template
    (chat_pieces); only the assistant's tokens are counted.

    The ids are written as they come (uint32), never held as Python ints. `cache` (a path
    stem in the run's folder, e.g. out/tokens/train): they go to cache.bin (and the counted
    mask to cache.counted.bin), with cache.json holding the key: the data's path, size and
    modification time (each file's, for a folder), the tokenizer's `fingerprint` and these
    options. A later call with the same key maps those files instead of tokenizing."""
    data = Path(data)
    kind = data_kind(data, text_field, chat)
    _check_reading(tokenizer, data, kind, doc_separator, text_field, chat)
    pieces = _pieces(tokenizer, data, kind, doc_separator, text_field, chat)
    if cache is None:
        ids, counted = io.BytesIO(), io.BytesIO() if chat else None
        _write_tokens(_token_runs(tokenizer, pieces), ids, counted)
        return Tokens(np.frombuffer(ids.getbuffer(), np.uint32),
                      np.frombuffer(counted.getbuffer(), np.bool_) if chat else None)
    key = {"format": CACHE_FORMAT, "data": str(data.resolve()), "files": _stamps(data), "tokenizer": fingerprint,
           "doc_separator": doc_separator, "text_field": text_field, "chat": chat}
    return _cached(cache, key) or _write_cache(cache, key, _token_runs(tokenizer, pieces), chat)


def _check_reading(tokenizer, data: Path, kind: str, doc_separator: str | None, text_field: str | None,
                   chat: bool) -> None:
    """Refuse in one line a reading option that does not apply to `data`, and a tokenizer that
    lacks what the reading needs (an end-of-text token to end documents, a chat template)."""
    what = {"text": "a text file", "json lines": "JSON Lines", "dataset": "a datasets dataset",
            "folder": "a folder of text files"}[kind]
    if doc_separator is not None and kind in ("json lines", "dataset"):
        raise ValueError(f"--doc-separator splits text into documents; {data} is {what}, whose records are the "
                         "documents")
    if chat and kind == "folder":
        raise ValueError(f"--chat reads conversations from JSON Lines or a datasets dataset; {data} is {what}")
    if text_field is not None and (chat or kind == "folder"):
        raise ValueError(f"--text-field names the text of JSON Lines objects or dataset rows; {data} is {what}"
                         + (" of conversations, whose messages --chat reads" if chat else ""))
    if not chat and (kind != "text" or doc_separator is not None) and tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {tokenizer.name_or_path} has no end-of-text token (eos_token), and "
                         f"{'--doc-separator' if kind == 'text' else what} needs one to end each document; give a "
                         "plain text file without --doc-separator")
    if chat and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the tokenizer in {tokenizer.name_or_path} has no chat template, which --chat renders "
                         "the conversations with (chat_template.jinja, or chat_template in tokenizer_config.json)")


def _stamps(data: Path) -> list:
    """[name, size, modification time in ns] of the data file, or of every file under the folder."""
    files = sorted(p for p in data.rglob("*") if p.is_file()) if data.is_dir() else [data]
    return [[p.relative_to(data).as_posix() if data.is_dir() else p.name, p.stat().st_size, p.stat().st_mtime_ns]
            for p in files]


def _cache_files(cache: Path) -> tuple[Path, Path, Path]:
    """(ids, counted mask, key) of a token cache stem."""
    return tuple(cache.with_name(cache.name + suffix) for suffix in (".bin", ".counted.bin", ".json"))


def _cached(cache: Path, key: dict) -> Tokens | None:
    """The cache's tokens, memory-mapped, where its key is `key` and its files are whole."""
    ids_file, counted_file, key_file = _cache_files(cache)
    try:
        saved = json.loads(key_file.read_text(encoding="utf-8"))
        n = saved["tokens"]
        if saved["key"] != key or ids_file.stat().st_size != 4 * n or (
                key["chat"] and counted_file.stat().st_size != n):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None

    def mapped(file, dtype):
        return np.memmap(file, dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)

    return Tokens(mapped(ids_file, np.uint32), mapped(counted_file, np.bool_) if key["chat"] else None)


def _write_cache(cache: Path, key: dict, runs: Iterator[tuple[list[int], bool]], chat: bool) -> Tokens:
    """Tokenize into the cache: each file written under a temporary name and renamed, the key
    last, so a key on disk always describes whole files (a kill leaves the cache unused)."""
    ids_file, counted_file, key_file = _cache_files(cache)
    files = [ids_file, *([counted_file] if chat else []), key_file]  # in the order they are renamed
    temporaries = {}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        key_file.unlink(missing_ok=True)
        for path in files:
            temporaries[path] = _temporary(path)
        with open(temporaries[ids_file], "wb") as ids, \
                open(temporaries[counted_file], "wb") if chat else contextlib.nullcontext() as counted:
            n = _write_tokens(runs, ids, counted)
        temporaries[key_file].write_text(json.dumps({"key": key, "tokens": n}, indent=1), encoding="utf-8")
        for path in files:
            os.replace(temporaries[path], path)
    except OSError as e:  # a full or read-only disk, named; an error reading the data (its path in it) as it is
        if e.filename is not None and Path(e.filename) not in {cache.parent, *files, *temporaries.values()}:
            raise
        raise OSError(f"{cache.parent}: cannot write the token cache ({e.strerror or e})") from e
    finally:
        for temporary in temporaries.values():
            temporary.unlink(missing_ok=True)
    return _cached(cache, key)


def _temporary(path: Path) -> Path:
    """A new empty temporary file beside `path` (checkpoint.temporary_beside), after removing
    those a killed run left there."""
    remove_stale_temporaries(path)
    return temporary_beside(path)


def _write_tokens(runs: Iterator[tuple[list[int], bool]], ids, counted) -> int:
    """Append each run's ids (uint32) to the binary file `ids` and, where `counted` is given, one
    byte a token (1: it carries loss) to that file; the number of tokens."""
    n = 0
    for run, carries_loss in runs:
        ids.write(np.asarray(run, np.uint32).tobytes())
        if counted is not None:
            counted.write((b"\1" if carries_loss else b"\0") * len(run))
        n += len(run)
    return n


Piece = tuple[str | int, bool]  # a text to tokenize or one token id; whether its tokens carry loss


def _token_runs(tokenizer, pieces: Iterator[Piece]) -> Iterator[tuple[list[int], bool]]:
    """(ids, counted) of each piece, in order, the texts tokenized TOKENIZE_BATCH at a time."""
    pending = []
    for piece in pieces:
        pending.append(piece)
        if len(pending) == TOKENIZE_BATCH:
            yield from _encoded(tokenizer, pending)
            pending = []
    yield from _encoded(tokenizer, pending)


def _encoded(tokenizer, pieces: list[Piece]) -> Iterator[tuple[list[int], bool]]:
    texts = [text for text, _ in pieces if isinstance(text, str)]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else ())
    for piece, counted in pieces:
        yield (next(encoded) if isinstance(piece, str) else [piece]), counted


def _pieces(tokenizer, data: Path, kind: str, doc_separator: str | None, text_field: str | None,
            chat: bool) -> Iterator[Piece]:
    eos = tokenizer.eos_token_id
    if kind == "text":
        yield from _text_pieces(data, doc_separator, eos)
        return
    if kind == "folder":
        for file in _folder_files(data):
            yield from _text_pieces(file, doc_separator, eos)
            yield eos, True
        return
    field = "messages" if chat else text_field or "text"
    records = _json_lines(data) if kind == "json lines" else _dataset_rows(data, field)
    for where, record in records:
        if chat:
            yield from chat_pieces(tokenizer, _messages(record, where), where)
        else:
            yield _record_text(record, field, where), True
            yield eos, True


def _lines(file: Path) -> Iterator[tuple[int, str]]:
    """(line number, line with its newline) of a UTF-8 file, read line by line in binary; a
    byte that is not UTF-8 is named with its offset and line."""
    offset = 0
    with open(file, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"data file {file} is not UTF-8 text: {e.reason} at byte {offset + e.start} "
                                 f"(line {number})") from None
            offset += len(raw)


def _text_pieces(file: Path, doc_separator: str | None, eos: int | None) -> Iterator[Piece]:
    for _, line in _lines(file):
        if doc_separator is not None and line.rstrip("\r\n") == doc_separator:
            yield eos, True
        else:
            yield line, True


def _folder_files(folder: Path) -> list[Path]:
    """The files under a data folder, sorted by relative path (hidden ones skipped); anything
    that is not a regular file is refused, naming it."""
    files = sorted(p for p in folder.rglob("*") if not any(part.startswith(".") for part in
                                                            p.relative_to(folder).parts) and not p.is_dir())
    if not files:
        raise ValueError(f"data folder {folder} holds no files")
    return [regular_file(p, "data file") for p in files]


def _json_lines(file: Path) -> Iterator[tuple[str, object]]:
    """("path:line", object) of each non-blank line of a JSON Lines file."""
    for number, line in _lines(file):
        if line.strip():
            try:
                yield f"{file}:{number}", json.loads(line)
            except ValueError as e:
                raise ValueError(f"{file}:{number}: not a JSON object ({e})") from None


def _dataset_rows(folder: Path, column: str) -> Iterator[tuple[str, dict]]:
    """("folder row n", {column: value}) of each row of a datasets dataset saved to `folder` (a
    dataset dict: its train split), read from its memory-mapped Arrow files."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{folder} is a datasets dataset (save_to_disk); reading it needs the datasets package: "
                         "pip install 'l2l-hw[data]'") from None
    try:
        dataset = datasets.load_from_disk(str(folder))
    except Exception as e:  # datasets' own errors: a missing or corrupt Arrow file, a foreign state.json
        raise ValueError(f"{folder}: the datasets dataset cannot be loaded: {first_line(e)}") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise ValueError(f"{folder} holds the splits {', '.join(dataset)}, no train split; give one split's "
                             f"folder ({folder / next(iter(dataset))})")
        dataset = dataset["train"]
    if column not in dataset.column_names:
        raise ValueError(f"{folder}: the dataset has no column {column!r} (its columns: "
                         f"{', '.join(dataset.column_names)}); --text-field names the text column, --chat reads "
                         "'messages'")
    for number, row in enumerate(dataset.select_columns([column])):
        yield f"{folder} row {number}", row


def _record_text(record, field: str, where: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        hint = ("; it holds \"messages\": give --chat (chat=True) to train on conversations"
                if isinstance(record, dict) and "messages" in record else "")
        raise ValueError(f"{where}: no text field {field!r} (a JSON object with {field!r}: a string){hint}")
    return record[field]


def _messages(record, where: str) -> list[dict]:
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ValueError(f"{where}: not a conversation (a JSON object with \"messages\": a list of "
                         "{\"role\": ..., \"content\": ...})")
    return messages


def chat_pieces(tokenizer, messages: list[dict], where: str = "a conversation") -> Iterator[Piece]:
    """A conversation as the tokenizer's chat template renders it, in pieces (text, counted):
    what each assistant message adds after the generation prompt (its content and the
    template's end of turn) is counted, the rest is not. The template renders the messages up
    to each assistant message with the generation prompt, then through it; each rendering must
    begin with the one before, as it does when the template renders turn by turn."""
    def render(count: int, prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(messages[:count], tokenize=False, add_generation_prompt=prompt)
        except Exception as e:  # the template's own raise_exception, or a message it cannot render
            raise ValueError(f"{where}: the tokenizer's chat template cannot render it: {first_line(e)}") from None

    renderings = []  # (the conversation rendered so far, whether its new text is counted)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            renderings += [(render(i, True), False), (render(i + 1, False), True)]
    renderings.append((render(len(messages), False), False))
    done = ""
    for text, counted in renderings:
        if not text.startswith(done):
            raise ValueError(f"{where}: the chat template does not render this conversation turn by turn (the text "
                             "up to an assistant message does not begin the text through it), so the assistant's "
                             "tokens cannot be told apart")
        yield text[len(done):], counted
        done = text


class Minibatches(Sequence):
    """`(inputs, targets)` minibatches of packed blocks, made when read: block b is tokens
    [b*T, (b+1)*T) of `tokens` (a memory map when cached), `blocks` the training order,
    `batch_size` blocks a minibatch, `which` the minibatches of this sequence (a slice of it is
    another Minibatches: a held-out share). Labels are the input ids, -100 where a token is not
    counted (chat); a masked LM's (`masking`: mask token id, fraction, seed) are the masked
    tokens only, drawn per minibatch from (seed, its number)."""

    def __init__(self, tokens: Tokens, blocks: torch.Tensor, batch_size: int, seq_len: int, loss_fn: TokenLoss,
                 masking: tuple[int, float, int] | None = None, which: range | None = None):
        self.tokens, self.blocks, self.batch_size, self.seq_len = tokens, blocks, batch_size, seq_len
        self.loss_fn, self.masking = loss_fn, masking
        self.which = range(len(blocks) // batch_size) if which is None else which

    def __len__(self) -> int:
        return len(self.which)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return Minibatches(self.tokens, self.blocks, self.batch_size, self.seq_len, self.loss_fn, self.masking,
                               self.which[k])
        number, size, T = self.which[k], self.batch_size, self.seq_len
        rows = self.blocks[number * size:(number + 1) * size].numpy()
        input_ids = torch.from_numpy(_blocks(self.tokens.ids, T)[rows].astype(np.int64))  # (B, T)
        labels = input_ids.clone()
        if self.tokens.counted is not None:
            labels[~torch.from_numpy(_blocks(self.tokens.counted, T)[rows])] = IGNORE_INDEX
        if self.masking is not None:
            mask_id, fraction, seed = self.masking
            chosen = torch.from_numpy(np.random.default_rng([seed, number]).random(input_ids.shape) < fraction)
            labels[~chosen] = IGNORE_INDEX
            input_ids[chosen] = mask_id
        return batch(self.loss_fn, input_ids, labels)


def _blocks(array: np.ndarray, seq_len: int) -> np.ndarray:
    """The whole blocks of `array`, (n, seq_len): a view, nothing read."""
    n = len(array) // seq_len
    return array[:n * seq_len].reshape(n, seq_len)


def finetune_batches(path, data_file, batch_size: int, seq_len: int, seed: int = 0,
                     mask_fraction: float = 0.15, doc_separator: str | None = None,
                     text_field: str | None = None, chat: bool = False, cache: Path | None = None) -> Minibatches:
    """One epoch of `(inputs, targets)` minibatches for relay.train_step from local data,
    tokenized by the tokenizer in the model folder `path` (tokenize_text, with its `cache`).

    The tokens are packed into blocks of `seq_len`, as transformers' run_clm packs them (the
    last, shorter block dropped), shuffled with `seed`, `batch_size` per minibatch (the last,
    shorter group dropped). Causal LMs: labels are the input ids (the loss shifts), -100 where
    a token is not counted (chat: all but the assistant's; a block with no counted target is
    left out). Masked LMs (BERT): `mask_fraction` of the tokens are replaced by the mask token
    and are the only labelled ones. Targets carry the token count (`TokenLoss.targets`)."""
    folder = model_folder(path)
    config = load_config(folder)
    masked = masked_lm(config)
    tokenizer = load_tokenizer(folder)
    if batch_size < 1 or seq_len < 2:
        raise ValueError(f"batch_size must be >= 1 and seq_len >= 2, got {batch_size} and {seq_len}")
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise ValueError(f"a context of {seq_len} tokens is longer than the model's position table: "
                         f"{folder / 'config.json'} has {limit} positions")
    if masked and tokenizer.mask_token_id is None:
        raise ValueError(f"the tokenizer in {folder} has no mask token; a masked LM needs one")
    if masked and chat:
        raise ValueError(f"--chat trains a causal LM on the assistant's tokens; {folder} holds a masked LM")
    tokens = tokenize_text(tokenizer, data_file, doc_separator, text_field, chat, cache,
                           tokenizer_fingerprint(folder) if cache is not None else "")
    if len(tokens.ids) and int(tokens.ids.max()) >= config.vocab_size:
        raise ValueError(f"the tokenizer in {folder} gives token id {int(tokens.ids.max())}, past the model's "
                         f"vocabulary: {folder / 'config.json'} has vocab_size {config.vocab_size}")
    blocks = torch.randperm(len(tokens.ids) // seq_len, generator=torch.Generator().manual_seed(seed))
    if tokens.counted is not None:  # a block whose targets are all -100 has no loss to take a mean of
        blocks = blocks[torch.from_numpy(_blocks(tokens.counted, seq_len)[:, 1:].any(1))[blocks]]
    if len(blocks) < batch_size:
        counted = " with an assistant token" if chat else ""
        raise ValueError(f"{data_file} gives {len(tokens.ids)} tokens, {len(blocks)} blocks of {seq_len}{counted}: "
                         f"fewer than one minibatch of {batch_size}")
    return Minibatches(tokens, blocks, batch_size, seq_len, TokenLoss(shift=not masked),
                       (tokenizer.mask_token_id, mask_fraction, seed) if masked else None)
