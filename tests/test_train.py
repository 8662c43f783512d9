"""The training layer (l2l_hw/train.py): the guide's loop runs and resumes exactly, the
metrics reach callbacks and TensorBoard, and the package's imports stay layered."""
import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import l2l_hw
from l2l_hw.cli import main
from l2l_hw.train import ConfigError, TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "16", "--batch-size", "4",
        "--micro-batches", "2", "--lr", "3e-3", "--seed", "7"]

pytestmark = pytest.mark.usefixtures("one_thread")


def readme_training_snippet() -> str:
    readme = (ROOT / "docs" / "GUIDE.md").read_text()  # README's reference part
    section = readme.split("### The training loop from Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_guides_training_loop_runs_and_its_resume_is_bit_identical_to_a_straight_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    snippet = readme_training_snippet()
    assert "l2l_hw.train(" in snippet and "resume=True" in snippet
    scope = {}
    exec(compile(snippet, "docs/GUIDE.md", "exec"), scope)
    result = scope["result"]
    assert result.relay.step == 40 and [r["step"] for r in result.history] == list(range(1, 41))
    saved = [json.loads(line) for line in (tmp_path / "runs/mlp/metrics.jsonl").read_text().splitlines()]
    assert saved == result.history
    # the same config without the stop: one straight run (independent of the checkpoint), on the
    # the guide's layers built again (the relay left the snippet's own with their structure only)
    assert all(p.is_meta for layer in scope["layers"] for p in layer.parameters())
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(16, 64), nn.GELU()), nn.Linear(64, 1)]
    straight_cfg = dataclasses.replace(scope["cfg"], stop_after=None, out=str(tmp_path / "straight"))
    straight = train(straight_cfg, layers=layers, loss_fn=nn.functional.mse_loss, data=scope["data"],
                     val_data=scope["data"][:4])
    for got, want in zip(result.relay.materialize().parameters(), straight.relay.materialize().parameters()):
        assert torch.equal(got, want)
    assert [r["loss"] for r in result.history] == [r["loss"] for r in straight.history]
    assert result.val_loss == straight.val_loss


def test_resume_with_a_config_that_differs_from_the_checkpoint_is_refused_naming_the_field(tmp_path):
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(20)]
    cfg = TrainConfig(steps=20, batch_size=8, micro_batches=2, eval_every=10, out=str(tmp_path), verbose=False)
    train(cfg, layers=[nn.Linear(4, 2)], loss_fn=nn.functional.mse_loss, data=data)
    with pytest.raises(ConfigError, match=r"lr is 0.002 in the checkpoint, 0.1 given"):
        train(dataclasses.replace(cfg, lr=0.1, resume=True), layers=[nn.Linear(4, 2)],
              loss_fn=nn.functional.mse_loss, data=data)
    # a longer step target may change: the warm-up (None: a tenth of steps) stays the one the run began with
    longer = train(dataclasses.replace(cfg, steps=40, resume=True), layers=[nn.Linear(4, 2)],
                   loss_fn=nn.functional.mse_loss, data=data * 2)
    assert longer.relay.step == 40 and longer.relay.eps.config.warmup_steps == 2  # 20 // 10, not 40 // 10


def test_callbacks_get_every_metrics_row_and_a_prebuilt_relay_is_trained_in_place():
    torch.manual_seed(0)
    relay = l2l_hw.Relay([nn.Linear(4, 8), nn.Linear(8, 2)], nn.functional.mse_loss,
                         eps=l2l_hw.make_eps("cpu", lr=1e-2), micro_batches=2)
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(5)]
    seen = []
    result = train(TrainConfig(steps=5, eval_every=2, out=None, verbose=False), relay=relay, data=data,
                   val_data=data[:1], callbacks=[seen.append])
    assert result.relay is relay and relay.step == 5
    assert seen == result.history and [r["step"] for r in seen] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in seen if "val_loss" in r] == [2, 4, 5]
    # a finite iterable that ends early ends the run there, validated
    short = train(TrainConfig(steps=10, eval_every=4, out=None, verbose=False), relay=relay, data=data[:2],
                  val_data=data[:1])
    assert relay.step == 7 and short.history[-1]["step"] == 7 and "val_loss" in short.history[-1]


