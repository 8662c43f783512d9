"""fp32_div against SoftFloat f32_div, bit-exact with flags."""

import softfloatpy as sf

from fp_common import vector_tests, F32, FpTB, boundary_grid


class TB(FpTB):
    OPERAND_PORTS = ("a", "b")

    async def check_ops(self, name, operands, stall=True):
        await self.check(name, sf.f32_div, (F32, F32), F32, operands, stall)


def special_vectors():
    sp = F32.specials()
    return [(a, b) for a in sp for b in sp]


def boundary_vectors():
    grid = boundary_grid(F32)
    vec = [(a, b) for a in grid for b in grid]
    # Targeted: quotients at the overflow threshold, at the normal/subnormal
    # border (min normal / (1 + ulp) rounds back to min normal), exact
    # quotients (6/3, subnormal / 2), division by zero, 1/3-style periodic
    # quotients.
    vec += [
        (0x7F7FFFFF, 0x3F7FFFFF), (0x7F7FFFFF, 0x3F800000), (0x7F000000, 0x3F000000),
        (0x00800000, 0x3F800001), (0x00800001, 0x3F800001), (0x00FFFFFF, 0x40000000),
        (0x40C00000, 0x40400000), (0x00000003, 0x40000000), (0x00000001, 0x40000000),
        (0x3F800000, 0x40400000), (0x3F800000, 0x00000000), (0xBF800000, 0x80000000),
        (0x00000001, 0x7F7FFFFF), (0x7F7FFFFF, 0x00000001), (0x3F800000, 0x3F800001),
    ]
    return vec


def random_vectors(n, rng):
    """Exponents uniform over 0..255 for half; the other half keeps the
    quotient near the representable range (exponent difference 0 +- 30 or
    near the subnormal edge) and some have few mantissa bits."""
    vec = []
    for _ in range(n):
        a = F32.random_value(rng)
        r = rng.random()
        if r < 0.5:
            b = F32.random_value(rng)
        else:
            ea = (a >> 23) & 0xFF
            target = rng.choice((rng.randint(97, 157), rng.randint(-30, 5)))
            eb = min(max(ea - target + 127, 0), 254)
            b = F32.random_value(rng, eb, eb)
            if r > 0.9:
                keep = ~((1 << rng.randint(12, 23)) - 1)
                a, b = a & keep, b & keep
        vec.append((a, b))
    return vec


# The four tests every unit bench runs: specials, boundaries, random, back to back.
globals().update(vector_tests(TB, special_vectors, boundary_vectors, random_vectors,
                              random_seed=3003))
