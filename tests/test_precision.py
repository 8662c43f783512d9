"""Mixed precision: low-precision compute, fp32 masters, fp32 gradient sums rounded once, overflow
discards the whole step."""
import copy
import math

import pytest
import safetensors.torch
import torch
from torch import nn

import l2l_hw
from l2l_hw.models.gpt import lm_loss
from tests.helpers import DEVICES, coherent_batches, coherent_layers, ranks_ok, record_pushes
from tests.test_relay_equivalence import gpt, gpt_batches

BACKENDS = ["golden", "cpu"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
def test_low_precision_training_tracks_fp32(backend, precision, device):
    data = gpt_batches(8)
    losses = {}
    for p in ("fp32", precision):
        relay = l2l_hw.Relay(gpt(), lm_loss, eps=l2l_hw.make_eps(backend, lr=3e-3), micro_batches=2, precision=p, device=device)
        losses[p] = [relay.train_step(x, y) for x, y in data]
        state = relay.eps.state_dict()
        assert all(t.dtype == torch.float32 for k, t in state.items() if k != "step")  # fp32 masters
        working = relay.eps.fetch("layer1")
        assert all(t.dtype == relay.compute_dtype for t in working.values())
    assert losses[precision][-1] < losses[precision][0]  # it learns
    assert max(abs(a - b) for a, b in zip(losses["fp32"], losses[precision])) < 0.05 * losses["fp32"][0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
def test_inf_gradient_mid_backward_leaves_every_layer_at_its_pre_step_state(backend, device):
    eps = l2l_hw.make_eps(backend, lr=1e-3)
    relay = l2l_hw.Relay(gpt(), lm_loss, eps=eps, micro_batches=2, precision="fp16", device=device)
    data = gpt_batches(3)
    relay.train_step(*data[0])
    before = {k: v.clone() for k, v in eps.state_dict().items()}
    scale = relay.loss_scale
    push = eps.push_grads
    pushed = []

    def inject(key, grads, inv_scale=1.0):
        pushed.append(key)
        if key == "layer1":  # a middle layer: the head and block 2 were updated already
            grads = dict(grads)
            name = next(iter(grads))
            grads[name] = grads[name].clone()
            grads[name].view(-1)[0] = float("inf")
        push(key, grads, inv_scale)

    eps.push_grads = inject
    relay.train_step(*data[1])
    assert pushed.index("layer1") > 0, "later layers must have been updated before the overflow"
    after = eps.state_dict()
    for k, v in before.items():
        assert torch.equal(v, after[k]), f"{k} changed in a discarded step"
    assert relay.loss_scale == scale / 2
    eps.push_grads = push
    relay.train_step(*data[2])  # the next step trains normally
    assert eps.step == 2


def test_loss_scale_grows_after_clean_steps():
    relay = l2l_hw.Relay(gpt(), lm_loss, eps=l2l_hw.make_eps("golden"), micro_batches=1, precision="fp16")
    relay.scaler.growth_interval = 2
    scale = relay.loss_scale
    for x, y in gpt_batches(2):
        relay.train_step(x, y)
    assert relay.loss_scale == 2 * scale


def test_precision_must_match_an_eps_already_in_use():
    eps = l2l_hw.make_eps("cpu")
    l2l_hw.Relay(gpt(), lm_loss, eps=eps)
    with pytest.raises(ValueError, match="precision='bf16' needs an EPS whose working copy is bf16"):
        l2l_hw.Relay(gpt(), lm_loss, eps=eps, precision="bf16")
    with pytest.raises(ValueError, match="precision='fp8': must be one of fp32, bf16, fp16"):
        l2l_hw.Relay(gpt(), lm_loss, eps=l2l_hw.make_eps("cpu"), precision="fp8")


# -- gradient sums over micro-batches ------------------------------------------------------------
MICRO_BATCHES = 32
PER_MICRO_BATCH = 4  # samples
ROUNDINGS = 1.5  # the bound: the pushed gradient's error, in units of one rounding of the exact sum
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SCALE = 2.0 ** 14  # every sum of the coherent model's scaled gradients fits fp16 (65504) there


def group_of(i: int, name: str, tied: bool) -> str:
    """The EPS entry "layer{k}/{name}" of layer i's parameter: a tied weight is its first user's."""
    return "layer0/weight" if tied and (i, name) == (2, "weight") else f"layer{i}/{name}"


def exact_gradients(x, t, dtype, u: int, tied: bool) -> list[dict[tuple[int, str], torch.Tensor]]:
    """Plain PyTorch in fp64 on the weights and inputs the relay computes on (rounded to `dtype`):
    each micro-batch's loss (weighted by its share of the batch, as the minibatch mean) and the
    gradient of each use of each parameter, as [micro-batch][(layer, name)] -> fp64 tensor. A tied
    weight is untied here, so each use's contribution stands alone."""
    model = copy.deepcopy(coherent_layers(tied)).double()
    if tied:
        model[2].weight = nn.Parameter(model[0].weight.detach().clone())
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).double())
    grads = []
    for xs, ts in zip(x.chunk(u), t.chunk(u)):
        model.zero_grad()
        (nn.functional.mse_loss(model(xs.to(dtype).double()), ts.double()) * (len(xs) / len(x))).backward()
        grads.append({(i, n): p.grad.clone() for i, layer in enumerate(model) for n, p in layer.named_parameters()})
    return grads