def test_tensorboard_event_files_hold_every_metric_at_every_step(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "4", "--eval-every", "2", "--tensorboard", "--out", str(out)]) == 0
    events = event_accumulator.EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for name in ("loss", "lr", "tokens_per_s", "elapsed", "val_loss"):
        logged = {e.step: e.value for e in events.Scalars(name)}
        want = {r["step"]: r[name] for r in rows if name in r}
        assert logged.keys() == want.keys() and all(logged[s] == pytest.approx(v, rel=1e-6) for s, v in want.items())


# ---------------------------------------------------------------------------- layering

def package_modules() -> dict[str, ast.Module]:
    """Every module of l2l_hw as it is on disk now (modules other developers add included)."""
    found = {}
    for path in sorted((ROOT / "l2l_hw").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def imports_of(name: str, tree: ast.Module, modules) -> list[tuple[str, ast.ImportFrom | ast.Import]]:
    """(imported l2l_hw module, node) for every import statement, at any depth of the file."""
    package = name if name in modules and (ROOT / Path(*name.split("."), "__init__.py")).exists() \
        else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node) for a in node.names if a.name.startswith("l2l_hw")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("l2l_hw"):
                continue
            for a in node.names:  # `from pkg import module` imports the module
                out.append((f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base, node))
    return out


def test_no_module_imports_a_private_name_of_another_module():
    offenders = []
    for path in [*(ROOT / "l2l_hw").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert not offenders, offenders


def _private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines: its functions, classes and methods, the attributes it
    assigns (self._x = ...) and its module-level variables."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_reads_a_private_attribute_of_another_module():
    """`x._name` (x not self or cls) where `_name` is private to another l2l_hw module: what one
    module needs of another is public. Not flagged: torch's own tensor attributes, and PYNQ's
    `_name_` hooks (its device protocol)."""
    trees = {path: ast.parse(path.read_text()) for path in [*(ROOT / "l2l_hw").rglob("*.py"),
                                                           *(ROOT / "tests").rglob("*.py")]}
    defined = {path: _private_names(tree) for path, tree in trees.items()}
    library = set().union(*(names for path, names in defined.items() if "l2l_hw" in path.parts))
    offenders = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            name = getattr(node, "attr", "")
            if (isinstance(node, ast.Attribute) and name in library and name not in defined[path]
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and not hasattr(torch.Tensor, name) and not name.endswith("_")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders


def import_graph() -> dict[str, set[str]]:
    """module -> the l2l_hw modules it imports, at any depth of the file (a function's lazy
    import included: it is a cycle all the same, only deferred). A package's __init__ counts
    as a module: importing a package's submodule back into it closes a cycle."""
    modules = package_modules()
    graph = {name: set() for name in modules}
    for name, tree in modules.items():
        for target, _ in imports_of(name, tree, modules):
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of more than one module: each holds an import cycle."""
    index, low, stack, found = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_strongly_connected_finds_the_cycle_pynq_and_pynq_sim_had():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(graph) == [{"a", "b", "c"}]


def test_no_import_cycle_inside_l2l_hw():
    cycles = strongly_connected(import_graph())
    assert not cycles, cycles


def imports_between(importers: str, imported: str) -> list[str]:
    """'a imports b' for every import of a module in package (or module) `imported` by one in `importers`."""
    def inside(name, package):
        return name == package or name.startswith(package + ".")
    modules = package_modules()
    return [f"{name} imports {target}" for name, tree in modules.items() if inside(name, importers)
            for target, _ in imports_of(name, tree, modules) if inside(target, imported) and target != name]


def test_the_library_never_imports_the_command_line():
    users = imports_between("l2l_hw", "l2l_hw.cli")
    assert not users, users


def test_the_hardware_floor_never_imports_the_eps():
    """l2l_hw/hw (register map, driver, transports) sits below the EPS that uses it: what
    both need (the quantization block) lives in the register map, l2l_hw/hw/regs.py."""
    users = imports_between("l2l_hw.hw", "l2l_hw.eps")
    assert not users, users
