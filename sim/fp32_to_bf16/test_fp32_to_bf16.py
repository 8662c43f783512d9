"""fp32_to_bf16 against SoftFloat f32_to_bf16, bit-exact with flags."""

import softfloatpy as sf

from fp_common import vector_tests, BF16, F32, FpTB, boundary_grid

DROPPED = 16  # mantissa bits binary32 has and bfloat16 lacks


class TB(FpTB):
    OPERAND_PORTS = ("a",)

    async def check_ops(self, name, operands, stall=True):
        await self.check(name, sf.f32_to_bf16, (F32,), BF16, operands, stall)


def special_vectors():
    return [(a,) for a in F32.specials()]


def tie_patterns():
    """Dropped bits just below, at and above the half-way point, and zero."""
    half = 1 << (DROPPED - 1)
    return (0, 1, half - 1, half, half + 1, (1 << DROPPED) - 1)


def boundary_vectors():
    vec = [(a,) for a in boundary_grid(F32)]
    # Every boundary value with its dropped bits replaced by each tie pattern,
    # with the kept LSB both even and odd.
    low = (1 << DROPPED) - 1
    for x in boundary_grid(F32):
        for t in tie_patterns():
            vec.append(((x & ~low) | t,))
            vec.append(((x & ~low) | (1 << DROPPED) | t,))
    return vec


def random_vectors(n, rng):
    vec = []
    ties = tie_patterns()
    low = (1 << DROPPED) - 1
    for _ in range(n):
        x = F32.random_value(rng)
        if rng.random() < 0.3:
            x = (x & ~low) | rng.choice(ties)
        vec.append((x,))
    return vec


# The four tests every unit bench runs: specials, boundaries, random, back to back.
globals().update(vector_tests(TB, special_vectors, boundary_vectors, random_vectors,
                              random_seed=5003))
