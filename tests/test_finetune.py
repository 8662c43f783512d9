"""`l2l finetune` behaves like the Hugging Face tools: the text as written, packed as run_clm packs
it (newlines kept); transformers' Trainer defaults, its loss curve matched; a seed that fixes
every draw; the model folder's other files (tokenizer, generation config) carried over unchanged."""
import json
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel

from l2l_hw import finetune_data, hf
from l2l_hw.cli import main
from l2l_hw.train import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

PARAGRAPHS = ("The cat sat on the mat.\nIt was warm there.\n\nThe dog sat on the log,\nand the log was cold.\n\n"
              "A bird sang in the tree\nall day long.\n\n") * 12


def byte_level_tokenizer(text: str):
    """A small byte-level BPE tokenizer trained on `text`: it keeps every byte, newlines included."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>")


@pytest.fixture
def gpt2_folder(tmp_path):
    """gpt2_folder(dropout): a tiny GPT-2 with a byte-level tokenizer, a generation config, and the text."""
    (tmp_path / "text.txt").write_text(PARAGRAPHS)

    def make(dropout: float = 0.0) -> Path:
        folder = tmp_path / f"gpt2-{dropout}"
        tokenizer = byte_level_tokenizer(PARAGRAPHS)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                           resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                           bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id))
        model.generation_config.max_new_tokens = 17  # a generation config of its own, to carry over
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return folder

    return make


def test_the_text_is_tokenized_as_written_and_packed_blocks_decode_to_the_source(gpt2_folder, tmp_path):
    folder = gpt2_folder()
    tokenizer = hf.load_tokenizer(folder)
    ids = finetune_data.tokenize_text(tokenizer, tmp_path / "text.txt").ids.tolist()
    assert tokenizer.decode(ids) == PARAGRAPHS  # every newline and blank line kept, no token added
    batches = finetune_data.finetune_batches(folder, tmp_path / "text.txt", batch_size=2, seq_len=16, seed=0)
    blocks = [tokenizer.decode(row) for inputs, _ in batches for row in inputs.tolist()]
    assert all(block in PARAGRAPHS for block in blocks)  # each a stretch of the text as written
    assert sum("\n" in block for block in blocks) >= len(blocks) // 2
    separated = tmp_path / "docs.txt"
    separated.write_text("first doc\n---\nsecond doc\n")
    ids = finetune_data.tokenize_text(tokenizer, separated, doc_separator="---").ids.tolist()
    assert tokenizer.decode(ids) == "first doc\n<|endoftext|>second doc\n"


def finetune_argv(folder: Path, tmp_path: Path, out: str, *extra: str) -> list[str]:
    text = str(tmp_path / "text.txt")
    return ["finetune", "--model", str(folder), "--data", text, "--val-data", text, "--out", str(tmp_path / out),
            "--batch-size", "4", "--micro-batches", "2", "--context", "16", "--seed", "7", *extra]


# weight decay 0.1: Trainer exempts biases and norms, so must we; a warm-up share: Trainer's warmup_steps below 1
@pytest.mark.parametrize("weight_decay, warmup_ratio", [(0.0, None), (0.1, None), (0.0, 0.12)])
def test_the_loss_curve_matches_transformers_trainer_with_its_defaults(gpt2_folder, tmp_path, weight_decay,
                                                                       warmup_ratio):
    folder = gpt2_folder()
    steps, lr = 20, 1e-3  # the defaults otherwise: linear decay to 0, no warm-up, no weight decay, AdamW
    warmup = ["--warmup-ratio", str(warmup_ratio)] if warmup_ratio is not None else []
    assert main(finetune_argv(folder, tmp_path, "l2l", "--steps", str(steps), "--lr", str(lr),
                              "--weight-decay", str(weight_decay), *warmup)) == 0
    ours = [r["loss"] for r in read_metrics(tmp_path / "l2l" / "metrics.jsonl")]

    batches = finetune_data.finetune_batches(folder, tmp_path / "text.txt", batch_size=4, seq_len=16, seed=7)
    rows = [{"input_ids": row, "labels": row} for inputs, _ in batches for row in inputs]
    losses = []

    class InOrder(transformers.Trainer):  # the relay's minibatches, in the relay's order
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, *args, num_items_in_batch=None, **kwargs):
            loss = super().compute_loss(model, inputs, *args, num_items_in_batch=num_items_in_batch, **kwargs)
            # Trainer divides the loss's token sum by the labels counted before the causal shift (64
            # here); the model's own loss, and the relay's, by the tokens the shift leaves (60)
            counted = (inputs["labels"][:, 1:] != -100).sum()
            losses.append((loss[0] if isinstance(loss, tuple) else loss).item() * float(num_items_in_batch / counted))
            return loss

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=4, max_steps=steps, learning_rate=lr,
        weight_decay=weight_decay, warmup_steps=warmup_ratio or 0,
        seed=7, max_grad_norm=0.0,  # the relay updates each layer eagerly: it clips only when asked
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, dataloader_drop_last=True)
    InOrder(model=transformers.AutoModelForCausalLM.from_pretrained(folder), args=args, train_dataset=rows).train()
    assert len(ours) == len(losses) == steps
    for step, (a, b) in enumerate(zip(ours, losses), 1):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: l2l {a} vs Trainer {b}"
    assert ours[-1] < ours[0]


def test_the_seed_fixes_every_draw_dropout_included_and_the_folder_s_files_carry_over(gpt2_folder, tmp_path):
    folder = gpt2_folder(dropout=0.1)
    runs = []
    for out in ("a", "b"):
        assert main(finetune_argv(folder, tmp_path, out, "--steps", "6", "--lr", "1e-3")) == 0
        runs.append(tmp_path / out)
    assert read_metrics(runs[0] / "metrics.jsonl") == [
        {**r, "tokens_per_s": read_metrics(runs[0] / "metrics.jsonl")[i]["tokens_per_s"],
         "elapsed": read_metrics(runs[0] / "metrics.jsonl")[i]["elapsed"]}
        for i, r in enumerate(read_metrics(runs[1] / "metrics.jsonl"))]
    a, b = (transformers.AutoModelForCausalLM.from_pretrained(run / "model").state_dict() for run in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (runs[0] / "model" / name).read_bytes() == (folder / name).read_bytes(), name
    assert json.loads((runs[0] / "model" / "generation_config.json").read_text())["max_new_tokens"] == 17


def test_json_lines_are_documents_each_ended_by_the_end_of_text_token_and_a_bad_line_is_named(gpt2_folder, tmp_path):
    tokenizer = hf.load_tokenizer(gpt2_folder())
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "The cat sat.\nOn the mat."}) + "\n\n" + json.dumps({"text": "A bird."}) + "\n")
    ids = finetune_data.tokenize_text(tokenizer, data).ids.tolist()
    assert tokenizer.decode(ids) == "The cat sat.\nOn the mat.<|endoftext|>A bird.<|endoftext|>"
    data.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=f"{data}:1: no text field 'text'"):
        finetune_data.tokenize_text(tokenizer, data)
    data.write_text('{"text": "x"}\n{"text": \n')
    with pytest.raises(ValueError, match=f"{data}:2: not a JSON object"):
        finetune_data.tokenize_text(tokenizer, data)


def test_epochs_set_the_run_s_length_from_the_data(gpt2_folder, tmp_path, capsys):
    folder = gpt2_folder()
    assert main(finetune_argv(folder, tmp_path, "run", "--epochs", "2")) == 0
    passes = len(finetune_data.finetune_batches(folder, tmp_path / "text.txt", batch_size=4, seq_len=16, seed=7))
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == list(range(1, 2 * passes + 1))
    capsys.readouterr()
    assert main(finetune_argv(folder, tmp_path, "other", "--epochs", "2", "--steps", "3")) == 2
    assert "--epochs and --steps" in capsys.readouterr().err
