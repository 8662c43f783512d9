"""The device: the relay's step replayed on a model's traces (trace.ModelTrace), against a ledger
of the bytes the relay's accounting counts (relay/memory.py), sampled where it samples.

    replay_step(model, policies, ...)    a train_step of relay/executor.py: StepMemory (peaks)
    replay_evaluate(model, ...)          an evaluate (a validation minibatch)
    pipeline_step(model, stage, ...)     a 1F1B stage's step

Each replays the action list the relay or the stage runs (relay/actions.py): one replay of
any list (_Replay), as one interpreter runs any list on the device.

Each takes the layers' traces and what the run chose (policies per layer, where activations are
kept, whether the device is the host, the gradient sums' width), never a config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from l2l_hw.estimate.trace import ModelTrace
from l2l_hw.relay.actions import SCHEDULES, evaluation, layer_major, next_visits


class _Ledger:
    """What the relay's accounting would count: named holders of storages (id -> bytes), each
    storage counted once however many hold it; `kept` holders are the activations kept for the
    backward (DeviceMemory's kept peak), the rest is everything else it samples."""

    def __init__(self, shared: tuple[str, ...] = ()):
        self.holders: dict[object, tuple[dict, bool]] = {}
        self.refs: dict[object, int] = {}
        self.kept_refs: dict[object, int] = {}
        self.size: dict[object, int] = {}
        self.total = self.kept_total = self.shared_total = 0
        self.peak = self.kept_peak = self.own_peak = 0
        self.shared = shared  # kinds of storage that are not the device's own (the EPS's buffers, on the CPU)

    def put(self, name, storages: dict, kept: bool = False) -> None:
        self.drop(name)
        self.holders[name] = (storages, kept)
        for sid, nbytes in storages.items():
            self.size[sid] = nbytes
            if not self.refs.get(sid):
                self.total += nbytes
                self.shared_total += nbytes if sid[0] in self.shared else 0
            self.refs[sid] = self.refs.get(sid, 0) + 1
            if kept:
                if not self.kept_refs.get(sid):
                    self.kept_total += nbytes
                self.kept_refs[sid] = self.kept_refs.get(sid, 0) + 1

    def drop(self, name) -> None:
        if name not in self.holders:
            return
        storages, kept = self.holders.pop(name)
        for sid in storages:
            self.refs[sid] -= 1
            if not self.refs[sid]:
                self.total -= self.size[sid]
                self.shared_total -= self.size[sid] if sid[0] in self.shared else 0
            if kept:
                self.kept_refs[sid] -= 1
                if not self.kept_refs[sid]:
                    self.kept_total -= self.size[sid]

    def drop_all(self, match: Callable[[object], bool]) -> None:
        for name in [n for n in self.holders if match(n)]:
            self.drop(name)

    def sample(self) -> None:
        self.peak = max(self.peak, self.total)
        self.kept_peak = max(self.kept_peak, self.kept_total)
        self.own_peak = max(self.own_peak, self.total - self.shared_total)


@dataclass
class StepMemory:
    """The device bytes of one relay step: the peak the relay's accounting reports
    (memory_report()'s peak_bytes, kept_activation_peak_bytes), the peak of what is not the
    EPS's own buffers (the CPU fetches the working copy without copying it), and what the step
    holds at most in host memory of its own (activations="host": the stash)."""

    peak: int
    kept_peak: int
    own_peak: int
    host_stash: int = 0
    actions: list = field(default_factory=list)  # (action, the device bytes after it), in the list's order


class _Replay:
    """An action list (relay/actions.py) run on a ledger instead of a device: each action does to
    the ledger what the stage's interpreter (relay/interpreter.py) does to the device, and the
    ledger is sampled where the interpreter samples. `model` is the stage's (its layers 0..n-1);
    `policies[i]` what layer i keeps for the backward ("none", "full", "selective");
    `first_stage`: the stage's input is the minibatch (on the host device: views of it);
    `last_stage`: its last layer is the model's. `after`: (action, device bytes after it)."""

    def __init__(self, model: ModelTrace, policies: list[str], activations: str, on_host: bool,
                 sum_widening: int, first_stage: bool = True, last_stage: bool = True):
        self.model, self.policies, self.activations = model, policies, activations
        self.on_host, self.sum_widening = on_host, sum_widening
        self.first_stage, self.last_stage = first_stage, last_stage
        self.u = len(model.traces[0])
        self.book = _Ledger(shared=("w", "frozen") if on_host else ())
        self.alias: dict[tuple, tuple] = {}  # an output that is the layer's input (a mask passed on)
        self.host = {"now": 0, "peak": 0}  # activations="host": the stash's bytes in host memory
        self.stashed: dict = {}  # activations="host": what went down, by stash key
        self.after: list[tuple] = []
        self.users: dict[str, list[int]] = {}  # group -> the layers using it, ascending
        for i, groups in enumerate(model.groups):
            for key in groups:
                self.users.setdefault(key, []).append(i)

    # -- references ----------------------------------------------------------------------------
    def act(self, i, j, k):  # input k of layer i, micro-batch j
        if i == 0 and self.first_stage and self.on_host:
            return ("batch", k)
        ref = ("a", i, j, k)
        while ref in self.alias:
            ref = self.alias[ref]
        return ref

    def inputs(self, i, j, floating_only=False) -> dict:
        t = self.model.traces[i][j]
        out = {}
        for k, b in enumerate(t.inputs):
            if t.floating[k] or not floating_only:
                ref = self.act(i, j, k)
                out[ref] = sum(self.model.traces[0][jj].inputs[k] for jj in range(self.u)) if ref[0] == "batch" else b
        return out

    def outputs(self, i, j) -> dict:
        t = self.model.traces[i][j]
        for k, a in enumerate(t.output_alias):
            if a is not None:
                self.alias[("a", i + 1, j, k)] = self.act(i, j, a)
        return {self.act(i + 1, j, k): b for k, b in enumerate(t.outputs)}

    def graph(self, i, j, refs, own, phase) -> dict:
        """The storages a graph saves; phase "forward" (a forward's, or the last layer's),
        "recompute" (the backward's second forward: its own output, its input from the stash)."""
        t, out, model = self.model.traces[i][j], {}, self.model
        from_host = phase == "recompute" and self.activations == "host"
        for kind, what in refs:
            if kind == "in":
                ref = self.act(i, j, what)
                out[("h",) + ref if from_host else ref] = self.inputs(i, j)[ref]
            elif kind == "out":
                fresh = phase == "recompute" or self.loss_layer(i)
                out[("o", i, j, what) if fresh else self.act(i + 1, j, what)] = t.outputs[what]
            elif kind == "param":
                key = model.names[i].get(what, (None,))[0]
                out[("w", key) if key else ("frozen", i)] = model.group_bytes[key] if key else model.frozen[i]
            elif kind == "kept":
                out[("h", "k", i, j, what) if from_host else ("k", i, j, what)] = t.kept_own[what]
            elif kind == "own":
                out[(phase, i, j, what)] = own[what]
        return {k: v for k, v in out.items() if v}

    def kept_outputs(self, i, j) -> dict:
        t = self.model.traces[i][j]
        return {(("k", i, j, what) if kind == "own" else self.act(i + 1, j, what)):
                (t.kept_own[what] if kind == "own" else t.outputs[what]) for kind, what in t.kept}

    def loss_layer(self, i) -> bool:
        return self.last_stage and i == len(self.model.traces) - 1

    def key(self, i, mbs):  # the interpreter's name of a visit
        return i if len(mbs) > 1 else (i, mbs[0] % self.u)

    # -- weights -------------------------------------------------------------------------------
    def fetch(self, i, mbs) -> None:  # layer_params: the groups come off the weight stream and are live
        book, model = self.book, self.model
        for key in model.groups[i]:
            book.drop(("inflight", key))
            if ("live", mbs, key) not in book.holders:
                book.put(("live", mbs, key), {("w", key): model.group_bytes[key]})
        if model.frozen[i]:
            book.put(("frozen", mbs, i), {("frozen", i): model.frozen[i]})

    def prefetch_next(self) -> None:  # the next visit's weights, and its stash (activations="host")
        nxt = self.next_visit[self.at]
        if nxt is None:
            return
        for key in self.model.groups[nxt.layer]:
            if ("live", nxt.mbs, key) not in self.book.holders:
                self.book.put(("inflight", key), {("w", key): self.model.group_bytes[key]})
        for name in (("stash", self.key(nxt.layer, nxt.mbs)), ("stash-kept", self.key(nxt.layer, nxt.mbs))):
            if name in self.stashed:
                self.book.put(("coming", name), self.stashed.pop(name), kept=True)

    def bind(self, action) -> None:
        self.fetch(action.layer, action.mbs)
        self.prefetch_next()

    def release_forward(self, i, mbs) -> None:
        kept = lambda u: self.policies[u] == "none"  # noqa: E731 (its graph holds its weights)
        if not kept(i):
            self.book.drop(("frozen", mbs, i))
        for key in self.model.groups[i]:
            users = self.users[key]
            if users[-1] == i and not any(kept(u) for u in users):
                self.book.drop(("live", mbs, key))

    def release_backward(self, i, mbs) -> None:
        self.book.drop(("frozen", mbs, i))
        for key in self.model.groups[i]:
            if self.users[key][0] == i:
                self.book.drop(("live", mbs, key))
                self.book.drop_all(lambda name: name[:2] == ("grad", key))

    # -- the stash -----------------------------------------------------------------------------
    def stash_put(self, name, held: dict) -> None:
        if self.activations == "device":
            self.book.put(name, held, kept=True)
            return
        self.stashed[name] = {("h",) + k: v for k, v in held.items()}  # copies in host memory
        self.host["now"] += sum(held.values())
        self.host["peak"] = max(self.host["peak"], self.host["now"])

    def stash_take(self, name) -> dict:
        book = self.book
        if self.activations == "device":
            held = book.holders.get(name, ({}, True))[0]
            book.drop(name)
            return held
        prefetch_name = ("coming", name)
        held = self.stashed.pop(name, None) or book.holders.get(prefetch_name, ({}, True))[0]
        book.drop(prefetch_name)
        self.host["now"] -= sum(held.values())
        return held

    def push_grads(self, i) -> None:  # the layer's backward made (or added to) its parameters' gradients
        for key, name, nbytes in self.model.names[i].values():
            self.book.put(("grad", key, name), {("g", key, name): nbytes * self.sum_widening})

    def grads_in(self, i, g) -> None:  # the gradients of layer i's inputs (none for the model's input)
        if not (i == 0 and self.first_stage):
            self.book.put(("grads_in", g), {("gi",) + k: v for k, v in self.inputs(i, g % self.u, True).items()})

    # -- the actions ---------------------------------------------------------------------------
    def run(self, actions) -> StepMemory:
        self.actions, self.after = list(actions), []
        self.next_visit = next_visits(self.actions)
        book, u = self.book, self.u
        for g in range(u):  # the micro-batches: uploaded at the step's start, or their receives posted
            if self.first_stage:
                book.put(("act", g), self.inputs(0, g))
            else:
                book.put(("posted", g), self.inputs(0, g))
            if not self.last_stage:  # the gradients of the stage's outputs (a mask passed on gets none)
                t = self.model.traces[-1][g]
                book.put(("posted-grads", g), {("gr", g, k): b for k, b in enumerate(t.outputs)
                                               if t.output_alias[k] is None})
        for self.at, action in enumerate(self.actions):
            getattr(self, action.op)(action)
            self.after.append((action, book.total))
        return StepMemory(book.peak, book.kept_peak, book.own_peak, self.host["peak"],
                          [(str(action), nbytes) for action, nbytes in self.after])

    def run_stage(self, actions, first: int) -> StepMemory:
        """`actions` of a stage whose layers are the model's [first, first + n): its own layers are
        this replay's 0..n-1; the actions keep the model's indices in what run returns."""
        shifted = [a._replace(layer=a.layer - first) if a.layer is not None else a for a in actions]
        step = self.run(shifted)
        step.actions = [(str(a), nbytes) for a, (_, nbytes) in zip(actions, step.actions)]
        return step

    def forward(self, a) -> None:
        book, i, mbs = self.book, a.layer, a.mbs
        p, key = self.policies[i], self.key(a.layer, a.mbs)
        self.bind(a)
        if p != "none":
            self.stash_put(("stash", key), {k: v for g in mbs for k, v in self.inputs(i, g % self.u).items()})
        kept = {}
        for g in mbs:
            j = g % self.u
            t = self.model.traces[i][j]
            if p == "none":
                book.put(("saved", i, g), self.graph(i, j, t.graph, t.own, "forward"), kept=True)
            elif p == "selective":
                kept.update(self.kept_outputs(i, j))
            book.put(("outs", g), self.outputs(i, j))
            book.sample()
        if kept:
            self.stash_put(("stash-kept", key), kept)
        self.release_forward(i, mbs)
        for g in mbs:
            book.put(("act", g), book.holders[("outs", g)][0])
            book.drop(("outs", g))

    def loss(self, a) -> None:
        book, i = self.book, a.layer
        self.bind(a)
        for g in a.mbs:
            t = self.model.traces[i][g % self.u]
            book.put(("saved", i, g), self.graph(i, g % self.u, t.graph, t.own, "forward"), kept=True)
            book.sample()
            self.push_grads(i)
            self.grads_in(i, g)
            book.sample()  # with the gradients it made
            book.drop(("saved", i, g))
        for g in a.mbs:
            book.drop(("act", g))
        self.release_backward(i, a.mbs)

    def backward(self, a) -> None:
        book, i, mbs, u = self.book, a.layer, a.mbs, self.u
        p, key = self.policies[i], self.key(a.layer, a.mbs)
        self.bind(a)
        inputs_left = self.stash_take(("stash", key)) if p != "none" else {}
        cache = self.stash_take(("stash-kept", key)) if p == "selective" else {}
        for g in mbs:
            book.put(("grads_out", g), book.holders[("grads_in", g)][0])
            book.drop(("grads_in", g))
        for g in mbs:
            j = g % u
            t = self.model.traces[i][j]
            if p != "none":  # what the policy still holds of the layer: the later micro-batches'
                mine = {("h",) + k if self.activations == "host" else k for k in self.inputs(i, j)}
                if j == u - 1 or not (i == 0 and self.first_stage and self.on_host):
                    inputs_left = {k: v for k, v in inputs_left.items() if k not in mine}
                cache = {k: v for k, v in cache.items() if k[-3:-1] != (i, j)}
                book.put(("held",), {**inputs_left, **cache}, kept=True)
                refs, own = (t.graph, t.own) if p == "full" else (t.replay, t.replay_own)
                book.put(("saved", i, g), self.graph(i, j, refs, own, "recompute"), kept=True)
            book.sample()
            self.push_grads(i)
            self.grads_in(i, g)
            book.sample()  # with the gradients it made
            book.drop(("grads_out", g))
            if p != "none":
                book.drop(("saved", i, g))
        book.drop_all(lambda name: name[0] == "saved" and name[1] == i and name[2] in mbs)
        book.drop(("held",))
        self.release_backward(i, mbs)

    def infer(self, a) -> None:
        book, i = self.book, a.layer
        self.bind(a)
        for g in a.mbs:
            book.put(("act", g), self.outputs(i, g % self.u))
        book.sample()
        book.drop(("frozen", a.mbs, i))
        for key in self.model.groups[i]:
            if self.users[key][-1] == i:
                book.drop(("live", a.mbs, key))

    def score(self, a) -> None:
        self.infer(a)
        for g in a.mbs:
            self.book.drop(("act", g))

    def recv(self, a) -> None:
        g = a.mbs[0]
        posted = ("posted", g) if a.what == "activations" else ("posted-grads", g)
        held = self.book.holders[posted][0]
        self.book.put(("act", g) if a.what == "activations" else ("grads_in", g), held)
        self.book.drop(posted)

    def send(self, a) -> None:  # what is sent stays until the stage's sends are finished (the run's end)
        g = a.mbs[0]
        name = ("act", g) if a.what == "activations" else ("grads_in", g)
        self.book.put(("sent", a.what, g), self.book.holders.get(name, ({}, False))[0])
        self.book.drop(name)

    def commit(self, a) -> None:
        pass


def replay_step(model: ModelTrace, policies: list[str], activations: str = "device",
                on_host: bool = True, sum_widening: int = 1) -> StepMemory:
    """The relay's train_step: its action list (relay/actions.py, layer_major) replayed on
    `model`'s storages, each layer keeping for the backward what its policy keeps. on_host: the
    device is the CPU (the micro-batches are views of the minibatch, the working copies the EPS's
    own buffers). sum_widening: a gradient sum's bytes per byte of the working copy (2 where bf16
    / fp16 gradients are summed in fp32, relay/precision.py)."""
    replay = _Replay(model, policies, activations, on_host, sum_widening)
    return replay.run(layer_major(range(len(model.traces)), len(model.traces[0])))


def replay_evaluate(model: ModelTrace, on_host: bool = True, stage: int = 0, stages: int = 1,
                    first: int = 0) -> StepMemory:
    """An evaluate (a validation minibatch, no graph) of the relay, or of a pipeline's stage: its
    action list replayed."""
    replay = _Replay(model, ["full"] * len(model.traces), "device", on_host, 1, stage == 0, stage == stages - 1)
    layers = range(first, first + len(model.traces))
    return replay.run_stage(evaluation(layers, len(model.traces[0]), stages, stage), first)


def pipeline_step(model: ModelTrace, stage: int, stages: int, policies: list[str], on_host: bool,
                  sum_widening: int = 1, activations: str = "device", first: int = 0) -> StepMemory:
    """A 1F1B stage's step (relay/pipeline.py): the stage's action list (relay/actions.py,
    OneFOneB) replayed on the stage's `model` (the model's layers [first, first + n)), each layer
    visited for one micro-batch at a time, the step's receives posted at its start and its sends
    held until its end."""
    n, last_stage = len(model.traces), stage == stages - 1
    replay = _Replay(model, policies, activations, on_host, sum_widening, stage == 0, last_stage)
    layers = list(range(first, first + n))
    actions = SCHEDULES["flush"].actions(stage, stages, [layers], len(model.traces[0]), layers[-1] if last_stage else -1)
    return replay.run_stage(actions, first)
