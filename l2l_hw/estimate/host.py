"""What a run holds on the host: the EPS's bytes as its engine lays out every tensor (in RAM, or
with --state-dir the region files and the images in flight), the checkpoint's, and one rank's
host memory: this process's baseline, the EPS, the layers' buffers, the data, and the phases
that come and go (host_parts)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from l2l_hw.estimate.ledger import StepMemory
from l2l_hw.estimate.trace import ModelTrace, RunModel


# ---------------------------------------------------------------------------- the EPS, the checkpoint
def eps_oracle(cfg):
    """A cpu EPS of cfg's optimizer and state format, configured as the relay configures the
    run's (working copy, double buffers): it registers nothing; its buffer_layout and
    stored_slots give the bytes of every tensor the run's EPS keeps."""
    from l2l_hw.eps import make_eps

    eps = make_eps("cpu", optimizer=cfg.optimizer, momentum=cfg.momentum, state=cfg.optimizer_state,
                   delay_compensation=cfg.delay_compensation)  # predict: a working copy of its own
    eps.configure(working_dtype=cfg.precision, double_buffer=_double_buffered(cfg))
    return eps


def _double_buffered(cfg) -> bool:
    """As the relay decides: a step can be discarded whole (fp16, skip_nonfinite) or the previous
    version is read (PipeDream-2BW, a 2bw pipeline)."""
    return cfg.precision == "fp16" or cfg.skip_nonfinite or cfg.stale_weights


def tensor_bytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass
class EpsBytes:
    memory: int  # host bytes of the state (in RAM), or of the images in flight (state_dir)
    fetched: int  # of which the working copy (pinned where the device is CUDA)
    disk: int  # the region files under state_dir (0 without)


def eps_bytes(cfg, shapes: dict[str, dict[str, torch.Size]]) -> EpsBytes:
    """The bytes the run's EPS keeps for the groups `shapes`, as its engine lays them out."""
    from l2l_hw.eps.disk import GROUPS_IN_FLIGHT
    from l2l_hw.eps.disk_store import RegionLayout

    eps = eps_oracle(cfg)
    try:
        memory = fetched = 0
        regions = []
        for key, tensors in shapes.items():
            layout = RegionLayout(key)
            for shape in tensors.values():
                for _, _, spec in eps.buffer_layout(torch.Size(shape)):
                    memory += tensor_bytes(spec.shape, spec.dtype)
                    fetched += tensor_bytes(spec.shape, spec.dtype) if spec.fetched else 0
                    layout.add(spec.shape, spec.dtype, "fetched" if spec.fetched else "state")
            regions.append(sum(layout.sizes().values()))
    finally:
        eps.close()
    if cfg.state_dir is None:
        return EpsBytes(memory, fetched, 0)
    return EpsBytes(sum(sorted(regions)[-GROUPS_IN_FLIGHT:]), fetched, sum(regions))


def checkpoint_bytes(cfg, model: ModelTrace) -> int:
    """checkpoint.safetensors as the training loop writes it: the relay's state (the EPS's stored
    slots, the previous version where double buffered, its step, the layers' buffers), the RNG
    and data states, and the run's config in its header (checkpoint.file_bytes)."""
    from l2l_hw.checkpoint import file_bytes, run_meta
    from l2l_hw.eps.base import StateEntry

    eps = eps_oracle(cfg)
    try:
        entries = {"relay.eps/step": StateEntry(torch.Size([]), torch.int64, None)}
        for key, tensors in model.shapes.items():
            for name, shape in tensors.items():
                for slot, (s, dtype) in eps.stored_slots(torch.Size(shape)).items():
                    entries[f"relay.eps/{key}/{name}/{slot}"] = StateEntry(torch.Size(s), dtype, None)
                if eps.double_buffer:
                    entries[f"relay.eps/{key}/{name}/previous"] = StateEntry(torch.Size(shape), torch.float32, None)
    finally:
        eps.close()
    for i, buffers in enumerate(model.buffers):
        entries.update({f"relay.buffers/{i}/{n}": StateEntry(torch.Size(s), dtype, None)
                        for n, (s, dtype) in buffers.items()})
    rng = torch.get_rng_state()
    entries["rng.torch"] = StateEntry(rng.shape, rng.dtype, None)
    if cfg.model is None:  # the reference corpus's sampler (train.CorpusBatches)
        entries["data.generator"] = StateEntry(rng.shape, rng.dtype, None)
    elapsed = 1e4 + 1 / 3  # seconds trained, as long a float as the header writes (its only unknown: a few bytes)
    return file_bytes(entries, run_meta(cfg, cfg.steps, elapsed))


