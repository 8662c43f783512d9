"""What a new user meets in the first hour (issue 49): `make train` can be run again, each
command's --help says only what holds for it, sizes take units, the banner says what the run
is (its recompute plan, a resume, each save), samples stay on one line, and the messages name
the way out."""
import json
import re
import subprocess
from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer, models

from l2l_hw.cli import build_parser, main
from l2l_hw.finetune import one_line
from l2l_hw.options import parse_size

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "2", "--width", "32", "--heads", "2", "--context", "16", "--batch-size", "4",
        "--micro-batches", "2"]

pytestmark = pytest.mark.usefixtures("one_thread")


def make_n(*args: str) -> str:
    """The commands `make` would run (-n: none is run)."""
    return subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_make_train_replaces_its_run_passes_args_and_resumes_when_asked():
    again = [line for line in make_n("train", "-o", ".venv/.installed-core").splitlines() if "l2l train" in line]
    assert again and "--out runs/latest --overwrite" in again[0]
    passed = make_n("train", "-o", ".venv/.installed-core", "ARGS=--steps 7", "OUT=runs/b")
    assert "--out runs/b --overwrite --steps 7" in passed
    resumed = make_n("train", "-o", ".venv/.installed-core", "ARGS=--resume --steps 400")
    assert "--resume --steps 400" in resumed and "--overwrite" not in resumed


def test_make_train_installs_the_core_only_and_make_test_the_rest():
    core = (ROOT / "requirements.txt").read_text()
    for heavy in ("deepspeed", "pyarrow", "yowasp", "pynq", "datasets", "cocotb"):
        assert heavy not in core, heavy
    assert "-r requirements.txt" in (ROOT / "requirements-test.txt").read_text()
    plan = make_n("test", "-W", "requirements.txt", "-W", "requirements-test.txt")
    assert "pip install -q -r requirements-test.txt" in plan


def help_text(command: str) -> str:
    return next(a for a in build_parser()._subparsers._group_actions[0].choices.items()
                if a[0] == command)[1].format_help()


def test_each_command_s_help_says_only_what_holds_for_that_command():
    finetune, train = (help_text(c).split("options:", 1)[1] for c in ("finetune", "train"))  # the flags' text
    assert "l2l train" not in finetune and "train's" not in finetune
    assert "finetune" not in train
    required = finetune.split("required:")[1].split("\n\n")[0]
    assert "--model DIR" in required and "--data PATH" in required  # first, under their own heading
    assert "the text to train on" in train and "stdlib" not in finetune


@pytest.mark.parametrize("text, size", [("1073741824", 2**30), ("1GiB", 2**30), ("1.5GiB", 3 * 2**29),
                                        ("512MB", 512 * 10**6), ("2G", 2 * 10**9), ("1e9", 10**9)])
def test_a_size_takes_bytes_or_a_unit(text, size):
    assert parse_size(text) == size


def cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's refusals
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("value, words", [("-5", ["--activation-budget", "is not a size", "GiB"]),
                                          ("0", ["--activation-budget 0", "at least 1 bytes"]),
                                          ("1XB", ["'1XB' is not a size"])])
def test_a_bad_size_is_one_line_that_never_says_none(capsys, value, words):
    rc, _, err = cli(capsys, "train", "--activation-budget", value)
    assert rc == 2 and len(err.splitlines()) == 1 and "None" not in err
    assert all(w in err for w in words), err


def test_the_banner_says_the_recompute_plan_a_resume_and_the_lamb_lr(tmp_path, capsys):
    out = tmp_path / "run"
    rc, printed, err = cli(capsys, "train", *TINY, "--steps", "2", "--activation-budget", "1MiB", "--out", str(out))
    assert rc == 0, err
    assert "recompute planned within 1.0 MiB of kept activations (the first step runs full" in printed
    assert re.search(r"^recompute planned within 1\.0 MiB of kept activations: \w+ at layers ", printed, re.M), printed
    rc, printed, err = cli(capsys, "train", "--resume", "--steps", "3", "--out", str(out))
    assert rc == 0, err
    assert f"resumed from {out / 'checkpoint.safetensors'} at step 2 (128 tokens trained), on to step 3" in printed
    rc, printed, _ = cli(capsys, "train", *TINY, "--steps", "1", "--optimizer", "lamb", "--out", str(tmp_path / "l"))
    assert rc == 0 and "a low lr for lamb" in printed


def test_a_sample_is_one_line_with_its_control_characters_escaped():
    assert one_line("def f():\n\treturn 1\n") == "def f():\\n\\treturn 1\\n"
    assert one_line("naïve — ok") == "naïve — ok"


def test_conversations_without_chat_are_refused_with_the_way_to_train_on_them(tmp_path):
    from l2l_hw.finetune_data import tokenize_text

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"hi": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>")),
        eos_token="<eos>")
    with pytest.raises(ValueError, match=r"no text field 'text'.*give --chat"):
        tokenize_text(tokenizer, data)


def test_info_says_what_fpga_pynq_needs(capsys):
    rc, printed, _ = cli(capsys, "info")
    line = next(line for line in printed.splitlines() if "fpga-pynq" in line)
    assert rc == 0 and "needs a PYNQ board" in line and "--overlay" in line and "ValueError" not in line
