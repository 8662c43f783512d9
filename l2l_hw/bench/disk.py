"""`l2l bench disk`: the disk tier against the raw disk and DeepSpeed's aio at its best; steps on disk against in RAM.

All in one run, on files under --dir (a disk filesystem; everything written there is
removed at the end). A shared machine's disk drifts by tens of percent within seconds, so
the I/O measurements take turns, one pass of each per round (bench/timer.py), and each
figure is the min / median / max of its rounds; a ratio is taken within a round.

  raw device   fio (libaio, O_DIRECT, the tier's request size, queue depth 8; the write
               overwrites a file fio laid out first) where it is installed, and dd (1 MiB
               requests, oflag=direct / iflag=direct)
  tier         the EPS's RegionStore (l2l_hw/eps/disk_store.py) writing --size-gib as regions
               of --region-mib, then reading them back: images, checksums and all
  aio          DeepSpeed's aio handle at its best, where its op builds (DS_ACCELERATOR=cpu,
               libaio-dev): first tuned in DeepSpeed's own manner (bench/aio.py: ds_nvme_tune's
               sweep over block size, queue depth, submission, completion and threads, on
               pre-allocated files from a page-locked buffer), then its best write and best
               read setting on the same bytes as the tier, in files of the region size
  steps        the same GPT and minibatch trained with the CPU EPS in RAM and with
               state_dir (8-bit m and v), taking turns step by step; the median step, and
               the share of the disk run's step that its main thread spent waiting on the disk

fio, the tier and aio each write over blocks written before, as the tier's write-back does
in training: fio's laid-out file, the tier's regions and aio's pre-allocated files after an
untimed first pass.

`--llama-layers N` runs the large-model benchmark instead: a Llama-2-7B-shaped model
(hidden 4096, MLP 11008, 32 heads, vocabulary 32000) with N decoder layers, random
weights, 8-bit m and v and an fp32 working copy, its state under --dir: STEPS steps, a
checkpoint, one more step; then a fresh process loads the checkpoint into the same
state_dir and takes that step again. Both report the step's loss and the crc32 of every
state tensor after it (bit-exact resume: equal), their peak RSS, step times, tokens/s and
the share of each step the main thread waited on the disk.

`--memory-limit SIZE` runs training inside that memory limit instead (bench/disk_limit.py): the
reference GPT with its state STATE_RATIO (3) times the limit on disk, in a cgroup of the limit,
against the same model in RAM outside it: step times, peaks, losses bit-identical.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import zlib
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch

import l2l_hw
from l2l_hw.bench import aio, disk_limit, print_report, train_steps
from l2l_hw.bench.timer import round_robin
from l2l_hw.eps.disk import GROUPS_IN_FLIGHT
from l2l_hw.eps.disk_store import CHUNK_BYTES, IO_THREADS, RegionStore
from l2l_hw.models import GPTConfig, build_gpt, lm_loss
from l2l_hw.options import parse_size

MODEL = GPTConfig(n_layer=6, n_embd=384, n_head=6, block_size=128)
BATCHES = (1, 16)  # 1: the disk's I/O is the step; 16: compute per layer exceeds the layer's I/O
MICRO_BATCHES = 4
FIO_DEPTH = 8
AIO_SWEEP_MIB = 512  # bytes each point of the aio sweep writes and reads: ds_nvme_tune's 400M, in regions


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def raw_fio(path: Path, nbytes: int) -> dict | None:
    """fio's sequential write (over a file it lays out first) then read of `nbytes` at `path` (GB/s);
    None without fio."""
    if shutil.which("fio") is None:
        return None
    out = {}
    for rw in ("write", "read"):
        result = subprocess.run(["fio", "--name=raw", f"--filename={path}", f"--size={nbytes}", f"--rw={rw}",
                                 f"--bs={min(CHUNK_BYTES, nbytes)}", f"--iodepth={FIO_DEPTH}", "--ioengine=libaio",
                                 "--direct=1", "--overwrite=1", "--output-format=json"],
                                capture_output=True, text=True, check=True)
        job = json.loads(result.stdout)["jobs"][0][rw]
        out[rw] = job["bw_bytes"] / 1e9
    path.unlink()
    return out


def raw_dd(path: Path, nbytes: int) -> dict:
    """dd's write then read of `nbytes` at `path` with 1 MiB direct requests (GB/s)."""
    count = nbytes >> 20
    out = {}
    for rw, args in (("write", ["if=/dev/zero", f"of={path}", "oflag=direct", f"count={count}"]),
                     ("read", [f"if={path}", "of=/dev/null", "iflag=direct"])):
        err = subprocess.run(["dd", "bs=1M", *args], capture_output=True, text=True, check=True).stderr
        seconds = float(re.search(r"copied, ([0-9.]+) s", err).group(1))
        out[rw] = _gbps(nbytes, seconds)
    path.unlink()
    return out


