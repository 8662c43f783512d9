"""What a new user meets in the second hour (issue 62): the RTL build announced before its wait,
switches' help as sentences, files with the user's umask, the cumulative time labelled, figures
only for the losses they belong to, the estimate's folder the estimated command's, `make train`'s
time as it is, and transformers' mask functions called in the words of the installed version."""
import inspect
import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from l2l_hw import estimate, hf
from l2l_hw.cli import build_parser, main
from l2l_hw.hw import verilator
from tests.test_hf import make_batch, tiny
from tests.test_train import readme_training_snippet

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "16", "--batch-size", "4",
        "--micro-batches", "2", "--seed", "3"]

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- 1. the RTL build's wait
def test_the_rtl_build_says_so_first_with_its_length_and_cache_and_a_cached_one_says_nothing(tmp_path, monkeypatch,
                                                                                            capsys):
    monkeypatch.setenv("L2L_HW_CACHE", str(tmp_path))
    monkeypatch.setattr(verilator, "toolchain", lambda: tmp_path / "bin")  # no g++ run: the build is faked
    said_before = []

    def build(out, data_width, lanes, bin_dir, verbose=False):
        said_before.append(capsys.readouterr().err)  # what the user saw when the wait began
        out.mkdir(parents=True)
        (out / "libl2l_sim.so").write_bytes(b"")

    monkeypatch.setattr(verilator, "build", build)
    lib = verilator.library_path()
    out = tmp_path / "verilator" / verilator.build_key(verilator.DEFAULT_DATA_WIDTH, verilator.DEFAULT_LANES)
    assert lib == out / "libl2l_sim.so"
    assert said_before == [f"building the RTL simulation once (DATA_WIDTH 512, 4 lanes), about 2 min; "
                           f"cached in {out}\n"]
    assert verilator.library_path() == lib and said_before == [said_before[0]]  # cached: no build, no line
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------- 3. a switch's help
def rendered_help(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", "finetune", "estimate"])
def test_every_switch_s_help_is_a_sentence_not_a_value(command, capsys):
    text = rendered_help(capsys, command)
    # a switch: its flag, then its help after two spaces or on the next line (an option has a value first)
    switches = dict(re.findall(r"^  (--[a-z0-9-]+)(?:, -[-a-z0-9]+)*(?: {2,}|\n {20,})(\S+ \S+ \S+)", text, re.M))
    assert {"--no-save", "--resume", "--overwrite", "--tensorboard"} <= switches.keys(), switches
    assert switches["--no-save"] == "write no checkpoint"
    assert not [flag for flag, words in switches.items() if words.split()[0].strip(":(,") in ("True", "False")]


# ---------------------------------------------------------------------------- 4. the user's umask
@pytest.mark.parametrize("command,required", [("finetune", "--data PATH --model DIR"), ("train", "")])
def test_help_puts_the_required_then_the_common_options_first_and_the_usage_names_the_required(
        command, required, capsys):
    text = rendered_help(capsys, command)
    usage = text.splitlines()[0]
    assert usage == f"usage: l2l {command} {required + ' ' if required else ''}[options]  (the common ones first below)"
    headings = [line for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    expected = ["options:", "required:", "common options:"] if required else ["options:", "common options:"]
    assert headings[:len(expected)] == expected
    common = text.split("common options:")[1].split("\n\n")[0]
    for flag in ("--out", "--steps", "--lr", "--batch-size", "--state-dir", "--resume", "--nproc-per-node"):
        assert f"\n  {flag}" in common, flag


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def modes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}


def test_the_saved_model_s_files_take_the_user_s_umask_as_the_folder_s_other_files(tmp_path, umask):
    model = tiny("gpt2")
    model.save_pretrained(tmp_path / "start")
    (tmp_path / "start" / "README.md").write_text("a file of the model folder, copied\n")
    relay = hf.from_pretrained(tmp_path / "start", eps=hf_eps())
    hf.save_replacing(relay, tmp_path / "model", files_from=tmp_path / "start")
    (tmp_path / "mine.txt").write_text("")  # what open() makes under this umask: the reference
    file_mode = (tmp_path / "mine.txt").stat().st_mode & 0o777
    assert file_mode == 0o666 & ~umask
    assert modes(tmp_path / "model") == {name: file_mode for name in ("model.safetensors", "config.json",
                                                                      "generation_config.json", "README.md")}
    (tmp_path / "made").mkdir()
    assert (tmp_path / "model").stat().st_mode & 0o777 == (tmp_path / "made").stat().st_mode & 0o777
    relay.close()


def hf_eps():
    import l2l_hw

    return l2l_hw.make_eps("cpu")


def test_a_run_s_files_and_checkpoint_take_the_user_s_umask(tmp_path, umask):
    assert main(["train", *TINY, "--steps", "2", "--out", str(tmp_path / "run")]) == 0
    (tmp_path / "mine.txt").write_text("")
    file_mode = (tmp_path / "mine.txt").stat().st_mode & 0o777
    assert modes(tmp_path / "run") == {"checkpoint.safetensors": file_mode, "metrics.jsonl": file_mode,
                                       "loss.png": file_mode}


# ---------------------------------------------------------------------------- 5. the time, labelled
def test_a_resumed_run_says_its_time_in_all_and_this_run_s(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "4", "--out", str(out), "--stop-after", "2"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    in_all, before = rows[-1]["elapsed"], rows[1]["elapsed"]  # the checkpoint of step 2 counted the first 2
    end = next(line for line in printed.splitlines() if line.startswith("step 4/4"))
    assert end.endswith(f"  ({in_all:.1f} s training in all, {in_all - before:.1f} s this run)"), end


def test_a_run_from_the_start_says_its_time_alone(tmp_path, capsys):
    assert main(["train", *TINY, "--steps", "2", "--out", str(tmp_path / "run")]) == 0
    end = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("step 2/2"))
    assert re.fullmatch(r"step 2/2  final val loss \S+ \(perplexity \S+\)  \(\d+\.\d s training\)", end), end


# ---------------------------------------------------------------------------- 6. figures of the loss
def test_the_guide_s_regression_reports_no_perplexity_or_tokens_but_samples_per_second(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(readme_training_snippet(), "docs/GUIDE.md", "exec"), scope)
    printed = capsys.readouterr().out
    assert "perplexity" not in printed and "token" not in printed and "context" not in printed, printed
    assert "1,280 samples in 40 steps" in printed and "(640 samples trained)" in printed
    rows = scope["result"].history
    assert not [r for r in rows if "tokens_per_s" in r or "val_perplexity" in r]
    assert rows[9]["val_loss"] is not None
    for before, row in zip(rows, rows[1:]):
        if row["step"] != 21:  # the resumed process's first step: elapsed goes on from the checkpoint
            assert row["samples_per_s"] == pytest.approx(32 / (row["elapsed"] - before["elapsed"]), rel=1e-9)


def test_a_language_model_keeps_its_perplexity_and_tokens_per_second(tmp_path):
    assert main(["train", *TINY, "--steps", "2", "--eval-every", "2", "--out", str(tmp_path / "run")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("tokens_per_s" in r and "samples_per_s" not in r for r in rows)
    assert rows[-1]["val_perplexity"] == pytest.approx(torch.tensor(rows[-1]["val_loss"]).double().exp().item())
    assert rows[1]["tokens_per_s"] == pytest.approx(4 * 16 / (rows[1]["elapsed"] - rows[0]["elapsed"]), rel=1e-9)


def test_a_loss_marked_over_tokens_gets_the_language_model_s_figures(tmp_path):
    from l2l_hw.train import TrainConfig, train

    def token_loss(logits, targets):
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    token_loss.over_tokens = True
    torch.manual_seed(0)
    layers = [nn.Embedding(11, 8), nn.Linear(8, 11)]
    ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(0))
    result = train(TrainConfig(steps=2, batch_size=4, micro_batches=1, eval_every=2, out=None, verbose=False),
                   layers=layers, loss_fn=token_loss, data=[(ids, ids)] * 2, val_data=[(ids, ids)])
    assert "tokens_per_s" in result.history[0] and "val_perplexity" in result.history[-1]
    result.relay.close()


# ---------------------------------------------------------------------------- 7. the estimate's folder
def test_estimate_checks_the_disk_where_the_estimated_command_writes(tmp_path, monkeypatch, capsys):
    from transformers import LlamaConfig

    folder = tmp_path / "model"
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=64, architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not read by an estimate")
    asked = []
    monkeypatch.setattr(estimate.machine, "free_disk_bytes", lambda path: asked.append(str(path)) or 1 << 50)
    monkeypatch.chdir(tmp_path)
    defaults = {c: build_parser().parse_args([c, "--model", "m", "--data", "d"] if c == "finetune" else [c]).out
                for c in ("train", "finetune")}
    assert defaults == {"train": "runs/latest", "finetune": "runs/finetune"}  # the two commands differ
    for argv, command in ((["--model", str(folder)], "finetune"), (["--layers", "1", "--width", "32"], "train")):
        asked.clear()
        assert main(["estimate", *argv, "--json"]) == 0, capsys.readouterr().err
        assert asked and set(asked) == {defaults[command]}  # asked once a search step
    asked.clear()
    assert main(["estimate", "--model", str(folder), "--out", "elsewhere", "--json"]) == 0
    assert asked and set(asked) == {"elsewhere"}


# ---------------------------------------------------------------------------- 8. make train's time
def test_make_train_s_time_in_the_readme_is_the_makefile_s():
    makefile = (ROOT / "Makefile").read_text()
    stated = re.search(r"^# `make train` takes ((?:.*\n#)*.*)\ntrain:", makefile, re.M)  # the comment above it
    assert stated, "the Makefile states what `make train` takes"
    readme = (ROOT / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("make train"))
    assert "1-3 min" not in line
    figures = re.findall(r"\d+-\d+ min", stated.group(1))
    assert len(figures) == 2, "the first run (with the install) and a later one"
    for figure in figures:
        assert figure in line, (figure, line)


# ---------------------------------------------------------------------------- 11. transformers' masks
def as_in_5_0(real):
    """create_*_causal_mask with transformers 5.0's signature (input_embeds, a cache_position)."""
    def create(config, input_embeds, attention_mask, cache_position, past_key_values, position_ids=None,
               or_mask_function=None, and_mask_function=None):
        assert torch.equal(cache_position, torch.arange(input_embeds.shape[1])) and past_key_values is None
        return hf.mask_call(real, config, input_embeds, attention_mask, position_ids)
    return create


def as_in_5_25(real):
    """create_*_causal_mask with transformers 5.25's: `cache`, and past_key_values a keyword that
    warns (deprecate_kwarg's expose_in_signature keeps it in the signature)."""
    missing = object()

    def create(config, inputs_embeds, attention_mask, cache, position_ids=None, or_mask_function=None,
               and_mask_function=None, block_sequence_ids=None, layer_idx=None, allow_is_causal_skip=True, *,
               past_key_values=missing):
        if past_key_values is not missing:
            warnings.warn("`past_key_values` is deprecated and will be removed in version 5.40.0 for "
                          "`create_causal_mask`. Use `cache` instead.", FutureWarning)
        assert cache is None
        return hf.mask_call(real, config, inputs_embeds, attention_mask, position_ids)
    return create


def bidirectional_as_in(version: str, real):
    if version == "5.0":
        def create(config, input_embeds, attention_mask, encoder_hidden_states=None, or_mask_function=None,
                   and_mask_function=None):
            return hf.mask_call(real, config, input_embeds, attention_mask)
    else:
        missing = object()

        def create(config, inputs_embeds, attention_mask, encoder_hidden_states=None, cache=None,
                   or_mask_function=None, and_mask_function=None, allow_is_bidirectional_skip=True,
                   position_ids=None, *, past_key_values=missing, **kwargs):
            if past_key_values is not missing:
                warnings.warn("`past_key_values` is deprecated", FutureWarning)
            return hf.mask_call(real, config, inputs_embeds, attention_mask)
    return create


@pytest.mark.parametrize("version", ["5.0", "5.25"])
@pytest.mark.parametrize("kind", ["llama-gqa-tied-bias", "mistral-sliding", "bert"])
def test_the_layers_compute_the_model_s_logits_with_either_end_of_the_range_s_masks(kind, version, monkeypatch):
    """The pinned range's ends name the masks' arguments differently; both give HF's own logits,
    and nothing warns (5.25 warns on `past_key_values`, which 5.40 removes)."""
    from transformers import masking_utils as mu

    model = tiny(kind)
    ids, mask, _ = make_batch(0)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits  # transformers' own masks, as installed
    for name in ("create_causal_mask", "create_sliding_window_causal_mask"):
        real = getattr(mu, name)
        monkeypatch.setattr(mu, name, (as_in_5_0 if version == "5.0" else as_in_5_25)(real))
    monkeypatch.setattr(mu, "create_bidirectional_mask", bidirectional_as_in(version, mu.create_bidirectional_mask))
    layers, _ = hf.split(model)
    x = (ids, mask)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        for layer in layers:
            x = layer(x)
    assert torch.equal(x, expected)


def test_the_installed_transformers_is_called_without_a_future_warning():
    from transformers import masking_utils as mu

    model = tiny("llama-gqa-tied-bias")
    ids, mask, _ = make_batch(0)
    layers, _ = hf.split(model)
    x = (ids, mask)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        for layer in layers:
            x = layer(x)
    params = inspect.signature(mu.create_causal_mask).parameters
    given = hf.mask_arguments(mu.create_causal_mask, model.config, torch.zeros(1, 3, 4), None, torch.arange(3)[None])
    assert set(given) <= set(params) and all(p.name in given for p in params.values()
                                             if p.default is inspect.Parameter.empty
                                             and p.kind is not inspect.Parameter.VAR_KEYWORD)


def test_the_pin_is_the_range_tested():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"transformers>=5.0,<6"' in pyproject
    pinned = re.search(r"^transformers==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert (5, 0) <= tuple(map(int, pinned.split(".")[:2])) < (6, 0)
