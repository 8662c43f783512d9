"""`l2l bench gpu --out DIR`: the GPU campaign, the relay against each regime's strongest peers, under one memory cap.

Parts, in order; each writes its result into DIR/summary.json as it goes (a run cut short keeps
what finished) and prints its figures as it goes. Every side of every comparison runs under the
same device memory cap (--memory-cap, default 24 GiB: torch.cuda.set_per_process_memory_fraction
in each side's process).

    tests        the CUDA-parametrized relay tests (relay == PyTorch to 1e-5, TF32 off); their
                 exit code is the part's
    matmul_peak  the bf16 matmul (8192^3), 5 runs: the best of the sample is the measured peak
                 (with the spread), beside the part's dense bf16 figure (figures.py): the two
                 denominators of every MFU
    regime_a     fits resident: 1.21 B GPT; the relay against PyTorch compiled in its own recipe
    loss         50 steps of a 1.05 B GPT on the stdlib corpus: the relay against the same-recipe
                 PyTorch, same data and seed; the bound is PyTorch's own drift (its minibatch in
                 one micro-batch instead of two: the same sums re-associated) x2; a control run
                 of PyTorch at twice the learning rate must fall outside it (else the bound could
                 not tell such an error, and the part fails)
    regime_b     ~3 B (9 layers of Llama-3-8B's shape): ZeRO-2 offload, FSDP2 with its optimizer on
                 the host; PyTorch with checkpointing reported where it cannot hold it
    regime_c     Llama-3-8B's shape: ZeRO-3 offload, FSDP2 CPU offload (regimes.py)
    capacity     under the cap, the largest GPT of width 2048 each side trains, both searched in
                 this part (capacity.py): PyTorch checkpointing every block with one-sequence
                 micro-batches, the relay until the host's memory stops it

`--parts` also takes: llama_8b (`l2l finetune --device cuda` on the 8.03 B folder, the user's
command, with the most exact optimizer state the host holds), llama_largest (the deepest
Llama-3-8B-shaped model the relay trains with 8-bit state), the first campaign's
memory_by_depth, trace, syncs, eps (extras.py), and overlap (`l2l bench overlap` on the GPU: the
host update under the compute at 1, 2, 4 and 8 micro-batches, with the planned device share).

A part fails when it raises or when what it measured breaks its rule (a CUDA test fails, a NaN
or inf anywhere, a loss outside its bound, a peer that cannot run for another reason than
memory, a side with no grid point that runs); it is cut when it runs past its limit
(--part-limit, or what is left of --time-limit). summary.json names every failure ("failed")
and every cut ("cut"), a part not started for want of time among them, and the command exits 1
when there is one.

Files: summary.json, tests.txt (the tests' output), log.txt (the commands' output), trace.json.
The model folders, the side processes' logs and runs go to --work (default: a temporary folder,
removed at the end). `--dry-run` runs every part at toy size on the CPU, the relay on the
asynchronous twin of a device (cpu-async), the peers on the CPU (DeepSpeed's CPU accelerator,
FSDP2 on one gloo rank), with stand-ins for the memory sizes that send each regime down each of
its paths (a peer its estimator refuses, runs that take a fresh load each), and writes the same
files; CI runs it. Time budget and the device command: docs/GPU_CAMPAIGN.md.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import l2l_hw
from l2l_hw.bench.gpu import (capacity as gpu_capacity, checks as gpu_checks, llama as gpu_llama, peers as gpu_peers,
                               regimes as gpu_regimes)
from l2l_hw.bench.gpu.figures import dense_bf16_peak, flops_per_token, fmt_spread, mfu, rate_spread, spread
from l2l_hw.bench.gpu.partners import GPTPartner, state_bytes_per_parameter
from l2l_hw.bench.gpu.sides import Sides
from l2l_hw.bench.gpu.watch import log_tail
from l2l_hw.models import Corpus, GPTConfig, count_parameters

FILES = ("summary.json", "tests.txt", "log.txt", "trace.json")
MAX_FILE_BYTES = 16 * 2**20
TEST_FILES = ("tests/test_relay_equivalence.py", "tests/test_relay_options.py", "tests/test_precision.py",
              "tests/test_eps_engine.py", "tests/test_transport.py")
# The largest model's EPS may take this share of MemAvailable less HOST_OVERHEAD: the EPS's bytes per
# parameter are measured whole (`l2l bench capacity`: 8.05 with 8-bit state against 8.03 counted);
# outside it `l2l finetune` holds the CUDA context and torch (~2 GiB), pinned staging for a few
# layers' weights and gradients (~2 GiB at Llama-3-8B's 436 MB layers) and the shard it reads.
HOST_MARGIN = 0.97
HOST_OVERHEAD = 6 * 2**30
ADAMW = {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}  # every side's, the Llama regimes
MEMORY_CAP_GIB = 24.0  # the card most fine-tuners own
TIME_LIMIT_S = 570.0  # a lent machine's call is 10 minutes; a minute left for the start and the exit
PART_LIMIT_S = 480.0  # each part under 8 minutes


@dataclass(frozen=True)
class Sizes:
    """What each part runs: a real campaign's sizes, or the dry run's toys."""

    width: int  # the reference GPT's width in regime_a, capacity, loss
    heads: int
    context: int
    micro_batch: int  # sequences a micro-batch (extras.py)
    resident_layers: int  # 1.21 B parameters at width 2048 (gpu_extras.trace: twice this)
    capacity_batch: int  # sequences a step under the cap
    capacity_micro_batches: int  # the relay's
    capacity_start: tuple[int | None, int | None]  # the searches' first depths (PyTorch, relay; None: predicted)
    capacity_resolution: tuple[float, float]  # where each search stops (gpu_capacity.search)
    cap_bytes: int | None  # the dry run's stand-in for the cap (None: --memory-cap)
    host_bytes: int | None  # the dry run's stand-in for the host's memory (None: the real one)
    loss_layers: int
    loss_batch: int
    loss_steps: int
    loss_lr: float
    matmul_n: int
    rounds: int  # timed runs of each figure (>= 3)
    matmul_rounds: int = 5
    llama: dict = field(default_factory=dict)  # the Llama shape
    llama_context: int = 4096
    llama_batch: int = 8
    llama_micro_batches: int = 4
    llama_warmup: int = 2
    llama_timed: int = 5
    timeout_s: int = 600  # one subprocess (a probe, a finetune) or one request to a side
    tests_k: str = "cuda"


REAL = Sizes(width=2048, heads=16, context=1024, micro_batch=8, resident_layers=24, capacity_batch=64,
             capacity_micro_batches=8, capacity_start=(None, None), capacity_resolution=(0.0, 0.1), cap_bytes=None,
             host_bytes=None, loss_layers=20, loss_batch=16, loss_steps=50, loss_lr=1e-4, matmul_n=8192, rounds=3,
             llama=gpu_llama.LLAMA_3_8B)
DRY = Sizes(width=64, heads=4, context=32, micro_batch=2, resident_layers=2, capacity_batch=8,
            capacity_micro_batches=2, capacity_start=(16, 32), capacity_resolution=(1.0, 1.0), cap_bytes=24 * 2**20,
            host_bytes=160 * 2**20, loss_layers=2, loss_batch=4, loss_steps=12, loss_lr=3e-3, matmul_n=256, rounds=3,
            llama={**gpu_llama.LLAMA_3_8B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 256},
            llama_context=64, llama_batch=4, llama_micro_batches=2, llama_warmup=1, llama_timed=3, timeout_s=300,
            tests_k="twin and transport")
DRY_LLAMA_LAYERS = (2, 3)  # the dry run's "8 B" depth and its largest (no host limit is searched there)


class PartFailed(Exception):
    """A part measured what its rule does not allow; its result is kept beside the failure."""

    def __init__(self, reason: str, result: dict):
        super().__init__(reason)
        self.result = result


class Campaign:
    """One campaign's device, sizes, cap, folders and side processes; each part a method."""

    def __init__(self, out: Path, work: Path, dry_run: bool, peers: tuple[str, ...] = gpu_peers.PEERS,
                 memory_cap_gib: float = MEMORY_CAP_GIB, time_limit_s: float = TIME_LIMIT_S,
                 part_limit_s: float = PART_LIMIT_S):
        self.out, self.work, self.dry_run = out, work, dry_run
        self.sizes = DRY if dry_run else REAL
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.relay_device = "cpu-async" if dry_run else "cuda"
        self.cap_bytes = self.sizes.cap_bytes or int(memory_cap_gib * 2**30)
        self.adamw = ADAMW
        self.time_limit_s, self.part_limit_s = time_limit_s, part_limit_s
        name = "cpu (1 thread a process)" if dry_run else torch.cuda.get_device_name(0)
        s = self.sizes
        chosen = {"relay", *peers}
        self.regimes = {k: _only(r, chosen) for k, r in gpu_regimes.regimes(dry_run, s.width, s.heads,
                                                                             s.context).items()}
        self.summary = {"dry_run": dry_run, "device": name, "memory_cap_bytes": self.cap_bytes,
                        "time_limit_s": time_limit_s, "part_limit_s": part_limit_s, "sizes": asdict(s),
                        "regimes": {k: asdict(r) for k, r in self.regimes.items()}, "torch": torch.__version__,
                        "l2l_hw": getattr(l2l_hw, "__version__", None), "parts": {}, "failed": {}, "cut": {}}
        self.peak = {"measured": None, "dense": dense_bf16_peak(name)}
        self.max_file_bytes = MAX_FILE_BYTES
        self.partial: dict = {}  # the running part's figures so far
        self.sides = Sides(self.device.type, self.cap_bytes, work,
                           dict(os.environ, PYTHONUNBUFFERED="1",
                                **({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"} if dry_run else {})),
                           s.timeout_s)

    # -- running --------------------------------------------------------------------------
    def say(self, text: str) -> None:
        print(f"[l2l bench gpu {time.strftime('%H:%M:%S')}] {text}", flush=True)

    def write(self, name: str, text: str) -> None:
        """DIR/name, written whole (a temporary renamed), cut to its last MAX_FILE_BYTES."""
        data = text.encode()[-MAX_FILE_BYTES:]
        tmp = self.out / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.out / name)

    def log(self, title: str, text: str) -> None:
        with open(self.out / "log.txt", "a") as f:
            f.write(f"\n===== {title}\n{text}\n")

    def progress(self) -> None:
        """summary.json with the running part's figures so far (a part records as it goes)."""
        self.write("summary.json", json.dumps(self.summary, indent=1, default=str))

    def run(self, parts) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        for name in FILES[1:]:  # every file exists, whatever parts fail
            self.write(name, "")
        deadline = gpu_checks.Deadline(self.time_limit_s, self.part_limit_s)
        threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
        if self.dry_run:  # toy models lose several-fold to thread-pool round trips on shared cores
            torch.set_num_threads(1)
            os.environ["OMP_NUM_THREADS"] = "1"  # and so do the processes it starts
        try:
            for name in parts:
                self.part(name, deadline)
        finally:
            self.sides.close()
            torch.set_num_threads(threads)
            if omp is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = omp
        self.summary["verdict"] = ("failed" if self.summary["failed"] else "cut" if self.summary["cut"]
                                   else "passed")
        self.progress()
        return self.summary

    def part(self, name: str, deadline: gpu_checks.Deadline) -> None:
        limit, why = deadline.for_part(name)
        self.partial = result = {}
        self.summary["parts"][name] = result
        t0 = time.perf_counter()
        if limit > 0:
            self.say(f"{name} ...")
        try:
            with gpu_checks.time_limit(limit, why):
                result.update(getattr(self, name)() or {})
        except gpu_checks.Cut as e:
            result["cut"] = str(e)
            self.sides.close(now=True)  # a side may be mid-request: ended, started again when next asked
        except PartFailed as e:
            result.update(e.result)
            result["failed"] = str(e)
        except (gpu_regimes.PartFailedHere, gpu_checks.CheckFailed) as e:
            result["failed"] = str(e)
        except Exception as exc:  # one part failing must not cost the others
            result.update(failed=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
        result["seconds"] = round(time.perf_counter() - t0, 1)
        for key in ("failed", "cut"):
            if key in result:
                self.summary[key][name] = result[key]
        self.progress()
        state = (f"FAILED: {result['failed']}" if "failed" in result else f"CUT: {result['cut']}" if "cut" in result
                 else "done")
        self.say(f"{name} {state} ({result['seconds']} s)")
        self.free()

    def free(self) -> None:
        gc.collect()  # a relay's EPS (tens of GB of host state) goes before the next part builds its own
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def host_budget(self) -> int:
        """The host memory the sides may take: the dry run's stand-in, or MemAvailable x HOST_MARGIN."""
        return self.sizes.host_bytes or int(_mem_available() * HOST_MARGIN)

    # -- the reference GPT ----------------------------------------------------------------
    def gpt(self, layers: int) -> GPTConfig:
        s = self.sizes
        return GPTConfig(n_layer=layers, n_embd=s.width, n_head=s.heads, block_size=s.context, bias=False)

    def per_token(self, cfg: GPTConfig) -> float:
        tables = (256 + cfg.block_size) * cfg.n_embd  # the token and position embeddings: lookups
        return flops_per_token(count_parameters(cfg) - tables, cfg.n_layer, cfg.n_embd, cfg.block_size)

    def batch(self, sequences: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        shape = (sequences, self.sizes.context)
        return torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g)

    def relay(self, cfg: GPTConfig, micro_batches: int, recompute: str = "none", activations: str = "device",
              threads: int | None = None, account_memory: bool = False, lr: float = 1e-4) -> l2l_hw.Relay:
        from l2l_hw.models import build_gpt, lm_loss

        torch.manual_seed(0)
        eps = l2l_hw.make_eps("cpu", optimizer="adamw", lr=lr)
        return l2l_hw.Relay(build_gpt(cfg), lm_loss, eps=eps, device=self.relay_device, micro_batches=micro_batches,
                            recompute=recompute, activations=activations, precision="bf16", threads=threads,
                            account_memory=account_memory)

    def figures(self, tokens: int, seconds, per_token: float) -> dict:
        rate = rate_spread(tokens, seconds)
        return {"tokens_per_s": rate, "step_s": spread(seconds),
                **mfu(rate["median"], per_token, self.peak["measured"], self.dense_peak())}

    def dense_peak(self) -> float | None:
        """The part's dense bf16 FLOP/s (None for a part not in figures.py's table)."""
        return self.peak["dense"]["tflops"] * 1e12 if self.peak["dense"]["tflops"] else None

    # -- the parts --------------------------------------------------------------------------
    def tests(self) -> dict:
        root = Path(__file__).resolve().parents[3]
        if not (root / "tests").is_dir():
            raise FileNotFoundError(f"no tests folder under {root} (an installed package): run from a checkout")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", self.sizes.tests_k, *TEST_FILES]
        env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=self.sizes.timeout_s)
        self.write("tests.txt", done.stdout + done.stderr)
        last = (done.stdout.strip().splitlines() or [""])[-1]
        self.say(f"tests: {last}")
        result = {"command": " ".join(cmd[1:]), "returncode": done.returncode, "result": last}
        if done.returncode != 0:
            raise PartFailed(f"pytest exited {done.returncode}: {last}", result)
        return result

    def matmul_peak(self) -> dict:
        n = self.sizes.matmul_n
        a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=self.device) for _ in range(2))
        repeats = 20

        def run() -> float:
            self._sync()
            t0 = time.perf_counter()
            for _ in range(repeats):
                a @ b
            self._sync()
            return (time.perf_counter() - t0) / repeats

        run()
        tflops = rate_spread(2 * n ** 3 / 1e12, [run() for _ in range(self.sizes.matmul_rounds)])
        gpu_checks.finite("matmul TFLOP/s", [tflops["min"], tflops["max"]])
        self.peak["measured"] = tflops["max"] * 1e12  # the best of the sample: what the part can do
        self.say(f"matmul_peak: bf16 {n}^3 best {tflops['max']:,.1f} TFLOP/s of {fmt_spread(tflops, ' TFLOP/s', 1)}; "
                 f"dense bf16 of the part: {self.peak['dense']['tflops']} TFLOP/s ({self.peak['dense']['source']})")
        return {"n": n, "peak_tflops": tflops["max"], "peak_is": "the best of the sample", "tflops": tflops,
                "spread": (tflops["max"] - tflops["min"]) / tflops["max"], "dense_bf16": self.peak["dense"]}

    def regime_a(self) -> dict:
        return gpu_regimes.run_regime(self, "regime_a")

    def regime_b(self) -> dict:
        return gpu_regimes.run_regime(self, "regime_b")

    def regime_c(self) -> dict:
        return gpu_regimes.run_regime(self, "regime_c")

    def capacity(self) -> dict:
        s = self.sizes
        layer = count_parameters(self.gpt(1)) - count_parameters(self.gpt(0))
        spec = {"width": s.width, "heads": s.heads, "context": s.context, "device": self.device.type,
                "relay_device": self.relay_device, "cap_bytes": self.cap_bytes, "host_bytes": s.host_bytes}
        probe = lambda side, **kw: lambda layers: gpu_capacity.run_probe(  # noqa: E731
            {**spec, "side": side, "layers": layers, **kw}, timeout=s.timeout_s)
        # PyTorch: micro-batches of one sequence, every block checkpointed
        start = s.capacity_start[0] or int(self.cap_bytes * 0.85 / (state_bytes_per_parameter("autocast") * layer))
        torch_layers, best, torch_tries = gpu_capacity.search(
            probe("torch", batch=s.capacity_batch, micro_batches=s.capacity_batch, steps=1 + s.rounds), start,
            s.capacity_resolution[0])
        self.say(f"capacity: PyTorch trains {torch_layers} layers under {self.cap_bytes / 2**30:g} GiB "
                 f"(probes {torch_tries})")
        result = {"cap_bytes": self.cap_bytes, "torch_layers": torch_layers, "torch_probes": torch_tries}
        self.partial.update(result)  # kept where the relay's search is cut
        if torch_layers:
            cfg = self.gpt(torch_layers)
            result.update(torch_parameters=count_parameters(cfg), torch_peak_device_bytes=best["peak_device_bytes"],
                          torch=self.figures(s.capacity_batch * s.context, best["seconds"][1:], self.per_token(cfg)))
        # The relay: its host memory, predicted from the EPS's 14 B per parameter and the host stash
        host = s.host_bytes or _mem_available()
        stash = s.capacity_batch * s.context * s.width * 2
        start = s.capacity_start[1] or max(1, int((host * 0.8 - HOST_OVERHEAD) / (14 * layer + stash)))
        relay_layers, best, relay_tries = gpu_capacity.search(
            probe("relay", batch=s.capacity_batch, micro_batches=s.capacity_micro_batches, steps=1 + s.rounds),
            start, s.capacity_resolution[1])
        if not relay_layers:
            raise PartFailed("the relay trained no depth under the cap", result)
        cfg = self.gpt(relay_layers)
        result.update(relay_layers=relay_layers, relay_parameters=count_parameters(cfg), relay_probes=relay_tries,
                      relay=self.figures(s.capacity_batch * s.context, best["seconds"][1:], self.per_token(cfg)),
                      relay_peak_device_bytes=best["peak_device_bytes"], relay_peak_rss_bytes=best["peak_rss_bytes"])
        result["relay_over_torch_parameters"] = (result["relay_parameters"] / result["torch_parameters"]
                                                 if torch_layers else None)
        self.say(f"capacity: the relay trains {relay_layers} layers ({result['relay_parameters'] / 1e9:.2f} B, "
                 f"{result['relay_over_torch_parameters'] or 0:.2f}x PyTorch's) at "
                 f"{fmt_spread(result['relay']['tokens_per_s'])} tokens/s (probes {relay_tries})")
        return result

    def loss(self) -> dict:
        s = self.sizes
        cfg = self.gpt(s.loss_layers)
        corpus = Corpus.load()
        g = torch.Generator().manual_seed(0)
        batches = [corpus.batch("train", s.loss_batch, s.context, generator=g) for _ in range(s.loss_steps)]
        relay = self.relay(cfg, micro_batches=2, lr=s.loss_lr)
        curves = self.partial["curves"] = {"relay": [relay.train_step(x, y) for x, y in batches]}
        relay.close()
        del relay
        self.free()
        runs = (("torch", 2, s.loss_lr), ("torch_one_micro_batch", 1, s.loss_lr),
                ("torch_twice_the_lr", 2, 2 * s.loss_lr))  # the last: an error the bound must catch
        for name, u, lr in runs:
            partner = GPTPartner(cfg, self.device, "recipe", u, lr=lr)
            curves[name] = [partner.step(x.to(self.device), y.to(self.device)) for x, y in batches]
            del partner
            self.free()
            self.progress()
        result = {"parameters": count_parameters(cfg), "steps": s.loss_steps, "lr": s.loss_lr, "curves": curves}
        for name, curve in curves.items():
            try:
                gpu_checks.finite(f"the {name} loss curve", curve)
            except gpu_checks.CheckFailed as e:
                raise PartFailed(str(e), result) from None
        drift = gpu_checks.drift([curves["torch"], curves["torch_one_micro_batch"]])["drift"]
        bound = gpu_checks.bound(drift)
        diff = gpu_checks.difference([curves["relay"]], [curves["torch"]])
        control = gpu_checks.difference([curves["torch_twice_the_lr"]], [curves["torch"]])
        result.update(max_abs_difference=diff, torch_drift=drift, bound=bound, agree=gpu_checks.agrees(diff, bound),
                      twice_the_lr_difference=control, bound_catches_twice_the_lr=not gpu_checks.agrees(control, bound),
                      drift_is="PyTorch against itself: the same recipe with the minibatch in one micro-batch instead "
                               "of two (the same sums re-associated)")
        self.say(f"loss: {s.loss_steps} steps, {curves['relay'][0]:.4f} -> {curves['relay'][-1]:.4f}; relay vs "
                 f"PyTorch max |diff| {diff:.2e}, PyTorch's own drift {drift:.2e}, bound {bound:.2e}; PyTorch at twice "
                 f"the lr differs by {control:.2e}")
        if not result["agree"]:
            raise PartFailed(f"the loss curves differ by {diff:.3g} nats, over the bound {bound:.3g}", result)
        if not result["bound_catches_twice_the_lr"]:
            raise PartFailed(f"the bound {bound:.3g} cannot tell a run at twice the learning rate (it differs by "
                             f"{control:.3g})", result)
        return result

    # -- Llama: `l2l finetune`, its peers, the largest --------------------------------------
    def folders(self) -> gpu_llama.Folders:
        return gpu_llama.Folders(self.work / "llama", self.sizes.llama, self.device.type)

    def finetune(self, layers: int, optimizer_state: str) -> dict:
        s = self.sizes
        folders = self.folders()
        t0 = time.perf_counter()
        folder = folders.folder(layers)
        text = folders.text(gpu_llama.words_for(s.llama_warmup + s.llama_timed + 2, s.llama_batch, s.llama_context))
        made = time.perf_counter() - t0
        run = gpu_llama.finetune(folder, text, self.work / f"finetune-{layers}-{optimizer_state}",
                                 device=self.relay_device, context=s.llama_context, batch=s.llama_batch,
                                 micro_batches=s.llama_micro_batches, warmup=s.llama_warmup, timed=s.llama_timed,
                                 optimizer_state=optimizer_state, precision="bf16", adamw=ADAMW, seed=0,
                                 timeout=s.timeout_s)
        self.log(f"l2l finetune, {layers} layers", log_tail(
            self.work / f"finetune-{layers}-{optimizer_state}.log", 8000))
        figures = {**gpu_llama.with_mfu(run, self.peak["measured"], self.dense_peak()), "folder_s": made,
                   "optimizer_state": optimizer_state}
        self.say(f"l2l finetune, {layers} layers ({figures['parameters'] / 1e9:.2f} B, {optimizer_state} state): "
                 f"{fmt_spread(figures['tokens_per_s'])} tokens/s, {fmt_spread(figures['tflops'], ' TFLOPS', 1)}, "
                 f"peak device {_gib(figures['peak_device_bytes'])}, peak host RSS "
                 f"{_gib(figures['peak_host_rss_bytes'])}, GPU idle {_share(figures['gpu_idle_share'])}")
        return figures

    def llama_8b(self) -> dict:
        """With the most exact optimizer state this host holds (fp32 state at 8.03 B needs ~138 GiB)."""
        from l2l_hw.estimate import STATE_FORMATS_BY_PRECISION

        layers = DRY_LLAMA_LAYERS[0] if self.dry_run else self.sizes.llama["num_hidden_layers"]
        refused = {}
        for state in STATE_FORMATS_BY_PRECISION:
            try:
                return {**self.finetune(layers, state), "refused": refused}
            except gpu_llama.DoesNotFit as e:
                refused[state] = str(e)
                self.say(f"llama_8b: {state} state does not fit: {e}")
        raise RuntimeError(f"no optimizer state format fits: {refused}")

    def llama_largest(self) -> dict:
        from l2l_hw.train import TrainConfig, eps_bytes_per_parameter

        bpp = eps_bytes_per_parameter(TrainConfig(precision="bf16", optimizer_state="8bit"))
        host = _mem_available()
        layers = (DRY_LLAMA_LAYERS[1] if self.dry_run
                  else gpu_llama.deepest(self.sizes.llama, host * HOST_MARGIN - HOST_OVERHEAD, bpp))
        self.say(f"llama_largest: {layers} layers from {_gib(host)} available at {bpp:.2f} B/parameter (8-bit state)")
        return {"host_available_bytes": host, "eps_bytes_per_parameter": bpp, **self.finetune(layers, "8bit")}

    # -- the first campaign's parts (extras.py) ---------------------------------------------
    def memory_by_depth(self) -> dict:
        from l2l_hw.bench.gpu import extras as gpu_extras

        return gpu_extras.memory_by_depth(self)

    def trace(self) -> dict:
        from l2l_hw.bench.gpu import extras as gpu_extras

        return gpu_extras.trace(self)

    def syncs(self) -> dict:
        from l2l_hw.bench.gpu import extras as gpu_extras

        return gpu_extras.syncs(self)

    def eps(self) -> dict:
        from l2l_hw.bench.gpu import extras as gpu_extras

        return gpu_extras.eps(self)

    def overlap(self) -> dict:
        from l2l_hw.bench.gpu import extras as gpu_extras

        return gpu_extras.overlap(self)


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def _only(regime: gpu_regimes.Regime, chosen: set[str]) -> gpu_regimes.Regime:
    """The regime with the sides `--peers` chose (the relay always)."""
    from dataclasses import replace

    return replace(regime, sides=tuple(k for k in regime.sides if k in chosen),
                   capacity_peers=tuple(k for k in regime.capacity_peers if k in chosen))


