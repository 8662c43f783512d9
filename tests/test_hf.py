"""Hugging Face models through the relay (l2l_hw.hf), against transformers itself.

Tiny random models of each supported layout are built from their configs (nothing is
downloaded), saved by transformers, loaded by l2l_hw.hf.from_pretrained and trained
10 steps; PyTorch trains the same model with `model(..., labels=...).loss` and
torch.optim.AdamW. Per-step losses and final parameters agree to 1e-5; parameters whose
exact gradient is zero are compared as docs/NUMERICS.md says ("Hugging Face models").
"""
import json
import math

import pytest
import torch

pytest.importorskip("transformers")
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (AutoModelForCausalLM, AutoModelForMaskedLM, BertConfig, BertForMaskedLM,  # noqa: E402
                          GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

import l2l_hw  # noqa: E402
from l2l_hw import finetune_data, hf  # noqa: E402
from tests.helpers import rel_diff  # noqa: E402

transformers.logging.set_verbosity_error()

TOL = 1e-5
STEPS, BATCH, SEQ, VOCAB = 10, 6, 8, 61
OPTIM = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def adam_step_bound(t: int) -> float:
    """max |m_hat_t| / sqrt(v_hat_t) over all gradient sequences (Cauchy-Schwarz on the two
    moving averages): how far AdamW's step t moves a parameter, in units of lr, whatever
    its gradient (1 at t = 1, 1.04 at t = 10)."""
    b1, b2 = OPTIM["betas"]
    r = b1 * b1 / b2
    return (1 - b1) / (1 - b2) ** 0.5 * ((1 - r ** t) / (1 - r)) ** 0.5 * (1 - b2 ** t) ** 0.5 / (1 - b1 ** t)


def tiny(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2)
    # Rotary pairs turn by theta^(-2k/head_dim) per position: at the default 10^4 and head_dim 4,
    # one pair turns 0.07 rad over the sequence and the key bias on it has a near-zero,
    # cancellation-dominated gradient (docs/NUMERICS.md); 100 turns every pair >= 0.7 rad.
    rope = dict(rope_theta=100.0)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          bos_token_id=0, eos_token_id=0))
    if kind == "llama-gqa-tied-bias":
        return LlamaForCausalLM(LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=True, attention_bias=True, **rope))
    if kind == "llama-untied":
        return LlamaForCausalLM(LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=1,
                                            tie_word_embeddings=False, **rope))
    if kind == "bert":
        return BertForMaskedLM(BertConfig(**common, num_attention_heads=2, max_position_embeddings=16,
                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=2))
    if kind == "gemma3":  # local (sliding) and global layers, each with its own rotary table
        return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **common, num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=3,
            layer_types=["sliding_attention", "full_attention"], rope_theta=100.0))
    if kind == "mistral-sliding":  # a window shorter than the sequence: the sliding mask matters
        return MistralForCausalLM(MistralConfig(**common, num_attention_heads=4, num_key_value_heads=2,
                                                sliding_window=3))
    raise ValueError(kind)


def auto_class(model):
    return AutoModelForMaskedLM if isinstance(model, BertForMaskedLM) else AutoModelForCausalLM


def make_batch(step: int):
    """input_ids, right-padding attention_mask and labels whose -100s are spread unevenly over
    the micro-batches (samples 0 and 1 carry almost no loss), as a real batch has them."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[2, 5:] = 0
    mask[5, 3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.rand(BATCH, SEQ, generator=g) < 0.3] = -100
    labels[0, :-2] = -100
    labels[1, 1:] = -100
    return ids, mask, labels


def zero_gradient(key: str, shape: torch.Size) -> torch.Tensor:
    """Elements whose exact gradient is zero: the key bias of attention without rotary
    embeddings (softmax over keys is invariant to the per-query constant q.b_k it adds; with
    rotary embeddings the bias is rotated per key position and trains); in GPT-2 the
    middle third of c_attn's bias."""
    zero = torch.zeros(shape, dtype=torch.bool)
    if key.endswith("attention.self.key.bias"):
        zero[:] = True
    elif key.endswith("attn.c_attn.bias"):
        n = shape[0] // 3
        zero[n:2 * n] = True
    return zero


