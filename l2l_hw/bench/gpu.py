"""`l2l bench gpu --out DIR`: the GPU campaign, the relay against the strongest partners, in one call.

Parts, in order; each writes its result into DIR/summary.json as it ends (a run cut short keeps
what finished) and prints its figures as it goes. A part fails when it raises or when what it
measured breaks its rule (a CUDA test fails, the loss curves part, a peer asked for cannot run);
summary.json names every failure ("failed") and the command exits 1 when there is one.

    tests          the CUDA-parametrized relay tests (relay == PyTorch to 1e-5, TF32 off); their
                   exit code is the part's
    matmul_peak    the bf16 matmul (8192^3), 3 runs; the part's dense bf16 figure from its name
                   (gpu_figures.DENSE_BF16_TFLOPS): the two denominators of every MFU
    resident       a 1.21 B GPT (24 x 2048, context 1024) that fits the device, micro-batches of
                   8 sequences, at 8 micro-batches a step and at 2: the relay (bf16, no recompute)
                   against PyTorch with bf16 autocast and with the relay's own recipe resident
                   (gpu_partners), taking turns; then against torch.compile of the stronger; the
                   relay's ratio against the strongest of the three
    capacity       under a 16 GiB cap, the largest GPT of that width each side trains, searched
                   by probes in fresh processes (gpu_capacity): PyTorch checkpointing every block
                   with one-sequence micro-batches, the relay until the host's memory stops it;
                   each timed at its largest (64 sequences a step)
    loss           50 steps of a 1.05 B GPT (20 x 2048) on the stdlib corpus: the relay against
                   the same-recipe PyTorch, same data and seed; the bound is PyTorch against
                   itself: the same recipe with the minibatch in one micro-batch instead of two
                   (the same sums re-associated, bf16's noise), x2 (LOSS_BOUND_FACTOR)
    llama_8b       a Llama-3-8B-shaped folder (gpu_llama) made on the machine, `l2l finetune
                   --device cuda --no-save` at context 4096, 8 sequences in 4 micro-batches, AdamW
                   with the most exact state the host holds (fp32, else bf16, else 8-bit; fp32 at
                   8.03 B needs ~138 GiB, an H200 machine has 125): tokens/s, TFLOPS with attention, MFU, peak device memory, peak host
                   RSS, the GPU's idle share over 5 timed steps after 2 of warm-up
    peers          DeepSpeed ZeRO-3 offload, ZeRO-2 offload (ZeRO-Offload), FSDP2 CPU offload and
                   resident PyTorch (where it fits) on the deepest model of Llama-3-8B's shape
                   every peer's host footprint fits in this machine (gpu_peers.host_bytes: 8 B
                   needs 217 GB under ZeRO-3 offload; 14 layers, 4.1 B, fit 125 GiB), against
                   `l2l finetune` on the same folder (gpu_peers); --peers picks which run
    llama_largest  the deepest model of Llama-3-8B's shape the relay trains here with 8-bit
                   optimizer state, sized from the host's memory and the EPS's bytes per
                   parameter: the same figures

`--parts` also takes four parts kept from the first campaign (H200, 2026-11-26), outside the
default set to keep it within its time: memory_by_depth, trace (a profiler trace of capped
relay steps, DIR/trace.json), syncs, eps (gpu_extras).

Time budget: measured seconds of each part and the device calls that fit the rest into 15
minutes of device time are in docs/GPU_CAMPAIGN.md ("Time budget and the device command").

Files: summary.json, tests.txt (the tests' output), log.txt (the commands' output), trace.json.
The model folders and runs go to --work (default: a temporary folder, removed at the end).
`--dry-run` runs every part at toy size on the CPU, the relay on the asynchronous twin of a
device (cpu-async), the peers on the CPU (DeepSpeed's CPU accelerator, FSDP2 on one gloo
rank), and writes the same files; CI runs it.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import l2l_hw
from l2l_hw.bench import gpu_capacity, gpu_llama, gpu_peers
from l2l_hw.bench.gpu_figures import dense_bf16_peak, flops_per_token, fmt_spread, mfu, rate_spread, spread
from l2l_hw.bench.gpu_partners import RECIPES, GPTPartner, state_bytes_per_parameter
from l2l_hw.bench.gpu_watch import log_tail, watch
from l2l_hw.bench.timer import round_robin
from l2l_hw.models import Corpus, GPTConfig, build_gpt, count_parameters, lm_loss

FILES = ("summary.json", "tests.txt", "log.txt", "trace.json")
MAX_FILE_BYTES = 16 * 2**20
TEST_FILES = ("tests/test_relay_equivalence.py", "tests/test_relay_options.py", "tests/test_precision.py",
              "tests/test_eps_engine.py", "tests/test_transport.py")
LOSS_BOUND_FACTOR = 2.0  # the relay may differ from PyTorch twice as much as PyTorch from itself
LOSS_BOUND_FLOOR = 1e-3  # nats: below this two curves agree whatever the reference's noise
# The largest model's EPS may take this share of MemAvailable less HOST_OVERHEAD: the EPS's bytes per
# parameter are measured whole (`l2l bench capacity`: 8.05 with 8-bit state against 8.03 counted);
# outside it `l2l finetune` holds the CUDA context and torch (~2 GiB), pinned staging for a few
# layers' weights and gradients (~2 GiB at Llama-3-8B's 436 MB layers) and the shard it reads.
HOST_MARGIN = 0.97
HOST_OVERHEAD = 6 * 2**30
ADAMW = {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


@dataclass(frozen=True)
class Sizes:
    """What each part runs: a real campaign's sizes, or the dry run's toys."""

    width: int  # the reference GPT's width in resident, capacity, loss
    heads: int
    context: int
    micro_batch: int  # sequences a micro-batch (resident)
    micro_batch_counts: tuple[int, ...]  # resident: micro-batches a step
    resident_layers: int  # 1.21 B parameters at width 2048
    capacity_batch: int  # sequences a step under the cap
    capacity_micro_batches: int  # the relay's
    capacity_start: tuple[int | None, int | None]  # the searches' first depths (PyTorch, relay; None: predicted)
    capacity_resolution: tuple[float, float]  # where each search stops (gpu_capacity.search)
    cap_bytes: int  # the device memory cap of capacity
    host_bytes: int | None  # the dry run's stand-in for the host's memory (None: the real one)
    loss_layers: int
    loss_batch: int
    loss_steps: int
    matmul_n: int
    rounds: int  # timed runs of each figure (>= 3)
    llama: dict = field(default_factory=dict)  # the Llama shape
    llama_context: int = 4096
    llama_batch: int = 8
    llama_micro_batches: int = 4
    llama_warmup: int = 2
    llama_timed: int = 5
    peer_steps: int = 4  # 1 warm-up + 3 timed
    timeout_s: int = 600  # one subprocess (a probe, a finetune, a peer)
    tests_k: str = "cuda"


REAL = Sizes(width=2048, heads=16, context=1024, micro_batch=8, micro_batch_counts=(8, 2), resident_layers=24,
             capacity_batch=64, capacity_micro_batches=8, capacity_start=(None, None), capacity_resolution=(0.0, 0.1),
             cap_bytes=16 * 2**30, host_bytes=None, loss_layers=20, loss_batch=16, loss_steps=50, matmul_n=8192,
             rounds=3, llama=gpu_llama.LLAMA_3_8B)
DRY = Sizes(width=64, heads=4, context=32, micro_batch=2, micro_batch_counts=(4, 2), resident_layers=2,
            capacity_batch=8, capacity_micro_batches=2, capacity_start=(16, 8), capacity_resolution=(1.0, 1.0),
            cap_bytes=24 * 2**20, host_bytes=160 * 2**20, loss_layers=2, loss_batch=4, loss_steps=8, matmul_n=256,
            rounds=3, llama={**gpu_llama.LLAMA_3_8B, "hidden_size": 64, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
                             "max_position_embeddings": 256},
            llama_context=64, llama_batch=4, llama_micro_batches=2, llama_warmup=1, llama_timed=3, peer_steps=4,
            timeout_s=300, tests_k="twin and transport")
DRY_LLAMA_LAYERS = (2, 3)  # the dry run's "8 B" depth and its largest (no host limit is searched there)


class PartFailed(Exception):
    """A part measured what its rule does not allow; its result is kept beside the failure."""

    def __init__(self, reason: str, result: dict):
        super().__init__(reason)
        self.result = result


PEER_RUNS = ("relay",) + gpu_peers.PEERS  # what the peers part runs (--peers picks)


class Campaign:
    """One campaign's device, sizes and folders; each part a method."""

    def __init__(self, out: Path, work: Path, dry_run: bool, peers: tuple[str, ...] = PEER_RUNS):
        self.out, self.work, self.dry_run, self.peer_runs = out, work, dry_run, peers
        self.sizes = DRY if dry_run else REAL
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.relay_device = "cpu-async" if dry_run else "cuda"
        name = f"cpu ({torch.get_num_threads()} threads)" if dry_run else torch.cuda.get_device_name(0)
        self.summary = {"dry_run": dry_run, "device": name, "sizes": asdict(self.sizes), "torch": torch.__version__,
                        "l2l_hw": l2l_hw.__version__ if hasattr(l2l_hw, "__version__") else None,
                        "parts": {}, "failed": {}}
        self.peak = {"measured": None, "dense": dense_bf16_peak(name)}
        self.max_file_bytes = MAX_FILE_BYTES
        self.llama_runs: dict[int, dict] = {}  # depth -> the relay's figures there (llama_8b, peers)

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

    def run(self, parts) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        for name in FILES[1:]:  # every file exists, whatever parts fail
            self.write(name, "")
        for name in parts:
            self.say(f"{name} ...")
            t0 = time.perf_counter()
            try:
                result = getattr(self, name)()
            except PartFailed as e:
                result = {**e.result, "failed": str(e)}
            except Exception as exc:  # one part failing must not cost the others
                result = {"failed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
            result["seconds"] = round(time.perf_counter() - t0, 1)
            self.summary["parts"][name] = result
            if "failed" in result:
                self.summary["failed"][name] = result["failed"]
            self.write("summary.json", json.dumps(self.summary, indent=1, default=str))
            self.say(f"{name} {'FAILED: ' + result['failed'] if 'failed' in result else 'done'} "
                     f"({result['seconds']} s)")
            self.free()
        return self.summary

    def free(self) -> None:
        gc.collect()  # a relay's EPS (tens of GB of host state) goes before the next part builds its own
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

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
              threads: int | None = None, account_memory: bool = False) -> l2l_hw.Relay:
        torch.manual_seed(0)
        eps = l2l_hw.make_eps("cpu", optimizer="adamw", lr=1e-4)
        return l2l_hw.Relay(build_gpt(cfg), lm_loss, eps=eps, device=self.relay_device, micro_batches=micro_batches,
                            recompute=recompute, activations=activations, precision="bf16", threads=threads,
                            account_memory=account_memory)

    def timed(self, train_step, x, y):
        """A step function returning its own seconds (the step has ended when train_step returns)."""

        def step() -> float:
            self._sync()
            t0 = time.perf_counter()
            train_step(x, y)
            return time.perf_counter() - t0

        return step

    def rates(self, steps: dict, tokens: int, per_token: float) -> dict:
        """Each step function timed round robin (1 warm-up, `rounds` runs): tokens/s and TFLOPS spreads."""
        times = round_robin(steps, self.sizes.rounds, warmup=1, self_timed=True)
        return {name: self.figures(tokens, t, per_token) for name, t in times.items()}

    def figures(self, tokens: int, seconds, per_token: float) -> dict:
        rate = rate_spread(tokens, seconds)
        return {"tokens_per_s": rate, "step_s": spread(seconds),
                **mfu(rate["median"], per_token, self.peak["measured"], self._dense())}

    def _dense(self) -> float | None:
        return self.peak["dense"]["tflops"] * 1e12 if self.peak["dense"]["tflops"] else None

    # -- the parts --------------------------------------------------------------------------
    def tests(self) -> dict:
        root = Path(__file__).resolve().parents[2]
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
        tflops = rate_spread(2 * n ** 3 / 1e12, [run() for _ in range(self.sizes.rounds)])
        self.peak["measured"] = tflops["median"] * 1e12
        self.say(f"matmul_peak: bf16 {n}^3 {fmt_spread(tflops, ' TFLOP/s', 1)}; dense bf16 of the part: "
                 f"{self.peak['dense']['tflops']} TFLOP/s ({self.peak['dense']['source']})")
        return {"n": n, "tflops": tflops, "dense_bf16": self.peak["dense"]}

    def resident(self) -> dict:
        s = self.sizes
        cfg = self.gpt(s.resident_layers)
        per_token = self.per_token(cfg)
        result = {"parameters": count_parameters(cfg), "flops_per_token": per_token}
        for u in s.micro_batch_counts:
            x, y = self.batch(u * s.micro_batch)
            tokens = x.numel()
            relay = self.relay(cfg, u)
            partners = {r: GPTPartner(cfg, self.device, r, u) for r in RECIPES}
            steps = {"relay": self.timed(relay.train_step, x, y)}
            steps.update({r: self.timed(p.step, x.to(self.device), y.to(self.device)) for r, p in partners.items()})
            first = self.rates(steps, tokens, per_token)
            stronger = max(RECIPES, key=lambda r: first[r]["tokens_per_s"]["median"])
            del partners, steps
            self.free()
            compiled = GPTPartner(cfg, self.device, stronger, u, compiled=True)
            t0 = time.perf_counter()
            compiled.step(x.to(self.device), y.to(self.device))  # the compilation
            compile_s = time.perf_counter() - t0
            second = self.rates({"relay": self.timed(relay.train_step, x, y),
                                 "compiled": self.timed(compiled.step, x.to(self.device), y.to(self.device))},
                                tokens, per_token)
            del compiled, relay
            self.free()
            partners = {**{r: (first[r], first["relay"]) for r in RECIPES},
                        f"compiled_{stronger}": (second["compiled"], second["relay"])}
            best = max(partners, key=lambda k: partners[k][0]["tokens_per_s"]["median"])
            ratio = {k: rel["tokens_per_s"]["median"] / p["tokens_per_s"]["median"] for k, (p, rel) in partners.items()}
            result[f"micro_batches_{u}"] = {
                "tokens_per_step": tokens, "relay": first["relay"], "relay_beside_compiled": second["relay"],
                **{k: p for k, (p, _) in partners.items()}, "compile_s": compile_s, "strongest": best,
                "relay_over": ratio, "relay_over_strongest": ratio[best]}
            self.say(f"resident u={u} ({tokens:,} tokens/step): relay {fmt_spread(first['relay']['tokens_per_s'])}"
                     + "".join(f"; {k} {fmt_spread(p['tokens_per_s'])}" for k, (p, _) in partners.items())
                     + f" tokens/s; relay / strongest ({best}) = {ratio[best]:.3f}")
        return result

    def capacity(self) -> dict:
        s = self.sizes
        layer = count_parameters(self.gpt(1)) - count_parameters(self.gpt(0))
        spec = {"width": s.width, "heads": s.heads, "context": s.context, "device": self.device.type,
                "relay_device": self.relay_device, "cap_bytes": s.cap_bytes, "host_bytes": s.host_bytes}
        probe = lambda side, **kw: lambda layers: gpu_capacity.run_probe(  # noqa: E731
            {**spec, "side": side, "layers": layers, **kw}, timeout=s.timeout_s)
        # PyTorch: micro-batches of one sequence, every block checkpointed
        start = s.capacity_start[0] or int(s.cap_bytes * 0.85 / (state_bytes_per_parameter("autocast") * layer))
        torch_layers, best, torch_tries = gpu_capacity.search(
            probe("torch", batch=s.capacity_batch, micro_batches=s.capacity_batch, steps=1 + s.rounds), start,
            s.capacity_resolution[0])
        self.say(f"capacity: PyTorch trains {torch_layers} layers under {s.cap_bytes / 2**30:g} GiB "
                 f"(probes {torch_tries})")
        result = {"cap_bytes": s.cap_bytes, "torch_layers": torch_layers, "torch_probes": torch_tries}
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
        relay = self.relay(cfg, micro_batches=2)
        curves = {"relay": [relay.train_step(x, y) for x, y in batches]}
        del relay
        self.free()
        for name, u in (("torch", 2), ("torch_one_micro_batch", 1)):
            partner = GPTPartner(cfg, self.device, "recipe", u)
            curves[name] = [partner.step(x.to(self.device), y.to(self.device)) for x, y in batches]
            del partner
            self.free()
        diff = max(abs(a - b) for a, b in zip(curves["relay"], curves["torch"]))
        noise = max(abs(a - b) for a, b in zip(curves["torch"], curves["torch_one_micro_batch"]))
        bound = max(LOSS_BOUND_FACTOR * noise, LOSS_BOUND_FLOOR)
        result = {"parameters": count_parameters(cfg), "steps": s.loss_steps, "curves": curves,
                  "max_abs_difference": diff, "torch_noise": noise, "bound": bound, "agree": diff <= bound}
        self.say(f"loss: {s.loss_steps} steps, {curves['relay'][0]:.4f} -> {curves['relay'][-1]:.4f}; relay vs "
                 f"PyTorch max |diff| {diff:.2e}, PyTorch's own bf16 noise {noise:.2e}, bound {bound:.2e}")
        if not result["agree"]:
            raise PartFailed(f"the loss curves differ by {diff:.3g} nats, over the bound {bound:.3g}", result)
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
        figures = {**gpu_llama.with_mfu(run, self.peak["measured"], self._dense()), "folder_s": made,
                   "optimizer_state": optimizer_state}
        self.say(f"l2l finetune, {layers} layers ({figures['parameters'] / 1e9:.2f} B, {optimizer_state} state): "
                 f"{fmt_spread(figures['tokens_per_s'])} tokens/s, {fmt_spread(figures['tflops'], ' TFLOPS', 1)}, "
                 f"peak device {_gib(figures['peak_device_bytes'])}, peak host RSS "
                 f"{_gib(figures['peak_host_rss_bytes'])}, GPU idle {_share(figures['gpu_idle_share'])}")
        self.llama_runs[layers] = figures
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

    def peers(self) -> dict:
        s = self.sizes
        host = _mem_available()
        runs = [p for p in gpu_peers.PEERS if p in self.peer_runs]

        def fits(layers: int) -> bool:
            parameters = gpu_llama.parameters(s.llama, layers)["total"]
            return all(gpu_peers.host_bytes(p, parameters) <= host for p in runs)

        layers = (DRY_LLAMA_LAYERS[0] if self.dry_run
                  else max((n for n in range(s.llama["num_hidden_layers"] + 1) if fits(n)), default=0))
        result = {"layers": layers, "host_available_bytes": host, "sized_by": (
            f"the deepest every peer's host memory fits in the {_gib(host)} available (gpu_peers.host_bytes: "
            f"DeepSpeed's estimators; ZeRO-2 offload's pinned buffers as it allocates them)")}
        self.say(f"peers: the model of Llama-3-8B's shape with {layers} layers ({result['sized_by']})")
        relay = None
        if "relay" in self.peer_runs:
            relay = result["relay"] = self.llama_runs.get(layers) or self.finetune(layers, "fp32")
        folder = self.folders().folder(layers)
        text = self.folders().text(gpu_llama.words_for(s.llama_warmup + s.llama_timed + 2, s.llama_batch,
                                                       s.llama_context))
        failed = []
        for peer in runs:
            try:
                result[peer] = self.peer(peer, folder, text, layers)
            except Exception as e:
                result[peer] = {"failed": f"{type(e).__name__}: {e}"}
                failed.append(peer)
            figures = result[peer]
            if "tokens_per_s" in figures:
                ratio = ""
                if relay is not None:
                    figures["relay_over_peer"] = relay["tokens_per_s"]["median"] / figures["tokens_per_s"]["median"]
                    ratio = f"; relay / {peer} = {figures['relay_over_peer']:.2f}"
                self.say(f"peers: {peer} {fmt_spread(figures['tokens_per_s'])} tokens/s, "
                         f"{fmt_spread(figures['tflops'], ' TFLOPS', 1)}{ratio}")
            else:
                self.say(f"peers: {peer}: {figures.get('failed') or figures.get('not_run')}")
        if failed:
            raise PartFailed("peers that could not run: " + "; ".join(f"{p}: {result[p]['failed']}" for p in failed),
                             result)
        return result

    def peer(self, peer: str, folder: Path, text: Path, layers: int) -> dict:
        s = self.sizes
        params = gpu_llama.parameters(s.llama, layers)["total"]
        if peer == "torch_resident" and self.device.type == "cuda":
            need = params * gpu_peers.RESIDENT_DEVICE_BYTES_PER_PARAMETER
            have = torch.cuda.get_device_properties(0).total_memory
            if need > have:
                return {"not_run": f"does not fit: {params / 1e9:.2f} B parameters x 16 B = {_gib(need)} before "
                                   f"activations, the device has {_gib(have)}"}
        rows = self.work / f"peer-{peer}-{layers}.jsonl"
        rows.unlink(missing_ok=True)
        spec = {"peer": peer, "model": str(folder), "data": str(text), "batch": s.llama_batch,
                "context": s.llama_context, "micro_batches": s.llama_micro_batches, "seed": 0,
                "cache": str(self.work / "peer-tokens"), "adamw": ADAMW, "device": self.device.type,
                "steps": s.peer_steps, "rows": str(rows), "port": _free_port()}
        env = dict(os.environ, PYTHONUNBUFFERED="1", **({"DS_ACCELERATOR": "cpu"} if self.dry_run else {}))
        log = self.work / f"peer-{peer}-{layers}.log"
        seen = watch([sys.executable, "-m", "l2l_hw.bench.gpu_peers", json.dumps(spec)], rows, log,
                               timeout=s.timeout_s, env=env)
        self.log(f"{peer}, {layers} layers", log_tail(log, 8000))
        if seen["returncode"] != 0 or len(seen["rows"]) < s.peer_steps:
            raise RuntimeError(f"exit {seen['returncode']} after {len(seen['rows'])} of {s.peer_steps} steps"
                               f"{' (' + seen['killed'] + ')' if seen['killed'] else ''}: "
                               f"{log_tail(log, 600)}")
        cfg = json.loads((folder / "config.json").read_text())
        figures = gpu_llama.step_figures(seen["rows"][1:], seen["rows"][0]["seen_at"], seen, cfg, s.llama_context,
                                         s.llama_batch)
        return gpu_llama.with_mfu(figures, self.peak["measured"], self._dense())

    # -- the first campaign's parts (gpu_extras) --------------------------------------------
    def memory_by_depth(self) -> dict:
        from l2l_hw.bench import gpu_extras

        return gpu_extras.memory_by_depth(self)

    def trace(self) -> dict:
        from l2l_hw.bench import gpu_extras

        return gpu_extras.trace(self)

    def syncs(self) -> dict:
        from l2l_hw.bench import gpu_extras

        return gpu_extras.syncs(self)

    def eps(self) -> dict:
        from l2l_hw.bench import gpu_extras

        return gpu_extras.eps(self)


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _share(x) -> str:
    return "n/a (no NVML)" if x is None else f"{x:.3f}"