def _gib(n) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def _share(x) -> str:
    return "n/a (no NVML)" if x is None else f"{x:.3f}"


PARTS = ("tests", "matmul_peak", "regime_a", "loss", "regime_b", "regime_c", "capacity")
EXTRA_PARTS = ("llama_8b", "llama_largest", "memory_by_depth", "trace", "syncs", "eps", "overlap")


def run(out: str, dry_run: bool = False, parts: tuple[str, ...] = PARTS, work: str | None = None,
        peers: tuple[str, ...] = gpu_peers.PEERS, memory_cap_gib: float = MEMORY_CAP_GIB,
        time_limit_s: float = TIME_LIMIT_S, part_limit_s: float = PART_LIMIT_S) -> dict:
    if not dry_run and not torch.cuda.is_available():
        raise ValueError("l2l bench gpu needs a CUDA device (torch.cuda.is_available() is False); "
                         "--dry-run runs it at toy size on the CPU")
    limits = dict(memory_cap_gib=memory_cap_gib, time_limit_s=time_limit_s, part_limit_s=part_limit_s)
    for key, value in limits.items():
        if not value > 0:
            raise ValueError(f"{key.replace('_', ' ')} must be a positive number, got {value!r}")
    if work is not None:
        return Campaign(Path(out), Path(work), dry_run, peers, **limits).run(parts)
    with tempfile.TemporaryDirectory(prefix="l2l-bench-gpu-", ignore_cleanup_errors=True) as tmp:
        return Campaign(Path(out), Path(tmp), dry_run, peers, **limits).run(parts)


