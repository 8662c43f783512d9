"""Options written once: every option field of every component's dataclass is exactly one flag
of `l2l train` / `l2l finetune`, with the dataclass's default, allowed values and kind; no flag
exists without a field; the dataclasses check what they declare, from Python as from the CLI."""
import argparse
import dataclasses

import pytest

import l2l_hw
from l2l_hw.cli import build_parser, size
from l2l_hw.options import OptionError, allowed_choices, option_fields, spec
from l2l_hw.relay import RelayOptions
from l2l_hw.train import COMPONENTS, CONTROL_FIELDS, ConfigError, TrainConfig

COMMANDS = ("train", "finetune")
PYTHON_ONLY = {"verbose"}  # the command line always reports; cli=False says so in the declaration


def command_parser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def flags(command: str) -> dict[str, list[argparse.Action]]:
    """The parser's flags by destination (help excluded)."""
    found: dict[str, list[argparse.Action]] = {}
    for action in command_parser(command)._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            found.setdefault(action.dest, []).append(action)
    return found


def declared(command: str) -> dict[str, dataclasses.Field]:
    return {f.name: f for component in COMPONENTS for f in option_fields(component)
            if command in spec(f)["commands"] and spec(f)["cli"]}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_field_is_exactly_one_flag_and_every_flag_is_a_field(command):
    have, want = flags(command), declared(command)
    have.pop("nproc_per_node", None)  # the launch's own flag (cli.add_launch_flag): how many processes, not a run option
    assert set(have) == set(want), (set(have) ^ set(want))
    config_field = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name, field in want.items():
        (action,) = have[name]  # exactly one flag
        meta = spec(field)
        assert action.option_strings == [meta["flag"] or "--" + name.replace("_", "-"), *meta["aliases"]]
        default = meta["command_defaults"].get(command, config_field[name].default)
        if name in CONTROL_FIELDS:  # run control: the real default
            assert action.default == default, name
        else:  # a run flag is None unless given (--resume tells them apart); TrainConfig fills the default
            assert action.default is None, name
            if default is not None and not isinstance(default, bool):
                assert f"(default {default})" in action.help, name
        if meta["kind"] == "choice":
            assert tuple(action.choices) == allowed_choices(meta), name
        elif meta["kind"] == "bool":
            assert action.nargs == 0, name
        else:
            assert action.type is {"int": int, "float": float, "bytes": size}.get(meta["kind"], str), name
        assert action.required == (command in meta["required_in"]), name


def test_the_only_option_fields_without_a_flag_are_the_declared_python_only_ones():
    every = {f.name for component in COMPONENTS for f in option_fields(component)}
    flagged = set(declared("train")) | set(declared("finetune"))
    assert every - flagged == PYTHON_ONLY
    assert {f.name for f in dataclasses.fields(TrainConfig)} == every  # the config is its components, nothing else


def test_help_groups_the_flags_by_component(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    for component in COMPONENTS:
        title = component.__doc__.strip().split(". ")[0].splitlines()[0].rstrip(".")
        assert title + ":" in text, title


@pytest.mark.parametrize("component,values,field", [
    (RelayOptions, dict(micro_batches=0), "micro_batches"),
    (RelayOptions, dict(micro_batches=2.5), "micro_batches"),
    (RelayOptions, dict(layer_drop=1.0), "layer_drop"),
    (RelayOptions, dict(activations="disk"), "activations"),
    (RelayOptions, dict(clip_mode="global"), "clip_mode"),
    (RelayOptions, dict(device="tpu"), "device"),
    (RelayOptions, dict(recompute=1), "recompute"),
])
def test_a_component_refuses_what_its_declaration_does_not_allow_naming_the_field(component, values, field):
    with pytest.raises(OptionError) as e:
        component(**values)
    assert e.value.field == field and str(e.value).startswith(f"{field}=")


def test_relay_takes_its_options_as_a_dataclass_or_as_keywords_and_refuses_unknown_ones():
    from torch import nn

    eps = l2l_hw.make_eps("cpu")
    relay = l2l_hw.Relay([nn.Linear(2, 2)], nn.functional.mse_loss, eps=eps,
                         options=RelayOptions(micro_batches=2), recompute="none")
    assert relay.options == RelayOptions(micro_batches=2, recompute="none")
    with pytest.raises(TypeError, match="unknown option.*micro_batch\\b"):
        l2l_hw.Relay([nn.Linear(2, 2)], nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu"), micro_batch=2)


def test_train_config_reports_a_component_s_refusal_as_a_config_error_and_keeps_the_trainer_s_defaults():
    with pytest.raises(ConfigError, match=r"^micro_batches=0: must be a whole number >= 1$"):
        TrainConfig(micro_batches=0)
    assert TrainConfig().micro_batches == 4 and RelayOptions().micro_batches == 1


def test_the_pipeline_options_are_declared_once_and_the_trainer_passes_dist_timeout_to_the_stages():
    from l2l_hw.relay.options import PipelineConfig, PipelineOptions

    mine = {f.name: f for f in option_fields(PipelineConfig)}
    trainer = {f.name: f for f in option_fields(PipelineOptions)}
    assert set(trainer) == {f"pipeline_{n}" for n in mine if n != "timeout_s"}
    for name, f in trainer.items():  # the same default, help and rule; only the commands differ
        own = mine[name[len("pipeline_"):]]
        assert f.default == own.default and {**spec(f), "commands": None} == {**spec(own), "commands": None}
    cfg = TrainConfig(pipeline_stages=3, pipeline_schedule="flush", pipeline_boundaries="1,2", dist_timeout=7.5)
    assert cfg.pipeline_config() == PipelineConfig(stages=3, schedule="flush", boundaries="1,2", timeout_s=7.5)
    with pytest.raises(ConfigError, match="pipeline_boundaries='2': must name 2 layer"):  # PipelineConfig's rule
        TrainConfig(pipeline_stages=3, pipeline_boundaries="2")