# ---------------------------------------------------------------------------- host memory
# Measured on this project's 2-core CPU machine (glibc malloc, torch's CPU allocator on it),
# `l2l train` and `l2l finetune` at 1.5 to 160 M parameters (tests/test_estimate.py; the two
# allocator figures were set from those runs' peaks, and are what this estimate knows least):
CORPUS_RSS_PER_BYTE = 2.0  # the reference corpus: its bytes as tensors, and what reading them left (1.9)
TOKENIZER_RSS_PER_BYTE = 4.0  # a fast tokenizer in memory, per byte of its files
ALLOCATOR_SLACK = 1.0  # freed activations glibc keeps resident: RSS grows 1.5 to 3.1x the step's live bytes
LIBRARY_BUFFERS = 24 << 20  # MKL's packing buffers, oneDNN's caches, the plot's figure: on first use (~24 MiB)
TOKEN_BYTES = 4  # finetune's token cache: uint32 ids (finetune_data), mapped
TEXT_BYTES_PER_TOKEN = 4.0  # where the tokens are not counted yet: about 4 bytes of text a token (BPE, English)


@functools.lru_cache(maxsize=8)
def corpus_bytes(data) -> int:
    """The bytes of the reference corpus l2l train reads (models.corpus: the files it takes, by
    their sizes, up to its cap), without reading them (Corpus.load caches the corpus too)."""
    from l2l_hw.models.corpus import SIZE_CAP_BYTES, sorted_files, stdlib_root

    root = stdlib_root() if data is None else Path(data).expanduser()
    if root.is_file():
        return min(root.stat().st_size, SIZE_CAP_BYTES)
    total = 0
    for rel in sorted_files(root, ".py" if data is None else None):
        with contextlib.suppress(OSError):
            total += (root / rel).stat().st_size
        if total >= SIZE_CAP_BYTES:
            return SIZE_CAP_BYTES
    return total


def files_bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def token_bytes(cfg) -> int:
    """finetune's tokens in memory (the cache's mapped files): the cache's size where a run of the
    same data left it in --out, else TEXT_BYTES_PER_TOKEN bytes of --data a token."""
    total = 0
    for role, data in (("train", cfg.data), ("val", cfg.val_data)):
        if data is None:
            continue
        cache = Path(cfg.out) / "tokens" / f"{role}.bin" if cfg.out is not None else None
        if cache is not None and cache.is_file():
            total += cache.stat().st_size * (TOKEN_BYTES + 1) // TOKEN_BYTES if cfg.chat else cache.stat().st_size
            continue
        path = Path(data).expanduser()
        text = files_bytes(path.rglob("*")) if path.is_dir() else (path.stat().st_size if path.is_file() else 0)
        total += int(text / TEXT_BYTES_PER_TOKEN * (TOKEN_BYTES + (1 if cfg.chat else 0)))
    return total


def tokenizer_bytes(folder: Path) -> int:
    from l2l_hw.finetune_data import TOKENIZER_STATE

    return int(TOKENIZER_RSS_PER_BYTE * files_bytes(folder / name for name in TOKENIZER_STATE))


HUB_SHARD_BYTES = 5 * 10**9  # the shards of a model as the Hugging Face Hub holds them (save_pretrained of 4.x)


def weights_files(folder: Path, parameters: int) -> list[int]:
    """The sizes of a Hugging Face folder's safetensors files (its shards), from the file system;
    a folder of config.json alone (weights elsewhere, or not yet fetched): the `parameters` in the
    config's dtype, in the Hub's 5 GB shards."""
    from l2l_hw import hf

    try:
        index = hf.weights_file(folder)
    except FileNotFoundError:
        dtype = getattr(hf.load_config(folder), "dtype", None)
        whole = parameters * (dtype.itemsize if isinstance(dtype, torch.dtype) else 4)
        full, rest = divmod(whole, HUB_SHARD_BYTES)
        return [HUB_SHARD_BYTES] * full + ([rest] if rest else [])
    if index.name == hf.WEIGHTS_FILE:
        return [index.stat().st_size]
    shards = sorted(set(hf.shard_map(index).values()))
    if not shards:
        raise ValueError(f"{index} names no weights (its weight_map is empty): give the folder as save_pretrained "
                         "wrote it, or config.json alone")
    return [shard.stat().st_size for shard in shards]


