"""`l2l finetune`'s data and run as the Hugging Face tools give them: a `datasets` folder or a folder
of files, conversations through the tokenizer's chat template with the loss on the assistant's
tokens only, the tokens cached beside the run, Trainer's warm-up share, the banner, a greedy
sample, and a loadable model folder saved whole during training."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.nn import functional as F

import l2l_hw
from l2l_hw import finetune_data, hf
from l2l_hw.cli import main
from l2l_hw.finetune import finetune
from l2l_hw.finetune import one_line as log_line
from l2l_hw.train import TrainConfig
from tests.test_finetune import PARAGRAPHS, finetune_argv, gpt2_folder  # noqa: F401 (a fixture)
from tests.test_nothing_lost import cli, one_line

pytestmark = pytest.mark.usefixtures("one_thread")

# ChatML, with transformers' generation markers around what an assistant message adds after the
# generation prompt: transformers' own return_assistant_tokens_mask is then the reference.
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' %}"
                 "{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}{% else %}"
                 "{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Where did the cat sit?"},
     {"role": "assistant", "content": "On the mat."}, {"role": "user", "content": "And the dog?"},
     {"role": "assistant", "content": "On the log,\nwhich was cold."}],
    [{"role": "user", "content": "What sang in the tree?"}, {"role": "assistant", "content": "A bird, all day long."}],
] * 12


def tokenizer_with(text: str, eos: bool = True, chat_template: str | None = None):
    """A byte-level BPE tokenizer trained on `text`, with ChatML's special tokens; an end-of-text
    token and a chat template where asked."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **({"eos_token": "<|endoftext|>"} if eos
                                                                              else {}))
    tokenizer.chat_template = chat_template
    return tokenizer


def model_folder(path: Path, tokenizer, n_positions: int = 64) -> Path:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=n_positions, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_argv(folder: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["finetune", "--model", str(folder), "--data", str(data), "--out", str(out), "--context", "16",
            "--batch-size", "2", "--micro-batches", "1", "--steps", "2", *extra]


def chat_text() -> str:
    return PARAGRAPHS + "".join(m["role"] + m["content"] for c in CONVERSATIONS for m in c)


# ---------------------------------------------------------------------------- sources

def test_a_datasets_folder_and_a_folder_of_files_give_their_documents_each_ended_by_end_of_text(tmp_path):
    datasets = pytest.importorskip("datasets")
    tokenizer = tokenizer_with(PARAGRAPHS)
    docs = ["The cat sat.\nOn the mat.", "A bird sang.", "The dog\n\nsat on the log."]
    expected = "".join(d + "<|endoftext|>" for d in docs)
    datasets.Dataset.from_dict({"body": docs, "id": [1, 2, 3]}).save_to_disk(tmp_path / "ds")
    from_rows = finetune_data.tokenize_text(tokenizer, tmp_path / "ds", text_field="body")
    assert tokenizer.decode(from_rows.ids.tolist()) == expected
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs})}).save_to_disk(tmp_path / "dd")
    assert tokenizer.decode(finetune_data.tokenize_text(tokenizer, tmp_path / "dd").ids.tolist()) == expected
    for name, doc in zip(("b/2.txt", "a.txt", "c/d/3.md"), (docs[1], docs[0], docs[2])):  # read in sorted order
        (tmp_path / "files" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "files" / name).write_text(doc)
    (tmp_path / "files" / ".hidden").write_text("not data")
    assert tokenizer.decode(finetune_data.tokenize_text(tokenizer, tmp_path / "files").ids.tolist()) == expected


