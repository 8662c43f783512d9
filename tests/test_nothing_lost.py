"""Nothing lost, nothing hung: a folder that holds a run is never overwritten unasked, no file
this program did not write is removed, no read blocks, a run gone non-finite stops before it
checkpoints, SIGINT/SIGTERM stop at a step boundary and resume bit-exactly, and every bad input
(flags, model folders, data, checkpoints) is one stderr line naming the problem, with every
existing file unchanged."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import l2l_hw
from l2l_hw.checkpoint import load_checkpoint, save_checkpoint
from l2l_hw.cli import main
from l2l_hw.train import NonFiniteLoss, TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--layers", "2", "--width", "64", "--context", "64", "--batch-size", "8", "--micro-batches", "2"]
CKPT = "checkpoint.safetensors"

pytestmark = pytest.mark.usefixtures("one_thread")


def rows(out: Path) -> int:
    """The rows of a run's metrics.jsonl so far (a run in another process: l2l train's output
    check makes the file to try it and removes it again)."""
    try:
        return (out / "metrics.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


def snapshot(*folders: Path) -> dict[str, str]:
    """sha256 of every regular file under the folders, by path: what a refused run must not change."""
    hashes = {}
    for folder in folders:
        for p in sorted(Path(folder).rglob("*")):
            if p.is_file():
                hashes[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return hashes


def cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def one_line(err: str, command: str, *words: str) -> str:
    """stderr is exactly one line, `l2l COMMAND: ...`, holding every word."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"l2l {command}: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def refused(capsys, argv: list[str], words: list[str], *keep: Path, code: int = 2) -> str:
    """The command exits `code` with one line holding `words`, and no file under `keep` changed."""
    before = snapshot(*keep)
    rc, _, err = cli(capsys, *argv)
    assert rc == code, err
    line = one_line(err, argv[0], *words)
    assert snapshot(*keep) == before
    return line


def trained(tmp_path: Path, capsys, name="run", *extra: str, steps=4) -> Path:
    out = tmp_path / name
    rc, _, err = cli(capsys, "train", *SMALL, "--steps", str(steps), "--eval-every", "2", "--out", str(out), *extra)
    assert rc == 0, err
    return out


def same_run(a: Path, b: Path) -> None:
    ta, ma = load_checkpoint(a / CKPT)
    tb, mb = load_checkpoint(b / CKPT)
    assert ta.keys() == tb.keys() and ma["step"] == mb["step"]
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    rows = [[(r["step"], r["loss"], r.get("val_loss")) for r in map(json.loads, (p / "metrics.jsonl").open())]
            for p in (a, b)]
    assert rows[0] == rows[1]


# ---------------------------------------------------------------------------- the output folder

@pytest.mark.parametrize("extra", [[], ["--width", "32", "--heads", "2"]], ids=["same-run", "other-shape"])
def test_a_folder_holding_a_run_is_refused_without_resume_or_overwrite(tmp_path, capsys, extra):
    out = trained(tmp_path, capsys)
    refused(capsys, ["train", *SMALL, "--steps", "4", "--out", str(out), *extra],
            [f"--out {out}", "already holds a run", "--resume", "--overwrite"], out)


def test_the_default_out_folder_is_protected_too_and_overwrite_replaces_the_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["train", *SMALL, "--steps", "2", "--eval-every", "2"]
    assert cli(capsys, *argv)[0] == 0
    refused(capsys, argv, ["--out runs/latest", "already holds a run"], tmp_path / "runs")
    (tmp_path / "runs/latest/notes.txt").write_text("mine")  # a file the run did not write
    rc, _, err = cli(capsys, *argv[:-4], "--width", "32", "--heads", "2", "--steps", "2", "--overwrite")
    assert rc == 0, err
    tensors, meta = load_checkpoint(tmp_path / "runs/latest" / CKPT)
    assert meta["config"]["width"] == 32 and (tmp_path / "runs/latest/notes.txt").read_text() == "mine"
    assert [json.loads(r)["step"] for r in (tmp_path / "runs/latest/metrics.jsonl").open()] == [1, 2]