PARTS = ("tests", "matmul_peak", "resident", "capacity", "loss", "llama_8b", "peers", "llama_largest")
EXTRA_PARTS = ("memory_by_depth", "trace", "syncs", "eps")


def run(out: str, dry_run: bool = False, parts: tuple[str, ...] = PARTS, work: str | None = None,
        peers: tuple[str, ...] = PEER_RUNS) -> dict:
    if not dry_run and not torch.cuda.is_available():
        raise ValueError("l2l bench gpu needs a CUDA device (torch.cuda.is_available() is False); "
                         "--dry-run runs it at toy size on the CPU")
    if work is not None:
        return Campaign(Path(out), Path(work), dry_run, peers).run(parts)
    with tempfile.TemporaryDirectory(prefix="l2l-bench-gpu-", ignore_cleanup_errors=True) as tmp:
        return Campaign(Path(out), Path(tmp), dry_run, peers).run(parts)


def format_report(summary: dict) -> str:
    lines = [f"GPU campaign on {summary['device']}{' (dry run)' if summary['dry_run'] else ''}"]
    for name, result in summary["parts"].items():
        state = f"FAILED: {result['failed']}" if "failed" in result else "ok"
        lines.append(f"  {name:14s} {state} ({result['seconds']} s)")
    lines.append(f"{len(summary['failed'])} of {len(summary['parts'])} parts failed" if summary["failed"]
                 else f"all {len(summary['parts'])} parts passed")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR", help="folder for summary.json, tests.txt, log.txt and "
                                                               "trace.json")
    p.add_argument("--work", metavar="DIR", help="folder for the model folders and runs (default: a temporary "
                                                 "folder, removed at the end; the Llama parts need ~35 GB)")
    p.add_argument("--dry-run", action="store_true", help="every part at toy size on the CPU (the relay on the "
                                                          "asynchronous twin, the peers on the CPU): the same files")
    p.add_argument("--parts", nargs="+", choices=PARTS + EXTRA_PARTS, default=list(PARTS),
                   help=f"the parts to run (default: {' '.join(PARTS)})")
    p.add_argument("--peers", nargs="+", choices=PEER_RUNS, default=list(PEER_RUNS),
                   help=f"what the peers part runs (default: {' '.join(PEER_RUNS)}); without relay, no ratio")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def run_from_args(args) -> int:
    summary = run(args.out, args.dry_run, tuple(args.parts), args.work, tuple(args.peers))
    print(json.dumps(summary, indent=2, default=str) if args.json else format_report(summary))
    return 1 if summary["failed"] else 0
