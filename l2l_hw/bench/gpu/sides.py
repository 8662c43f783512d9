"""The sides of a comparison, each in a process of its own that loads, trains and unloads on request.

One process per family (relay, torch, deepspeed, fsdp2: gpu_peers.FAMILY), started on first
use and kept for the campaign (`Sides`), so that imports, CUDA's context and DeepSpeed's ops
are paid once, and so that each process has its own device memory cap
(torch.cuda.set_per_process_memory_fraction: every side under the same cap). The campaign
talks to it one JSON line at a time on its stdin, and reads its answers on a pipe of their own
(the process's stdout is sent to its log, with whatever the libraries print):

    {"load": {...}}   build the side from the saved model at a grid point (gpu_peers.side_config):
                      {"loaded": seconds}
    {"steps": n}      n training steps on the next minibatches: one {"row": {step, loss, seconds,
                      tokens}} each, then {"done": {peak_device_bytes, peak_rss_bytes}}
    {"unload": true}  free the model, its optimizer and their memory (host and device)
    {"exit": true}

A request that fails answers {"error": "...", "memory": true when memory ran out}, unloads, and
the process serves the next request; a process that dies (the OOM killer, a CUDA error) is
reported as such (SideDied) and started again at the next load. `python -m
l2l_hw.bench.gpu.sides '{json}'` is the process.
"""
from __future__ import annotations

import gc
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

MEMORY_ERRORS = ("out of memory", "can't allocate memory", "cannot allocate memory", "std::bad_alloc")


class SideError(RuntimeError):
    """A request failed in the side's process (it lives on); `memory`: memory ran out."""

    def __init__(self, message: str, memory: bool):
        super().__init__(message)
        self.memory = memory


class SideDied(RuntimeError):
    """The side's process ended (killed by the OOM killer, crashed, no answer in time): its exit
    and its log's end; `memory`: killed by SIGKILL, as the OOM killer kills."""

    def __init__(self, message: str, memory: bool = False):
        super().__init__(message)
        self.memory = memory


# ----------------------------------------------------------------------------- the campaign's end
class Side:
    """One family's process, seen from the campaign."""

    def __init__(self, family: str, device: str, cap_bytes: int | None, log: Path, env: dict | None = None,
                 timeout_s: float = 600):
        self.family, self.device, self.cap_bytes, self.log, self.env = family, device, cap_bytes, log, env
        self.timeout_s = timeout_s
        self.child: subprocess.Popen | None = None
        self.starts = 0

    def _start(self) -> None:
        read, write = os.pipe()
        spec = {"family": self.family, "device": self.device, "cap_bytes": self.cap_bytes, "port": free_port(),
                "answers_fd": write}
        with open(self.log, "ab") as log:
            self.child = subprocess.Popen([sys.executable, "-m", "l2l_hw.bench.gpu.sides", json.dumps(spec)],
                                          stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                          env=self.env, pass_fds=(write,), start_new_session=True, text=True)
        os.close(write)
        answers: queue.Queue = queue.Queue()  # this process's: a process before it has its own
        self.answers = answers
        reader = os.fdopen(read, "r")

        def pump() -> None:
            for line in reader:
                answers.put(json.loads(line))
            answers.put(None)  # the process's end

        threading.Thread(target=pump, daemon=True).start()
        self.starts += 1

    def start(self) -> None:
        """Start the process if it is not running (it imports its libraries while the campaign goes on)."""
        if self.child is None or self.child.poll() is not None:
            self._start()

    def request(self, what: dict, rows: list | None = None) -> dict:
        """Send one request; its last answer. Rows of a `steps` request go into `rows`."""
        self.start()
        try:
            self.child.stdin.write(json.dumps(what) + "\n")
            self.child.stdin.flush()
        except BrokenPipeError:
            pass  # it died: said below
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                answer = self.answers.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close(now=True)
                raise SideDied(f"{self.family}: no answer to {list(what)[0]} within {self.timeout_s:g} s; "
                               "its process was ended") from None
            if answer is None:
                code = self.child.wait()
                self.child = None
                raise SideDied(f"{self.family}'s process ended (exit {code}"
                               f"{', killed by SIGKILL: the OOM killer' if code == -9 else ''}): "
                               f"{_tail(self.log, 700)}", memory=code == -9)
            if "row" in answer and rows is not None:
                rows.append(answer["row"])
            elif "error" in answer:
                raise SideError(answer["error"], answer.get("memory", False))
            elif "row" not in answer:
                return answer

    def load(self, spec: dict) -> float:
        return self.request({"load": spec})["loaded"]

    def steps(self, n: int) -> tuple[list[dict], dict]:
        rows: list[dict] = []
        done = self.request({"steps": n}, rows)["done"]
        return rows, done

    def unload(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.request({"unload": True})

    def close(self, now: bool = False) -> None:
        """End the process: asked to exit (20 s), else killed; `now`: killed (it may be mid-request)."""
        if self.child is None:
            return
        if self.child.poll() is None and not now:
            try:
                self.child.stdin.write(json.dumps({"exit": True}) + "\n")
                self.child.stdin.flush()
                self.child.wait(timeout=20)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
        if self.child.poll() is None:
            os.killpg(self.child.pid, 9)
            self.child.wait()
        self.child = None


class Sides:
    """The campaign's side processes by family, started on first use, closed together."""

    def __init__(self, device: str, cap_bytes: int | None, work: Path, env: dict | None, timeout_s: float):
        self.device, self.cap_bytes, self.work, self.env, self.timeout_s = device, cap_bytes, work, env, timeout_s
        self.by_family: dict[str, Side] = {}

    def __getitem__(self, family: str) -> Side:
        if family not in self.by_family:
            self.by_family[family] = Side(family, self.device, self.cap_bytes, self.work / f"side-{family}.log",
                                          self.env, self.timeout_s)
        return self.by_family[family]

    def start(self, families) -> None:
        """Start these families' processes at once: their imports overlap each other and the work."""
        for family in families:
            self[family].start()

    def close(self, now: bool = False) -> None:
        for side in self.by_family.values():
            side.close(now)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path, chars: int) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