def test_a_run_that_failed_before_training_leaves_nothing_that_blocks_the_next(tmp_path, capsys):
    out = tmp_path / "run"
    rc, _, err = cli(capsys, "train", *SMALL, "--steps", "2", "--out", str(out), "--data", str(tmp_path / "none"))
    assert rc == 2
    assert cli(capsys, "train", *SMALL, "--steps", "2", "--out", str(out))[0] == 0


def run_with_timeout(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "l2l_hw.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)  # a read that blocks fails the test, not the suite


@pytest.fixture
def fifo_folder(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "text.txt").write_text("def f(x):\n    return x + 1\n" * 400)
    os.mkfifo(data / "pipe")
    return data


def test_data_folder_with_a_fifo_is_read_without_blocking_and_the_fifo_is_named(tmp_path, fifo_folder):
    before = snapshot(fifo_folder)
    done = run_with_timeout(["train", *SMALL, "--steps", "1", "--out", str(tmp_path / "run"),
                             "--data", str(fifo_folder)])
    assert done.returncode == 0, done.stderr
    assert snapshot(fifo_folder) == before
    assert "skipped 1 path(s) that are not regular files (pipe)" in done.stdout


def test_data_that_is_a_fifo_is_one_line_for_train_and_finetune(tmp_path, fifo_folder, hf_folder):
    pipe, model = fifo_folder / "pipe", hf_folder("gpt2")
    before = snapshot(tmp_path)
    done = run_with_timeout(["train", *SMALL, "--steps", "1", "--out", str(tmp_path / "a"), "--data", str(pipe)])
    assert done.returncode == 2
    one_line(done.stderr, "train", f"--data {pipe}", "FIFO")
    done = run_with_timeout(finetune(model, pipe, tmp_path / "b"))
    assert done.returncode == 2
    one_line(done.stderr, "finetune", str(pipe), "FIFO", "not a regular file")
    assert {k: v for k, v in snapshot(tmp_path).items() if "/a/" not in k and "/b/" not in k} == before


# ---------------------------------------------------------------------------- non-finite runs

def test_a_run_gone_non_finite_stops_naming_the_step_keeps_its_last_checkpoint_and_samples_nothing(tmp_path,
                                                                                                  capsys):
    out = tmp_path / "run"
    rc, stdout, err = cli(capsys, "train", *SMALL, "--steps", "8", "--eval-every", "1", "--lr", "1e30",
                          "--out", str(out))
    assert rc == 2
    line = one_line(err, "train", "loss is nan at step", "keeps step")
    bad = int(line.split("at step ")[1].split()[0])
    assert "sample" not in stdout
    tensors, meta = load_checkpoint(out / CKPT)
    assert meta["step"] == bad - 1 and all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())
    assert max(json.loads(r)["step"] for r in (out / "metrics.jsonl").open()) == bad - 1


def linear_data(poison: int | None = None):
    g = torch.Generator().manual_seed(0)
    data = []
    for k in range(12):
        x = torch.randn(8, 4, generator=g)
        data.append((x * float("nan") if k == poison else x, x.sum(1, keepdim=True)))
    return data


def test_skip_nonfinite_discards_a_poisoned_step_and_trains_on_while_the_default_stops_there():
    cfg = TrainConfig(steps=10, batch_size=8, micro_batches=2, lr=1e-2, out=None, verbose=False, eval_every=100)
    layers = lambda: [nn.Linear(4, 8), nn.Linear(8, 1)]  # noqa: E731
    torch.manual_seed(0)
    with pytest.raises(NonFiniteLoss, match="loss is nan at step 4"):
        train(cfg, layers=layers(), loss_fn=nn.functional.mse_loss, data=linear_data(poison=3))
    torch.manual_seed(0)
    result = train(TrainConfig(**{**cfg.__dict__, "skip_nonfinite": True}), layers=layers(),
                   loss_fn=nn.functional.mse_loss, data=linear_data(poison=3))
    assert [r["step"] for r in result.history] == list(range(1, 11))
    assert all(torch.isfinite(p).all() for p in result.relay.materialize().parameters())


