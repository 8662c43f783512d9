"""A byte-level GPT as a list of layers for the L2L relay.

nanoGPT's model, cut at the seams the relay needs: `build_gpt` returns an
nn.Sequential [Embedding, Block * n_layer, Head] whose layers pass one plain
activation tensor (B, T, C) from each to the next, so the relay can run one
layer at a time over all micro-batches.
"""
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from l2l_hw.approx import FewBitGELU, RandomProjectionLinear
from l2l_hw.options import check_options, fail, option

VOCAB_SIZE = 256  # one token per byte: no tokenizer, nothing to download
GELUS = ("exact", "fewbit")  # the MLP's GELU backward: exact, or l2l_hw.approx.FewBitGELU


@dataclass
class GPTConfig:
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    block_size: int = 128  # longest context, in bytes
    dropout: float = 0.0
    bias: bool = True  # biases in the Linears and LayerNorms, as GPT-2
    tie_weights: bool = False  # Head's weight IS Embedding's token table
    gelu: str = "exact"  # "fewbit": 3-bit GELU' in backward (l2l_hw.approx.FewBitGELU)
    linear_projection: float = 0.0  # > 0: MLP Linears keep a random sketch of this ratio of rows for backward


TRAIN_ONLY = ("train",)  # `l2l finetune` takes its model from the folder


@dataclass(frozen=True)
class ModelOptions:
    """The reference GPT's shape, as `l2l train` sets it (the context length is the data's)."""

    layers: int = option(GPTConfig.n_layer, "transformer blocks", kind="int", low=1, commands=TRAIN_ONLY)
    width: int = option(GPTConfig.n_embd, "embedding width", kind="int", low=1, commands=TRAIN_ONLY)
    heads: int = option(GPTConfig.n_head, "attention heads (must divide --width)", kind="int", low=1,
                        commands=TRAIN_ONLY)
    dropout: float = option(GPTConfig.dropout, "dropout probability", kind="float", low=0.0, high=1.0,
                            high_open=True, commands=TRAIN_ONLY)
    tie_weights: bool = option(GPTConfig.tie_weights, "share the token table with the LM head", kind="bool",
                               commands=TRAIN_ONLY)
    gelu: str = option(GPTConfig.gelu, "GELU backward: exact, or fewbit (3 bits saved per element)",
                       kind="choice", choices=GELUS, commands=TRAIN_ONLY)
    linear_projection: float = option(
        GPTConfig.linear_projection, "> 0: the MLP Linears save a random projection of this ratio of the rows for "
        "the weight gradient instead of their input (0: exact)", kind="float", low=0.0, high=1.0, metavar="RATIO",
        commands=TRAIN_ONLY)

    def __post_init__(self):
        check_options(self)
        if self.width % self.heads:
            divisors = [str(d) for d in range(1, self.width + 1) if self.width % d == 0][:12]
            fail("heads", self.heads, f"must divide width ({self.width}): {', '.join(divisors)}")

    def gpt_config(self, context: int) -> GPTConfig:
        return GPTConfig(n_layer=self.layers, n_embd=self.width, n_head=self.heads, block_size=context,
                         dropout=self.dropout, tie_weights=self.tie_weights, gelu=self.gelu,
                         linear_projection=self.linear_projection)


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(VOCAB_SIZE, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.gelu not in GELUS:
            raise ValueError(f"gelu must be one of {', '.join(GELUS)}, got {cfg.gelu!r}")
        # Approximate backwards: same parameters and init, less saved for backward.
        linear = partial(RandomProjectionLinear, ratio=cfg.linear_projection) if cfg.linear_projection > 0 else nn.Linear
        self.c_fc = linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)  # (B, T, 4C)
        self.gelu = FewBitGELU() if cfg.gelu == "fewbit" else nn.GELU()
        self.c_proj = linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, VOCAB_SIZE, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))  # (B, T, 256)


def _init_weights(module: nn.Module, n_layer: int):
    # GPT-2 init: N(0, 0.02); residual projections scaled by 1/sqrt(2 * n_layer)
    # because each block adds two of them to the residual stream.
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj") else 0.02
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)


def _make_layer(cfg: GPTConfig, i: int) -> nn.Module:
    """Layer i of [Embedding, Block * n_layer, Head], as its constructor initialises it."""
    return Embedding(cfg) if i == 0 else Head(cfg) if i == cfg.n_layer + 1 else Block(cfg)


