"""Schedules as data: a step of the relay or of a pipeline stage is a list of actions.

    forward  i m    one visit of layer i on micro-batches m: its weights bound (fetched,
                    unless a kept graph holds them), the next visit's fetch started, its
                    forward on each micro-batch, what the recompute policy keeps kept; then
                    its weights released (a group after its last forward use, unless a
                    kept graph computes on them)
    loss     i m    the model's last layer: forward, loss and backward on each micro-batch
    backward i m    one visit of layer i: its forward recomputed (or its graph taken) and
                    backpropagated on each micro-batch; a group's gradient leaves after its
                    last use in the backward (its first user): summed in host memory where
                    micro-batches of the step are still to come, else pushed to the EPS
    infer    i m    evaluation: layer i's forward without grad; its weights released after
                    their last use
    score    i m    evaluation: the model's last layer and the loss, no backward
    recv / send     a pipeline stage's activations (from the stage before, to the next) and
                    their gradients (from the next, to the stage before), micro-batch m
    commit   t      step t's pushed updates committed (the EPS's, whatever the backend)

A visit over several micro-batches (the relay: every micro-batch of the step) holds the
layer's weights once for all of them; a visit of one micro-batch (a pipeline stage, whose
1F1B interleaves micro-batches) holds them for that one. Micro-batches are numbered over the
list's steps (step t's are t*M .. t*M + M - 1), so a 2BW pipeline's list spans several steps.

The layer stage runs any list (l2l_hw/relay/interpreter.py); the Relay and the pipeline each
only make theirs (layer_major, one_f_one_b) and run it. `print(*actions, sep="\\n")` shows one.
The model to learn from: torch.distributed.pipelining's _Action lists and its runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

COMPUTE = ("forward", "loss", "backward", "infer", "score")


class Action(NamedTuple):
    op: str  # forward, loss, backward, infer, score, recv, send, commit
    layer: int | None = None  # the whole model's layer (forward, loss, backward)
    mbs: tuple[int, ...] = ()  # the micro-batches (over the list's steps)
    what: str = ""  # recv / send: "activations" or "gradients"
    step: int = 0  # commit: the step of the list it commits

    def __str__(self) -> str:
        mbs = f"{self.mbs[0]}-{self.mbs[-1]}" if len(self.mbs) > 1 else "".join(map(str, self.mbs))
        if self.op in COMPUTE:
            return f"{self.op} {self.layer} mb {mbs}"
        if self.op == "commit":
            return f"commit step {self.step}"
        return f"{self.op} {self.what} mb {mbs}"


def next_visits(actions: Sequence[Action]) -> list[Action | None]:
    """For each action, the compute action after it (None after the last): whose weights a visit
    starts fetching once it has its own."""
    out: list[Action | None] = [None] * len(actions)
    for n in range(len(actions) - 2, -1, -1):
        out[n] = actions[n + 1] if actions[n + 1].op in COMPUTE else out[n + 1]
    return out


def layer_major(layers: Sequence[int], micro_batches: int) -> list[Action]:
    """The relay's step over the active `layers` (ascending, the last is the model's last): each
    layer visited once forward on every micro-batch, the last layer's loss, each layer once
    backward in reverse; then the commit."""
    every = tuple(range(micro_batches))
    return ([Action("forward", i, every) for i in layers[:-1]] + [Action("loss", layers[-1], every)] +
            [Action("backward", i, every) for i in reversed(layers[:-1])] + [Action("commit")])


def evaluation(layers: Sequence[int], micro_batches, stages: int = 1, stage: int = 0) -> list[Action]:
    """Evaluation over the stage's `layers` (ascending; the model's last is last where this stage
    has it): one visit of each layer on every micro-batch (the relay), or, on a pipeline stage,
    each micro-batch received, through the layers, sent on (`micro_batches`: an int M or the
    stage's micro-batches one at a time, a list)."""
    if stages == 1:
        every = tuple(range(micro_batches))
        return [Action("infer", i, every) for i in layers[:-1]] + [Action("score", layers[-1], every)]
    out = []
    for g in range(micro_batches):
        out += [Action("recv", mbs=(g,), what="activations")] if stage > 0 else []
        out += [Action("infer", i, (g,)) for i in layers]
        if stage < stages - 1:
            out.append(Action("send", mbs=(g,), what="activations"))
        else:
            out[-1] = out[-1]._replace(op="score")
    return out


@dataclass(frozen=True)
class OneFOneB:
    """1F1B (PipeDream-Flush's order): fill with S - s - 1 forwards, then alternate one forward
    and one backward, then drain. At most S - s micro-batches in flight on stage s."""

    name: str
    pipedream_2bw: bool  # compute on the weights one commit back (2bw) or on the newest (flush)

    @staticmethod
    def order(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
        """("F", j) / ("B", j): the forwards and backwards of micro-batches through the stage."""
        fill = min(stages - stage - 1, micro_batches)
        out = [("F", j) for j in range(fill)]
        for j in range(micro_batches - fill):
            out += [("F", fill + j), ("B", j)]
        return out + [("B", j) for j in range(micro_batches - fill, micro_batches)]

    def actions(self, stage: int, stages: int, step_layers: Sequence[Sequence[int]], micro_batches: int,
                last_layer: int) -> list[Action]:
        """Stage `stage`'s list for the steps whose active layers here are `step_layers` (one list a
        step, ascending; `last_layer`: the model's last): each micro-batch received, through the
        stage's layers one visit each, sent on; its gradients back the same way; each step
        committed after its last micro-batch's backward."""
        first, last = stage == 0, stage == stages - 1
        out = []
        for kind, g in self.order(stage, stages, micro_batches * len(step_layers)):
            t, j = divmod(g, micro_batches)
            here = step_layers[t]
            if kind == "F":
                out += [Action("recv", mbs=(g,), what="activations")] if not first else []
                out += [Action("loss" if i == last_layer else "forward", i, (g,)) for i in here]
                out += [Action("send", mbs=(g,), what="activations")] if not last else []
            else:
                out += [Action("recv", mbs=(g,), what="gradients")] if not last else []
                out += [Action("backward", i, (g,)) for i in reversed(here) if i != last_layer]
                out += [Action("send", mbs=(g,), what="gradients")] if not first else []
                out += [Action("commit", step=t)] if j == micro_batches - 1 else []
        return out

    @staticmethod
    def bubble(stages: int, micro_batches: int) -> float:
        """The idle fraction of a step with equal stages and free transfers: (S - 1) / (M + S - 1)."""
        return (stages - 1) / (micro_batches + stages - 1)


SCHEDULES = {"flush": OneFOneB("flush", pipedream_2bw=False), "2bw": OneFOneB("2bw", pipedream_2bw=True)}
