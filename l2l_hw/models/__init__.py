"""Reference models for the relay: a byte-level GPT as a list of layers, and its corpus."""
from l2l_hw.models.corpus import Corpus
from l2l_hw.models.gpt import GPTConfig, Block, Embedding, Head, build_gpt, count_parameters, generate, lm_loss

__all__ = ["Corpus", "GPTConfig", "Block", "Embedding", "Head", "build_gpt", "count_parameters", "generate", "lm_loss"]
