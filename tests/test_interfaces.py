"""The interfaces between components. The relay's export API: the trained weights by each
layer's own names, streamed one EPS group at a time, a tied parameter once; materialize() and
the Hugging Face export use it, and nothing outside l2l_hw/relay reads the relay's internals
(its plans). The EPS interface: abstract methods only; the sharded EPS implements it by
wrapping another EPS, with no method that does nothing."""
import ast
from pathlib import Path

import torch
from torch import nn

import l2l_hw
from l2l_hw.models import GPTConfig, build_gpt, lm_loss

ROOT = Path(__file__).resolve().parents[1]


def trained_relay(tie_weights: bool):
    torch.manual_seed(0)
    relay = l2l_hw.Relay(build_gpt(GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8, tie_weights=tie_weights)),
                         lm_loss, eps=l2l_hw.make_eps("cpu", lr=1e-2), micro_batches=2)
    x = torch.randint(0, 256, (4, 8))
    relay.train_step(x, x.roll(-1, 1))
    return relay


def test_export_gives_every_tensor_of_every_layer_once_with_the_eps_masters_and_a_tied_one_as_none():
    relay = trained_relay(tie_weights=True)
    exported = list(relay.export())
    model = relay.materialize()
    names = [(i, n) for i, layer in enumerate(model) for n, _ in (*layer.named_parameters(), *layer.named_buffers())]
    assert [(e.layer, e.name) for e in exported] == names
    head = len(model) - 1
    tied = [e for e in exported if e.tensor is None]
    assert [(e.layer, e.name, e.first) for e in tied] == [(head, "lm_head.weight", (0, "wte.weight"))]
    masters = {key: relay.eps.master(key) for key in relay.eps.shapes}  # layer i's own tensors: group layer{i}
    given = [e for e in exported if e.tensor is not None and e.name in masters.get(f"layer{e.layer}", {})]
    for e in given:
        assert torch.equal(e.tensor, masters[f"layer{e.layer}"][e.name]), (e.layer, e.name)
    assert len(given) == sum(len(group) for group in masters.values())  # every master, once
    assert model[head].lm_head.weight is model[0].wte.weight  # one Parameter, as in the model trained


def test_export_reads_one_eps_group_at_a_time_in_layer_order(monkeypatch):
    relay = trained_relay(tie_weights=False)
    reads = []
    real = relay.eps.master
    monkeypatch.setattr(relay.eps, "master", lambda key: reads.append(key) or real(key))
    list(relay.export())
    assert reads == [f"layer{i}" for i in range(len(relay.layers))]


def test_nothing_outside_the_relay_package_reads_its_plans():
    readers = []
    for path in (ROOT / "l2l_hw").rglob("*.py"):
        if "relay" in path.relative_to(ROOT / "l2l_hw").parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "plans":
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not readers, readers


def test_relay_of_plain_modules_exports_frozen_parameters_and_buffers_as_held():
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    net[0].bias.requires_grad_(False)
    relay = l2l_hw.Relay(list(net), nn.functional.mse_loss, eps=l2l_hw.make_eps("cpu"))
    exported = {(e.layer, e.name): e.tensor for e in relay.export()}
    assert torch.equal(exported[(0, "bias")], net[0].bias.detach())
    assert torch.equal(exported[(1, "running_mean")], torch.zeros(3))
    assert exported[(0, "weight")].dtype == torch.float32 and not exported[(0, "weight")].is_meta


def test_the_eps_interface_is_abstract_methods_and_the_sharded_eps_has_no_method_that_does_nothing():
    import inspect

    from l2l_hw.eps.base import EPS
    from l2l_hw.eps.sharded import ShardedEps

    assert {"configure", "register", "fetch", "push_grads", "commit_step", "discard_step", "wait", "master",
            "state_entries", "load_state_dict"} <= EPS.__abstractmethods__
    tree = ast.parse(inspect.getsource(ShardedEps))
    empty = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.Lambda)):
            body = node.body if isinstance(node, ast.FunctionDef) else [ast.Return(node.body)]
            body = [b for b in body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]  # docstring
            if not body or all(isinstance(b, ast.Pass) for b in body) or (
                    len(body) == 1 and isinstance(body[0], ast.Return)
                    and (body[0].value is None or isinstance(body[0].value, ast.Constant))):
                empty.append(getattr(node, "name", f"lambda at line {node.lineno}"))
    assert not empty, empty
    assert not ShardedEps.__abstractmethods__


def test_no_eps_module_reads_a_private_attribute_of_another_object():
    """The engine, its kernels and its storages meet through public names only: in l2l_hw/eps/ no
    `x._name` but on self or cls (ctypes' `_fields_` is a public protocol name)."""
    readers = []
    for path in sorted((ROOT / "l2l_hw" / "eps").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("_")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not readers, readers


def private_names_of_classes(tree: ast.Module) -> set[str]:
    """The private names a module's classes define: their methods and class attributes, and what
    their methods store on self."""
    names = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_"):
                names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_")
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id.startswith("_"):
                names.add(node.id)
    return {n for n in names if not n.endswith("__")}


def test_no_module_reads_a_private_attribute_that_another_module_defines():
    """Components meet through public names: no `x._name` (x not self or cls) in one module of
    l2l_hw where `_name` belongs to a class of another. torch's own private names (a module's
    `_parameters`, a tensor's `_version`) are torch's, which l2l_hw's classes do not define."""
    trees = {path: ast.parse(path.read_text()) for path in sorted((ROOT / "l2l_hw").rglob("*.py"))}
    owners: dict[str, set[Path]] = {}
    for path, tree in trees.items():
        for name in private_names_of_classes(tree):
            owners.setdefault(name, set()).add(path)
    readers = [f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}"
               for path, tree in trees.items() for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr in owners and path not in owners[node.attr]
               and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
    assert not readers, readers