def test_finetune_trains_on_a_datasets_folder_by_its_text_column(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    folder = model_folder(tmp_path / "model", tokenizer_with(PARAGRAPHS))
    datasets.Dataset.from_dict({"body": PARAGRAPHS.split("\n\n")}).save_to_disk(tmp_path / "ds")
    rc, _, err = cli(capsys, *run_argv(folder, tmp_path / "ds", tmp_path / "run", "--text-field", "body"))
    assert rc == 0, err
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model") is not None


def test_a_datasets_folder_is_one_line_without_the_package_or_without_its_column(tmp_path, capsys, monkeypatch):
    datasets = pytest.importorskip("datasets")
    folder = model_folder(tmp_path / "model", tokenizer_with(PARAGRAPHS))
    datasets.Dataset.from_dict({"body": ["a cat"] * 4}).save_to_disk(tmp_path / "ds")
    argv = run_argv(folder, tmp_path / "ds", tmp_path / "run")
    rc, _, err = cli(capsys, *argv)
    assert rc == 2
    one_line(err, "finetune", str(tmp_path / "ds"), "no column 'text'", "body", "--text-field")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: its import fails
    rc, _, err = cli(capsys, *argv, "--text-field", "body")
    assert rc == 2
    one_line(err, "finetune", str(tmp_path / "ds"), "needs the datasets package", "pip install")


@pytest.mark.parametrize("data", ["jsonl", "folder", "separator"])
def test_documents_need_an_end_of_text_token_and_a_tokenizer_without_one_is_one_line(tmp_path, capsys, data):
    folder = model_folder(tmp_path / "model", tokenizer_with(PARAGRAPHS, eos=False))
    path, extra = {"jsonl": (tmp_path / "d.jsonl", []), "folder": (tmp_path / "files", []),
                   "separator": (tmp_path / "d.txt", ["--doc-separator", "###"])}[data]
    if data == "folder":
        path.mkdir()
        (path / "a.txt").write_text(PARAGRAPHS)
    else:
        path.write_text(json.dumps({"text": PARAGRAPHS}) + "\n" if data == "jsonl" else PARAGRAPHS)
    rc, _, err = cli(capsys, *run_argv(folder, path, tmp_path / "run", *extra))
    assert rc == 2
    one_line(err, "finetune", str(folder), "no end-of-text token")
    assert not (tmp_path / "run" / "checkpoint.safetensors").exists()


@pytest.mark.parametrize("data, flags, words", [
    ("d.jsonl", ["--doc-separator", "###"], ["--doc-separator", "JSON Lines, whose records are the documents"]),
    ("files", ["--chat"], ["--chat reads conversations", "a folder of text files"]),
    ("files", ["--text-field", "body"], ["--text-field", "a folder of text files"]),
    ("d.jsonl", ["--chat", "--text-field", "body"], ["--text-field", "whose messages --chat reads"]),
])
def test_reading_options_that_do_not_apply_to_the_data_are_one_line(tmp_path, capsys, data, flags, words):
    folder = model_folder(tmp_path / "model", tokenizer_with(PARAGRAPHS, chat_template=CHAT_TEMPLATE))
    path = tmp_path / data
    if data == "files":
        path.mkdir()
        (path / "a.txt").write_text(PARAGRAPHS)
    else:
        path.write_text(json.dumps({"text": PARAGRAPHS}) + "\n")
    rc, _, err = cli(capsys, *run_argv(folder, path, tmp_path / "run", *flags))
    assert rc == 2
    one_line(err, "finetune", str(path), *words)


# ---------------------------------------------------------------------------- chat

def write_conversations(path: Path) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    return path


def test_chat_counts_exactly_the_assistant_tokens_transformers_marks_and_the_loss_is_their_mean(tmp_path):
    tokenizer = tokenizer_with(chat_text(), chat_template=CHAT_TEMPLATE)
    folder = model_folder(tmp_path / "model", tokenizer)
    data = write_conversations(tmp_path / "chat.jsonl")
    tokens = finetune_data.tokenize_text(tokenizer, data, chat=True)
    ids, counted = [], []
    for conversation in CONVERSATIONS:  # the reference: transformers' own assistant mask
        rendered = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
        ids += rendered["input_ids"]
        counted += rendered["assistant_masks"]
    assert tokens.ids.tolist() == ids
    assert tokens.counted.tolist() == [bool(c) for c in counted]
    assert 0 < sum(counted) < len(counted)

    seq_len = 16
    batches = finetune_data.finetune_batches(folder, data, batch_size=4, seq_len=seq_len, seed=3, chat=True)
    reference = torch.tensor(ids)
    labels_of = torch.where(torch.tensor(counted, dtype=torch.bool), reference, torch.tensor(-100))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    relay = hf.from_pretrained(folder, eps=l2l_hw.make_eps("cpu"), micro_batches=2)
    for number, (inputs, targets) in enumerate(batches):
        rows = batches.blocks[number * 4:(number + 1) * 4]
        spans = [slice(b * seq_len, (b + 1) * seq_len) for b in rows.tolist()]
        labels = torch.stack([labels_of[s] for s in spans])
        assert torch.equal(inputs, torch.stack([reference[s] for s in spans]))
        assert torch.equal(targets[0], labels)
        assert (labels[:, 1:] != -100).any()  # a block without an assistant target is left out
        with torch.no_grad():
            logits = model(inputs).logits  # (B, T, vocab)
        expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        assert abs(relay.evaluate(inputs, targets) - expected.item()) <= 1e-5 * expected.item()


def test_chat_reads_a_datasets_messages_column_as_it_reads_json_lines(tmp_path):
    datasets = pytest.importorskip("datasets")
    tokenizer = tokenizer_with(chat_text(), chat_template=CHAT_TEMPLATE)
    datasets.Dataset.from_dict({"messages": CONVERSATIONS}).save_to_disk(tmp_path / "ds")
    from_rows = finetune_data.tokenize_text(tokenizer, tmp_path / "ds", chat=True)
    from_lines = finetune_data.tokenize_text(tokenizer, write_conversations(tmp_path / "chat.jsonl"), chat=True)
    assert from_rows.ids.tolist() == from_lines.ids.tolist()
    assert from_rows.counted.tolist() == from_lines.counted.tolist()


def test_chat_without_a_chat_template_is_one_line(tmp_path, capsys):
    folder = model_folder(tmp_path / "model", tokenizer_with(chat_text()))
    data = write_conversations(tmp_path / "chat.jsonl")
    rc, _, err = cli(capsys, *run_argv(folder, data, tmp_path / "run", "--chat"))
    assert rc == 2
    one_line(err, "finetune", str(folder), "no chat template", "--chat")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "no messages"}) + "\n")
    folder = model_folder(tmp_path / "model2", tokenizer_with(chat_text(), chat_template=CHAT_TEMPLATE))
    rc, _, err = cli(capsys, *run_argv(folder, tmp_path / "bad.jsonl", tmp_path / "run2", "--chat"))
    assert rc == 2
    one_line(err, "finetune", f"{tmp_path / 'bad.jsonl'}:1", "not a conversation", "messages")


