"""Schedules as data (l2l_hw/relay/actions.py): the lists docs/ARCHITECTURE.md shows are the
ones the code makes, and every list a schedule makes is a valid step: each micro-batch up
through the stage's layers in order and back down, the stages' sends matching the next
stage's receives one for one, each step committed after its last backward."""
import itertools
import re
from pathlib import Path

import pytest

from l2l_hw.relay.actions import SCHEDULES, layer_major

DOC = (Path(__file__).parent.parent / "docs" / "ARCHITECTURE.md").read_text()


def doc_blocks() -> list[str]:
    section = DOC[DOC.index("## A step as an action list"):DOC.index("## The relay's public surface")]
    return re.findall(r"```\n(.*?)```", section, re.S)


def test_the_relay_list_in_the_docs_is_the_one_the_relay_runs():
    assert doc_blocks()[0].splitlines() == [str(a) for a in layer_major([0, 1, 2, 3], 2)]


def test_the_pipeline_lists_in_the_docs_are_the_ones_each_stage_runs():
    rows = doc_blocks()[1].splitlines()[1:]
    columns = [[row[:29].strip() for row in rows], [row[29:].strip() for row in rows]]
    for stage, layers in enumerate(([0, 1], [2, 3])):
        made = [str(a) for a in SCHEDULES["flush"].actions(stage, 2, [layers], 2, 3)]
        assert [line for line in columns[stage] if line] == made


def check_stage_list(actions, layers_of_step, m, stage, stages, last_layer):
    """Each micro-batch: received (but on the first stage), forward through the step's layers
    ascending (the model's last layer as the loss), sent (but on the last stage); later its
    gradient received, backward descending, sent; each step committed once, after its
    micro-batches' backwards."""
    steps = len(layers_of_step)
    for g in range(steps * m):
        t = g // m
        mine = [a for a in actions if g in a.mbs]
        here = layers_of_step[t]
        want = ([("recv", None, "activations")] if stage > 0 else []) + \
            [("loss" if i == last_layer else "forward", i, "") for i in here] + \
            ([("send", None, "activations")] if stage < stages - 1 else []) + \
            ([("recv", None, "gradients")] if stage < stages - 1 else []) + \
            [("backward", i, "") for i in reversed(here) if i != last_layer] + \
            ([("send", None, "gradients")] if stage > 0 else [])
        assert [(a.op, a.layer, a.what) for a in mine] == want
    commits = [n for n, a in enumerate(actions) if a.op == "commit"]
    assert [actions[n].step for n in commits] == list(range(steps))
    for t, n in enumerate(commits):
        assert all(n > k for k, a in enumerate(actions) if a.op == "backward" and a.mbs[0] // m == t)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_every_1f1b_list_is_a_valid_step_and_the_stages_links_pair_up(schedule):
    for stages, m, steps in itertools.product((1, 2, 3, 4), (1, 2, 3, 5), (1, 3)):
        bounds = [round(s * 8 / stages) for s in range(stages + 1)]
        lists = []
        for s in range(stages):
            layers = [list(range(bounds[s], bounds[s + 1]))] * steps
            lists.append(SCHEDULES[schedule].actions(s, stages, layers, m, 7))
            check_stage_list(lists[-1], layers, m, s, stages, 7)
        for s in range(stages - 1):  # what stage s sends, stage s + 1 receives, in the same order
            sent = [(a.what, a.mbs) for a in lists[s] if a.op == "send" and a.what == "activations"]
            assert sent == [(a.what, a.mbs) for a in lists[s + 1] if a.op == "recv" and a.what == "activations"]
            back = [(a.what, a.mbs) for a in lists[s + 1] if a.op == "send" and a.what == "gradients"]
            assert back == [(a.what, a.mbs) for a in lists[s] if a.op == "recv" and a.what == "gradients"]


def test_the_relay_list_visits_each_active_layer_once_each_way_over_every_micro_batch():
    for layers in ([0, 1, 2, 3], [1, 3], [3]):
        actions = layer_major(layers, 3)
        assert [(a.op, a.layer) for a in actions] == \
            [("forward", i) for i in layers[:-1]] + [("loss", layers[-1])] + \
            [("backward", i) for i in reversed(layers[:-1])] + [("commit", None)]
        assert all(a.mbs == (0, 1, 2) for a in actions if a.op != "commit")


def test_only_the_interpreter_runs_a_layer_backward():
    # torch.autograd.backward over a layer's outputs (and a loss's .backward()) in one module of relay/
    relay = Path(__file__).parent.parent / "l2l_hw" / "relay"
    callers = {p.name for p in relay.glob("*.py")
               if re.search(r"torch\.autograd\.backward\(|\.backward\(\)", p.read_text())}
    assert callers == {"interpreter.py"}