def exact_sums(per_micro_batch: list[dict], tied: bool) -> dict[str, torch.Tensor]:
    """Each EPS entry's exact gradient: the fp64 sum over micro-batches and uses."""
    sums = {}
    for grads in per_micro_batch:
        for (i, n), g in grads.items():
            key = group_of(i, n, tied)
            sums[key] = sums.get(key, 0) + g
    return sums


def rel_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


def assert_within_one_rounding(pushed: dict[str, torch.Tensor], exact: dict[str, torch.Tensor], dtype, what: str):
    """Each pushed gradient (already multiplied by its inverse loss scale, in fp64) is within
    ROUNDINGS x the error of rounding its exact sum to `dtype` once."""
    assert set(pushed) == set(exact), what
    for key, s in exact.items():
        one = rel_error(s.to(dtype), s)
        err = rel_error(pushed[key], s)
        assert err <= ROUNDINGS * one, f"{what}: {key} is {err / one:.2f}x one {dtype} rounding ({one:.1e})"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("device", DEVICES)
def test_gradient_over_32_micro_batches_is_within_1_5_roundings_of_the_exact_fp64_sum(precision, tied, device):
    dtype, u = DTYPES[precision], MICRO_BATCHES
    x, t = coherent_batches(1, u * PER_MICRO_BATCH)[0]
    per_micro_batch = exact_gradients(x, t, dtype, u, tied)
    exact = exact_sums(per_micro_batch, tied)
    eps = l2l_hw.make_eps("cpu", optimizer="sgd", lr=1e-3)
    relay = l2l_hw.Relay(coherent_layers(tied), nn.functional.mse_loss, eps=eps, micro_batches=u,
                         precision=precision, device=device)
    if relay.scaler is not None:
        relay.scaler.scale = FP16_SCALE
    scale = relay.loss_scale
    pushed = {}
    record_pushes(eps, pushed)
    relay.train_step(x, t)
    assert relay.loss_scale == scale, "the step overflowed: no gradient to compare"
    got = {}
    for key, group in pushed.items():
        inv_scale = float(group.pop("inv_scale"))
        assert inv_scale == 1 / scale
        for name, g in group.items():
            assert g.dtype == dtype, f"{key}/{name} went to the EPS as {g.dtype}: the copy down must stay {dtype}"
            got[f"{key}/{name}"] = g.double() * inv_scale
    assert_within_one_rounding(got, exact, dtype, f"{precision}, {u} micro-batches")
    # The bound tells the two sums apart: a running sum in `dtype` of the same micro-batches' exact
    # gradients (what autograd's accumulation into a low-precision .grad computes) is far outside it.
    for key, s in exact.items():
        running = torch.zeros_like(s, dtype=dtype)
        for grads in per_micro_batch:
            for (i, n), g in grads.items():
                if group_of(i, n, tied) == key:
                    running += (g * scale).to(dtype)
        assert rel_error(running.double() / scale, s) > 2 * rel_error(s.to(dtype), s), key


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_sum_beyond_fp16_range_from_in_range_micro_batches_discards_the_step_and_halves_the_scale(device):
    # The tied model at the default scale: each backward's gradient fits fp16, some sum does not
    # (the reference says so first). Rounded once to fp16 on its way, that sum is an overflow.
    u = MICRO_BATCHES
    x, t = coherent_batches(1, u * PER_MICRO_BATCH)[0]
    eps = l2l_hw.make_eps("cpu", optimizer="sgd", lr=1e-3)
    relay = l2l_hw.Relay(coherent_layers(tied=True), nn.functional.mse_loss, eps=eps, micro_batches=u,
                         precision="fp16", device=device)
    scale, fp16_max = relay.loss_scale, torch.finfo(torch.float16).max
    per_micro_batch = exact_gradients(x, t, torch.float16, u, tied=True)
    assert max(float(g.abs().max()) for grads in per_micro_batch for g in grads.values()) * scale < fp16_max / 4
    assert max(float(s.abs().max()) for s in exact_sums(per_micro_batch, tied=True).values()) * scale > fp16_max
    before = eps.state_dict()
    relay.train_step(x, t)
    assert relay.loss_scale == scale / 2
    after = eps.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items()), "a step with an overflow changed the state"
    relay.train_step(x, t)  # at half the scale the sums fit: the step trains
    assert relay.loss_scale == scale / 2 and eps.step == 1


