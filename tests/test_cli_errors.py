"""Every bad input to `l2l train` is one clear line and exit 2 (an output that cannot be
written: exit 1), never a traceback; every byte of a checkpoint is checked; a run killed at
any moment resumes bit-identically and leaves no temporary file."""
import builtins
import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from l2l_hw.checkpoint import load_checkpoint
from l2l_hw.cli import main
from l2l_hw.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--layers", "2", "--width", "64", "--context", "64", "--batch-size", "8", "--micro-batches", "2"]
CKPT = "checkpoint.safetensors"

pytestmark = pytest.mark.usefixtures("one_thread")


def run_cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    try:
        rc = main(["train", *argv])
    except SystemExit as e:  # argparse's own refusals (a choice not allowed)
        rc = e.code
    err = capsys.readouterr().err
    return rc, err


def assert_one_clear_line(err: str, *words: str):
    message = [line for line in err.splitlines() if line.startswith("l2l train: ")]
    assert "Traceback" not in err, err
    assert len(message) == 1, err
    for word in words:
        assert word in message[0], (word, message[0])


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    (d / "empty.txt").write_bytes(b"")
    (d / "twelve.txt").write_bytes(b"hello world!")
    (d / "binary.bin").write_bytes(bytes(range(256)) * 64)
    return d


BAD_FLAGS = [  # (flags, the words the one line must hold)
    (["--heads", "5"], ["--heads 5", "divide width"]),
    (["--heads", "0"], ["--heads 0", ">= 1"]),
    (["--eval-every", "0"], ["--eval-every 0", ">= 1"]),
    (["--eval-every", "-1"], ["--eval-every -1", ">= 1"]),
    (["--width", "0"], ["--width 0", ">= 1"]),
    (["--context", "0"], ["--context 0", ">= 1"]),
    (["--layers", "0"], ["--layers 0", ">= 1"]),
    (["--device", "tpu"], ["--device tpu", "cpu, cuda or cuda:N"]),
    (["--lr", "inf"], ["--lr inf", "finite"]),
    (["--lr", "nan"], ["--lr nan", "finite"]),
    (["--layer-drop", "1.5"], ["--layer-drop 1.5", "[0, 1)"]),
    (["--linear-projection", "2"], ["--linear-projection 2", "[0, 1]"]),
    (["--dropout", "-0.1"], ["--dropout -0.1", "[0, 1)"]),
    (["--stop-after", "-1"], ["--stop-after -1", ">= 1"]),
    (["--stop-after", "0"], ["--stop-after 0", ">= 1"]),
    (["--steps", "-5"], ["--steps -5", ">= 1"]),
    (["--warmup", "50", "--steps", "10"], ["--warmup 50", "steps (10)"]),
    (["--micro-batches", "9"], ["--micro-batches 9", "batch_size (8)"]),
    (["--clip-grad-norm", "0"], ["--clip-grad-norm 0", "> 0"]),
    (["--momentum", "inf"], ["--momentum inf", "finite"]),
    (["--eps", "tpu"], ["--eps", "invalid choice: 'tpu'", "cpu"]),
    (["--eps", "fpga-pynq"], ["--eps fpga-pynq", "needs an overlay"]),
    (["--overlay", "x.bit"], ["--overlay x.bit", "fpga-pynq"]),
    (["--activations", "host", "--recompute", "none"], ["--activations host", "recompute"]),
    (["--shard-state", "--optimizer-state", "8bit"], ["--optimizer-state 8bit", "fp32 optimizer state only"]),
    (["--eps", "fpga-sim", "--optimizer-state", "bf16"], ["fpga-sim EPS", "state='bf16'", "cpu or golden"]),
    (["--out", "/proc/x"], ["--out /proc/x", "cannot write"]),
    (["--out", "/sys/l2l_out"], ["--out /sys/l2l_out", "cannot write"]),
]