def tier(folder: Path, nbytes: int, region_bytes: int) -> dict:
    """The RegionStore writing, then reading, `nbytes` as regions of `region_bytes` (GB/s)."""
    store = RegionStore(folder, GROUPS_IN_FLIGHT)
    keys = [f"region{i}" for i in range(nbytes // region_bytes)]
    for key in keys:
        store.add_region(key, {"bytes": [region_bytes]}, {"fetched": 0, "state": region_bytes}, rule={})

    def write_all(fill: bool) -> float:
        t0 = time.perf_counter()
        for i, key in enumerate(keys):
            with store.use(key, (), replaces=("state",)) as image:
                if fill:  # what an update writes, as aio's buffer holds its pattern: each 8 bytes their index
                    words = image.buffer[:region_bytes].view(torch.int64)
                    torch.arange(i * words.numel(), (i + 1) * words.numel(), out=words)
            store.write_back(key)  # timed: the bytes that are there stand for what an update wrote
        store.flush()
        return time.perf_counter() - t0

    # untimed: the images' first use, as in a run's first step (their pages written, so faulted in:
    # never written, a write would send the kernel's zero page and the first read fault them in)
    write_all(fill=True)
    write = write_all(fill=False)
    store.evict()
    t0 = time.perf_counter()
    for i, key in enumerate(keys):
        for ahead in keys[i + 1:i + 3]:
            store.read_ahead(ahead, ("state",))
        with store.use(key, ("state",)):
            pass
    read = time.perf_counter() - t0
    store.close()
    shutil.rmtree(folder)
    return {"write": _gbps(len(keys) * region_bytes, write), "read": _gbps(len(keys) * region_bytes, read),
            "memory_bytes": GROUPS_IN_FLIGHT * region_bytes}


def load_aio():
    """DeepSpeed's aio op, or why not (bench/aio.py)."""
    return aio.load_op()


def _trainer(batch: int, state_dir: Path | None):
    torch.manual_seed(0)
    extra = {"state_dir": state_dir} if state_dir is not None else {}
    eps = l2l_hw.make_eps("cpu", lr=1e-3, state="8bit", **extra)
    relay = l2l_hw.Relay(build_gpt(MODEL), lm_loss, eps=eps, micro_batches=min(MICRO_BATCHES, batch))
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (batch, MODEL.block_size), generator=g) for _ in range(2))
    return relay, lambda: train_steps(relay, [(x, y)], 1)[0]


def steps(folder: Path, batch: int, rounds: int) -> dict:
    """Step time with the state in RAM and on disk, round robin; the disk run's waits."""
    ram, ram_step = _trainer(batch, None)
    disk, disk_step = _trainer(batch, folder)
    store = disk.eps.storage.store
    waits = []

    def disk_timed():
        before = store.waited.get("MainThread", 0.0)
        seconds = disk_step()
        waits.append(store.waited.get("MainThread", 0.0) - before)
        return seconds

    store.flush()  # the registration's writes
    read0, written0 = store.bytes_read, store.bytes_written
    times = round_robin({"ram": ram_step, "disk": disk_timed}, rounds, warmup=1, self_timed=True)
    store.flush()  # the last step's writes
    median = {name: statistics.median(t) for name, t in times.items()}
    report = {"batch": batch, "tokens": batch * MODEL.block_size, "ram_step_s": median["ram"],
              "disk_step_s": median["disk"], "ratio": median["disk"] / median["ram"],
              "wait_share": statistics.median(w / s for w, s in zip(waits[1:], times["disk"])),
              "disk_bytes_per_step": (store.bytes_read - read0 + store.bytes_written - written0) / (rounds + 1),
              "memory_bound_bytes": disk.eps.storage.memory_bound(), "state_bytes": store.disk_bytes()}
    disk.eps.close()
    ram.eps.close()
    shutil.rmtree(folder)
    return report