def pushed_by_rank(path, world: int) -> list[dict[str, torch.Tensor]]:
    """What each rank's EPS received in the first step (a worker's `record`), times its inverse scale."""
    out = []
    for rank in range(world):
        got = safetensors.torch.load_file(f"{path}.{rank}")
        out.append({k: g for k, g in got.items() if not k.endswith("/inv_scale")})
        assert all(float(s) == 1.0 for k, s in got.items() if k.endswith("/inv_scale"))
    return out


def powersgd_first_step(s: torch.Tensor, name: str, rank: int) -> torch.Tensor:
    """PowerSGD's first step on the ranks' mean gradient s (Vogels et al. 2019, Algorithm 1; the
    error feedback is still zero, so the ranks' sum is linear): P = s Q0, the projection of s
    onto the span of P, in fp64. Q0: the draw every rank makes (l2l_hw.relay.powersgd.initial_q)."""
    from l2l_hw.relay.powersgd import initial_q

    q0 = initial_q(name, s.shape[1], min(*s.shape, rank)).double()
    p_hat = torch.linalg.qr(s @ q0).Q
    return p_hat @ (p_hat.T @ s)


@pytest.mark.parametrize("reduction", ["replicated", pytest.param("sharded", marks=pytest.mark.slow),
                                       pytest.param("powersgd", marks=pytest.mark.slow)])  # CI runs one of 3 launches
def test_data_parallel_gradient_over_2_ranks_of_32_micro_batches_is_within_1_5_roundings(tmp_path, reduction):
    # Each rank sums its 32 micro-batches in fp32; the ranks reduce the fp32 sums (PowerSGD: compress
    # them); one rounding after.
    world, u, tied, rank = 2, MICRO_BATCHES, False, 4
    batch = world * u * PER_MICRO_BATCH
    ranks_ok("tests.dp_worker", world, dict(model="coherent", optimizer="sgd-momentum", steps=1, batch=batch,
                                            micro_batches=u, precision="bf16", shard_state=reduction == "sharded",
                                            grad_compression="powersgd" if reduction == "powersgd" else "none",
                                            powersgd_rank=rank, record=str(tmp_path / "pushed")), timeout_s=180)
    x, t = coherent_batches(1, batch)[0]
    exact = exact_sums(exact_gradients(x, t, torch.bfloat16, world * u, tied), tied)
    if reduction == "powersgd":  # the 32 x 32 weights are compressed at rank 4, the biases go exact
        exact = {k: powersgd_first_step(s, k, rank) if s.dim() == 2 else s for k, s in exact.items()}
    ranks = pushed_by_rank(tmp_path / "pushed", world)
    assert all(g.dtype == torch.bfloat16 for pushed in ranks for g in pushed.values())
    if reduction == "sharded":  # rank r holds elements [r S, (r + 1) S) of each flattened tensor, S = ceil(numel / world)
        whole = {k: torch.cat([pushed[k] for pushed in ranks])[:exact[k].numel()].view(exact[k].shape)
                 for k in exact}
        assert_within_one_rounding({k: g.double() for k, g in whole.items()}, exact, torch.bfloat16, "sharded")
    else:  # every rank's EPS receives the whole average
        for rank, pushed in enumerate(ranks):
            assert_within_one_rounding({k: g.double() for k, g in pushed.items()}, exact, torch.bfloat16,
                                       f"rank {rank}")


def test_pipeline_stages_push_gradients_summed_in_fp32_within_1_5_roundings(tmp_path):
    world, u, tied = 2, MICRO_BATCHES, False
    batch = u * PER_MICRO_BATCH
    ranks_ok("tests.pipe_worker", world, dict(model="coherent", optimizer="adamw", steps=1, batch=batch,
                                              micro_batches=u, precision="bf16", schedule="flush",
                                              record=str(tmp_path / "pushed")), timeout_s=180)
    x, t = coherent_batches(1, batch)[0]
    exact = exact_sums(exact_gradients(x, t, torch.bfloat16, u, tied), tied)
    stages = pushed_by_rank(tmp_path / "pushed", world)
    got = {k: g.double() for pushed in stages for k, g in pushed.items()}
    assert all(g.dtype == torch.bfloat16 for pushed in stages for g in pushed.values())
    assert_within_one_rounding(got, exact, torch.bfloat16, "2 pipeline stages")


