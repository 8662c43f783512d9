"""The three regimes of the GPU campaign, each with the peers its users would choose, under one memory cap.

    regime_a  fits resident: the 1.21 B GPT (24 x 2048, context 1024); PyTorch in the relay's
              own recipe, compiled, resident; the relay must reach 0.95 of it
    regime_b  weights and gradients fit the cap, optimizer state does not: about 3 B (9 layers of
              Llama-3-8B's shape, 3.01 B); DeepSpeed ZeRO-2 offload (ZeRO-Offload), FSDP2 with
              its optimizer on the host; PyTorch with activation checkpointing, which cannot
              hold 16 B a parameter there, reported with its error and measured at the largest
              depth it holds; the relay must reach 1.3x the strongest
    regime_c  the weights do not fit: Llama-3-8B's shape (8.03 B); DeepSpeed ZeRO-3 offload
              (parameters and optimizer on the host), FSDP2 CPU offload; 1.3x the strongest

Every side runs in its own process under the same cap (sides.py), from the same saved model (a
GPT state file; a Llama folder through from_pretrained), on the same minibatches, the same
tokens a step, the same AdamW. A regime runs in five steps, recorded in the JSON as they end:

  1. sizes   each side's estimator (gpu_peers.needs) at the regime's depth against the host's
             available memory and the cap; a side it refuses is reported with that error, and
             the largest depth it admits is searched; the sides are compared at the largest
             depth they all admit
  2. grid    each side's short pre-run: its batch shapes, then each documented knob alone on the
             fastest shape, 1 warm-up and `grid_steps` timed steps a point, each from the saved
             model; every point, its error where it failed, and the winner
  3. runs    the winners take turns, `rounds` runs each (A B C A B C ...): in live processes, one
             window of `window` steps a run, where every side's host footprint fits together;
             else a fresh load a run (1 warm-up step, then the window)
  4. loss    PyTorch's own drift over its runs and grid points (the same model, data and recipe:
             other shapes, other knobs) x2 bounds every other side's difference from it, step by
             step; NaN or inf anywhere fails
  5. ratios  the relay's median tokens/s over each peer's, against the strongest, and the target

A peer that fails for another reason than memory, a NaN, a loss outside its bound, a side with
no point that runs: each fails the part with its reason (the other sides still run).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from l2l_hw.bench.gpu import checks as gpu_checks, llama as gpu_llama, peers as gpu_peers
from l2l_hw.bench.gpu.figures import ATTENTION, flops_per_token, fmt_spread, mfu
from l2l_hw.bench.gpu.sides import SideDied, SideError


@dataclass(frozen=True)
class Regime:
    name: str
    title: str
    model: str  # "gpt" (the reference GPT: width, heads) or "llama" (the campaign's Llama shape)
    layers: int  # the regime's depth
    batch: int  # sequences a step (the same tokens a step for every side)
    context: int
    sides: tuple[str, ...]  # compared, the relay first
    shapes: tuple[int, ...]  # sequences a micro-batch the grids try
    target_ratio: float
    capacity_peers: tuple[str, ...] = ()  # reported at `layers` with their error, measured at their largest
    width: int = 0  # the GPT's
    heads: int = 0
    grid_steps: int = 1  # timed steps of a grid point (after one warm-up)
    grid_points: int = 8  # points run at most per side (the shapes first)
    grid_budget_s: float = 150.0  # seconds of grid per side; the points past it are skipped, and said
    window: int = 2  # timed steps a run
    rounds: int = 3
    host_bytes: int | None = None  # the dry run's stand-in for the host's available memory
    cap_bytes: int | None = None  # the dry run's stand-in for the cap (None: the campaign's)


def regimes(dry_run: bool, width: int, heads: int, context: int) -> dict[str, Regime]:
    if not dry_run:
        return {
            "regime_a": Regime("regime_a", "fits resident: 1.21 B GPT", "gpt", 24, 64, context,
                               ("relay", "torch_compiled"), (8, 16), 0.95, width=width, heads=heads, grid_points=4),
            "regime_b": Regime("regime_b", "weights and gradients fit, optimizer state does not: ~3 B", "llama", 9, 8,
                               4096, ("relay", "zero2_offload", "fsdp2_offload"), (1, 2), 1.3,
                               capacity_peers=("torch_checkpointed",), grid_points=5, grid_budget_s=120),
            "regime_c": Regime("regime_c", "the weights do not fit: Llama-3-8B", "llama", 32, 8, 4096,
                               ("relay", "zero3_offload", "fsdp2_offload"), (1, 2), 1.3, grid_points=5,
                               grid_budget_s=120),
        }
    return {  # toy sizes; stand-ins chosen so that each path runs (campaign.DRY, tests/test_bench_gpu.py)
        "regime_a": Regime("regime_a", "fits resident (toy)", "gpt", 2, 8, context, ("relay", "torch_compiled"),
                           (2, 4), 0.95, width=width, heads=heads, grid_points=3, window=1, host_bytes=8 * 2**30),
        "regime_b": Regime("regime_b", "optimizer state does not fit (toy)", "llama", 3, 4, 64,
                           ("relay", "zero2_offload", "fsdp2_offload"), (1, 2), 1.3,
                           capacity_peers=("torch_checkpointed",), grid_points=3, window=1, host_bytes=16 * 2**30,
                           cap_bytes=2_400_000),  # PyTorch's 16 B a parameter holds 1 layer of 3
        "regime_c": Regime("regime_c", "the weights do not fit (toy)", "llama", 3, 4, 64,
                           ("relay", "zero3_offload", "fsdp2_offload"), (1, 2), 1.3, grid_points=2, window=1,
                           host_bytes=gpu_peers.HOST_PROCESS_BYTES + 4_000_000),  # ZeRO-3 holds 2 layers of 3
    }


class Runner:
    """One regime on a campaign `c` (campaign.Campaign): its model, sizes, grids, runs and checks."""

    def __init__(self, c, regime: Regime, result: dict):
        self.c, self.r, self.result = c, regime, result
        self.failures: list[str] = []
        self.cap = regime.cap_bytes or c.cap_bytes
        self.host = regime.host_bytes or c.host_budget()
        self.folders = gpu_llama.Folders(c.work / "llama", c.sizes.llama, c.device.type) if regime.model == "llama" \
            else None
        self.saved: dict[int, dict] = {}  # depth -> what a side loads
        self.models: dict[int, gpu_peers.Model] = {}

    # -- the model ------------------------------------------------------------------------
    def model(self, layers: int) -> gpu_peers.Model:
        if layers not in self.models:
            self.models[layers] = self._model(layers)
        return self.models[layers]

    def _model(self, layers: int) -> gpu_peers.Model:
        r = self.r
        if r.model == "gpt":
            from l2l_hw.models import count_parameters

            cfg = self.gpt(layers)
            per_layer = count_parameters(self.gpt(1)) - count_parameters(self.gpt(0))
            return gpu_peers.Model(count_parameters(cfg), max(per_layer, 256 * r.width), r.width, layers, 256,
                                   4 * r.width, 0)
        shape = self.c.sizes.llama
        n = gpu_llama.parameters(shape, layers)
        h = shape["hidden_size"]
        kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
        return gpu_peers.Model(n["total"], max(gpu_llama.layer_parameters(shape), shape["vocab_size"] * h), h, layers,
                               shape["vocab_size"], shape["intermediate_size"], h * kv)

    def gpt(self, layers: int):
        from l2l_hw.models import GPTConfig

        return GPTConfig(n_layer=layers, n_embd=self.r.width, n_head=self.r.heads, block_size=self.r.context,
                         bias=False)

    def per_token(self, layers: int) -> float:
        """Model FLOPs a token, causal attention counted as computed (figures.py)."""
        m = self.model(layers)
        tables = m.vocab * m.hidden if self.r.model == "llama" else (256 + self.r.context) * m.hidden
        return flops_per_token(m.parameters - tables, layers, m.hidden, self.r.context)

    def minibatches(self) -> int:
        r = self.r
        return max(1 + r.grid_steps, 1 + r.rounds * r.window) + 2

    def load_spec(self, kind: str, knobs: dict, layers: int) -> dict:
        c, r = self.c, self.r
        if layers not in self.saved:
            self.saved[layers] = self._save(layers)
        return {"kind": kind, "knobs": knobs, "batch": r.batch, "context": r.context, "seed": 0, "adamw": c.adamw,
                "relay_device": c.relay_device, **self.saved[layers],
                "config": gpu_peers.side_config(kind, knobs, r.batch, c.adamw, c.device.type)}

    def _save(self, layers: int) -> dict:
        """The saved model all sides start from, and its data."""
        c, r = self.c, self.r
        if r.model == "gpt":
            from l2l_hw.models import Corpus, build_gpt

            cfg = self.gpt(layers)
            torch.manual_seed(0)
            state, batches = c.work / f"{r.name}-gpt-{layers}.pt", c.work / f"{r.name}-batches.pt"
            torch.save(build_gpt(cfg).state_dict(), state)
            g = torch.Generator().manual_seed(0)
            corpus = Corpus.load()
            torch.save([corpus.batch("train", r.batch, r.context, generator=g) for _ in range(self.minibatches())],
                       batches)
            return {"gpt": dataclasses.asdict(cfg), "state": str(state), "batches": str(batches)}
        t0 = time.perf_counter()
        folder = self.folders.folder(layers)
        text = self.folders.text(gpu_llama.words_for(self.minibatches(), r.batch, r.context))
        self.result.setdefault("folder_s", {})[str(layers)] = round(time.perf_counter() - t0, 1)
        return {"folder": str(folder), "text": str(text), "cache": str(c.work / "tokens")}

    # -- 1. sizes --------------------------------------------------------------------------
    def needs(self, kind: str, knobs: dict, layers: int) -> gpu_peers.Needs:
        return gpu_peers.needs(kind, self.model(layers), knobs, self.r.context, batch=self.r.batch)

    def fits(self, n: gpu_peers.Needs) -> str | None:
        """None, or why the estimate does not fit here."""
        short = []
        if n.host_bytes > self.host:
            short.append(f"host {_gib(n.host_bytes)} > {_gib(self.host)} available")
        if n.device_bytes > self.cap:
            short.append(f"device {_gib(n.device_bytes)} > the {_gib(self.cap)} cap")
        return "; ".join(short) or None

    def points(self, kind: str) -> list[dict]:
        """Every point of the side's grid: the shapes, and the variations on the smallest."""
        g = gpu_peers.grid(kind, self.model(1).hidden, self.r.shapes)
        return g.first_points() + g.second_points(g.first_points()[0])

    def lean(self, kind: str) -> dict:
        """The side's leanest grid point at the regime's depth (the least device memory, then host)."""
        def need(knobs: dict) -> tuple[int, int]:
            n = self.needs(kind, knobs, self.r.layers)
            return n.device_bytes, n.host_bytes

        return min(self.points(kind), key=need)

    def largest(self, kind: str, start: int) -> int:
        """The most layers, at most `start`, at which one of the side's grid points fits."""
        points = self.points(kind)
        return next((n for n in range(start, 0, -1)
                     if any(self.fits(self.needs(kind, k, n)) is None for k in points)), 0)

    def size(self, kind: str) -> dict:
        """The side at the regime's depth by its estimator: a point that fits, or the leanest's
        shortfall and the largest depth one of its points fits."""
        fitting = [k for k in self.points(kind) if self.fits(self.needs(kind, k, self.r.layers)) is None]
        knobs = fitting[0] if fitting else self.lean(kind)
        n = self.needs(kind, knobs, self.r.layers)
        entry = {"at": self.r.layers, "host_bytes": n.host_bytes, "device_bytes": n.device_bytes, "how": n.how,
                 "estimates": n.parts, "knobs": knobs}
        if fitting:
            return {**entry, "fits": True, "layers": self.r.layers}
        why = self.fits(n)
        largest = self.largest(kind, self.r.layers - 1)
        self.c.say(f"{self.r.name}: {kind} does not fit {self.r.layers} layers by its estimator ({why}); "
                   f"the largest it admits: {largest}")
        return {**entry, "fits": False, "error": f"does not fit {self.r.layers} layers: {why}", "layers": largest}

    # -- one load of one side ----------------------------------------------------------------
    def trial(self, kind: str, knobs: dict, layers: int, steps: int) -> dict:
        """Load `kind` at a point, train `steps` steps (the first a warm-up), unload: its figures."""
        side = self.c.sides[gpu_peers.FAMILY[kind]]
        spec = self.load_spec(kind, knobs, layers)  # a config DeepSpeed refuses raises here: a failure
        try:
            load_s = side.load(spec)
            rows, done = side.steps(steps)
        except (SideError, SideDied) as e:
            _unload(side)
            return {"error": str(e), "memory": e.memory}
        except BaseException:  # a cut: the side may be mid-request, so it is ended, not asked
            side.close(now=True)
            raise
        _unload(side)
        return {"load_s": load_s, **done, **self.rate(kind, rows[1:]), "losses": [row["loss"] for row in rows],
                **({"deepspeed_read": spec["config"]["deepspeed_read"]} if "deepspeed_read" in spec["config"] else {})}

    def rate(self, kind: str, rows: list[dict]) -> dict:
        seconds = sum(row["seconds"] for row in rows)
        tokens = sum(row["tokens"] for row in rows)
        return {"tokens_per_s": tokens / seconds if seconds > 0 else float("nan"), "timed_steps": len(rows)}

    def check_losses(self, where: str, values, what: str = "losses") -> bool:
        """True where every value is finite; else False, the failure recorded."""
        try:
            gpu_checks.finite(f"{where} {what}", values)
            return True
        except gpu_checks.CheckFailed as e:
            self.failures.append(str(e))
            return False

    # -- 2. grid -----------------------------------------------------------------------------
    def tune(self, kind: str, layers: int) -> dict | None:
        r = self.r
        g = gpu_peers.grid(kind, self.model(1).hidden, r.shapes)
        record = self.result["grids"][kind] = {"points": [], "skipped": []}
        t0, steps = time.perf_counter(), 1 + r.grid_steps

        def run(points: list[dict]) -> None:
            for knobs in points:
                if len(record["points"]) >= r.grid_points or (
                        len(record["points"]) >= 2 and time.perf_counter() - t0 > r.grid_budget_s):
                    record["skipped"].append({"knobs": knobs, "why": f"past the grid's {r.grid_points} points or "
                                                                     f"{r.grid_budget_s:g} s"})
                    continue
                n = self.needs(kind, knobs, layers)
                why = self.fits(n)
                point = {"knobs": knobs, "host_bytes": n.host_bytes, "device_bytes": n.device_bytes}
                if why is not None:
                    point["error"] = f"not run: its estimate does not fit ({why})"
                else:
                    point.update(self.trial(kind, knobs, layers, steps))
                    if "error" in point and not point.get("memory"):
                        self.failures.append(f"{kind} at {knobs}: {point['error']}")
                    elif "losses" in point and not (self.check_losses(f"{kind} at {knobs}", point["losses"]) and
                                                    self.check_losses(f"{kind} at {knobs}", [point["tokens_per_s"]],
                                                                      "tokens/s")):
                        point["error"] = "a loss or its rate is not finite"
                record["points"].append(point)
                self.c.progress()
                self.c.say(f"{r.name}: {kind} {knobs}: " + (point["error"][:200] if "error" in point else
                                                            f"{point['tokens_per_s']:,.0f} tokens/s"))

        def best() -> dict | None:
            ran = [p for p in record["points"] if "error" not in p]
            return max(ran, key=lambda p: p["tokens_per_s"]) if ran else None

        for knobs in g.first_points():  # every point's config is built (and DeepSpeed's validated) up front
            gpu_peers.side_config(kind, knobs, r.batch, self.c.adamw, self.c.device.type)
        run(g.first_points())
        second = g.second_points(best()["knobs"] if best() else g.first_points()[0])  # none ran: from the leanest
        for knobs in second:
            gpu_peers.side_config(kind, knobs, r.batch, self.c.adamw, self.c.device.type)
        run(second)
        winner = best()
        record["winner"] = winner["knobs"] if winner else None
        record["seconds"] = round(time.perf_counter() - t0, 1)
        return winner["knobs"] if winner else None

    # -- 3. runs -----------------------------------------------------------------------------
    def together(self, winners: dict[str, dict], layers: int) -> bool:
        host = sum(self.needs(k, w, layers).host_bytes for k, w in winners.items())
        if host > self.host:
            return False
        if self.c.device.type == "cuda":
            total = torch.cuda.get_device_properties(0).total_memory
            return len(winners) * (self.cap + 2**30) <= total
        return True

    def runs(self, winners: dict[str, dict], layers: int) -> dict[str, list[list[float]]]:
        r = self.r
        live = self.together(winners, layers)
        self.result["alternation"] = (f"A B A B: {r.rounds} runs each, " + (
            f"windows of {r.window} steps in live processes (their host footprints fit together)" if live else
            f"a fresh load a run (1 warm-up, {r.window} timed steps: their host footprints do not fit together)"))
        runs = self.result["runs"] = {k: {"tokens_per_s_runs": [], "order": []} for k in winners}
        trajectories: dict[str, list[list[float]]] = {k: [] for k in winners}
        loaded = []
        try:
            if live:
                for kind, knobs in winners.items():
                    side = self.c.sides[gpu_peers.FAMILY[kind]]
                    side.load(self.load_spec(kind, knobs, layers))
                    loaded.append(side)
                    rows, _ = side.steps(1)
                    trajectories[kind].append([row["loss"] for row in rows])
            for round_no, kind in gpu_checks.alternated(list(winners), r.rounds):
                if live:
                    rows, done = self.c.sides[gpu_peers.FAMILY[kind]].steps(r.window)
                    figures = {**done, **self.rate(kind, rows)}
                    trajectories[kind][0].extend(row["loss"] for row in rows)
                else:
                    figures = self.trial(kind, winners[kind], layers, 1 + r.window)
                    if "error" in figures:
                        raise SideError(f"{kind}, run {round_no + 1}: {figures['error']}", figures.get("memory"))
                    trajectories[kind].append(figures["losses"])
                runs[kind]["tokens_per_s_runs"].append(figures["tokens_per_s"])
                runs[kind]["order"].append(round_no)
                for key in ("peak_device_bytes", "peak_rss_bytes"):
                    runs[kind][key] = max(runs[kind].get(key) or 0, figures.get(key) or 0) or None
                self.c.progress()
        except (SideError, SideDied):
            for side in loaded:
                _unload(side)
            raise
        except BaseException:  # a cut: the sides may be mid-request, so they are ended, not asked
            for side in loaded:
                side.close(now=True)
            raise
        for side in loaded:
            _unload(side)
        return trajectories

    # -- the whole regime --------------------------------------------------------------------
    def run(self) -> dict:
        c, r, res = self.c, self.r, self.result
        c.sides.start(dict.fromkeys(gpu_peers.FAMILY[k] for k in r.sides + r.capacity_peers))  # imports meanwhile
        res.update(title=r.title, memory_cap_bytes=self.cap, host_available_bytes=self.host, layers_asked=r.layers,
                   tokens_per_step=r.batch * r.context, sides=list(r.sides), grids={}, sizes={})
        for kind in r.sides + r.capacity_peers:
            res["sizes"][kind] = self.size(kind)
        layers = min(res["sizes"][k]["layers"] for k in r.sides)
        res["layers"] = layers
        if layers < 1:
            raise gpu_checks.CheckFailed(f"no depth every side's estimator admits: {res['sizes']}")
        res["parameters"] = self.model(layers).parameters
        res["compared_at"] = (f"{layers} layers, the regime's depth" if layers == r.layers else
                              f"{layers} layers: the largest every side's estimator admits (the errors at "
                              f"{r.layers} are in sizes)")
        c.say(f"{r.name}: {r.title}: compared at {layers} layers ({res['parameters'] / 1e9:.2f} B), cap "
              f"{_gib(self.cap)}, host {_gib(self.host)}")
        c.progress()
        winners = {}
        for kind in r.sides:
            try:
                knobs = self.tune(kind, layers)
            except Exception as e:  # noqa: BLE001  a peer that cannot even be configured fails; the others run
                self.failures.append(f"{kind}: {type(e).__name__}: {str(e)[:600]}")
                res["grids"].setdefault(kind, {})["failed"] = f"{type(e).__name__}: {str(e)[:2000]}"
                continue
            if knobs is None:
                self.failures.append(f"{kind}: no grid point ran at {layers} layers: "
                                     + "; ".join(p.get("error", "")[:200] for p in res["grids"][kind]["points"]))
            else:
                winners[kind] = knobs
        for kind in r.capacity_peers:
            res.setdefault("capacity_peers", {})[kind] = self.capacity_peer(kind)
        trajectories = {}
        if "relay" in winners and len(winners) > 1:
            try:
                trajectories = self.runs(winners, layers)
            except (SideError, SideDied) as e:
                self.failures.append(f"the alternated runs: {e}")
        self.finish(winners, trajectories, layers)
        if self.failures:
            raise PartFailedHere("; ".join(dict.fromkeys(self.failures)))
        return res

    def finish(self, winners: dict, trajectories: dict, layers: int) -> None:
        res, per_token = self.result, self.per_token(layers)
        res.update(flops_per_token=per_token, attention_counted=ATTENTION)
        for kind, run in res.get("runs", {}).items():
            if len(run["tokens_per_s_runs"]) == self.r.rounds:
                try:
                    run["tokens_per_s"] = gpu_checks.median_range(f"{kind} tokens/s", run["tokens_per_s_runs"])
                    run["tflops"] = {k: v * per_token / 1e12 if k != "runs" else v
                                     for k, v in run["tokens_per_s"].items()}
                    run.update({k: v for k, v in mfu(run["tokens_per_s"]["median"], per_token,
                                                     self.c.peak["measured"], self.c.dense_peak()).items()
                                if k != "tflops"})
                except gpu_checks.CheckFailed as e:
                    self.failures.append(str(e))
        # 4. the losses: every side's runs and grid points from step 1 against PyTorch's own drift
        every = {k: [p["losses"] for p in res["grids"][k]["points"] if "losses" in p] + trajectories.get(k, [])
                 for k in winners}
        for kind, curves in every.items():
            for curve in curves:
                self.check_losses(kind, curve)
        reference = [k for k in winners if k in gpu_peers.PYTORCH]
        check = res["loss_check"] = {"reference": reference[0] if reference else None}
        try:
            if not reference:
                raise gpu_checks.CheckFailed("no PyTorch side ran: no drift to bound the loss with")
            drift = gpu_checks.drift(every[reference[0]])
            limit = gpu_checks.bound(drift["drift"])
            check.update(pytorch_drift=drift, bound=limit, factor=gpu_checks.LOSS_BOUND_FACTOR,
                         floor=gpu_checks.LOSS_BOUND_FLOOR, max_abs_difference={}, agree={})
            for kind in winners:
                if kind == reference[0]:
                    continue
                diff = gpu_checks.difference(every[kind], every[reference[0]])
                check["max_abs_difference"][kind] = diff
                check["agree"][kind] = gpu_checks.agrees(diff, limit)
                if not check["agree"][kind]:
                    self.failures.append(f"{kind}'s losses differ from {reference[0]}'s by {diff:.3g} nats, over the "
                                         f"bound {limit:.3g} (2 x PyTorch's own drift {drift['drift']:.3g})")
        except gpu_checks.CheckFailed as e:
            self.failures.append(f"loss check: {e}")
        # 5. ratios
        rates = {k: run["tokens_per_s"]["median"] for k, run in res.get("runs", {}).items() if "tokens_per_s" in run}
        if "relay" in rates and len(rates) > 1:
            over = {k: rates["relay"] / v for k, v in rates.items() if k != "relay"}
            strongest = max(over, key=lambda k: rates[k])
            res.update(relay_over=over, strongest_peer=strongest, relay_over_strongest=over[strongest],
                       target_ratio=self.r.target_ratio, meets_target=over[strongest] >= self.r.target_ratio)
            self.c.say(f"{self.r.name}: " + "; ".join(f"{k} {fmt_spread(res['runs'][k]['tokens_per_s'])}"
                                                      for k in rates)
                       + f" tokens/s; relay / strongest ({strongest}) = {over[strongest]:.3f} (target "
                         f"{self.r.target_ratio})")

    def capacity_peer(self, kind: str) -> dict:
        """A peer that cannot hold the regime's depth: its error there, and its figures at the
        largest depth it holds (its estimator's, then one layer less while memory stops it)."""
        r, size = self.r, self.result["sizes"][kind]
        knobs = self.lean(kind)
        out = {"knobs": knobs}
        if size["fits"]:
            first = self.trial(kind, knobs, r.layers, 1 + r.window)
            if "error" not in first:
                return {**out, "layers": r.layers, **first, "note": "it holds the regime's depth"}
            out["error_at_regime_depth"] = first["error"]
            layers = r.layers - 1
        else:
            out["error_at_regime_depth"] = size["error"]
            layers = size["layers"]
            if layers < 1:
                n = self.needs(kind, knobs, 1)
                out.update(layers=0, note=f"its estimator admits no depth of this shape: at 1 layer host "
                                          f"{_gib(n.host_bytes)}, device {_gib(n.device_bytes)} ({n.how})")
                self.c.say(f"{r.name}: {kind}: {out['note'][:200]}")
                return out
        tries = []
        while layers >= 1 and len(tries) < 3:
            got = self.trial(kind, knobs, layers, 1 + r.window)
            tries.append({"layers": layers, **({"error": got["error"]} if "error" in got else {})})
            if "error" not in got:
                self.check_losses(kind, got["losses"])
                out.update(layers=layers, parameters=self.model(layers).parameters, tokens_per_s=got["tokens_per_s"],
                           peak_device_bytes=got.get("peak_device_bytes"))
                break
            if not got.get("memory"):
                self.failures.append(f"{kind} at {layers} layers: {got['error']}")
                break
            layers -= 1
        out["tries"] = tries
        if "layers" not in out:
            self.failures.append(f"{kind}: no depth ran ({tries})")
        self.c.say(f"{r.name}: {kind} at {r.layers} layers: {out['error_at_regime_depth'][:160]}; the largest it "
                   f"holds: {out.get('layers', 0)} layers")
        return out


class PartFailedHere(Exception):
    """The regime's failures, one line; the part keeps what it measured (campaign.Campaign)."""


def _unload(side) -> None:
    """Free what a side holds; a side that died has nothing left to free."""
    try:
        side.unload()
    except (SideError, SideDied):
        pass


def _gib(n) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def run_regime(c, name: str) -> dict:
    """The regime `name` on campaign `c`, its figures recorded into c.partial as they come."""
    return Runner(c, c.regimes[name], c.partial).run()

