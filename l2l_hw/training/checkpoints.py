"""A run's checkpoint: what one holds (the relay's state, every RNG state, the data position, the
run's config and step), writing it (save), and resuming from it: the run's config checked against
the checkpoint's (resume_config, load_for_resume), the state restored (restore), the metrics rows
read back up to its step (read_metrics)."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from l2l_hw.checkpoint import Checkpoint, CheckpointError, open_checkpoint, run_meta, save_checkpoint
from l2l_hw.training.config import CONTROL_FIELDS, FINGERPRINT, ConfigError, TrainConfig
from l2l_hw.training.files import CHECKPOINT, METRICS, OutputError
from l2l_hw.training.state import TrainState

# What --resume may change: the step target (a longer one also stretches a cosine schedule)
# and where the run happens (the device share of the update among it: its state is checkpointed
# alike). Every other field of the run is the checkpoint's.
RESUME_MAY_CHANGE = ("steps", "device", "eps_backend", "shard_state", "model", "device_update_layers")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def resume_config(out: str | os.PathLike, **given) -> TrainConfig:
    """The config of the run checkpointed in `out`, with `given` fields: those of
    RESUME_MAY_CHANGE and the control fields may differ, any other must agree."""
    meta = open_checkpoint(Path(out) / CHECKPOINT).meta
    saved = _saved_config(meta, Path(out) / CHECKPOINT)
    for name in ("data", "model", "val_data"):  # as the checkpoint holds them
        if given.get(name):
            given[name] = str(Path(given[name]).expanduser().resolve())
    clash = {k: v for k, v in given.items() if k in saved and k not in RESUME_MAY_CHANGE and v != saved[k]}
    if clash:
        raise ConfigError("--resume: the checkpoint's run differs from what is given: " + ", ".join(
            _clash(k, saved, given) for k in clash))
    saved = {k: v for k, v in saved.items() if k != FINGERPRINT}  # compared when the run resumes (load_for_resume)
    if given.get("state_dir") is None and isinstance(meta.get("state_dir"), str):  # the state stays where it was
        given["state_dir"] = meta["state_dir"]
    return TrainConfig(**{**saved, **given, "out": str(out), "resume": True})


def _clash(name: str, saved: dict, given: dict) -> str:
    if name == FINGERPRINT:
        return (f"the checkpoint was trained from the model in {saved.get('model')} (config fingerprint "
                f"{saved[name]}), and the model in {given.get('model')} has another config ({given.get(name)})")
    return f"{name} is {saved[name]!r} in the checkpoint, {given.get(name)!r} given"


def _saved_config(meta: dict, path: Path) -> dict:
    """The checkpoint's run config, checked as a TrainConfig (a checkpoint of another version may differ)."""
    known = {f.name for f in dataclasses.fields(TrainConfig)} - set(CONTROL_FIELDS) | {FINGERPRINT}
    saved = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(saved, dict) or not set(saved) <= known or not _is_int(meta.get("step")) \
            or meta["step"] < 0 or not _is_real(meta.get("elapsed")) or not meta["elapsed"] >= 0:
        raise ConfigError(f"{path}: its metadata is not what this l2l-hw writes (config, a step >= 0, elapsed)")
    try:  # wherever it resumes
        TrainConfig(**{**{k: v for k, v in saved.items() if k != FINGERPRINT}, "device": "cpu", "eps_backend": "cpu",
                       "out": None})
    except ConfigError as e:
        raise ConfigError(f"{path}: its config is not usable: {e}") from e
    return saved


def load_for_resume(cfg: TrainConfig):
    """The checkpoint in cfg.out (checked whole, read lazily) and its metadata, where its run is cfg's."""
    if cfg.out is None:
        raise ConfigError("resume needs out= (the folder holding the checkpoint)")
    checkpoint = open_checkpoint(Path(cfg.out) / CHECKPOINT)  # checked whole, read lazily: no copy of the state
    tensors, meta = checkpoint, checkpoint.meta
    saved, run = _saved_config(meta, Path(cfg.out) / CHECKPOINT), cfg.run_config()
    if cfg.warmup is None:  # as train() takes it
        run["warmup"] = saved["warmup"]
    clash = [k for k in saved if k not in RESUME_MAY_CHANGE and saved[k] != run.get(k)]
    if clash:
        raise ConfigError(f"resume: {cfg.out}/{CHECKPOINT} is a different run: " + ", ".join(
            _clash(k, saved, run) for k in clash))
    if cfg.steps < meta["step"]:
        raise ConfigError(f"is below the checkpoint's step {meta['step']}; give at least that many", "steps",
                          cfg.steps)
    return tensors, meta