@pytest.mark.parametrize("options", [dict(recompute="none"), dict(recompute="selective"), dict(pipedream_2bw=True),
                                     dict(clip_mode="layer"), dict(clip_mode="global")],
                         ids=["no-recompute", "selective", "2bw", "clip-layer", "clip-global"])
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_gradient_sums_hold_under_recompute_policies_2bw_and_clipping(options, device):
    dtype, u = torch.bfloat16, MICRO_BATCHES
    x, t = coherent_batches(1, u * PER_MICRO_BATCH)[0]
    exact = exact_sums(exact_gradients(x, t, dtype, u, tied=False), tied=False)
    norms = {}  # EPS group -> the fp64 norm of its exact gradient
    for key, s in exact.items():
        group = key.partition("/")[0]
        norms[group] = math.hypot(norms.get(group, 0.0), float(s.norm()))
    clip = 0.5 * min(norms.values()) if "clip_mode" in options else None  # every group is clipped
    eps = l2l_hw.make_eps("cpu", optimizer="sgd", lr=1e-3)
    relay = l2l_hw.Relay(coherent_layers(), nn.functional.mse_loss, eps=eps, micro_batches=u, precision="bf16",
                         device=device, clip_grad_norm=clip, **options)
    pushed, scales = {}, []
    record_pushes(eps, pushed)
    commit = eps.commit_step
    eps.commit_step = lambda grad_scale=1.0, **kw: scales.append(grad_scale) or commit(grad_scale=grad_scale, **kw)
    relay.train_step(x, t)
    coef = {group: 1.0 for group in norms}
    if options.get("clip_mode") == "layer":  # each group's pushed gradient is clipped to `clip`
        coef = {group: clip / (n + 1e-6) for group, n in norms.items()}
    if options.get("clip_mode") == "global":  # pushed whole; the factor comes at commit
        want = clip / (math.sqrt(sum(n * n for n in norms.values())) + 1e-6)
        assert scales == [pytest.approx(want, rel=2 ** -9)]
    want = {key: s * coef[key.partition("/")[0]] for key, s in exact.items()}
    got = {f"{k}/{n}": g.double() for k, group in pushed.items() for n, g in group.items() if n != "inv_scale"}
    assert_within_one_rounding(got, want, dtype, str(options))


@pytest.mark.parametrize("device", DEVICES)
def test_grad_sums_compute_opt_in_pushes_exactly_pytorchs_bf16_grad_accumulation(device):
    # The opt-in keeps autograd's running sum in bf16: plain PyTorch on the bf16 model, accumulating
    # .grad over the same micro-batches, gives the same bits.
    u = MICRO_BATCHES
    x, t = coherent_batches(1, u * PER_MICRO_BATCH)[0]
    model = copy.deepcopy(coherent_layers()).to(torch.bfloat16)
    for xs, ts in zip(x.chunk(u), t.chunk(u)):
        (nn.functional.mse_loss(model(xs.to(torch.bfloat16)).float(), ts) * (len(xs) / len(x))).backward()
    eps = l2l_hw.make_eps("cpu", optimizer="sgd", lr=1e-3)
    relay = l2l_hw.Relay(coherent_layers(), nn.functional.mse_loss, eps=eps, micro_batches=u, precision="bf16",
                         grad_sums="compute", device=device)
    pushed = {}
    record_pushes(eps, pushed)
    relay.train_step(x, t)
    for i, layer in enumerate(model):
        for name, p in layer.named_parameters():
            assert torch.equal(pushed[f"layer{i}"][name], p.grad), f"layer{i}/{name}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_gradient_larger_than_the_widening_chunk_is_summed_in_fp32_exactly(monkeypatch, dtype):
    # on the CPU a gradient past WIDEN_CHUNK elements is added to its fp32 sum a chunk at a time
    # (no fp32 copy of all of it): the same sum, bit for bit, as the fp32 additions done whole
    from l2l_hw.relay import precision

    monkeypatch.setattr(precision, "WIDEN_CHUNK", 1000)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, 613, generator=g).to(dtype) for _ in range(3)]  # 4291 elements: 5 chunks
    sums = precision.GradSums(dtype)
    leaf = sums.watch(torch.zeros(7, 613, dtype=dtype, requires_grad=True))
    for grad in grads:
        (leaf * grad).sum().backward()
    want = grads[0].float() + grads[1].float() + grads[2].float()
    assert torch.equal(sums.take({"w": leaf})["w"], want)
