"""fp32_to_fp16 against SoftFloat f32_to_f16, bit-exact with flags."""

import softfloatpy as sf

from fp_common import vector_tests, F16, F32, FpTB, boundary_grid

DROPPED = 13  # mantissa bits binary32 has and binary16 lacks


class TB(FpTB):
    OPERAND_PORTS = ("a",)

    async def check_ops(self, name, operands, stall=True):
        await self.check(name, sf.f32_to_f16, (F32,), F16, operands, stall)


def special_vectors():
    return [(a,) for a in F32.specials()]


def tie_patterns():
    """Dropped bits just below, at and above the half-way point, and zero."""
    half = 1 << (DROPPED - 1)
    return (0, 1, half - 1, half, half + 1, (1 << DROPPED) - 1)


def boundary_vectors():
    # binary32 values at binary16's range ends: its max, overflow threshold,
    # min normal, subnormals and the round-to-zero threshold 2^-25.
    f16_exps = [127 + e for e in (15, 16, 14, -14, -15, -24, -25, -26, -13)]
    grid = boundary_grid(F32) + [F32.pack(s, e, m) for s in (0, 1) for e in f16_exps
                                 for m in (0, 1, 0x7FFFFF, 0x7FE000, 0x7FF000, 0x400000, 0x001000)]
    vec = [(a,) for a in grid]
    # Every boundary value with its dropped bits replaced by each tie pattern,
    # with the kept LSB both even and odd.
    low = (1 << DROPPED) - 1
    for x in grid:
        for t in tie_patterns():
            vec.append(((x & ~low) | t,))
            vec.append(((x & ~low) | (1 << DROPPED) | t,))
    return vec


def random_vectors(n, rng):
    vec = []
    ties = tie_patterns()
    low = (1 << DROPPED) - 1
    for _ in range(n):
        # half the exponents uniform over 0..255, half inside binary16's reach
        if rng.random() < 0.5:
            x = F32.random_value(rng)
        else:
            x = F32.random_value(rng, 127 - 27, 127 + 16)
        if rng.random() < 0.3:
            x = (x & ~low) | rng.choice(ties)
        vec.append((x,))
    return vec


# The four tests every unit bench runs: specials, boundaries, random, back to back.
globals().update(vector_tests(TB, special_vectors, boundary_vectors, random_vectors,
                              random_seed=6003))