def format_report(summary: dict) -> str:
    lines = [f"GPU campaign on {summary['device']}{' (dry run)' if summary['dry_run'] else ''}, memory cap "
             f"{_gib(summary['memory_cap_bytes'])}"]
    for name, result in summary["parts"].items():
        state = (f"FAILED: {result['failed']}" if "failed" in result else f"CUT: {result['cut']}" if "cut" in result
                 else "ok")
        if "relay_over_strongest" in result:
            state += (f"; relay / {result['strongest_peer']} {result['relay_over_strongest']:.3f} (target "
                      f"{result['target_ratio']}: {'met' if result['meets_target'] else 'NOT met'})")
        lines.append(f"  {name:14s} {state} ({result['seconds']} s)")
    failed, cut, n = summary["failed"], summary["cut"], len(summary["parts"])
    lines.append(f"{len(failed)} failed and {len(cut)} cut of {n} parts" if failed or cut else f"all {n} parts passed")
    return "\n".join(lines)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR", help="folder for summary.json, tests.txt, log.txt and "
                                                               "trace.json")
    p.add_argument("--work", metavar="DIR", help="folder for the model folders, the sides' logs and runs (default: a "
                                                 "temporary folder, removed at the end; the Llama parts need ~35 GB)")
    p.add_argument("--dry-run", action="store_true", help="every part at toy size on the CPU (the relay on the "
                                                          "asynchronous twin, the peers on the CPU): the same files")
    p.add_argument("--parts", nargs="+", choices=PARTS + EXTRA_PARTS, default=list(PARTS),
                   help=f"the parts to run (default: {' '.join(PARTS)})")
    p.add_argument("--peers", nargs="+", choices=gpu_peers.PEERS, default=list(gpu_peers.PEERS),
                   help="the peers the regimes run beside the relay (default: all)")
    p.add_argument("--memory-cap", type=_positive, default=MEMORY_CAP_GIB, metavar="GiB",
                   help=f"the device memory every side may use (default {MEMORY_CAP_GIB:g})")
    p.add_argument("--time-limit", type=_positive, default=TIME_LIMIT_S, metavar="S",
                   help=f"seconds for the whole command; parts past it are cut (default {TIME_LIMIT_S:g})")
    p.add_argument("--part-limit", type=_positive, default=PART_LIMIT_S, metavar="S",
                   help=f"seconds for each part (default {PART_LIMIT_S:g})")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run_from_args(args) -> int:
    summary = run(args.out, args.dry_run, tuple(args.parts), args.work, tuple(args.peers), args.memory_cap,
                  args.time_limit, args.part_limit)
    print(json.dumps(summary, indent=2, default=str) if args.json else format_report(summary))
    return 1 if summary["failed"] or summary["cut"] else 0