# ----------------------------------------------------------------------------- the side's end
class Trainer:
    """A loaded side: step(k) trains on minibatch k and returns its mean loss; close() frees it."""

    def __init__(self, step, close=lambda: None):
        self.step, self.close = step, close


def _adamw(spec: dict) -> dict:
    a = spec["adamw"]
    return {"lr": a["lr"], "betas": tuple(a["betas"]), "eps": a["eps"], "weight_decay": a["weight_decay"]}


def _gpt_data(spec: dict):
    import torch

    from l2l_hw.models import GPTConfig

    return GPTConfig(**spec["gpt"]), torch.load(spec["state"]), torch.load(spec["batches"])


def _llama_data(spec: dict):
    """The minibatches `l2l finetune` trains on: the same function, seed and held-out tenth."""
    from l2l_hw import finetune_data

    batches = finetune_data.finetune_batches(spec["folder"], spec["text"], spec["batch"], spec["context"],
                                             seed=spec["seed"], cache=Path(spec["cache"]))
    held = len(batches) // 10 or (1 if len(batches) > 1 else 0)
    return batches[held:]


def build_relay(spec: dict, device) -> Trainer:
    import l2l_hw

    knobs, u = spec["knobs"], spec["batch"] // spec["knobs"]["micro_batch"]
    options = dict(device=spec["relay_device"], micro_batches=u, recompute=knobs["recompute"],
                   activations=knobs["activations"], precision="bf16")
    eps = l2l_hw.make_eps("cpu", optimizer="adamw", **_adamw(spec))
    try:
        if "gpt" in spec:
            from l2l_hw.models import build_gpt, lm_loss

            cfg, state, batches = _gpt_data(spec)
            layers = build_gpt(cfg)
            layers.load_state_dict(state)
            relay = l2l_hw.Relay(layers, lm_loss, eps=eps, **options)
        else:
            from l2l_hw import hf

            batches = _llama_data(spec)
            relay = hf.from_pretrained(spec["folder"], eps=eps, **options)
    except BaseException:
        eps.close()  # its worker and its host state go now, not when collected
        raise
    return Trainer(lambda k: relay.train_step(*batches[k % len(batches)]), relay.close)


def build_torch(spec: dict, device) -> Trainer:
    import torch

    knobs, u = spec["knobs"], spec["batch"] // spec["knobs"]["micro_batch"]
    if spec["kind"] == "torch_compiled":
        from l2l_hw.bench.gpu.partners import GPTPartner

        cfg, state, batches = _gpt_data(spec)
        torch.compiler.reset()  # compiled afresh at each load, as in a new process (no recompile limit reached)
        partner = GPTPartner(cfg, device, "recipe", u, checkpointed=knobs["checkpointed"], compiled=True,
                             state=state, adamw=spec["adamw"])
        return Trainer(lambda k: partner.step(*(t.to(device) for t in batches[k % len(batches)])))
    from transformers import AutoModelForCausalLM

    batches = _llama_data(spec)
    model = AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.float32).to(device)
    _checkpointing(model, spec["knobs"])
    return _torch_loop(spec, model, batches, device, fused=device.type == "cuda", autocast=True)


def build_deepspeed(spec: dict, device) -> Trainer:
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    config = spec["config"]["deepspeed"]
    batches = _llama_data(spec)
    keep = HfDeepSpeedConfig(config) if spec["kind"] == "zero3_offload" else None  # loads partitioned: zero.Init
    model = AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.bfloat16)
    if keep is None:
        model = model.to(device)
    _checkpointing(model, spec["knobs"])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    u = config["gradient_accumulation_steps"]

    def step(k: int) -> float:
        inputs, (labels, _) = batches[k % len(batches)]
        total = 0.0
        for x, y in zip(inputs.tensor_split(u), labels.tensor_split(u)):
            loss = engine(input_ids=x.to(device), labels=y.to(device)).loss
            engine.backward(loss)
            engine.step()  # the optimizer steps at the last micro-batch (gradient_accumulation_steps)
            total += loss.item() / u
        return total

    def close() -> None:
        nonlocal engine, keep
        engine.destroy()
        engine = keep = None

    return Trainer(step, close)


