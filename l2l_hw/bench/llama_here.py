"""`l2l bench llama-here`: Llama-3-8B's shape fine-tuned on this machine, as its user would: `l2l
estimate` first, then `l2l finetune` with what the estimate named, and the run's peak resident
memory against the estimate's.

The model folder is made here: Llama-3-8B's config.json (8.03 B parameters, 32 layers of
width 4096), a byte-level BPE tokenizer trained on a few hundred kB of this Python's own
sources (Llama's vocabulary keeps its 128256 rows; the tokenizer uses the first of them), and
that text as the data (2 kB more of it to validate on: each validation minibatch reads every
layer from the disk). No weights are written: `--weights random` draws each layer from the
config as transformers initializes a new model, one layer at a time. The run keeps its 8-bit
optimizer state and fp32 masters on disk (`--state-dir`), computes in bf16 and saves nothing
(`--no-save`: the state alone fills most of a 77 GB disk). Both commands run as child
processes; the run's peak RSS is the kernel's (`wait4`'s ru_maxrss), its step times its
metrics'. `--layers N` tries a shallower model of the same width (quick checks).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from l2l_hw.bench import print_report

LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
TEXT_BYTES = 400_000  # of the stdlib's sources: the tokenizer's training text and the data
VAL_BYTES = 2_000  # the validation text: a minibatch or two (each reads every layer's weights from the disk)
VOCAB = 2000  # the tokenizer's own vocabulary (the model keeps Llama's rows)
RUN_FLAGS = ("--weights", "random", "--optimizer-state", "8bit", "--precision", "bf16", "--no-save")


def make_folder(folder: Path, config: dict) -> Path:
    """config.json, a byte-level BPE tokenizer, the data text (returned) and val.txt in `folder`."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    text, stdlib = [], Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        text.append(path.read_text(encoding="utf-8", errors="replace"))
        if sum(map(len, text)) >= TEXT_BYTES + VAL_BYTES:
            break
    data = folder / "text.txt"
    data.write_text("".join(text)[:TEXT_BYTES], encoding="utf-8")
    (folder / "val.txt").write_text("".join(text)[TEXT_BYTES:TEXT_BYTES + VAL_BYTES], encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([data.read_text(encoding="utf-8")], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|end_of_text|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end_of_text|>",
                                                bos_token="<|end_of_text|>")
    fast.save_pretrained(folder)
    eos = fast.eos_token_id
    (folder / "config.json").write_text(json.dumps({**config, "bos_token_id": eos, "eos_token_id": eos}))
    return data


def _l2l(*args: str) -> list[str]:
    return [sys.executable, "-m", "l2l_hw.cli", *args]


def run(work: str, layers: int | None = None, context: int = 128, batch_size: int = 2, micro_batches: int = 2,
        steps: int = 2) -> dict:
    work_dir = Path(work)
    config = dict(LLAMA_3_8B, num_hidden_layers=layers or LLAMA_3_8B["num_hidden_layers"])
    folder, state, out = work_dir / "model", work_dir / "state", work_dir / "run"
    for stale in (state, out):
        shutil.rmtree(stale, ignore_errors=True)
    data = make_folder(folder, config)
    shape = ["--model", str(folder), "--data", str(data), "--val-data", str(folder / "val.txt"),
             "--context", str(context), "--batch-size", str(batch_size),
             "--micro-batches", str(micro_batches), "--state-dir", str(state), *RUN_FLAGS]
    asked = subprocess.run(_l2l("estimate", *shape, "--out", str(out), "--json"), capture_output=True, text=True)
    if asked.returncode != 0:
        raise RuntimeError(f"l2l estimate failed: {asked.stderr.strip() or asked.stdout.strip()}")
    estimate = json.loads(asked.stdout)
    if not estimate["fits"]:
        raise RuntimeError(f"l2l estimate says the run does not fit this machine: {'; '.join(estimate['shortfall'])}")
    start = time.perf_counter()
    child = subprocess.Popen(_l2l("finetune", *shape, "--out", str(out), "--steps", str(steps), "--eval-every",
                                  str(steps), "--remove-state-dir"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"l2l finetune exited {code}:\n{output[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    peak = usage.ru_maxrss * 1024  # kB on Linux
    return {"model": estimate["model"], "parameters": estimate["parameters"], "context": context,
            "batch_size": batch_size, "micro_batches": micro_batches, "steps": steps, "flags": list(RUN_FLAGS),
            "estimated_host_bytes": estimate["host_bytes"], "estimated_disk_bytes": estimate["disk_bytes"],
            "estimated_parts": estimate["host"], "peak_rss_bytes": peak,
            "peak_over_estimate": peak / estimate["host_bytes"], "losses": losses,
            "step_s": [r["elapsed"] for r in rows if "loss" in r], "seconds": seconds,
            "output_tail": output.strip().splitlines()[-6:]}


def format_report(r: dict) -> str:
    gib = 2**30
    return "\n".join([
        f"{r['model']}: {r['parameters'] / 1e9:.2f} B parameters, context {r['context']}, batch {r['batch_size']} in "
        f"{r['micro_batches']} micro-batches, {r['steps']} steps, {' '.join(r['flags'])}",
        f"  l2l estimate: host {r['estimated_host_bytes'] / gib:.2f} GiB, "
        f"disk {r['estimated_disk_bytes'] / gib:.2f} GiB",
        f"  l2l finetune: peak RSS {r['peak_rss_bytes'] / gib:.2f} GiB = {r['peak_over_estimate']:.3f} of the "
        "estimate; "
        f"losses {', '.join(f'{x:.4f}' for x in r['losses'])}; {r['seconds']:.0f} s in all (elapsed at each step: "
        f"{', '.join(f'{s:.0f}' for s in r['step_s'])} s)"])


def add_arguments(p) -> None:
    p.add_argument("--work", required=True, metavar="DIR", help="folder for the model, its state (~60 GiB at 32 "
                                                                 "layers, removed at the end) and the run")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 32, Llama-3-8B's)")
    p.add_argument("--context", type=int, default=128, help="tokens a sequence (default 128)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences a step (default 2)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches a step (default 2)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps (default 2)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run_from_args(args) -> int:
    for name in ("context", "batch_size", "micro_batches", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"l2l bench llama-here: --{name.replace('_', '-')} must be >= 1")
    if args.layers is not None and args.layers < 1:
        raise SystemExit("l2l bench llama-here: --layers must be >= 1")
    try:
        report = run(args.work, args.layers, args.context, args.batch_size, args.micro_batches, args.steps)
    except RuntimeError as e:
        raise SystemExit(f"l2l bench llama-here: {e}") from None
    return print_report(report, args.json, format_report)
