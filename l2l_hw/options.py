"""Options written once. Each component declares its options as one frozen dataclass whose
fields are made by `option()`: the default, the help text, the kind of value and what is
allowed. From that one declaration come the checks (`check_options`, called by each
dataclass's __post_init__), the trainer's config (TrainConfig composes the components'
dataclasses) and the command line's flags (l2l_hw/cli.py generates them). A new option is
one field in one dataclass.

    @dataclass(frozen=True)
    class RelayOptions:
        micro_batches: int = option(1, "micro-batches per minibatch", kind="int", low=1)
        def __post_init__(self):
            check_options(self)
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from typing import Any, Callable

KINDS = ("int", "float", "bool", "choice", "path", "text", "bytes")
# Units of a size on the command line (`--activation-budget 1.5GiB`): SI and binary, as DeepSpeed's
# configs and `--state-dir` users write them; a bare number is bytes.
SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
              "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
COMMANDS = ("train", "finetune")  # the `l2l` commands whose flags come from the options


class OptionError(ValueError):
    """An option value that is not allowed. `field`, `value` and `rule` ("must be ...") let a
    caller say it in its own words (the command line names the flag)."""

    def __init__(self, message: str, field: str | None = None, value=None, rule: str | None = None):
        self.field, self.value, self.rule = field, value, rule or message
        super().__init__(message)


def option(default: Any, help: str | dict[str, str], *, kind: str, choices: tuple | Callable[[], tuple] | None = None,
           low: float | None = None, high: float | None = None, low_open: bool = False, high_open: bool = False,
           check: Callable[[Any], str | None] | None = None, function_ok: bool = False, optional: bool = False,
           flag: str | None = None, aliases: tuple[str, ...] = (),
           metavar: str | None = None, commands: tuple[str, ...] = COMMANDS, required_in: tuple[str, ...] = (),
           command_defaults: dict[str, Any] | None = None, cli: bool = True) -> Any:
    """A dataclass field that is an option.

    help: one text, or a text per command ({"train": ..., "finetune": ...}: each command's --help
    says only what holds for it; help_for); a "bool"'s help is a sentence saying what its switch
    does (for a True default, flagged --no-...: what False does), never "True"/"False" first.
    kind: "int" (a whole number), "float" (a finite
    number), "bool", "choice" (one of `choices`, a tuple or a function giving one), "path" (a
    non-empty path), "text", "bytes" (a whole number of bytes; the command line also takes units:
    parse_size).
    low/high (with low_open/high_open): the allowed range of a number. A default of None
    (or optional=True) makes None allowed ("not set"). `check(value)` returns what is wrong with a value the
    kind allows, or None; function_ok: a function (of the step, say) is allowed too. The command line: `flag` (default --name-with-dashes) and its
    `aliases`, in the `commands` listed (`required_in` some of them, with
    `command_defaults` where a command's default differs); cli=False: an option of the
    Python API only."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    meta = dict(help=help, kind=kind, choices=choices, low=low, high=high, low_open=low_open, high_open=high_open,
                check=check, function_ok=function_ok, optional=optional or default is None, flag=flag, aliases=aliases, metavar=metavar, commands=commands,
                required_in=required_in, command_defaults=command_defaults or {}, cli=cli)
    return dataclasses.field(default=default, metadata={"option": meta})


def option_fields(cls_or_obj) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls_or_obj) if "option" in f.metadata]


def spec(f: dataclasses.Field) -> dict:
    return f.metadata["option"]


def help_for(meta: dict, command: str | None = None) -> str:
    """An option's help text for `command` (its own text where it has one per command)."""
    text = meta["help"]
    if isinstance(text, str):
        return text
    return text[command] if command in text else " / ".join(f"{c}: {t}" for c, t in text.items())


def parse_size(text: str) -> int:
    """A size as a user writes it: `1073741824`, `1e9`, `512MB`, `1.5GiB`, `2G` -> bytes (ValueError
    naming the units otherwise)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size: give bytes, or a number with a unit "
                         "(KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    size = float(m.group(1)) * SIZE_UNITS[m.group(2).lower()]
    if not math.isfinite(size) or size != int(size):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(size)


def allowed_choices(meta: dict) -> tuple:
    choices = meta["choices"]
    return tuple(choices() if callable(choices) else choices)


def with_default(cls, name: str, default: Any) -> Any:
    """The field `name` of option dataclass `cls` with another default: a composing config (the
    trainer) picks its own default for a component's option without declaring it again."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return dataclasses.field(default=default, metadata=f.metadata)