def build_fsdp2(spec: dict, device) -> Trainer:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    knobs = spec["knobs"]
    batches = _llama_data(spec)
    mesh = init_device_mesh(device.type, (1,))
    model = AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.float32)  # on the host: offloaded
    _checkpointing(model, spec["knobs"])
    policy = dict(mesh=mesh, reshard_after_forward=knobs["reshard_after_forward"],
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                  offload_policy=CPUOffloadPolicy(pin_memory=knobs["pin_memory"] and device.type == "cuda"))
    layers = list(model.model.layers)
    for layer in layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    ahead = knobs["prefetch"]
    if ahead:  # explicit prefetch: the next `ahead` layers gathered while one runs, both ways
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + ahead])
            layer.set_modules_to_backward_prefetch(layers[max(0, i - ahead):i][::-1])
    last = spec["batch"] // knobs["micro_batch"] - 1
    return _torch_loop(spec, model, batches, device, fused=True,
                       before=lambda j: model.set_requires_gradient_sync(j == last))  # sync once


def _checkpointing(model, knobs: dict) -> None:
    """transformers' activation checkpointing (non-reentrant: each decoder layer's input kept, its
    inside recomputed), unless the grid point turns it off."""
    if knobs.get("checkpointed", True):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _torch_loop(spec: dict, model, batches, device, fused: bool, autocast: bool = False,
                before=lambda j: None) -> Trainer:
    """A PyTorch step over the micro-batches: gradients summed, then AdamW."""
    import contextlib

    import torch

    u = spec["batch"] // spec["knobs"]["micro_batch"]
    opt = torch.optim.AdamW(model.parameters(), **_adamw(spec), **({"fused": True} if fused else {}))
    cast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

    def step(k: int) -> float:
        inputs, (labels, _) = batches[k % len(batches)]
        total = 0.0
        for j, (x, y) in enumerate(zip(inputs.tensor_split(u), labels.tensor_split(u))):
            before(j)
            with cast():
                loss = model(input_ids=x.to(device), labels=y.to(device)).loss / u
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return Trainer(step)


BUILDERS = {"relay": build_relay, "torch": build_torch, "deepspeed": build_deepspeed, "fsdp2": build_fsdp2}


def _reset_peaks(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM counts again from here


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        for name in ("_host_emptyCache",):  # pinned blocks the caching host allocator keeps
            getattr(torch._C, name, lambda: None)()


def _rss_peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def serve(spec: dict) -> None:
    """The side's process: requests from stdin, answers to spec["answers_fd"]."""
    import torch

    answers = os.fdopen(spec["answers_fd"], "w")

    def say(what: dict) -> None:
        answers.write(json.dumps(what) + "\n")
        answers.flush()

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(0)
        if spec["cap_bytes"]:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_bytes"] / total))
    if spec["family"] in ("deepspeed", "fsdp2"):
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(spec["port"]))
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        if spec["family"] == "deepspeed":
            import deepspeed

            deepspeed.init_distributed(dist_backend=backend)
        else:
            dist.init_process_group(backend, rank=0, world_size=1)
    import transformers  # noqa: F401  imported before the first request, while the campaign goes on

    from l2l_hw import finetune_data, hf  # noqa: F401
    trainer, step_no, tokens = None, 0, 0
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if "load" in request:
                if trainer is not None:
                    trainer.close()
                trainer = None
                _free(device)
                _reset_peaks(device)
                load = request["load"]
                t0 = time.perf_counter()
                torch.manual_seed(load["seed"])
                trainer = BUILDERS[spec["family"]](load, device)
                step_no, tokens = 0, load["batch"] * load["context"]
                say({"loaded": time.perf_counter() - t0})
            elif "steps" in request:
                if trainer is None:
                    raise RuntimeError("steps asked of a side with nothing loaded")
                for _ in range(request["steps"]):
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    loss = trainer.step(step_no)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    step_no += 1
                    say({"row": {"step": step_no, "loss": loss, "seconds": time.perf_counter() - t0,
                                 "tokens": tokens}})
                say({"done": {"peak_device_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda"
                              else None, "peak_rss_bytes": _rss_peak()}})
            elif "unload" in request:
                if trainer is not None:
                    trainer.close()
                trainer = None
                _free(device)
                say({"unloaded": True})
            elif "exit" in request:
                break
        except Exception as e:  # noqa: BLE001  the request fails, the process serves the next
            text = f"{type(e).__name__}: {e}"
            if trainer is not None:
                try:
                    trainer.close()
                except Exception:  # noqa: BLE001  what is left is freed below
                    pass
            trainer = None
            _free(device)
            say({"error": text[:2000], "memory": isinstance(e, MemoryError) or any(
                m in text.lower() for m in MEMORY_ERRORS)})
    if trainer is not None:
        trainer.close()


if __name__ == "__main__":
    os.dup2(2, 1)  # what the libraries print goes to the log (stderr), never into the answers
    serve(json.loads(sys.argv[1]))
