"""The reference run's data: the corpus of cfg.data, its training windows drawn as the run goes
(resumed exactly) and its validation windows, the same at every eval point."""
from __future__ import annotations

import torch

from l2l_hw.models import Corpus
from l2l_hw.training.config import ConfigError, TrainConfig

EVAL_BATCHES = 4  # validation minibatches per eval point of the reference corpus; the same windows every time


class CorpusBatches:
    """The reference corpus as an endless iterable of random (x, y) training windows,
    drawn from a generator seeded with `seed`; its state resumes exactly."""

    def __init__(self, corpus: Corpus, batch_size: int, context: int, seed: int):
        self.corpus, self.batch_size, self.context = corpus, batch_size, context
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        while True:
            yield self.corpus.batch("train", self.batch_size, self.context, self.generator)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])


def corpus_val_batches(corpus: Corpus, cfg: TrainConfig) -> list:
    """The validation windows of the reference corpus: EVAL_BATCHES minibatches from their
    own generator (seed + 1), the same at every eval point; training RNG never moves."""
    rng = torch.Generator().manual_seed(cfg.seed + 1)
    return [corpus.batch("val", cfg.batch_size, cfg.context, rng) for _ in range(EVAL_BATCHES)]


def load_corpus(cfg: TrainConfig) -> Corpus:
    """The reference corpus of cfg.data, with room for a context window in each split."""
    try:
        corpus = Corpus.load(cfg.data)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e), "data", cfg.data) from e
    for split in ("train", "val"):
        size = len(getattr(corpus, split))
        if size < cfg.context + 1:
            raise ConfigError(f"its {split} split has {size} bytes, fewer than context + 1 = {cfg.context + 1} "
                              "(a file's last tenth is validation)", "data", cfg.data)
    return corpus
