"""A run's validation: the relay's loss on this rank's part of each validation minibatch, averaged,
and (where the loss is over tokens) its perplexity, into the step's metrics row."""
from __future__ import annotations

from l2l_hw.distributed import rank_shard
from l2l_hw.training.metrics import perplexity
from l2l_hw.training.state import TrainState


def validate(state: TrainState, row: dict) -> float | None:
    """Validate now; the loss and its perplexity go into the step's metrics row."""
    row["val_loss"] = evaluate(state)
    if row["val_loss"] is not None and state.tokens:
        row["val_perplexity"] = perplexity(row["val_loss"])
    return row["val_loss"]


def evaluate(state: TrainState) -> float | None:
    """The mean validation loss over val_data (None without it)."""
    if state.val_data is None:
        return None
    losses = [state.relay.evaluate(*rank_shard(batch, *state.shard))
              for batch in state.val_data]
    return sum(losses) / len(losses)
