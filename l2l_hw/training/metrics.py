"""What a run writes and shows as it trains: the rows of metrics.jsonl, TensorBoard's events,
the progress bar, the loss curves (loss.png), and the figures a row holds (perplexity)."""
from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Iterator

from l2l_hw.checkpoint import temporary_beside
from l2l_hw.training.files import METRICS, TENSORBOARD, OutputError, summary_writer


class MetricsLog:
    """What a run writes and shows as it trains: the rows of metrics.jsonl, TensorBoard's events
    and the progress bar. `out` None: no files (no out, or a rank other than 0)."""

    def __init__(self, out: Path | None, tensorboard: bool, step: int):
        """The folder made and, with `tensorboard`, its writer opened (events past `step` purged)."""
        self.out = out
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
        self.board = _tensorboard(out, step) if tensorboard and out is not None else None
        self.metrics = self.bar = None

    @contextlib.contextmanager
    def opened(self, rows: list[dict], stop: int, step: int, show: bool) -> Iterator[MetricsLog]:
        """While the run trains: metrics.jsonl rewritten with `rows` (rows past the checkpoint are
        dropped) and the progress bar from `step` to `stop`, which closes (ends its line) before
        an error is reported. TensorBoard's writer is closed when the run ends well."""
        from tqdm import tqdm

        self.bar = tqdm(total=stop, initial=step, unit="step", desc="train", dynamic_ncols=True,
                        disable=True if not show else None)  # None: off unless a terminal
        with self.bar, open(self.out / METRICS if self.out is not None else os.devnull, "w") as self.metrics:
            self.write(rows)
            yield self
        if self.board is not None:
            self.board.close()

    def add(self, row: dict) -> None:
        if self.out is not None:
            self.write([row])

    def rewrite(self, rows: list[dict]) -> None:
        """Every row again (the last one has changed: its val_loss)."""
        if self.out is not None:
            self.write(rows, rewrite=True)

    def write(self, rows: list[dict], rewrite: bool = False) -> None:
        try:
            if rewrite:
                self.metrics.seek(0)
                self.metrics.truncate()
            self.metrics.writelines(json.dumps(r) + "\n" for r in rows)
            self.metrics.flush()
        except OSError as e:
            raise OutputError(f"{self.out / METRICS}: cannot write the metrics ({e.strerror or e})") from e

    def show(self, row: dict) -> None:
        """A step on TensorBoard and the progress bar."""
        if self.board is not None:
            for name, value in row.items():
                if name != "step" and value is not None:
                    self.board.add_scalar(name, value, row["step"])
        self.bar.update(1)
        rate = {"tok_s": row["tokens_per_s"]} if "tokens_per_s" in row else {"samples_s": row["samples_per_s"]}
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", **{k: f"{v:,.0f}" for k, v in rate.items()})


def _tensorboard(out: Path, step: int):
    """A SummaryWriter in out/tensorboard; events past `step` (a run resumed from there) are purged."""
    try:
        return summary_writer()(str(out / TENSORBOARD), purge_step=step + 1 if step else None)
    except OSError as e:
        raise OutputError(f"{out / TENSORBOARD}: cannot write the TensorBoard events ({e.strerror or e})") from e


def over_tokens(loss_fn) -> bool:
    """Whether `loss_fn` is a mean cross entropy over tokens (a language model's), which a loss
    says with an attribute `over_tokens = True` (lm_loss, hf.TokenLoss): then perplexity and
    tokens/s are figures of the run; of any other loss (an MSE, say) samples/s are."""
    return getattr(loss_fn, "over_tokens", False) is True


def training_time(elapsed: float, resumed_elapsed: float | None) -> str:
    """The end line's time: the seconds in train steps, of the run in all and of this process
    where it resumed (the checkpoint's figure counts every earlier segment)."""
    if resumed_elapsed is None:
        return f"{elapsed:.1f} s training"
    return f"{elapsed:.1f} s training in all, {elapsed - resumed_elapsed:.1f} s this run"


def perplexity(loss: float) -> float:
    """exp(mean token loss), inf where that overflows a float."""
    return math.exp(loss) if loss < 700 else math.inf


def plot(rows: list[dict], path: Path, title: str = "l2l train") -> None:
    """The loss curves as a PNG; nothing without matplotlib (the `plot` extra; the metrics hold it all)."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    val = [r for r in rows if r.get("val_loss") is not None]
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        written = temporary_beside(path)  # renamed into place once whole: the last plot survives a full disk
        try:
            fig.savefig(written, dpi=100, format="png")
            os.replace(written, path)
        finally:
            written.unlink(missing_ok=True)
    except OSError as e:
        raise OutputError(f"{path}: cannot write the plot ({e.strerror or e})") from e
    finally:
        plt.close(fig)
