"""A run's files in its output folder `out`: their names, what refuses a run before anything in
`out` changes (check_out), and making it ready once every input was checked (prepare_out)."""
from __future__ import annotations

import contextlib
from pathlib import Path

from l2l_hw import hf
from l2l_hw.checkpoint import remove_stale_temporaries
from l2l_hw.training.config import ConfigError, TrainConfig

CHECKPOINT, METRICS, PLOT, TENSORBOARD = "checkpoint.safetensors", "metrics.jsonl", "loss.png", "tensorboard"
MODEL = "model"  # a fine-tune's (l2l_hw/finetune.py): the Hugging Face folder it saves
RUN_FILES = (CHECKPOINT, METRICS, PLOT, TENSORBOARD)  # what a run writes into out: an earlier run is these
EVENT_FILES = "events.out.tfevents.*"  # the names SummaryWriter gives its files in out/tensorboard


class OutputError(OSError):
    """A file of the run could not be written (read-only, missing, full); the message names it."""


def earlier_run(out: Path) -> list[str]:
    """The files of a run already in `out`, by the names in RUN_FILES (an empty metrics file is
    none: a run that failed to start; tensorboard counts where it holds event files)."""
    found = [name for name in RUN_FILES if (out / name).is_file()]  # a folder of that name is not the run's
    if METRICS in found and (out / METRICS).stat().st_size == 0:
        found.remove(METRICS)
    return found + ([TENSORBOARD] if _event_files(out) else [])


def _event_files(out: Path) -> list[Path]:
    folder = out / TENSORBOARD
    return sorted(p for p in folder.glob(EVENT_FILES) if p.is_file()) if folder.is_dir() else []


def check_out(cfg: TrainConfig) -> None:
    """Everything about the output folder that can refuse the run, before anything in it changes
    (what is made to try it is removed again): it is a folder, or can be made, that takes files;
    a run already there is continued (resume), replaced (overwrite: prepare_out, once every input
    was checked), or the run is refused; the model folder a fine-tune saves holds nothing that
    saving would remove."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError("is a file, not a folder", "out", str(cfg.out))
    found = earlier_run(out) if out.is_dir() else []
    if found and not cfg.resume and not cfg.overwrite:
        raise ConfigError(f"already holds a run ({', '.join(found)}); continue it with --resume, replace it with "
                          "--overwrite, or give another --out", "out", str(cfg.out))
    if cfg.model is not None:
        foreign = hf.foreign_files(out / MODEL, cfg.model)
        if foreign:
            raise ConfigError(f"{out / MODEL} holds what saving the fine-tuned model there would remove "
                              f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}): move it, or give "
                              "another --out", "out", str(cfg.out))
    if cfg.tensorboard:
        summary_writer()
    made = [p for p in (*reversed(out.absolute().parents), out.absolute(), out.absolute() / METRICS)
            if not p.exists()]
    try:  # the metrics file opened as the run opens it; what this made is removed again
        out.mkdir(parents=True, exist_ok=True)
        with open(out / METRICS, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"cannot write there ({e.strerror or e})", "out", str(cfg.out)) from e
    finally:
        for path in reversed(made):
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() else path.unlink()


def prepare_out(cfg: TrainConfig) -> None:
    """Once every input of the run was checked: the output folder is made; with overwrite, the
    earlier run's files go (the names in RUN_FILES; of tensorboard/, its event files: nothing
    this program did not write); and the temporaries an interrupted checkpoint write of this
    program left."""
    out = Path(cfg.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if cfg.overwrite:
            for name in earlier_run(out):
                if name == TENSORBOARD:
                    for events in _event_files(out):
                        events.unlink()
                    with contextlib.suppress(OSError):  # kept where it holds anything else
                        (out / TENSORBOARD).rmdir()
                else:
                    (out / name).unlink()
        for name in (CHECKPOINT, PLOT, MODEL):  # what a killed run was writing when it died
            remove_stale_temporaries(out / name)
        with open(out / METRICS, "a"):
            pass
    except OSError as e:
        raise OutputError(f"{out}: cannot prepare the output folder ({e.strerror or e})") from e


def summary_writer():
    """TensorBoard's SummaryWriter (the tensorboard package is optional)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError("--tensorboard needs the tensorboard package (pip install tensorboard)") from e
    return SummaryWriter
