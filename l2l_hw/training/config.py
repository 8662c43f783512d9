"""A training run's config: each component's options (DataOptions and RunOptions here, the
others beside their components), composed flat into TrainConfig with the rules across them.

    cfg = TrainConfig(steps=200, out="runs/latest")      # l2l_hw.train(cfg) runs it
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from l2l_hw import hf
from l2l_hw.eps.options import EpsOptions, ScheduleOptions
from l2l_hw.models import GPTConfig
from l2l_hw.models.gpt import ModelOptions
from l2l_hw.options import OptionError, check_options, fail, option, with_default
from l2l_hw.relay import RelayOptions
from l2l_hw.relay.options import PipelineConfig, PipelineOptions


class ConfigError(OptionError):
    """A TrainConfig value, or a file or checkpoint the run needs, cannot be used; the message says
    which. With `field`: "field=value: what is allowed" (the CLI names the flag instead)."""

    def __init__(self, message: str, field: str | None = None, value=None):
        super().__init__(f"{field}={value!r}: {message}" if field else message, field, value, message)


@dataclass(frozen=True)
class DataOptions:
    """What the run trains on: the text, cut into minibatches of sequences."""

    data: str | None = option(None, {"train": "the text to train on: a file or a folder (default: this Python's "
                                       "stdlib sources)",
                                       "finetune": "the text to fine-tune on: a UTF-8 text file, a JSON Lines file, a "
                                       "folder of text files (each a document) or a datasets dataset (save_to_disk's "
                                       "folder)"},
                              kind="path", metavar="PATH", required_in=("finetune",))
    val_data: str | None = option(None, "data to validate on, read as --data is (default: a tenth of --data's "
                                  "minibatches, held out)", kind="path", metavar="PATH", commands=("finetune",))
    doc_separator: str | None = option(None, "a line that separates documents in --data: each is ended by the "
                                       "end-of-text token (default: the text as one stream, as run_clm reads it)",
                                       kind="text", metavar="LINE", commands=("finetune",))
    text_field: str | None = option(None, "--data is JSON Lines (or a datasets dataset): each object's text in this "
                                    "field (column) is a document (default for a .jsonl file or a dataset: text)",
                                    kind="text", metavar="NAME", commands=("finetune",))
    chat: bool = option(False, "--data holds conversations, {\"messages\": [{\"role\": ..., \"content\": ...}]} a "
                        "line (or a datasets column messages), rendered by the tokenizer's chat template; the loss "
                        "counts the assistant's tokens only", kind="bool", commands=("finetune",))
    context: int = option(GPTConfig.block_size, {"train": "bytes per sequence (the reference GPT reads bytes)",
                                                 "finetune": "tokens per sequence"}, kind="int", low=1)
    batch_size: int = option(32, "sequences per minibatch", kind="int", low=1)
    seed: int = option(1337, "seeds the weights, dropout and batches", kind="int", low=0, high=2**63, high_open=True)

    def __post_init__(self):
        check_options(self)


@dataclass(frozen=True)
class RunOptions:
    """Validation, checkpoints, the output folder and the run's control."""

    eval_every: int | None = option(None, "steps between validation and checkpoint (default: a tenth of --steps)",
                                    kind="int", low=1)
    model: str | None = option(None, "the Hugging Face model folder (config, safetensors, tokenizer)", kind="path",
                               metavar="DIR", commands=("finetune",), required_in=("finetune",))
    weights: str = option("pretrained", "where the model's weights start: pretrained (--model's safetensors), or "
                          "random (drawn from its config.json as transformers initializes a new model, one layer at a "
                          "time: a folder without weights, to try a model's shape on this machine)", kind="choice",
                          choices=hf.WEIGHTS, commands=("finetune",))
    out: str | None = option("runs/latest", "output folder (Python: None writes nothing)", kind="path",
                             optional=True, command_defaults={"finetune": "runs/finetune"})
    resume: bool = option(False, "continue exactly from --out's checkpoint and metrics", kind="bool")
    overwrite: bool = option(False, "replace the run already in --out (its checkpoint, metrics, plot); without it, "
                             "or --resume, an --out that holds a run is refused", kind="bool")
    stop_after: int | None = option(None, "checkpoint and stop at this step, keeping --steps as the schedule's length",
                                    kind="int", low=1, metavar="STEP")
    save_every: int | None = option(None, "steps between saves of the Hugging Face folder --out/model during training "
                                    "(each replaces the last whole; it is always saved at the end)", kind="int", low=1,
                                    metavar="STEPS", commands=("finetune",))
    prompt: str | None = option(None, "at each evaluation and at the end, print the model's greedy continuation of "
                                f"this text ({hf.SAMPLE_TOKENS} tokens; the weights are gathered on the CPU for it)",
                                kind="text", metavar="TEXT", commands=("finetune",),
                                check=lambda text: "must not be empty" if not text.strip() else None)
    tensorboard: bool = option(False, "also write the metrics as TensorBoard event files into --out/tensorboard",
                               kind="bool")
    save: bool = option(True, "write no checkpoint and no --out/model (save=False from Python), only metrics.jsonl, "
                        "loss.png and TensorBoard: a trial of speed or memory, which needs no disk for the state and "
                        "cannot be resumed", kind="bool", flag="--no-save")
    remove_state_dir: bool = option(False, "remove --state-dir's files once the run has finished and written its final "
                                    "checkpoint, which holds all of the state (without it the end line says where "
                                    "the folder is, its size, and that it may be deleted)", kind="bool")
    dist_timeout: float = option(300.0, "under torchrun: how long a rank waits for the others (a pipeline stage for its "
                                 "neighbours) before failing",
                                 kind="float", low=0.0, low_open=True, metavar="SECONDS")
    verbose: bool = option(True, "banner, progress bar, summary (and a sample of the reference GPT)", kind="bool",
                           cli=False)  # the command line always reports

    def __post_init__(self):
        check_options(self)
        if self.resume and self.overwrite:
            fail("overwrite", True, "replaces the run in out, resume continues it: give one of them")
        if not self.save:
            for name in ("resume", "stop_after", "save_every"):
                if getattr(self, name):
                    fail("save", False, f"writes no checkpoint or model, which {name} needs: give one of them")


