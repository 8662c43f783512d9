"""make_eps(..., state=...): bf16 and 8-bit optimizer state in the cpu and golden EPS (the
cpu EPS bit for bit as golden), checkpoints that keep the compressed state as it is (a
resumed run is bit-exact), and the backends that refuse a state format."""
import numpy as np
import pytest
import torch

import l2l_hw
from l2l_hw.checkpoint import open_checkpoint, save_checkpoint
from l2l_hw.eps import golden

STATES = ["bf16", "8bit"]
SHAPES = {"w": (300, 5), "b": (7,), "e": (2, 513)}  # none a multiple of the 256-element block
LR = dict(lr=3e-3, weight_decay=0.1)


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def grads(step, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(100 + step)
    out = {n: (torch.randn(s, generator=g) * 10.0 ** torch.empty(s).uniform_(-4, 1, generator=g)) for n, s in
           SHAPES.items()}
    out["e"][1] = 0  # a row, and so blocks, of zero gradient (zero state in those blocks)
    return {n: t.to(dtype) for n, t in out.items()}


def run(eps, steps, start=0):
    for step in range(start, start + steps):
        eps.push_grads("l0", grads(step))
        eps.commit_step()
    return eps


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().copy()


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and np.array_equal(bits(sa[k]), bits(sb[k])), k
    for n, t in a.fetch("l0").items():
        assert np.array_equal(bits(t), bits(b.fetch("l0")[n])), f"working copy {n}"


def make(backend, state, **options):
    eps = l2l_hw.make_eps(backend, working_dtype="bf16", state=state, **LR, **options)
    eps.register("l0", params())
    return eps


@pytest.mark.parametrize("double_buffer", [False, True], ids=["in-place", "double-buffer"])
@pytest.mark.parametrize("state", STATES)
def test_cpu_eps_bit_identical_to_golden_eps(state, double_buffer):
    cpu = run(make("cpu", state, double_buffer=double_buffer), 4)
    gold = run(make("golden", state, double_buffer=double_buffer), 4)
    assert_same_state(cpu, gold)


@pytest.mark.parametrize("state", STATES)
def test_state_dict_keeps_the_stored_form(state):
    eps = run(make("cpu", state), 2)
    sd = eps.state_dict()
    stored = golden.STORED_DTYPES[state]
    assert sd["l0/w/param"].dtype == torch.float32 and sd["l0/w/m"].dtype == stored == sd["l0/w/v"].dtype
    if state == "8bit":
        assert sd["l0/w/m_scale"].shape == (6,) and sd["l0/e/v_scale"].shape == (5,)  # ceil(1500/256), ceil(1026/256)
    # the fp32 view is the golden decoding of what is stored
    for slot in ("m", "v"):
        pieces = {k.split("/")[-1]: t for k, t in sd.items() if k.startswith(f"l0/w/{slot}")}
        decoded = golden.decode_state(golden.state_arrays({k: t.reshape(-1) for k, t in pieces.items()}), state, slot)
        assert np.array_equal(eps.read_state("l0", "w")[slot].reshape(-1).numpy().view(np.uint32), decoded.view(np.uint32))


@pytest.mark.parametrize("state", STATES)
def test_resume_from_checkpoint_is_bit_exact(state, tmp_path):
    straight = run(make("cpu", state), 5)
    first = run(make("cpu", state), 3)
    path = tmp_path / "eps.safetensors"
    save_checkpoint(path, first.state_entries(), {"state": state})
    resumed = l2l_hw.make_eps("cpu", working_dtype="bf16", state=state, **LR)
    resumed.register("l0", {n: torch.zeros(s) for n, s in SHAPES.items()})
    resumed.load_state_dict(open_checkpoint(path))
    assert resumed.step == 3
    run(resumed, 2, start=3)
    assert_same_state(resumed, straight)


def test_fp32_state_loads_into_8bit_eps_by_the_golden_encoding():
    fp32 = run(make("golden", "fp32"), 2)
    q8 = l2l_hw.make_eps("golden", working_dtype="bf16", state="8bit", **LR)
    q8.register("l0", {n: torch.zeros(s) for n, s in SHAPES.items()})
    sd = fp32.state_dict()
    for name in SHAPES:  # fp32 slots where the 8-bit EPS stores codes: encoded
        q8.load_tensor("l0", name, {s: sd[f"l0/{name}/{s}"] for s in ("param", "m", "v")})
    codes, scales = golden.quantize(sd["l0/w/v"].numpy(), golden.V_CODE)
    got = q8.state_dict()
    assert np.array_equal(got["l0/w/v"].reshape(-1).numpy(), codes)
    assert np.array_equal(got["l0/w/v_scale"].numpy().view(np.uint32), scales.view(np.uint32))


def test_a_checkpoint_of_another_state_format_is_refused():
    sd = run(make("cpu", "8bit"), 1).state_dict()
    bf16 = make("cpu", "bf16")
    with pytest.raises(ValueError, match=r"l0/\w/m is torch.uint8 .*expected torch.bfloat16"):
        bf16.load_state_dict(sd)


def test_unknown_state_format_is_refused():
    with pytest.raises(ValueError, match="unknown optimizer state format state='int4'; choose one of fp32, bf16, 8bit"):
        l2l_hw.make_eps("cpu", state="int4")


@pytest.mark.parametrize("backend", ["fpga-sim", "fpga-pynq"])
def test_fpga_backends_refuse_bf16_state_the_rtl_lacks_naming_what_they_support(backend):
    with pytest.raises(ValueError, match=rf"the {backend} EPS supports optimizer state fp32, 8bit only .*state='bf16'"):
        l2l_hw.make_eps(backend, state="bf16")


def test_sharded_eps_refuses_compressed_state():
    with pytest.raises(ValueError, match="shard_state=True keeps fp32 optimizer state only, not state='8bit'"):
        l2l_hw.make_eps("cpu", shard_state=True, state="8bit")