@pytest.mark.parametrize("flags,words", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_naming_flag_and_value_exit_2_before_training(tmp_path, capsys, flags, words):
    out = tmp_path / "run"
    argv = [*SMALL, "--steps", "2", "--out", str(out), *flags]
    rc, err = run_cli(capsys, *argv)
    assert rc == 2
    assert_one_clear_line(err, *words)
    assert not (out / CKPT).exists()  # refused up front: nothing trained


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_one_line(tmp_path, capsys):
    rc, err = run_cli(capsys, *SMALL, "--steps", "1", "--out", str(tmp_path), "--device", "cuda")
    assert rc == 2
    assert_one_clear_line(err, "--device cuda", "CUDA is not available")


@pytest.mark.parametrize("name,words", [("empty.txt", ["train split has 0 bytes", "context + 1 = 65"]),
                                        ("twelve.txt", ["split has", "context + 1 = 65"]),
                                        ("binary.bin", ["binary file"]),
                                        ("missing.txt", ["neither a file nor a folder"])])
def test_unusable_data_file_is_one_line_naming_it(tmp_path, capsys, data_files, name, words):
    path = data_files / name
    rc, err = run_cli(capsys, *SMALL, "--steps", "1", "--out", str(tmp_path / "run"), "--data", str(path))
    assert rc == 2
    assert_one_clear_line(err, f"--data {path}", *words)


def test_read_only_output_folder_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    out = tmp_path / "ro"
    out.mkdir()
    real_open = builtins.open

    def read_only(file, mode="r", *args, **kwargs):  # as a read-only file system answers a write
        if str(file).startswith(str(out)) and any(m in mode for m in "wax+"):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only)
    rc, err = run_cli(capsys, *SMALL, "--steps", "1", "--out", str(out))
    assert rc == 2
    assert_one_clear_line(err, f"--out {out}", "Read-only file system")


def trained(tmp_path, capsys, name="run", *extra, steps=4, stop_after=None) -> Path:
    out = tmp_path / name
    argv = [*SMALL, "--steps", str(steps), "--eval-every", "2", "--out", str(out), *extra]
    if stop_after:
        argv += ["--stop-after", str(stop_after)]
    rc, err = run_cli(capsys, *argv)
    assert rc == 0, err
    return out


def test_full_disk_while_checkpointing_is_one_line_and_the_previous_checkpoint_survives(tmp_path, capsys,
                                                                                         monkeypatch):
    import errno

    import l2l_hw.checkpoint as checkpoint

    out = trained(tmp_path, capsys, steps=2)
    before = (out / CKPT).read_bytes()
    real_fdopen = checkpoint.os.fdopen

    class FullDisk:
        """The checkpoint's file, on a disk that fills up after 4 KiB."""

        def __init__(self, f):
            self.f, self.room = f, 4096

        def write(self, data):
            n = memoryview(data).nbytes
            if n > self.room:
                self.f.write(bytes(memoryview(data).cast("B")[:self.room]))
                raise OSError(errno.ENOSPC, "No space left on device")
            self.room -= n
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(checkpoint.os, "fdopen", lambda fd, mode: FullDisk(real_fdopen(fd, mode)))
    rc, err = run_cli(capsys, "--resume", "--steps", "4", "--out", str(out))
    assert rc == 1
    assert_one_clear_line(err, str(out / CKPT), "No space left on device", "previous checkpoint is unchanged")
    assert (out / CKPT).read_bytes() == before and files(out) == [CKPT, "loss.png", "metrics.jsonl"]


def test_resume_refuses_flags_that_contradict_the_checkpoint_naming_both_values(tmp_path, capsys):
    out = trained(tmp_path, capsys, steps=4, stop_after=2)
    rows = (out / "metrics.jsonl").read_text()
    rc, err = run_cli(capsys, "--resume", "--out", str(out), "--width", "32", "--lr", "0.01")
    assert rc == 2
    assert_one_clear_line(err, "width is 64 in the checkpoint, 32 given", "lr is 0.002 in the checkpoint, 0.01 given")
    assert (out / "metrics.jsonl").read_text() == rows  # nothing trained, nothing mixed in
    # the same values as the checkpoint's are no contradiction
    rc, err = run_cli(capsys, "--resume", "--out", str(out), "--width", "64", *SMALL)
    assert rc == 0, err


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused(tmp_path, capsys):
    out = trained(tmp_path, capsys, steps=4)
    rc, err = run_cli(capsys, "--resume", "--steps", "2", "--out", str(out))
    assert rc == 2
    assert_one_clear_line(err, "--steps 2", "checkpoint's step 4")