# ---------------------------------------------------------------------------- signals

@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_at_a_step_boundary_in_one_line_and_the_resume_is_bit_exact(tmp_path, capsys, signum):
    argv = ["train", *SMALL, "--steps", "40", "--eval-every", "1000"]
    straight = tmp_path / "straight"
    assert cli(capsys, *argv, "--out", str(straight))[0] == 0
    out = tmp_path / "stopped"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "l2l_hw.cli", *argv, "--out", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while rows(out) < 2:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signum)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 128 + signum, err
    line = one_line(err, "train", "interrupted at step", "resume with --resume")
    step = int(line.split("at step ")[1].split(";")[0])
    assert 2 <= step < 40 and load_checkpoint(out / CKPT)[1]["step"] == step
    rc, _, err = cli(capsys, "train", "--resume", "--out", str(out))
    assert rc == 0, err
    same_run(straight, out)


# ---------------------------------------------------------------------------- checkpoints

def rewritten(out: Path, change) -> None:
    """The checkpoint with its entries or metadata changed by `change(tensors, meta)`, saved with
    valid checksums: only the run's own checks can refuse it."""
    tensors, meta = load_checkpoint(out / CKPT)
    change(tensors, meta)
    save_checkpoint(out / CKPT, tensors, meta)


CHECKPOINT_FAULTS = {  # name -> (change, words of the one line)
    "no rng.torch": (lambda t, m: t.pop("rng.torch"), ["rng.torch"]),
    "no data.generator": (lambda t, m: t.pop("data.generator"), ["data.generator"]),
    "no relay.eps/step": (lambda t, m: t.pop("relay.eps/step"), ["missing", "step"]),
    "short rng state": (lambda t, m: t.__setitem__("rng.torch", t["rng.torch"][:100]), ["rng.torch", "(100,)"]),
    "negative step": (lambda t, m: m.__setitem__("step", -1), ["step >= 0"]),
    "negative relay step": (lambda t, m: t.__setitem__("relay.eps/step", torch.tensor(-1)), ["step is -1"]),
    "steps disagree": (lambda t, m: t.__setitem__("relay.eps/step", torch.tensor(3)), ["step 3", "step 2"]),
    "extra tensor": (lambda t, m: t.__setitem__("relay.eps/layer9/w/param", torch.zeros(2)), ["layer9"]),
    "extra top-level tensor": (lambda t, m: t.__setitem__("junk", torch.zeros(2)), ["junk"]),
    "float rng": (lambda t, m: t.__setitem__("rng.torch", t["rng.torch"].float()), ["rng.torch", "float32"]),
}


@pytest.mark.parametrize("fault", list(CHECKPOINT_FAULTS))
def test_a_checkpoint_with_valid_checksums_but_bad_entries_is_one_line_naming_the_entry(tmp_path, capsys, fault):
    out = trained(tmp_path, capsys, steps=2)
    change, words = CHECKPOINT_FAULTS[fault]
    rewritten(out, change)
    refused(capsys, ["train", "--resume", "--steps", "4", "--out", str(out)], [str(out / CKPT), *words], out)


