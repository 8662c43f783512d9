"""Fine-tuning a local Hugging Face model through the relay: `l2l finetune` from Python.

    result = finetune(TrainConfig(model="DIR", data="PATH", out="runs/finetune", lr=5e-5, ...))

finetune() is train() (l2l_hw/train.py) with a Hugging Face model around it: its data
tokenized once and cached in out/tokens (l2l_hw/finetune_data.py), its weights streamed into
the EPS (hf.from_pretrained), validation on cfg.val_data or held-out minibatches, greedy samples
at each evaluation, and the model saved for transformers in out/model (hf.save_replacing).
TrainConfig's defaults are `l2l train`'s: `l2l finetune`'s own (lr, schedule, warm-up, weight
decay) are the options' command_defaults for "finetune", which the command line applies.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from pathlib import Path
from typing import Callable, Iterable

from l2l_hw import finetune_data, hf
from l2l_hw.distributed import Ranks, join_torchrun, rank_body
from l2l_hw.estimate import check_fits
from l2l_hw.inputs import path_kind
from l2l_hw.train import (MODEL, ConfigError, OutputError, TrainConfig, TrainResult, agree_to_start, as_config_error,
                          build_eps, check_out, check_state_dir, leave_together, planned_options, sharded, train)

TOKEN_CACHE = "tokens"  # in out: the tokenized data (finetune_data's cache), one folder per role (train, val)


def finetune(cfg: TrainConfig, callbacks: Iterable[Callable[[dict], None]] = ()) -> TrainResult:
    """`l2l finetune`: the Hugging Face model in cfg.model trained on cfg.data through the relay.

    The data (finetune_data.finetune_batches) is tokenized once into out/tokens (read back by a
    later run of the same data, tokenizer and options), packed and shuffled; validation is
    cfg.val_data or a tenth of the minibatches held out. cfg.epochs, where given, sets the steps.
    The weights stream into the EPS (hf.from_pretrained), train() trains them; out/model is the
    model as transformers saves it (the folder's other files copied unchanged), written at the
    end and every cfg.save_every steps, each time whole (hf.save_replacing). cfg.prompt: a
    greedy sample printed at each evaluation (the last step is one). Under torchrun the ranks
    join their group first: the relay built here averages its gradients across them."""
    ranks = join_torchrun(cfg.device, cfg.dist_timeout)
    with rank_body(ranks) as owned:
        return _finetune(cfg, ranks, callbacks, owned)


def _finetune(cfg: TrainConfig, ranks: Ranks, callbacks: Iterable[Callable[[dict], None]],
              owned: list) -> TrainResult:
    lead = ranks.lead
    say = print if cfg.verbose and lead else (lambda *_: None)
    out = Path(cfg.out) if cfg.out is not None else None
    failure = None
    try:  # before anything is read or written (the token cache goes into out), on every rank
        if cfg.prompt is not None and hf.masked_lm(hf.load_config(cfg.model)):
            raise ConfigError(f"a sample continues a causal LM's text, and {cfg.model} holds a masked LM", "prompt",
                              cfg.prompt)
        if cfg.weights == "pretrained":  # a folder without weights, found before the data is tokenized
            hf.weights_file(hf.model_folder(cfg.model))
        for name in ("data", "val_data"):
            if getattr(cfg, name) is not None and path_kind(getattr(cfg, name)) == "missing":
                raise ConfigError("does not exist", name, getattr(cfg, name))
        check_fits(cfg)  # before anything is read or loaded: a run this machine cannot hold is refused
        check_state_dir(cfg)
        if out is not None and lead:  # a run there is refused, or continued, or replaced once all is checked
            check_out(cfg)
    except Exception as e:
        failure = as_config_error(e)
    agree_to_start(ranks, failure)

    def minibatches(data, role: str):
        return finetune_data.finetune_batches(cfg.model, data, cfg.batch_size, cfg.context, seed=cfg.seed,
                                              doc_separator=cfg.doc_separator, text_field=cfg.text_field,
                                              chat=cfg.chat,
                                              cache=out / TOKEN_CACHE / role if out is not None else None)

    fit = minibatches(cfg.data, "train")
    if cfg.val_data is not None:
        val = minibatches(cfg.val_data, "val")
        say(f"validation: {len(val)} minibatches of {cfg.val_data}")
    else:  # a tenth of the minibatches held out, at least one where there are two
        held = len(fit) // 10 or (1 if len(fit) > 1 else 0)
        say(f"validation: {held} of the {len(fit)} minibatches of {cfg.data} held out"
            + ("" if held else " (none: give --val-data to validate)"))
        fit, val = fit[held:], fit[:held] or None
    if cfg.epochs is not None and not cfg.resume:  # the run's length in steps: its schedule needs it
        cfg = dataclasses.replace(cfg, steps=cfg.epochs * len(fit))
        say(f"{cfg.epochs} epoch(s) of {len(fit)} minibatches: {cfg.steps} steps")
    eps = build_eps(cfg, sharded(cfg, ranks))
    owned.append(eps)  # closed by rank_body on failure (and where the group ends here); else by the caller
    options, share = planned_options(cfg, eps, ranks.device)
    relay = hf.from_pretrained(cfg.model, eps=eps, weights=cfg.weights, seed=cfg.seed, options=options, plan=share)
    owned.append(relay)  # its caller closes TrainResult.relay
    tokenizer = hf.load_tokenizer(cfg.model) if cfg.prompt is not None and cfg.verbose else None
    saved_step = None

    def save() -> None:
        nonlocal saved_step
        if out is None or not cfg.save or saved_step == relay.step:
            return
        if lead:
            try:
                hf.save_replacing(relay, out / MODEL, files_from=cfg.model)
            except OSError as e:
                raise OutputError(f"{out / MODEL}: cannot save the model ({e.strerror or e}); the one saved "
                                  "before is unchanged") from e
            if relay.step < cfg.steps:  # the last save is reported with the run's end
                say(f"saved the model for transformers in {out / MODEL} at step {relay.step}")
        else:  # the export is a collective when the state is sharded: every rank takes part
            collections.deque(relay.export(), maxlen=0)
        saved_step = relay.step

    def at_each_step(row: dict) -> None:
        if cfg.save_every and row["step"] % cfg.save_every == 0:
            save()
        if tokenizer is not None and "val_loss" in row:  # an evaluation
            model = relay.materialize()  # every rank: with a sharded EPS the weights are gathered
            if lead:
                sample = cfg.prompt + hf.generate(model, tokenizer, cfg.prompt)
                print(f"sample at step {row['step']}: {one_line(sample)}")

    epochs = -(-cfg.steps // len(fit))  # passes enough for the steps
    result = train(cfg, relay=relay, data=itertools.chain.from_iterable(itertools.repeat(fit, epochs)),
                   val_data=val, callbacks=[at_each_step, *callbacks])
    save()
    if ranks.world > 1:  # leave together: rank 0 writes the model while a peer would tear the group down
        leave_together(ranks)
    if out is not None and cfg.save:
        say(f"saved the fine-tuned model for transformers in {out / MODEL}")
    return result


def one_line(text: str) -> str:
    """A sample as one line of the log: newlines, tabs and other control characters escaped
    (`\\n`), everything else as it is."""
    return "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape").decode() for c in text)