# ---------------------------------------------------------------------------- the token cache

def test_the_tokens_are_cached_beside_the_run_read_back_unchanged_and_a_changed_file_is_tokenized_anew(
        tmp_path, monkeypatch):
    folder = model_folder(tmp_path / "model", tokenizer_with(PARAGRAPHS))
    data = tmp_path / "text.txt"
    data.write_text(PARAGRAPHS)
    cache = tmp_path / "run" / "tokens" / "train"
    tokenizer_class = type(hf.load_tokenizer(folder))
    calls = []
    encode = tokenizer_class.__call__
    monkeypatch.setattr(tokenizer_class, "__call__", lambda self, *a, **k: calls.append(1) or encode(self, *a, **k))

    def read():
        calls.clear()
        return finetune_data.finetune_batches(folder, data, batch_size=2, seq_len=16, seed=0, cache=cache), len(calls)

    (first, made), (second, again) = read(), read()
    assert made > 0 and again == 0  # the second run maps the cache: the tokenizer is not called
    assert isinstance(second.tokens.ids, np.memmap) and second.tokens.ids.dtype == np.uint32
    assert second.tokens.ids.tolist() == finetune_data.tokenize_text(hf.load_tokenizer(folder), data).ids.tolist()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, second))
    data.write_text(PARAGRAPHS + "The end.\n")  # another size and time: tokenized anew
    changed, made = read()
    assert made > 0
    assert hf.load_tokenizer(folder).decode(changed.tokens.ids.tolist()) == PARAGRAPHS + "The end.\n"