def _spread(values) -> dict:
    values = list(values)
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def io(root: Path, nbytes: int, region: int, rounds: int, aio_best: tuple | None) -> dict:
    """Every I/O measurement, taking turns round by round: min / median / max of each, and of the
    tier's ratios within a round. `aio_best` is DeepSpeed's aio op and its best settings, or None."""
    passes = {"fio": lambda: raw_fio(root / "fio", nbytes), "dd": lambda: raw_dd(root / "dd", nbytes),
              "tier": lambda: tier(root / "tier", nbytes, region)}
    if aio_best is not None:
        op, best = aio_best
        passes["deepspeed_aio"] = lambda: aio.at_best(op, best, root / "aio", nbytes // region, region)
    runs = {name: r for name, r in round_robin(passes, rounds, warmup=0, self_timed=True).items()
            if r[0] is not None}  # fio: None where it is not installed
    report = {name: {rw: _spread(r[rw] for r in results) for rw in aio.DIRECTIONS}
              for name, results in runs.items()}
    pairs = [("tier", name) for name in runs if name != "tier"]
    pairs += [("deepspeed_aio", "fio")] if {"deepspeed_aio", "fio"} <= runs.keys() else []  # the peer's own standing
    for name, reference in pairs:
        report[f"{name}_vs_{reference}"] = {rw: _spread(a[rw] / b[rw] for a, b in zip(runs[name], runs[reference]))
                                            for rw in aio.DIRECTIONS}
    return report


def run(folder: str, size_gib: float = 2.0, region_mib: int = 256, rounds: int = 3,
        batches: tuple[int, ...] = BATCHES, aio_sweep_mib: int = AIO_SWEEP_MIB) -> dict:
    root = Path(folder) / f"l2l-bench-disk-{os.getpid()}"
    root.mkdir(parents=True)
    try:
        region = region_mib << 20
        nbytes = max(1, int(size_gib * 2**30) // region) * region  # whole regions
        op, aio_best = load_aio(), None
        if isinstance(op, str):
            peer = {"deepspeed_aio": op}  # why it is not measured
        else:  # DeepSpeed's own tuning first, on files of the tier's region size
            peer = {"deepspeed_aio_sweep": aio.sweep(op, root / "aio-sweep", max(1, (aio_sweep_mib << 20) // region),
                                                     region, rounds)}
            aio_best = op, peer["deepspeed_aio_sweep"]["best"]
        return {
            "folder": str(Path(folder).resolve()), "bytes": nbytes, "region_bytes": region,
            "request_bytes": CHUNK_BYTES, "io_threads": IO_THREADS, "groups_in_flight": GROUPS_IN_FLIGHT,
            "rounds": rounds, **peer, **io(root, nbytes, region, rounds, aio_best),
            "model": {"n_layer": MODEL.n_layer, "n_embd": MODEL.n_embd, "block_size": MODEL.block_size,
                      "params": sum(p.numel() for p in build_gpt(MODEL).parameters())},
            "steps": [steps(root / f"state{b}", b, rounds) for b in batches],
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=4096)
LLAMA_STEPS, LLAMA_CONTEXT = 3, 256


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def llama_relay(folder: Path, layers: int, random: bool):
    """The Llama-shaped relay over a disk-tier EPS in folder/state; weights N(0, 0.02) and norms 1
    (random), or zeros (to be replaced by a checkpoint), generated one layer at a time."""
    from transformers import LlamaConfig

    from l2l_hw.hf import skeleton, split

    config_dir = folder / "config"
    LlamaConfig(**LLAMA_7B, num_hidden_layers=layers, architectures=["LlamaForCausalLM"]).save_pretrained(config_dir)
    hf_layers, loss_fn = split(skeleton(config_dir))
    g = torch.Generator().manual_seed(0)

    def init(i, module):
        return {name: (torch.ones(p.shape) if p.dim() == 1 else torch.randn(p.shape, generator=g) * 0.02)
                if random else torch.zeros(p.shape) for name, p in module.named_parameters() if p.is_meta}

    eps = l2l_hw.make_eps("cpu", lr=1e-4, state="8bit", state_dir=folder / "state")
    return l2l_hw.Relay(hf_layers, loss_fn, eps=eps, init=init, micro_batches=1)


def _llama_step(relay, batch) -> dict:
    store = relay.eps.storage.store
    waited, moved, t0 = store.waited.get("MainThread", 0.0), store.bytes_read + store.bytes_written, time.perf_counter()
    loss = relay.train_step(*batch)
    seconds = time.perf_counter() - t0
    return {"loss": loss, "seconds": seconds, "wait_share": (store.waited.get("MainThread", 0.0) - waited) / seconds,
            "disk_bytes": store.bytes_read + store.bytes_written - moved}


def _state_crcs(relay) -> dict[str, str]:
    return {name: f"{zlib.crc32(e.read().contiguous().view(-1).view(torch.uint8).numpy()):08x}"
            for name, e in relay.state_entries().items()}


def _llama_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, LLAMA_7B["vocab_size"], (1, LLAMA_CONTEXT), generator=g)
    return ids, ids.clone()


def llama_train(folder: Path, layers: int) -> dict:
    """STEPS steps, a checkpoint, one more step; what that step gave."""
    from l2l_hw.checkpoint import save_checkpoint

    t0 = time.perf_counter()
    relay = llama_relay(folder, layers, random=True)
    report = {"setup_s": time.perf_counter() - t0, "params": sum(s.numel() for g in relay.eps.shapes.values()
                                                                for s in g.values()),
              "state_bytes": relay.eps.storage.disk_bytes(), "memory_bound_bytes": relay.eps.storage.memory_bound()}
    batch = _llama_batch()
    report["steps"] = [_llama_step(relay, batch) for _ in range(LLAMA_STEPS)]
    t0 = time.perf_counter()
    save_checkpoint(folder / "checkpoint.safetensors", relay.state_entries(), {"step": relay.step})
    report["checkpoint_s"] = time.perf_counter() - t0
    report["checkpoint_bytes"] = (folder / "checkpoint.safetensors").stat().st_size
    report["next"] = _llama_step(relay, batch)
    report["crcs"] = _state_crcs(relay)
    report["peak_rss_bytes"] = _peak_rss()
    relay.eps.close()
    return report


def llama_resume(folder: Path, layers: int) -> dict:
    """The checkpoint loaded into a fresh relay over the same state_dir; the step after it."""
    from l2l_hw.checkpoint import open_checkpoint

    t0 = time.perf_counter()
    relay = llama_relay(folder, layers, random=False)
    relay.load_state_dict(open_checkpoint(folder / "checkpoint.safetensors"))
    report = {"load_s": time.perf_counter() - t0, "next": _llama_step(relay, _llama_batch())}
    report["crcs"] = _state_crcs(relay)
    report["peak_rss_bytes"] = _peak_rss()
    relay.eps.close()
    return report


def llama(folder: str, layers: int) -> dict:
    """The large-model run (module docstring): two processes, one after the other."""
    root = Path(folder) / f"l2l-bench-llama-{os.getpid()}"
    root.mkdir(parents=True)
    try:
        runs = {}
        for phase in ("train", "resume"):
            code = (f"import json, sys; from pathlib import Path; from l2l_hw.bench import disk; "
                    f"print(json.dumps(disk.llama_{phase}(Path({str(root)!r}), {layers})))")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"the {phase} process failed:\n{out.stderr[-3000:]}")
            runs[phase] = json.loads(out.stdout.splitlines()[-1])
        train, resume = runs["train"], runs["resume"]
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return {"layers": layers, "context": LLAMA_CONTEXT, "physical_memory_bytes": physical,
                "bit_exact": train["crcs"] == resume["crcs"] and train["next"]["loss"] == resume["next"]["loss"],
                "train": {k: v for k, v in train.items() if k != "crcs"},
                "resume": {k: v for k, v in resume.items() if k != "crcs"}}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def format_llama(r: dict) -> str:
    t, res, gb = r["train"], r["resume"], 1e9
    steps = [*t["steps"], t["next"]]
    lines = [f"Llama-shaped, {r['layers']} layers x 4096, {t['params'] / 1e9:.2f} B parameters, 8-bit m and v, "
             f"fp32 working copy; state on disk {t['state_bytes'] / gb:.1f} GB "
             f"({t['state_bytes'] / r['physical_memory_bytes']:.2f}x physical memory), context {r['context']}",
             f"  set-up {t['setup_s']:.0f} s; in memory at most {t['memory_bound_bytes'] / gb:.1f} GB of state",
             *(f"  step {i + 1}: {s['seconds']:.1f} s, {r['context'] / s['seconds']:.1f} tokens/s, loss "
               f"{s['loss']:.4f}, waiting on disk {s['wait_share']:.1%}" for i, s in enumerate(steps)),
             f"  checkpoint {t['checkpoint_bytes'] / gb:.1f} GB in {t['checkpoint_s']:.0f} s; resumed in a fresh "
             f"process ({res['load_s']:.0f} s): step {len(steps)} {res['next']['seconds']:.1f} s, loss "
             f"{res['next']['loss']:.4f}; bit-exact: {r['bit_exact']}",
             f"  peak RSS {t['peak_rss_bytes'] / gb:.2f} GB training, {res['peak_rss_bytes'] / gb:.2f} GB resuming "
             f"({max(t['peak_rss_bytes'], res['peak_rss_bytes']) / r['physical_memory_bytes']:.1%} of physical memory)"]
    return "\n".join(lines)


def format_report(r: dict) -> str:
    def spread(d, unit):
        return f"{d['median']:5.2f}{unit} ({d['min']:.2f}-{d['max']:.2f})"

    def pair(name, unit=""):
        d = r.get(name)
        if not isinstance(d, dict):
            return str(d)
        return f"write {spread(d['write'], unit)}  read {spread(d['read'], unit)}"

    lines = [f"disk tier on {r['folder']}: {r['bytes'] / 2**30:.1f} GiB, regions of {r['region_bytes'] >> 20} MiB, "
             f"{r['request_bytes'] >> 20} MiB requests on {r['io_threads']} threads; GB/s, median (min-max) of "
             f"{r['rounds']} rounds",
             f"  {f'fio (libaio QD{FIO_DEPTH})':<22}{pair('fio') if 'fio' in r else 'not installed'}",
             f"  {'dd (1 MiB direct)':<22}{pair('dd')}",
             f"  {'tier':<22}{pair('tier')}",
             f"  {'deepspeed aio, best':<22}{pair('deepspeed_aio')}"]
    sweep = r.get("deepspeed_aio_sweep")
    if sweep:
        lines.append(f"    its sweep ({len(sweep['points'])} settings on {sweep['files']} x "
                     f"{sweep['file_bytes'] >> 20} MiB files, {sweep['seconds']:.0f} s): best write "
                     f"{sweep['best_named']['write']}; best read {sweep['best_named']['read']}")
    lines += [f"  {name.replace('_vs_', ' / '):<22}{pair(name, 'x')}" for name in
              ("tier_vs_fio", "tier_vs_dd", "tier_vs_deepspeed_aio", "deepspeed_aio_vs_fio") if name in r]
    m = r["model"]
    lines.append(f"steps: GPT {m['n_layer']} x {m['n_embd']}, context {m['block_size']} ({m['params'] / 1e6:.1f} M "
                 f"params), 8-bit m and v, median of the timed steps")
    lines.append(f"  {'batch':>6}{'RAM s':>9}{'disk s':>9}{'ratio':>8}{'waiting':>9}{'disk MB/step':>14}"
                 f"{'state MB':>10}{'bound MB':>10}")
    for s in r["steps"]:
        lines.append(f"  {s['batch']:>6}{s['ram_step_s']:>9.3f}{s['disk_step_s']:>9.3f}{s['ratio']:>8.2f}"
                     f"{s['wait_share']:>9.1%}{s['disk_bytes_per_step'] / 1e6:>14.0f}{s['state_bytes'] / 1e6:>10.0f}"
                     f"{s['memory_bound_bytes'] / 1e6:>10.0f}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--dir", default=".", help="where the files go (a disk filesystem; default: here)")
    p.add_argument("--size-gib", type=float, default=2.0, help="bytes each I/O measurement moves (default 2 GiB)")
    p.add_argument("--region-mib", type=int, default=256, help="the tier's region size (default 256 MiB)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of each timed variant: I/O passes, aio's finalists, steps (after a warm-up; default 3)")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="batch sizes of the step timing")
    p.add_argument("--aio-sweep-mib", type=int, default=AIO_SWEEP_MIB,
                   help=f"bytes each point of DeepSpeed aio's tuning sweep moves (default {AIO_SWEEP_MIB} MiB)")
    p.add_argument("--llama-layers", type=int, default=None, metavar="N",
                   help="the large-model run instead: a Llama-2-7B-shaped model with N decoder layers (32: 6.74 B)")
    p.add_argument("--memory-limit", type=_size, default=None, metavar="SIZE",
                   help="training inside this memory limit instead (a cgroup, as root): the reference GPT with "
                        "its state 3x the limit on disk against the same model in RAM, losses bit-identical "
                        "(bench/disk_limit.py; --rounds steps after a warm-up)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run_from_args(args) -> int:
    if args.memory_limit is not None:
        return disk_limit.run_from_args(args)
    if args.llama_layers is not None:
        return print_report(llama(args.dir, args.llama_layers), args.json, format_llama)
    report = run(args.dir, args.size_gib, args.region_mib, args.rounds, tuple(args.batches), args.aio_sweep_mib)
    return print_report(report, args.json, format_report)