COMPONENTS = (ModelOptions, DataOptions, ScheduleOptions, EpsOptions, RelayOptions, PipelineOptions, RunOptions)


@dataclass(frozen=True)
class TrainConfig(RunOptions, PipelineOptions, RelayOptions, EpsOptions, ScheduleOptions, DataOptions, ModelOptions):
    """One training run: the options of each component (COMPONENTS), each declared once in its own
    dataclass, with `l2l train`'s defaults: the reference GPT on the stdlib corpus.

    The default run: 0.9 M parameters, 4096 tokens a step, 200 steps. Measured with the
    relay on 2 CPU cores shared with other jobs: 250 steps took 147 s (val loss 2.22); 300
    steps at batch 16 reached 2.39 (lr 3e-3) and 2.52 (lr 6e-3). 200 steps keep the run
    inside 1 to 3 minutes with room for a slower machine.
    """

    micro_batches: int = with_default(RelayOptions, "micro_batches", 4)  # the relay's own default is 1

    def __post_init__(self):
        try:
            for component in COMPONENTS:
                component.__post_init__(self)
            if self.micro_batches > self.batch_size:
                fail("micro_batches", self.micro_batches, f"must be at most batch_size ({self.batch_size})")
            if self.min_lr is not None and self.min_lr > self.lr:
                fail("min_lr", self.min_lr, f"must be at most lr ({self.lr})")
            if self.delay_compensation != "none" and not self.stale_weights:
                fail("delay_compensation", self.delay_compensation, "corrects the weights PipeDream-2BW computes on, "
                     "one step stale; this run computes on the newest (flush, or no pipeline): give --pipeline-stages 2 "
                     "or more with --pipeline-schedule 2bw (or --pipedream-2bw), or drop it")
            if self.device_update_layers and (self.pipeline_stages > 1 or self.stale_weights):
                fail("device_update_layers", self.device_update_layers, "is the relay's, on the newest weights: a "
                     "pipeline's stages and PipeDream-2BW keep every update on the host; give 0 or drop it")
            if self.pipeline_stages > 1 and self.grad_compression != "none":
                fail("grad_compression", self.grad_compression, "compresses the gradient all-reduce of data "
                     f"parallelism, and a pipeline (pipeline_stages {self.pipeline_stages}) has none: drop it")
        except OptionError as e:
            raise ConfigError(e.rule, e.field, e.value) from None

    def run_config(self) -> dict:
        """The fields that define the run's numbers: saved in the checkpoint, compared on resume.
        A fine-tuning run also records its model's config fingerprint."""
        cfg = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in CONTROL_FIELDS}
        cfg["warmup"] = self.warmup_steps
        for name in ("data", "model", "val_data"):
            cfg[name] = str(Path(cfg[name]).expanduser().resolve()) if cfg[name] else None
        if self.model is not None:
            from l2l_hw.hf import config_fingerprint

            cfg[FINGERPRINT] = config_fingerprint(self.model)
        return cfg

    def model_config(self) -> GPTConfig:
        return self.gpt_config(self.context)

    @property
    def stale_weights(self) -> bool:
        """Each step computes on the weights one step stale: PipeDream-2BW, as a pipeline's schedule or
        the single process's mode."""
        return self.pipedream_2bw or (self.pipeline_stages > 1 and self.pipeline_schedule == "2bw")

    @property
    def eval_interval(self) -> int:
        """Steps between validations and checkpoints: eval_every, or a tenth of the run."""
        return self.eval_every or max(1, self.steps // 10)

    def pipeline_config(self) -> PipelineConfig:
        """The pipeline of the run (--pipeline-*): a stage waits for a neighbour as long as a rank
        waits for the others (--dist-timeout)."""
        return self.unprefixed(timeout_s=self.dist_timeout)


CONTROL_FIELDS = ("out", "resume", "overwrite", "stop_after", "tensorboard", "save", "verbose", "overlay", "kernel",
                  "state_dir", "remove_state_dir", "dist_timeout", "save_every", "prompt")
FINGERPRINT = "model_fingerprint"  # in a fine-tuning run's saved config: l2l_hw.hf.config_fingerprint