def test_a_resumed_finetune_reads_its_tokens_from_the_cache(gpt2_folder, tmp_path, monkeypatch):  # noqa: F811
    folder = gpt2_folder()
    argv = finetune_argv(folder, tmp_path, "run", "--steps", "4", "--warmup-ratio", "0.3")  # the same on resume
    assert main([*argv, "--stop-after", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "run" / "tokens").iterdir()) == ["train.bin", "train.json", "val.bin",
                                                                              "val.json"]
    tokenizer_class = type(hf.load_tokenizer(folder))
    monkeypatch.setattr(tokenizer_class, "__call__", lambda *a, **k: pytest.fail("tokenized again"))
    assert main([*argv, "--resume"]) == 0


# ---------------------------------------------------------------------------- the run

@pytest.mark.parametrize("flags, words", [
    (["--warmup-ratio", "0.1", "--warmup", "3"], ["--warmup and --warmup-ratio", "give one of them"]),
    (["--warmup-ratio", "1"], ["--warmup-ratio 1", "[0, 1)"]),
    (["--prompt", " "], ["--prompt", "must not be empty"]),
    (["--save-every", "0"], ["--save-every 0", ">= 1"]),
    (["--no-save", "--save-every", "2"], ["--no-save", "save_every needs"]),
    (["--no-save", "--stop-after", "2"], ["--no-save", "stop_after needs"]),
    (["--no-save", "--resume"], ["--no-save", "resume needs"]),
])
def test_bad_run_flags_are_one_line(gpt2_folder, tmp_path, capsys, flags, words):  # noqa: F811
    rc, _, err = cli(capsys, *finetune_argv(gpt2_folder(), tmp_path, "run", "--steps", "4", *flags))
    assert rc == 2
    one_line(err, "finetune", *words)