def _tied(cfg: GPTConfig, layers: list) -> nn.Sequential:
    if cfg.tie_weights:
        layers[-1].lm_head.weight = layers[0].wte.weight  # one nn.Parameter in two layers
    return nn.Sequential(*layers)


def build_gpt(cfg: GPTConfig) -> nn.Sequential:
    """[Embedding, Block * n_layer, Head]; same torch.manual_seed -> same weights."""
    layers = [_make_layer(cfg, i) for i in range(cfg.n_layer + 2)]
    for layer in layers:
        _init_weights(layer, cfg.n_layer)
    return _tied(cfg, layers)


def build_gpt_meta(cfg: GPTConfig) -> tuple[nn.Sequential, "GPTInit"]:
    """build_gpt(cfg) without ever holding it whole: its layers on the meta device, and the
    `init(i, module)` that makes layer i's weights for the relay (Relay's init=) just before
    the EPS registers them, one layer in memory at a time. Call it right after
    torch.manual_seed, where build_gpt would be called: the weights are build_gpt's bit for bit,
    and once every layer is made, GPTInit.finish() leaves torch's RNG where build_gpt leaves it."""
    init = GPTInit(cfg)  # draws what build_gpt's constructors draw, before the meta build (which draws nothing)
    with torch.device("meta"):
        layers = [_make_layer(cfg, i) for i in range(cfg.n_layer + 2)]
    return _tied(cfg, layers), init


class GPTInit:
    """build_gpt's weights one layer at a time, drawn as build_gpt draws them.

    build_gpt draws from torch's RNG in two passes: every layer's constructor (nn.Linear's
    kaiming_uniform_, nn.Embedding's normal_), then every layer's _init_weights. Both depend
    only on the shapes, in layer order, and the second overwrites what the first drew. So the
    constructors run here first, one layer at a time and each layer dropped (torch's RNG has
    no skip-ahead), leaving `cursor` where _init_weights starts; layer i is then made by its
    constructor under a forked RNG (values overwritten, draws discarded) and _init_weights
    from the cursor, the global RNG untouched. Layers come in order, each once; a later one
    (a pipeline stage's first) draws the ones before it and drops them."""

    def __init__(self, cfg: GPTConfig):
        self.cfg = cfg
        for i in range(cfg.n_layer + 2):
            _make_layer(cfg, i)
        self.cursor = torch.get_rng_state()
        self.next = 0  # the layer whose _init_weights draws come next

    def _draw(self, i: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            layer = _make_layer(self.cfg, i)
            torch.set_rng_state(self.cursor)
            _init_weights(layer, self.cfg.n_layer)
            self.cursor = torch.get_rng_state()
        self.next = i + 1
        return layer

    def __call__(self, i: int, module: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """Layer i's parameters and buffers by name, as build_gpt makes them."""
        if i < self.next:
            raise ValueError(f"layer {i} was made already (the next is {self.next}): GPTInit makes each layer once, "
                             "in order")
        while self.next < i:
            self._draw(self.next)
        layer = self._draw(i)
        return {name: t.detach() for name, t in (*layer.named_parameters(), *layer.named_buffers())}

    def finish(self) -> None:
        """Torch's RNG where build_gpt leaves it (the layers not made yet drawn and dropped)."""
        while self.next < self.cfg.n_layer + 2:
            self._draw(self.next)
        torch.set_rng_state(self.cursor)


def count_parameters(cfg: GPTConfig) -> int:
    """The parameters of build_gpt(cfg), counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_gpt(cfg).parameters())


def lm_loss(logits, targets):
    """Mean cross entropy over every token: logits (B, T, 256), targets (B, T) int64."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


lm_loss.over_tokens = True  # a cross entropy over tokens: l2l_hw.train reports its perplexity and tokens/s


@torch.no_grad()
def generate(model, prompt_bytes: bytes, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, block_size: int = 128, generator=None) -> bytes:
    """Sample bytes after `prompt_bytes` from a materialized nn.Sequential."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    prompt = prompt_bytes or b"\n"  # an empty context has nothing to attend to
    idx = torch.tensor(list(prompt), dtype=torch.long, device=device)[None]  # (1, T)
    for _ in range(max_new_tokens):
        logits = model(idx[:, -block_size:])[:, -1, :]  # (1, 256)
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)  # (1, 1)
        idx = torch.cat((idx, nxt), dim=1)
    model.train(was_training)
    return bytes(idx[0, len(prompt):].tolist())