def test_resume_from_a_folder_in_place_of_the_checkpoint_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    (out / CKPT).mkdir(parents=True)
    rc, err = run_cli(capsys, "--resume", "--out", str(out))
    assert rc == 2
    assert_one_clear_line(err, str(out / CKPT), "a folder, not a checkpoint file")


def test_resume_cuts_metrics_back_to_the_checkpoint_and_drops_a_torn_last_line(tmp_path, capsys):
    straight = trained(tmp_path, capsys, "straight", steps=4)
    out = trained(tmp_path, capsys, "split", steps=4, stop_after=2)
    with open(out / "metrics.jsonl", "a") as f:  # rows of a run killed after the checkpoint, the last one torn
        f.write(json.dumps({"step": 3, "loss": 9.0, "lr": 0.0, "tokens_per_s": 1.0, "elapsed": 1.0}) + "\n")
        f.write('{"step": 4, "loss": 9.')
    rc, err = run_cli(capsys, "--resume", "--out", str(out))
    assert rc == 0, err
    assert_same_runs(straight, out)


def test_a_metrics_line_that_is_not_the_last_and_is_broken_is_one_line_naming_the_file(tmp_path, capsys):
    out = trained(tmp_path, capsys, steps=4, stop_after=2)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(["{broken", *lines[1:]]) + "\n")
    rc, err = run_cli(capsys, "--resume", "--out", str(out))
    assert rc == 2
    assert_one_clear_line(err, str(out / "metrics.jsonl"), "line 1")


def test_leftover_temporary_files_of_a_dead_run_are_removed_others_kept_and_the_checkpoint_has_the_folder_s_mode(
        tmp_path, capsys):
    out = trained(tmp_path, capsys, steps=4, stop_after=2)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ours = [f".{name}.l2l-tmp-{int(dead.stdout)}-k2j3h4.tmp" for name in (CKPT, "loss.png")]  # a killed write's
    others = [".checkpoint.safetensors.k2j3h4.tmp", ".tmpAb12Cd",  # look alike, not written by this program
              f".checkpoint.safetensors.l2l-tmp-{os.getpid()}-x.tmp"]  # a live process's save in progress
    for name in (*ours, *others):
        (out / name).write_bytes(b"partial")
    model = out / f".model.l2l-tmp-{int(dead.stdout)}-q8r7.tmp"  # a fine-tune's model folder, half saved
    model.mkdir()
    (model / "config.json").write_text("{")
    rc, err = run_cli(capsys, "--resume", "--out", str(out))
    assert rc == 0, err
    assert files(out) == sorted([CKPT, "loss.png", "metrics.jsonl", *others])
    modes = {name: (out / name).stat().st_mode & 0o777 for name in (CKPT, "loss.png", "metrics.jsonl")}
    assert len(set(modes.values())) == 1, modes


def test_rewritten_learning_rate_in_the_checkpoint_metadata_is_refused(tmp_path, capsys):
    out = trained(tmp_path, capsys, steps=4, stop_after=2)
    raw = (out / CKPT).read_bytes()
    assert raw.count(b'\\"lr\\": 0.002') == 1
    (out / CKPT).write_bytes(raw.replace(b'\\"lr\\": 0.002', b'\\"lr\\": 0.009'))  # same length, valid JSON
    rc, err = run_cli(capsys, "--resume", "--out", str(out))
    assert rc == 2
    assert_one_clear_line(err, str(out / CKPT), "header", "crc32")


def test_train_config_arguments_are_checked_from_python_too():
    from l2l_hw.train import ConfigError

    for bad in [dict(lr="0.1"), dict(heads=2.0), dict(recompute=1), dict(seed=-1), dict(optimizer="adagrad"),
                dict(data=3), dict(clip_grad_norm=float("inf")), dict(dist_timeout=0)]:
        (name, value), = bad.items()
        with pytest.raises(ConfigError, match=f"^{name}={value!r}: ") as e:
            TrainConfig(**bad)
        assert e.value.field == name