def train_pytorch(model):
    opt = torch.optim.AdamW(model.parameters(), **OPTIM)
    losses, noise = [], {}
    for step in range(STEPS):
        ids, mask, labels = make_batch(step)
        opt.zero_grad()
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        if step == 0:  # the zero-gradient elements' gradient against the model's largest
            largest = max(float(p.grad.abs().max()) for p in model.parameters())
            for key, p in model.named_parameters():
                zero = zero_gradient(key, p.shape)
                if zero.any():
                    noise[key] = float(p.grad[zero].abs().max()) / largest
        opt.step()
        losses.append(loss.item())
    return losses, noise


def saved_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


@pytest.mark.parametrize("u", [1, 3])
@pytest.mark.parametrize("kind", ["gpt2", "llama-gqa-tied-bias", "llama-untied", "gemma3", "bert"])
def test_relay_trains_hf_model_as_pytorch_and_saves_what_transformers_loads(tmp_path, kind, u, one_thread):
    model = tiny(kind)
    model.save_pretrained(tmp_path / "start")
    hf_keys = set(saved_tensors(tmp_path / "start"))
    relay = hf.from_pretrained(tmp_path / "start", eps=l2l_hw.make_eps("cpu", **OPTIM), micro_batches=u,
                               exempt_from_decay=False)  # as torch.optim.AdamW(model.parameters())
    relay_losses = []
    for step in range(STEPS):
        ids, mask, labels = make_batch(step)
        relay_losses.append(relay.train_step(*hf.batch(relay.loss_fn, ids, labels, mask)))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    plain_losses, noise = train_pytorch(model)

    for step, (a, b) in enumerate(zip(relay_losses, plain_losses)):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: relay loss {a} vs PyTorch {b}"
    hf.save_pretrained(relay, tmp_path / "trained", max_shard_size="20KB")
    trained = saved_tensors(tmp_path / "trained")
    assert set(trained) == hf_keys, "the saved tensors differ from the ones transformers saves"
    expected = model.state_dict()
    for key, value in trained.items():
        zero = zero_gradient(key, value.shape)
        if zero.all():
            checked, other = value.new_zeros(0), value.new_zeros(0)
        else:
            checked, other = value[~zero], expected[key][~zero]
        if checked.numel():
            assert rel_diff(checked, other) <= TOL, f"{key}: relative difference {rel_diff(checked, other):.2e}"
        if zero.any():  # moved by rounding noise only, in both runs, within AdamW's bound
            assert noise[key] <= 1e-6, f"{key}: gradient {noise[key]:.1e} of the largest is not rounding noise"
            p0 = start[key][zero]
            bound = OPTIM["lr"] * sum(adam_step_bound(t) for t in range(1, STEPS + 1)) \
                + STEPS * OPTIM["lr"] * OPTIM["weight_decay"] * float(p0.abs().max()) + 1e-7
            for run in (value, expected[key]):
                assert float((run[zero] - p0).abs().max()) <= bound

    # The saved folder loads in transformers and computes what the relay's model computes.
    loaded = auto_class(model).from_pretrained(tmp_path / "trained")
    ids, mask, _ = make_batch(STEPS)
    materialized = relay.materialize()
    with torch.no_grad():
        relay_logits = materialized((ids, mask))
    assert rel_diff(logits(loaded, ids, mask), relay_logits) <= 1e-6
    # ... and what the PyTorch-trained model computes (the zero-gradient biases cannot change it).
    assert rel_diff(relay_logits, logits(model, ids, mask)) <= TOL


@pytest.mark.parametrize("kind", ["llama-gqa-tied-bias", "qwen2", "mistral-sliding", "gemma3", "gpt2", "bert"])
def test_split_layers_compute_the_model_logits_and_loss(kind):
    """One code path for the Llama family: HF's own layers, masks and rotary embedding."""
    model = tiny(kind)
    layers, loss_fn = hf.split(model)
    ids, mask, labels = make_batch(0)
    x = (ids, mask)
    with torch.no_grad():
        for layer in layers:
            x = layer(x)
        expected = model(ids, attention_mask=mask, labels=labels)
        assert rel_diff(x, expected.logits) <= 1e-6
        assert abs(float(loss_fn(x, loss_fn.targets(labels))) - float(expected.loss)) <= 1e-6 * float(expected.loss)


