"""The generated register-map views match their source hdl/l2l_optim_regs.json."""
import l2l_hw.hw.regs as regs
from l2l_hw.eps.golden import LAYERWISE_SCALARS, MUON_SCALARS, StepScalars
from l2l_hw.hw import gen_regs


def test_generated_register_files_are_fresh():
    for path, text in gen_regs.generated().items():
        assert path.read_text() == text, f"{path.name} is stale: run python -m l2l_hw.hw.gen_regs"


def test_scalar_registers_name_golden_step_scalars():
    fields = set(StepScalars.__dataclass_fields__) - {"nesterov"} - set(LAYERWISE_SCALARS) - set(MUON_SCALARS)
    assert set(regs.SCALARS) == fields


def test_register_offsets_are_word_aligned_and_distinct():
    words = []
    for off, width, _ in regs.REGISTERS.values():
        assert off % 4 == 0
        words += [off + 4 * i for i in range(width // 32)]
    assert len(words) == len(set(words))
    assert regs.CTRL == 0 and regs.GIE == 4 and regs.IER == 8 and regs.ISR == 0x0C and regs.PARAM_SRC == 0x10