def restore(state: TrainState, checkpoint: Checkpoint, meta: dict) -> None:
    """The run as the checkpoint left it. Every entry is checked (names, dtypes, shapes, the step)
    before the first is loaded; a fault is one CheckpointError naming the file and the entry."""
    try:
        data_state = _check_entries(state, checkpoint)
        state.relay.load_state_dict(checkpoint.view("relay."))  # streamed, one tensor at a time
        if state.relay.step != meta["step"]:
            raise ValueError(f"its relay state is at step {state.relay.step}, its metadata at step {meta['step']}")
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{checkpoint.path}: {e}") from None
    restore_rng({k: checkpoint[k].read() for k in checkpoint if k.startswith("rng.")})
    if hasattr(state.data, "load_state_dict"):
        state.data.load_state_dict(data_state)
    else:
        state.skip = state.relay.step
    state.elapsed = state.resumed_elapsed = meta["elapsed"]
    state.saved_step = meta["step"]
    if state.out is not None:
        state.history = read_metrics(state.out / METRICS, state.relay.step)


def _check_entries(state: TrainState, checkpoint: Checkpoint) -> dict:
    """The checkpoint's entries outside the relay: the RNG states this process restores and
    the data position the data takes (read and returned); nothing more, nothing less."""
    rng = torch.get_rng_state()
    expected = {"rng.torch": (rng.shape, rng.dtype)}
    if hasattr(state.data, "state_dict"):
        expected.update({f"data.{k}": (v.shape, v.dtype) for k, v in state.data.state_dict().items()})
    for name, (shape, dtype) in expected.items():
        if name not in checkpoint:
            raise ValueError(f"it has no entry {name!r} (the {'RNG' if name.startswith('rng.') else 'data'} "
                             "state a resume restores)")
        if checkpoint[name].shape != shape or checkpoint[name].dtype != dtype:
            raise ValueError(f"its entry {name!r} is {checkpoint[name].dtype} {tuple(checkpoint[name].shape)}; "
                             f"a resume needs {dtype} {tuple(shape)}")
    extra = sorted(k for k in checkpoint if not k.startswith(("relay.", "rng.cuda.")) and k not in expected)
    if extra:
        raise ValueError(f"it has entries this run does not restore: {', '.join(extra[:3])}")
    return {name[len("data."):]: checkpoint[name].read() for name in expected if name.startswith("data.")}


def save(state: TrainState) -> None:
    """A checkpoint of the step reached, into out (rank 0 writes it; every rank reads the relay's
    state: a collective when sharded); nothing where the run writes no checkpoint."""
    if state.out is None or not state.cfg.save:  # the same on every rank
        return
    # Streamed to the file, read one tensor at a time; every rank: a collective if sharded.
    tensors = {f"relay.{k}": v for k, v in state.relay.state_entries().items()}
    if not state.files:  # saved by rank 0: every rank knows the step, so none gathers it twice
        state.saved_step = state.relay.step
        return
    tensors.update(rng_tensors())
    if hasattr(state.data, "state_dict"):
        tensors.update({f"data.{k}": v for k, v in state.data.state_dict().items()})
    try:
        save_checkpoint(state.out / CHECKPOINT, tensors, run_meta(state.cfg, state.relay.step, state.elapsed))
    except OSError as e:
        raise OutputError(f"{state.out / CHECKPOINT}: cannot write the checkpoint ({e}); the previous "
                          "checkpoint is unchanged") from e
    state.saved_step = state.relay.step


def last_checkpoint(state: TrainState) -> str:
    """Where the run's newest checkpoint is, for a message that stops the run."""
    if state.out is None or not state.cfg.save:
        return "this run writes no checkpoint"
    if state.saved_step is None:
        return "no checkpoint was written yet"
    return f"{state.out / CHECKPOINT} keeps step {state.saved_step}"


def rng_tensors() -> dict[str, torch.Tensor]:
    """Every global RNG state that a step draws from (dropout, layer drop), for a checkpoint."""
    rng = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"rng.cuda.{i}"] = state
    return rng


def restore_rng(tensors: dict) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    cuda = sorted((k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda[: torch.cuda.device_count()]])


def read_metrics(path: Path, up_to_step: int | None = None) -> list[dict]:
    """The rows of a metrics.jsonl up to a step. A torn last line (a kill during its write) is
    dropped; any other line that is not a metrics row is an error naming the file and line."""
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not _is_int(row.get("step")):
                raise ValueError("no step")
        except ValueError:
            if number == len(lines):
                break
            raise ConfigError(f"{path}: line {number} is not a metrics row; move the file away to resume") from None
        rows.append(row)
    return [r for r in rows if up_to_step is None or r["step"] <= up_to_step]