def rule(meta: dict, optional: bool) -> str:
    """What a field allows, in words: "must be a whole number >= 1", "must be one of a, b", ..."""
    kind = meta["kind"]
    if kind == "bool":
        text = "must be True or False"
    elif kind == "choice":
        text = f"must be one of {', '.join(map(str, allowed_choices(meta)))}"
    elif kind == "bytes" and meta["low"] is not None:
        text = f"must be a size of at least {meta['low']:g} bytes (a number of bytes, or with a unit: 512MB, 1.5GiB)"
    elif kind in ("path", "text"):
        text = "must be a path (a non-empty str)" if kind == "path" else "must be a str"
    else:
        low, high = meta["low"], meta["high"]
        noun = "a whole number" if kind == "int" else "a finite number"
        if low is not None and high is not None:
            text = f"must be {noun} in {'(' if meta['low_open'] else '['}{low:g}, {high:g}" \
                   f"{')' if meta['high_open'] else ']'}"
        elif low is not None:
            text = f"must be {noun} {'>' if meta['low_open'] else '>='} {low:g}"
        else:
            text = f"must be {noun}"
    return text + (" or None" if optional else "")


def problem(meta: dict, value: Any, optional: bool) -> str | None:
    """What is wrong with `value` for an option (its rule), or None."""
    if value is None:
        return None if optional else rule(meta, optional)
    kind, bad = meta["kind"], False
    if callable(value) and meta["function_ok"]:
        return None
    if kind == "bool":
        bad = not isinstance(value, bool)
    elif kind == "choice":
        bad = value not in allowed_choices(meta)
    elif kind == "path":
        bad = not isinstance(value, (str, os.PathLike)) or not str(value).strip()
    elif kind == "text":
        bad = not isinstance(value, str)
    else:
        integral = isinstance(value, numbers.Integral) if kind in ("int", "bytes") else isinstance(value, numbers.Real)
        bad = isinstance(value, bool) or not integral or not math.isfinite(value) or _out_of_range(meta, value)
    if bad:
        return rule(meta, optional)
    return meta["check"](value) if meta["check"] is not None else None


def _out_of_range(meta: dict, value) -> bool:
    low, high = meta["low"], meta["high"]
    return ((low is not None and (value <= low if meta["low_open"] else value < low))
            or (high is not None and (value >= high if meta["high_open"] else value > high)))


def check_options(obj) -> None:
    """Every option field of dataclass `obj` against its declaration; OptionError naming the first
    bad one ("name=value: rule")."""
    for f in option_fields(obj):
        value = getattr(obj, f.name)
        wrong = problem(spec(f), value, optional=spec(f)["optional"])
        if wrong is not None:
            raise OptionError(f"{f.name}={value!r}: {wrong}", f.name, value, wrong)


def fail(name: str, value: Any, rule_text: str):
    """Raise the OptionError of a rule between options (or any rule check_options cannot see)."""
    raise OptionError(f"{name}={value!r}: {rule_text}", name, value, rule_text)


def prefixed(cls, prefix: str, doc: str, *, omit: tuple[str, ...] = (), **meta: Any) -> type:
    """The options of dataclass `cls` under names starting with `prefix`, for a composing config
    where the plain names would clash (the trainer's `pipeline_stages` is PipelineConfig's
    `stages`): the same declarations (default, help, rule), each field's option `meta` replaced
    where given (commands=...), the fields in `omit` left to the composer. A value is checked by
    building a `cls` (the rules between its fields included), an error naming the prefixed field;
    `unprefixed(**omitted)` builds that `cls`."""
    kept = [f for f in dataclasses.fields(cls) if f.name not in omit]

    def unprefixed(self, **omitted: Any):
        return cls(**{f.name: getattr(self, prefix + f.name) for f in kept}, **omitted)

    def __post_init__(self):
        try:
            unprefixed(self)
        except OptionError as e:
            name = prefix + e.field if e.field is not None else None
            raise OptionError(f"{name}={e.value!r}: {e.rule}", name, e.value, e.rule) from None

    fields = [(prefix + f.name, f.type, dataclasses.field(default=f.default, metadata={"option": {**spec(f), **meta}}))
              for f in kept]
    return dataclasses.make_dataclass(f"{cls.__name__}Options", fields, frozen=True, namespace={
        "__doc__": doc, "__module__": cls.__module__, "__post_init__": __post_init__, "unprefixed": unprefixed})


def pick(cls, obj) -> Any:
    """The options of dataclass `cls` taken from `obj` (a config composed of several), as a `cls`."""
    return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})
