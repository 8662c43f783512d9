"""The reference GPT (as a list of relay layers) and its byte corpus."""
import math

import pytest
import torch
import torch.nn.functional as F

from l2l_hw.models import Block, Corpus, Embedding, GPTConfig, Head, build_gpt, generate, lm_loss
from l2l_hw.models.corpus import sorted_files, split_files, stdlib_root

TINY = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16)


pytestmark = pytest.mark.usefixtures("one_thread")


def _build(cfg=TINY, seed=0):
    torch.manual_seed(seed)
    return build_gpt(cfg)


def test_build_gpt_is_embedding_blocks_head_passing_plain_tensors():
    model = _build()
    assert [type(m) for m in model] == [Embedding, Block, Block, Head]
    x = torch.randint(256, (3, TINY.block_size))
    act = x
    for layer in model:  # the relay's view: one layer at a time, one tensor between layers
        act = layer(act)
        assert isinstance(act, torch.Tensor)
    assert act.shape == (3, TINY.block_size, 256)


def test_build_gpt_same_seed_gives_bit_identical_weights_other_seed_differs():
    a, b, c = _build(seed=0), _build(seed=0), _build(seed=1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a[1].attn.c_attn.weight, c[1].attn.c_attn.weight)


def test_build_gpt_scales_residual_projections_by_depth():
    cfg = GPTConfig(n_layer=8, n_embd=128, n_head=4, block_size=16)
    model = _build(cfg)
    fc, proj = model[1].mlp.c_fc.weight.std().item(), model[1].mlp.c_proj.weight.std().item()
    assert fc == pytest.approx(0.02, rel=0.1)
    assert proj == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.1)


def test_tied_weights_are_one_parameter_object_and_one_storage():
    model = _build(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16, tie_weights=True))
    emb, head = model[0].wte.weight, model[-1].lm_head.weight
    assert emb is head
    assert emb.data_ptr() == head.data_ptr()
    untied = _build(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
    assert untied[0].wte.weight.data_ptr() != untied[-1].lm_head.weight.data_ptr()


def test_lm_loss_is_mean_cross_entropy_over_all_tokens_near_ln256_at_init():
    logits = torch.randn(2, 5, 256)
    targets = torch.randint(256, (2, 5))
    expected = torch.stack([F.cross_entropy(logits[b, t][None], targets[b, t][None])
                            for b in range(2) for t in range(5)]).mean()
    torch.testing.assert_close(lm_loss(logits, targets), expected)
    x = torch.randint(256, (4, TINY.block_size))
    assert lm_loss(_build()(x), x).item() == pytest.approx(math.log(256), abs=0.1)


def test_generate_returns_requested_bytes_and_is_reproducible_with_a_generator():
    model = _build()
    a = generate(model, b"def ", 30, temperature=0.8, top_k=10, block_size=TINY.block_size,
                 generator=torch.Generator().manual_seed(0))
    b = generate(model, b"def ", 30, temperature=0.8, top_k=10, block_size=TINY.block_size,
                 generator=torch.Generator().manual_seed(0))
    assert isinstance(a, bytes) and len(a) == 30 and a == b
    assert model.training  # generate leaves the mode as it found it


def test_stdlib_corpus_split_is_deterministic_and_disjoint_by_file():
    files = sorted_files(stdlib_root(), ".py")
    assert files and files == sorted(files)
    assert not any("site-packages" in f for f in files)
    train, val = split_files(files)
    assert set(train).isdisjoint(val) and len(train) + len(val) == len(files)
    assert 0.05 < len(val) / len(files) < 0.15  # ~1 file in 10
    assert split_files(files) == (train, val)
    corpus = Corpus.load()
    assert corpus.train.dtype == torch.uint8 and len(corpus.val) > 0
    assert Corpus.load() is corpus  # cached in memory


def test_corpus_batch_is_shifted_by_one_byte_and_reproducible_with_a_generator():
    corpus = Corpus.load()
    x, y = corpus.batch("train", 4, 32, torch.Generator().manual_seed(3))
    x2, _ = corpus.batch("train", 4, 32, torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x, x2)


def test_user_corpus_file_splits_last_tenth_and_folder_splits_by_file(tmp_path):
    text = tmp_path / "one.txt"
    text.write_bytes(bytes(range(32, 127)) * 100)
    c = Corpus.load(text)
    assert len(c.val) == len(text.read_bytes()) // 10
    assert bytes(c.val.tolist()) == text.read_bytes()[-len(c.val):]
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(40):
        (folder / f"f{i:02d}.txt").write_text(f"file {i:02d}\n" * 1000)
    (folder / "blob.bin").write_bytes(b"\0" * 100)  # binary files are skipped
    c = Corpus.load(folder)
    train_files, val_files = split_files(sorted(f"f{i:02d}.txt" for i in range(40)))
    assert len(c.train) + len(c.val) == 40 * len("file 00\n") * 1000
    assert len(c.val) == len(val_files) * len("file 00\n") * 1000