def test_tied_embedding_and_head_are_one_parameter_in_two_layers():
    layers, _ = hf.split(tiny("llama-gqa-tied-bias"))
    first, last = dict(layers[0].named_parameters()), dict(layers[-1].named_parameters())
    assert first["parts.embed_tokens.weight"] is last["parts.lm_head.weight"]
    untied, _ = hf.split(tiny("llama-untied"))
    assert dict(untied[0].named_parameters())["parts.embed_tokens.weight"] is not \
        dict(untied[-1].named_parameters())["parts.lm_head.weight"]


def test_plain_labels_give_the_micro_batch_token_mean_and_targets_give_hf_loss(one_thread):
    """The rule of the module docstring: with unbalanced -100s, plain labels weight each
    micro-batch's token mean by its samples (not HF's loss); targets() gives HF's loss."""
    model = tiny("llama-untied")
    ids, mask, labels = make_batch(0)
    expected = model(ids, attention_mask=mask, labels=labels).loss.item()
    layers, loss_fn = hf.split(model)
    shifted = loss_fn.counted(labels)
    with torch.no_grad():
        out = (ids, mask)
        for layer in layers:
            out = layer(out)
    relay = l2l_hw.Relay(layers, loss_fn, eps=l2l_hw.make_eps("cpu", **OPTIM), micro_batches=3)
    per_micro_batch = sum(float(loss_fn(o, t)) * len(t) / BATCH
                          for o, t in zip(out.split(2), labels.split(2)))
    assert abs(relay.evaluate((ids, mask), labels) - per_micro_batch) <= 1e-6 * per_micro_batch
    assert abs(per_micro_batch - expected) > 1e-3  # the counts are unbalanced: the plain mean differs
    assert abs(relay.evaluate(*hf.batch(loss_fn, ids, labels, mask)) - expected) <= 1e-6 * expected
    assert (shifted != -100).sum() == loss_fn.targets(labels)[1].sum().round()