def import_what_the_run_imports(cfg) -> None:
    """What l2l train / finetune import on their way (this estimate's fake tensors: check_fits runs
    it in the run's process; transformers' Trainer for its weight-decay rule; matplotlib for
    loss.png), so that this process's resident memory is the run's baseline."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode()  # its first construction imports torch's tracing stack (~70 MB)
    if cfg.model is not None:
        import transformers

        transformers.Trainer  # noqa: B018 (a lazy module: the attribute imports it)
    if cfg.out is not None:
        with contextlib.suppress(ImportError):
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot  # noqa: F401


def host_parts(cfg, run: RunModel, model: ModelTrace, eps: EpsBytes, step: StepMemory, *, baseline: int,
               on_host: bool, whole_model: int) -> tuple[dict[str, int], dict[str, int]]:
    """The host memory of one rank: what stays for the whole run, by what holds it (the baseline:
    this process now; the EPS; the relay's buffers; the data; the libraries' working buffers),
    and the phases that come and go, of which the largest counts:

        build  the reference GPT is made one layer at a time in fp32 as the EPS takes it
               (build_gpt_meta; a pipeline's stages build it whole); a Hugging Face model's
               weights file is mapped while its layers stream in
        step   the steps' (and validations') own bytes on the CPU, and what glibc's allocator
               keeps of them (ALLOCATOR_SLACK); on CUDA the pinned gradient staging
        end    the model gathered in fp32 for the reference GPT's sample or a fine-tune's --prompt
               (a fine-tune's save holds one shard of it), beside the heap the steps grew"""
    buffers = sum(tensor_bytes(s, d) for layer in model.buffers for s, d in layer.values())
    parts = {"baseline": baseline, "eps": eps.memory if cfg.eps_backend in ("cpu", "golden") else 0,
             "buffers": buffers + sum(model.frozen), "libraries": LIBRARY_BUFFERS}
    largest_layer = max(sum(math.prod(s) for s in t.values()) for t in model.shapes.values()) * 4
    if run.folder is None:
        parts["data"] = int(CORPUS_RSS_PER_BYTE * corpus_bytes(cfg.data))
        build = whole_model if cfg.pipeline_stages > 1 else 2 * largest_layer  # made, then registered (build_relay)
    else:
        parts["data"] = token_bytes(cfg)
        parts["tokenizer"] = tokenizer_bytes(run.folder)
        # a layer read from its shard (the largest one mapped), or drawn from the config and copied in
        build = (max(weights_files(run.folder, whole_model // 4)) + largest_layer if cfg.weights == "pretrained"
                 else 2 * largest_layer)
    if on_host:  # the device is this host: the step's own bytes (not the EPS's) and what the allocator keeps
        stepping, kept = int(step.own_peak * (1 + ALLOCATOR_SLACK)) + step.host_stash, step.own_peak
        if cfg.state_dir is not None:  # the disk tier's fetch copies the working copy out of its image
            stepping += step.peak - step.own_peak
    else:  # pinned: the gradients' staging buffers (two groups in flight), the stash sent down
        stepping = kept = 2 * max(model.group_bytes.values()) + step.host_stash
    if run.folder is None:  # the reference GPT: the report gathers the model for its sample
        end = whole_model if cfg.verbose else 0
    else:  # a fine-tune: --prompt gathers the model; the save holds one shard of it at a time
        from l2l_hw import hf

        saved = min(whole_model, hf.SHARD_BYTES) if cfg.save and cfg.out is not None else 0
        end = whole_model if cfg.prompt is not None else saved
    phases = {"build": build, "step": stepping, "end": end + kept if end else 0}
    return parts, phases


def eps_bytes_per_parameter(cfg) -> float:
    """The EPS's host bytes per trained parameter of cfg's run, from the engine's own layout (the
    fp32 master, the moments in their format, the working copy, the double buffers where a step
    can be discarded whole or computes one version back): what the banner reports."""
    n = 1 << 20
    return eps_bytes(dataclasses.replace(cfg, state_dir=None), {"g": {"w": torch.Size([n])}}).memory / n
