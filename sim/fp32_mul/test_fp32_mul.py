"""fp32_mul against SoftFloat f32_mul, bit-exact with flags."""

import softfloatpy as sf

from fp_common import vector_tests, F32, FpTB, boundary_grid


class TB(FpTB):
    OPERAND_PORTS = ("a", "b")

    async def check_ops(self, name, operands, stall=True):
        await self.check(name, sf.f32_mul, (F32, F32), F32, operands, stall)


def special_vectors():
    sp = F32.specials()
    return [(a, b) for a in sp for b in sp]


def boundary_vectors():
    grid = boundary_grid(F32)
    vec = [(a, b) for a in grid for b in grid]
    # Targeted: products at the overflow threshold (max * (1 + ulp)), at the
    # normal/subnormal border (min normal * (1 - ulp/2) rounds back up: not
    # tiny after rounding, tiny before), exact subnormal products, ties.
    vec += [
        (0x7F7FFFFF, 0x3F800001), (0x7F7FFFFF, 0x3F800000), (0x7F000000, 0x40000000),
        (0x00800000, 0x3F7FFFFF), (0x00800001, 0x3F7FFFFF), (0x00FFFFFF, 0x3F000000),
        (0x00800000, 0x3F000000), (0x00000003, 0x3F000000), (0x00000001, 0x3F000000),
        (0x00000001, 0x3F400000), (0x3F800001, 0x3F800001), (0x3FFFFFFF, 0x3FFFFFFF),
    ]
    return vec


def random_vectors(n, rng):
    """Exponents uniform over 0..255 for half; the other half keeps the
    product near the representable range (exponent sum 127 +- 30 or near the
    subnormal edge) and some have few mantissa bits so products are exact."""
    vec = []
    for _ in range(n):
        a = F32.random_value(rng)
        r = rng.random()
        if r < 0.5:
            b = F32.random_value(rng)
        else:
            ea = (a >> 23) & 0xFF
            target = rng.choice((rng.randint(97, 157), rng.randint(-30, 5)))
            eb = min(max(target + 127 - ea, 0), 254)
            b = F32.random_value(rng, eb, eb)
            if r > 0.9:
                keep = ~((1 << rng.randint(12, 23)) - 1)
                a, b = a & keep, b & keep
        vec.append((a, b))
    return vec


# The four tests every unit bench runs: specials, boundaries, random, back to back.
globals().update(vector_tests(TB, special_vectors, boundary_vectors, random_vectors,
                              random_seed=2003))