# ---------------------------------------------------------------------------- every byte checked

def assert_same_runs(want: Path, got: Path):
    tw, mw = load_checkpoint(want / CKPT)
    tg, mg = load_checkpoint(got / CKPT)
    assert tw.keys() == tg.keys() and mw["step"] == mg["step"] and mw["config"] == mg["config"]
    for name in tw:
        assert tw[name].dtype == tg[name].dtype and torch.equal(tw[name], tg[name]), name
    rw, rg = ([json.loads(line) for line in (p / "metrics.jsonl").read_text().splitlines()] for p in (want, got))
    assert [(r["step"], r["loss"], r["lr"], r.get("val_loss")) for r in rw] == \
           [(r["step"], r["loss"], r["lr"], r.get("val_loss")) for r in rg]


def test_300_random_bit_flips_across_a_checkpoint_each_refused_in_one_line_or_harmless(tmp_path, capsys):
    straight = trained(tmp_path, capsys, "straight", steps=4)
    split = trained(tmp_path, capsys, "split", steps=4, stop_after=3)
    original = (split / CKPT).read_bytes()
    metrics = (split / "metrics.jsonl").read_bytes()
    header_end = 8 + int.from_bytes(original[:8], "little")
    rng = random.Random(17)
    outcomes = {"refused": 0, "harmless": 0}
    for i in range(300):
        # half the flips in the length field and JSON header, half in the tensor data
        byte = rng.randrange(header_end) if i % 2 == 0 else rng.randrange(header_end, len(original))
        flipped = bytearray(original)
        flipped[byte] ^= 1 << rng.randrange(8)
        run = tmp_path / "flip"
        run.mkdir(exist_ok=True)
        (run / CKPT).write_bytes(bytes(flipped))
        (run / "metrics.jsonl").write_bytes(metrics)
        rc, err = run_cli(capsys, "--resume", "--out", str(run))
        if rc == 2:
            assert_one_clear_line(err, str(run / CKPT))
            outcomes["refused"] += 1
        else:  # only a flip that changes nothing the run reads may load: then it resumes bit-identically
            assert rc == 0, (byte, err)
            assert_same_runs(straight, run)
            outcomes["harmless"] += 1
    print(outcomes)
    assert outcomes["refused"] + outcomes["harmless"] == 300 and outcomes["refused"] >= 290, outcomes


def test_sigkill_at_10_random_moments_resumes_bit_identical_and_leaves_no_temporary_file(tmp_path, capsys):
    argv = [*SMALL, "--steps", "6", "--eval-every", "1"]  # a checkpoint every step: kills land in writes too
    t0 = time.monotonic()
    rc, err = run_cli(capsys, *argv, "--out", str(tmp_path / "straight"))
    assert rc == 0, err
    span = time.monotonic() - t0  # set-up and training, in this process
    rng = random.Random(5)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    landed = {"while running": 0, "with a checkpoint to resume": 0}
    for k in range(10):
        out = tmp_path / f"killed{k}"
        proc = subprocess.Popen([sys.executable, "-m", "l2l_hw.cli", "train", *argv, "--out", str(out)], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        proc.stdout.readline()  # the banner: set-up is done, training starts
        time.sleep(rng.uniform(0, span))
        landed["while running"] += proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()
        if (out / CKPT).exists():
            landed["with a checkpoint to resume"] += 1
            rc, err = run_cli(capsys, "--resume", "--out", str(out))
        else:  # killed before its first checkpoint: there is nothing to resume, start again
            rc, err = run_cli(capsys, *argv, "--out", str(out), "--overwrite")
        assert rc == 0, err
        assert_same_runs(tmp_path / "straight", out)
        assert files(out) == [CKPT, "loss.png", "metrics.jsonl"], files(out)
    print(landed)  # where the kills landed (pytest -s): the property above holds for each