def test_from_pretrained_fills_the_eps_from_every_shard_and_keeps_only_meta_layers(tmp_path, one_thread):
    model = tiny("llama-gqa-tied-bias")
    model.save_pretrained(tmp_path, max_shard_size="10KB")
    index = json.loads((tmp_path / hf.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2
    relay = hf.from_pretrained(tmp_path, eps=l2l_hw.make_eps("cpu", **OPTIM))
    assert all(p.is_meta for layer in relay.layers for p in layer.parameters())
    assert relay.layers[0].parts.embed_tokens.weight is relay.layers[-1].parts.lm_head.weight
    materialized = dict(relay.materialize().named_parameters())
    state = model.state_dict()
    for i, layer in enumerate(relay.layers):
        for name, keys in layer.hf_keys.items():
            if f"{i}.{name}" in materialized:
                assert torch.equal(materialized[f"{i}.{name}"], state[keys[0]]), keys[0]


def test_save_pretrained_single_file_and_tokenizer(tmp_path, one_thread):
    model = tiny("gpt2")
    model.save_pretrained(tmp_path / "in")
    tokenizer = word_tokenizer(["a b c"])
    relay = hf.from_pretrained(tmp_path / "in", eps=l2l_hw.make_eps("cpu", **OPTIM))
    hf.save_pretrained(relay, tmp_path / "out", tokenizer=tokenizer)
    assert (tmp_path / "out" / hf.WEIGHTS_FILE).is_file() and not (tmp_path / "out" / hf.INDEX_FILE).exists()
    assert hf.load_tokenizer(tmp_path / "out")("a c")["input_ids"] == tokenizer("a c")["input_ids"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids, mask, _ = make_batch(0)
    assert rel_diff(logits(loaded, ids, mask), logits(model, ids, mask)) == 0


# ---------------------------------------------------------------------------- fine-tuning data
TEXT = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog met on a mat",
        "the log was on the mat", "a dog sat"] * 6


def word_tokenizer(lines):
    """A WordLevel tokenizer trained on `lines`, as transformers wraps and saves it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "[MASK]", "</s>"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                mask_token="[MASK]", eos_token="</s>")


@pytest.fixture
def llama_folder(tmp_path):
    folder = tmp_path / "llama"
    tiny("llama-gqa-tied-bias").save_pretrained(folder)
    word_tokenizer(TEXT).save_pretrained(folder)
    (tmp_path / "data.txt").write_text("\n".join(TEXT) + "\n")
    return folder


def test_finetune_batches_are_the_tokenized_text_and_train_end_to_end(llama_folder, tmp_path, one_thread):
    tokenizer = hf.load_tokenizer(llama_folder)
    batches = finetune_data.finetune_batches(llama_folder, tmp_path / "data.txt", batch_size=4, seq_len=6)
    expected = []
    for line in TEXT:
        expected += tokenizer(line + "\n", add_special_tokens=False)["input_ids"]  # as written: no token added
    rows = sorted(tuple(r) for inputs, _ in batches for r in inputs.tolist())
    chunks = sorted(tuple(expected[k:k + 6]) for k in range(0, len(expected) // 6 * 6, 6))
    assert len(batches) == len(chunks) // 4 and set(rows) <= set(chunks) and len(rows) == len(batches) * 4
    inputs, (labels, per_sample) = batches[0]
    assert torch.equal(labels, inputs) and torch.allclose(per_sample, torch.full((4,), 5.0, dtype=per_sample.dtype))

    relay = hf.from_pretrained(llama_folder, eps=l2l_hw.make_eps("cpu", lr=1e-2), micro_batches=2)
    losses = [relay.train_step(*batches[k % len(batches)]) for k in range(8)]
    assert losses[-1] < losses[0]
    hf.save_pretrained(relay, tmp_path / "tuned", tokenizer=tokenizer)
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "tuned")
    assert abs(tuned(inputs, labels=labels).loss.item() - relay.evaluate(inputs, (labels, per_sample))) <= 1e-5


def test_finetune_batches_mask_tokens_for_a_masked_lm(tmp_path):
    folder = tmp_path / "bert"
    tiny("bert").save_pretrained(folder)
    tokenizer = word_tokenizer(TEXT)
    tokenizer.save_pretrained(folder)
    (tmp_path / "data.txt").write_text("\n".join(TEXT))
    inputs, (labels, _) = finetune_data.finetune_batches(folder, tmp_path / "data.txt", batch_size=4, seq_len=8)[0]
    chosen = labels != -100
    assert chosen.any() and (inputs[chosen] == tokenizer.mask_token_id).all()
    assert (inputs[~chosen] != tokenizer.mask_token_id).all()


def one_line_error(exc_info, *words):
    message = str(exc_info.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_bad_folders_and_architectures_say_what_is_wrong_and_what_is_supported(llama_folder, tmp_path):
    eps = l2l_hw.make_eps("cpu")
    with pytest.raises(FileNotFoundError) as e:
        hf.from_pretrained(tmp_path / "nowhere", eps=eps)
    one_line_error(e, "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as e:
        hf.from_pretrained(empty, eps=eps)
    one_line_error(e, "no config.json")
    for f in llama_folder.glob("*.safetensors"):
        f.rename(tmp_path / f.name)
    with pytest.raises(FileNotFoundError) as e:
        hf.from_pretrained(llama_folder, eps=eps)
    one_line_error(e, "no weights", hf.WEIGHTS_FILE, "--weights random")
    for f in tmp_path.glob("*.safetensors"):
        f.rename(llama_folder / f.name)
    for f in llama_folder.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(FileNotFoundError) as e:
        finetune_data.finetune_batches(llama_folder, tmp_path / "data.txt", 2, 4)
    one_line_error(e, "no tokenizer", "tokenizer.json")

    partial = tmp_path / "partial"  # a checkpoint that lacks one tensor the model needs
    tiny("gpt2").save_pretrained(partial)
    state = load_file(partial / hf.WEIGHTS_FILE)
    del state["transformer.h.1.mlp.c_fc.weight"]
    save_file(state, partial / hf.WEIGHTS_FILE, metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        hf.from_pretrained(partial, eps=eps)
    one_line_error(e, "transformer.h.1.mlp.c_fc.weight", "layer 2")

    t5 = tmp_path / "t5"
    transformers.T5Config(d_model=8, num_layers=1, num_heads=1, d_ff=8, vocab_size=VOCAB,
                          architectures=["T5ForConditionalGeneration"]).save_pretrained(t5)
    with pytest.raises(ValueError) as e:
        hf.from_pretrained(t5, eps=eps)
    one_line_error(e, "T5ForConditionalGeneration", "not supported", "GPT2LMHeadModel", "Llama")
    opt = tmp_path / "opt"  # a causal LM, not laid out as Llama (model.decoder.layers)
    transformers.OPTConfig(hidden_size=8, num_hidden_layers=1, ffn_dim=8, num_attention_heads=1, vocab_size=VOCAB,
                           word_embed_proj_dim=8, architectures=["OPTForCausalLM"]).save_pretrained(opt)
    with pytest.raises(ValueError) as e:
        hf.from_pretrained(opt, eps=eps)
    one_line_error(e, "OPTForCausalLM", "not supported", "Llama")


def test_l2l_finetune_end_to_end_resumes_and_saves_what_transformers_loads(llama_folder, tmp_path, capsys):
    """`l2l finetune` on a tiny Llama-layout folder and a local text file: it trains with the
    metrics and checkpoint of `l2l train`, stops and resumes, and the saved folder loads in
    transformers with the relay's weights; bad folders are one line and exit 2."""
    from l2l_hw.cli import main
    from l2l_hw.train import read_metrics

    out = tmp_path / "run"
    argv = ["finetune", "--model", str(llama_folder), "--data", str(tmp_path / "data.txt"), "--out", str(out),
            "--steps", "6", "--batch-size", "2", "--micro-batches", "2", "--context", "6", "--lr", "1e-2",
            "--eval-every", "3", "--seed", "0"]
    assert main(argv + ["--stop-after", "3"]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    assert main(argv + ["--resume"]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7)) and rows[-1]["val_loss"] is not None
    tuned = AutoModelForCausalLM.from_pretrained(out / "model")
    straight = tmp_path / "straight"  # the same six steps without the stop: the same weights
    assert main([a if a != str(out) else str(straight) for a in argv]) == 0
    reference = AutoModelForCausalLM.from_pretrained(straight / "model")
    for (name, got), want in zip(tuned.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(got, want), name
    assert hf.load_tokenizer(out / "model")("a b")["input_ids"] == hf.load_tokenizer(llama_folder)("a b")["input_ids"]
    capsys.readouterr()
    assert main(["finetune", "--model", str(tmp_path / "nowhere"), "--data", str(tmp_path / "data.txt"),
                 "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "does not exist" in err and "Traceback" not in err


def test_random_weights_are_drawn_as_transformers_initializes_the_config_layer_by_layer(llama_folder, tmp_path, capsys):
    """`--weights random`: a folder with config.json and a tokenizer (no safetensors) fine-tunes;
    each layer is drawn as transformers initializes the config's model (matrices from N(0, the
    config's initializer_range), norms 1, biases 0: checked against transformers' own draw), the
    same for the same seed; without it the folder's missing weights are refused in one line."""
    from l2l_hw.cli import main
    from l2l_hw.train import read_metrics

    for f in llama_folder.glob("*.safetensors"):
        f.unlink()
    config = transformers.AutoConfig.from_pretrained(llama_folder)
    config.initializer_range = 0.5  # far from the tiny model's defaults: a draw of another scale shows
    config.save_pretrained(llama_folder)
    argv = ["finetune", "--model", str(llama_folder), "--data", str(tmp_path / "data.txt"), "--steps", "2",
            "--batch-size", "2", "--micro-batches", "2", "--context", "6", "--eval-every", "2", "--seed", "0"]
    assert main(argv + ["--out", str(tmp_path / "no")]) == 2
    assert "no weights" in capsys.readouterr().err
    drawn = [hf.from_pretrained(llama_folder, eps=l2l_hw.make_eps("cpu"), weights="random", seed=seed).materialize()
             for seed in (3, 4, 3)]
    for a, b in zip(drawn[0].parameters(), drawn[2].parameters()):
        assert torch.equal(a, b)  # the same seed, the same draw
    reference = AutoModelForCausalLM.from_config(config)  # transformers' own draw of the same config
    for (name, a), b, want in zip(drawn[0].named_parameters(), drawn[1].parameters(), reference.parameters()):
        assert a.shape == want.shape, name
        if want.dim() >= 2:  # drawn, N(0, initializer_range): the same law, other values
            sigma = config.initializer_range  # a sample's std is within 5 of its standard errors of it
            assert abs(a.std().item() - sigma) < 5 * sigma / math.sqrt(2 * a.numel()), name
            assert not torch.equal(a, b), f"{name}: two draws are equal"
        else:  # norms' ones, biases' zeros
            assert torch.equal(a, want), name
    assert main(argv + ["--weights", "random", "--out", str(tmp_path / "run")]) == 0
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