def test_no_save_trains_the_same_steps_and_writes_no_checkpoint_or_model_and_needs_no_disk_for_them(
        gpt2_folder, tmp_path):  # noqa: F811
    from l2l_hw import estimate

    folder = gpt2_folder()
    argv = finetune_argv(folder, tmp_path, "saved", "--steps", "4")
    assert main(argv) == 0
    assert main([*finetune_argv(folder, tmp_path, "trial", "--steps", "4"), "--no-save"]) == 0
    saved, trial = tmp_path / "saved", tmp_path / "trial"
    assert {"checkpoint.safetensors", "model"} <= {p.name for p in saved.iterdir()}
    assert sorted(p.name for p in trial.iterdir()) == ["loss.png", "metrics.jsonl", "tokens"]
    rows = [[json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
            for out in (saved, trial)]
    assert rows[0] == rows[1] and len(rows[0]) == 4
    cfg = TrainConfig(model=str(folder), data=str(tmp_path / "text.txt"), out=str(trial), steps=4, verbose=False)
    needs = {save: estimate.estimate(TrainConfig(**{**cfg.__dict__, "save": save})).disk for save in (True, False)}
    assert {"checkpoint", "checkpoints", "model"} <= needs[True].keys()
    assert needs[False].keys() == {"tokens"}


def test_a_prompt_for_a_masked_lm_is_one_line(tmp_path, capsys):
    from tests.test_hf import TEXT, tiny, word_tokenizer

    folder = tmp_path / "bert"
    tiny("bert").save_pretrained(folder)
    word_tokenizer(TEXT).save_pretrained(folder)
    (tmp_path / "data.txt").write_text("\n".join(TEXT) + "\n")
    rc, _, err = cli(capsys, *run_argv(folder, tmp_path / "data.txt", tmp_path / "run", "--context", "8",
                                       "--prompt", "the"))
    assert rc == 2
    one_line(err, "finetune", "--prompt the", "masked LM", str(folder))


def test_the_banner_says_the_model_the_tokens_the_defaults_and_the_eps_memory_and_a_sample_is_transformers_greedy(
        gpt2_folder, tmp_path, capsys):  # noqa: F811
    folder = gpt2_folder()
    rc, out, err = cli(capsys, *finetune_argv(folder, tmp_path, "run", "--steps", "20", "--warmup-ratio", "0.1",
                                              "--eval-every", "10", "--prompt", "The cat"))
    assert rc == 0, err
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    total = sum(p.numel() for p in model.parameters())
    banner = out[out.index("l2l finetune:"):]
    for words in (f"gpt2, 2 layers, {total:,} parameters ({total:,} trained)", "64 tokens a step",
                  "1,280 tokens in 20 steps", "optimizer: adamw, lr 5e-05, linear to 0, warm-up 2 steps, weight decay "
                  "0, betas (0.9, 0.999), eps 1e-08", f"EPS cpu: about {total * 12 / 2**20:.1f} MiB of host memory "
                  "(12 B a trained parameter)"):
        assert words in banner, (words, banner)
    samples = [line for line in out.splitlines() if line.startswith("sample at step ")]
    assert [s.split(":")[0] for s in samples] == ["sample at step 10", "sample at step 20"]
    tokenizer = hf.load_tokenizer(folder)
    prompt = tokenizer("The cat", return_tensors="pt", add_special_tokens=False)["input_ids"]
    greedy = model.generate(prompt, do_sample=False, max_new_tokens=32, pad_token_id=tokenizer.eos_token_id)
    expected = log_line("The cat" + tokenizer.decode(greedy[0, prompt.shape[1]:]))
    assert out[out.index("sample at step 20: "):].startswith(f"sample at step 20: {expected}")


def hf_state(relay) -> dict[str, torch.Tensor]:
    """The relay's weights by every Hugging Face name they are saved and loaded by."""
    return {key: e.tensor for e in relay.export() if e.tensor is not None
            for key in relay.layers[e.layer].hf_keys.get(e.name, [])}


def test_save_every_writes_a_loadable_folder_equal_to_the_relay_at_that_step_and_replaces_it_whole(
        gpt2_folder, tmp_path, monkeypatch):  # noqa: F811
    folder, out = gpt2_folder(), tmp_path / "run"
    relays, checked = [], []
    from_pretrained = hf.from_pretrained
    monkeypatch.setattr(hf, "from_pretrained", lambda *a, **k: relays.append(from_pretrained(*a, **k)) or relays[-1])
    save_pretrained = hf.save_pretrained

    def failing_at_step_6(relay, path, **kwargs):
        save_pretrained(relay, path, **kwargs)
        if relay.step == 6:  # written, not yet renamed into place: as a kill there would leave it
            raise OSError("disk full")
    monkeypatch.setattr(hf, "save_pretrained", failing_at_step_6)

    def check(row):
        if row["step"] == 3:  # after this step's save
            loaded = transformers.AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
            weights = hf_state(relays[0])
            assert weights.keys() <= loaded.keys()
            assert all(torch.equal(loaded[k], weights[k]) for k in weights)
            checked.append({k: v.clone() for k, v in weights.items()})

    cfg = TrainConfig(model=str(folder), data=str(tmp_path / "text.txt"), out=str(out), steps=8, save_every=3,
                      batch_size=4, micro_batches=2, context=16, lr=1e-3, schedule="linear", warmup=0,
                      weight_decay=0.0, verbose=False)
    with pytest.raises(OSError, match="disk full"):
        finetune(cfg, callbacks=[check])
    assert len(checked) == 1  # step 3's folder checked; step 6's save failed before its check
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    assert all(torch.equal(loaded[k], checked[0][k]) for k in checked[0])  # step 3's folder, whole, still there
    initial = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert not all(torch.equal(initial[k], checked[0][k]) for k in checked[0])
    assert [p.name for p in out.iterdir() if p.name.startswith(".model")] == []