def test_load_state_dict_of_a_non_mapping_is_a_type_error_naming_what_it_takes():
    relay = l2l_hw.Relay([nn.Linear(2, 2)], nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu"))
    with pytest.raises(TypeError, match="mapping of name -> tensor.*got list"):
        relay.load_state_dict([1, 2, 3])
    with pytest.raises(TypeError, match="mapping of name -> tensor.*got list"):
        relay.eps.load_state_dict([1, 2, 3])


# ---------------------------------------------------------------------------- flags

SILENT_FLAGS = [  # flags that were accepted without effect or misread
    (["--shard-state"], ["--shard-state:", "torchrun"]),
    (["--momentum", "0.9"], ["--momentum 0.9", "sgd"]),
    (["--optimizer", "sgd", "--momentum", "2"], ["--momentum 2.0", "< 1"]),
    (["--clip-mode", "global"], ["--clip-mode global", "clip_grad_norm"]),
    (["--out", ""], ["--out ''", "non-empty"]),
    (["--lr", "-inf"], ["--lr -inf", "finite"]),
    (["--lr", "-1e-3"], ["--lr -0.001", ">= 0"]),
    (["--batch-size", "1e12"], ["--batch-size", "invalid int value: '1e12'"]),
    (["--resume", "--overwrite"], ["--overwrite", "give one of them"]),
]


@pytest.mark.parametrize("flags,words", SILENT_FLAGS, ids=[" ".join(f) for f, _ in SILENT_FLAGS])
def test_flags_without_effect_or_misread_are_one_line(tmp_path, capsys, flags, words):
    out = tmp_path / "run"
    refused(capsys, ["train", *SMALL, "--steps", "2", "--out", str(out), *flags], words, tmp_path)
    assert not out.exists() or not (out / CKPT).exists()


def test_make_eps_applies_the_same_momentum_rule_as_the_command_line():
    with pytest.raises(ValueError, match=r"momentum must be >= 0 and < 1 \(a finite number\), got 2.0"):
        l2l_hw.make_eps("cpu", optimizer="sgd", momentum=2.0)
    with pytest.raises(ValueError, match="momentum is SGD's; adamw takes none"):
        l2l_hw.make_eps("cpu", optimizer="adamw", momentum=0.9)


@pytest.mark.parametrize("size", [["--layers", "100000000"], ["--width", "1000000"], ["--context", "1000000"],
                                  ["--batch-size", "1000000000000", "--micro-batches", "1"]],
                         ids=lambda s: " ".join(s))
def test_absurd_sizes_are_refused_with_the_estimate_and_the_machine_s_memory(tmp_path, capsys, size):
    flags = dict(zip(SMALL[::2], SMALL[1::2]))
    flags.update(dict(zip(size[::2], size[1::2])))
    argv = ["train", *[x for kv in flags.items() for x in kv], "--steps", "1", "--out", str(tmp_path / "run")]
    refused(capsys, argv, ["does not fit", "host memory", "GiB needed", "available"], tmp_path)


def test_an_allocation_failure_is_one_line(tmp_path, capsys, monkeypatch):
    train_module = sys.modules["l2l_hw.train"]

    def fail(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 800000000000 bytes.\nmore detail")

    monkeypatch.setattr(train_module, "build_relay", fail)
    refused(capsys, ["train", *SMALL, "--steps", "1", "--out", str(tmp_path / "run")],
            ["out of memory", "can't allocate memory", "smaller"])


# ---------------------------------------------------------------------------- Hugging Face folders

@pytest.fixture
def hf_folder(tmp_path):
    """hf_folder(kind, **config changes): a tiny saved model with a word tokenizer, and data.txt."""
    from tests.test_hf import TEXT, tiny, word_tokenizer

    (tmp_path / "data.txt").write_text("\n".join(TEXT) + "\n")

    def make(kind="gpt2", name=None, **config):
        folder = tmp_path / (name or kind)
        model = tiny(kind)
        for key, value in config.items():
            setattr(model.config, key, value)
        model.save_pretrained(folder)
        word_tokenizer(TEXT).save_pretrained(folder)
        return folder

    return make


def finetune(folder: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["finetune", "--model", str(folder), "--data", str(data), "--out", str(out), "--steps", "2",
            "--batch-size", "2", "--micro-batches", "1", "--context", "6", "--eval-every", "2", *extra]


def test_finetune_resume_from_another_model_s_checkpoint_is_one_line(tmp_path, capsys, hf_folder):
    a, b = hf_folder("gpt2", "a"), hf_folder("llama-untied", "b")
    out = tmp_path / "run"
    rc, _, err = cli(capsys, *finetune(a, tmp_path / "data.txt", out))
    assert rc == 0, err
    refused(capsys, [*finetune(b, tmp_path / "data.txt", out), "--resume", "--steps", "4"],
            [str(a), str(b), "another config"], out, a, b)


def corrupt(folder: Path, name: str, data: bytes | None = None, cut: int | None = None) -> Path:
    path = folder / name
    path.write_bytes(data if data is not None else path.read_bytes()[:cut])
    return path


BAD_FOLDERS = {  # name -> (make the folder bad, words of the one line)
    "truncated safetensors": (lambda f: corrupt(f, "model.safetensors", cut=5000), ["model.safetensors"]),
    "garbage safetensors": (lambda f: corrupt(f, "model.safetensors", b"\x10\x00" + b"x" * 300),
                            ["model.safetensors", "not a readable safetensors file"]),
    "corrupt config.json": (lambda f: corrupt(f, "config.json", b'{"model_type": "gpt2", '),
                            ["config.json", "not a valid transformers config"]),
    "num_hidden_layers -1": (lambda f: corrupt(f, "config.json", json.dumps(
        {**json.loads((f / "config.json").read_text()), "n_layer": -1}).encode()), ["config.json", "n_layer is -1"]),
    "corrupt tokenizer.json": (lambda f: corrupt(f, "tokenizer.json", b"{not json"),
                               ["tokenizer", str("tokenizer.json"), "cannot be loaded"]),
    "corrupt index": (lambda f: [(f / "model.safetensors").rename(f / "x.safetensors"), corrupt(
        f, "model.safetensors.index.json", b"[1, 2")], ["model.safetensors.index.json", "weight_map"]),
    "small vocabulary": (lambda f: corrupt(f, "config.json", json.dumps(
        {**json.loads((f / "config.json").read_text()), "vocab_size": 4}).encode()), ["token id", "vocab_size 4"]),
    "int32 weights": (lambda f: int_weights(f), ["int32", "floating point"]),
    "nan weights": (lambda f: nan_weights(f), ["loss is nan at step 1"]),
}


def int_weights(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    save_file({k: v.to(torch.int32) for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})


def nan_weights(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    state["transformer.ln_f.weight"] = torch.full_like(state["transformer.ln_f.weight"], float("nan"))
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("fault", list(BAD_FOLDERS))
def test_a_model_folder_bad_inside_is_one_line_naming_the_file(tmp_path, capsys, hf_folder, fault):
    folder = hf_folder("gpt2")
    make_bad, words = BAD_FOLDERS[fault]
    make_bad(folder)
    out = tmp_path / "run"
    refused(capsys, finetune(folder, tmp_path / "data.txt", out), words, folder)
    assert not (out / "model").exists()


def test_a_llama_config_with_a_negative_layer_count_is_named_as_such_not_as_unsupported(tmp_path, capsys, hf_folder):
    folder = hf_folder("llama-untied")
    corrupt(folder, "config.json", json.dumps({**json.loads((folder / "config.json").read_text()),
                                                "num_hidden_layers": -1}).encode())
    line = refused(capsys, finetune(folder, tmp_path / "data.txt", tmp_path / "run"),
                   ["config.json", "num_hidden_layers is -1", ">= 1"], folder)
    assert "not supported" not in line


def test_finetune_context_past_the_position_table_is_one_line(tmp_path, capsys, hf_folder):
    folder = hf_folder("gpt2")  # n_positions 16
    refused(capsys, [*finetune(folder, tmp_path / "data.txt", tmp_path / "run"), "--context", "17"],
            ["context of 17 tokens", "16 positions", "config.json"], folder)


@pytest.mark.parametrize("data", ["empty folder", "bad utf-8", "missing"])
def test_finetune_data_that_is_not_a_text_file_is_named_for_what_it_is(tmp_path, capsys, hf_folder, data):
    folder = hf_folder("gpt2")
    path = tmp_path / "d"
    words = {"empty folder": ["holds no files"], "bad utf-8": ["not UTF-8", "byte 4"],
             "missing": ["does not exist"]}[data]
    if data == "empty folder":
        path.mkdir()
    elif data == "bad utf-8":
        path.write_bytes(b"the \xff cat\n" * 50)
    refused(capsys, finetune(folder, path, tmp_path / "run"), [str(path), *words], folder, tmp_path / "d")
