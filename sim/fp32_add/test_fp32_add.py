"""fp32_add against SoftFloat f32_add / f32_sub, bit-exact with flags."""

import softfloatpy as sf

from fp_common import vector_tests, F32, FpTB, boundary_grid


def add_or_sub(a, b, sub):
    return sf.f32_sub(a, b) if sub else sf.f32_add(a, b)


class TB(FpTB):
    OPERAND_PORTS = ("a", "b", "sub")

    async def check_ops(self, name, operands, stall=True):
        await self.check(name, add_or_sub, (F32, F32, None), F32, operands, stall)


def special_vectors():
    sp = F32.specials()
    return [(a, b, s) for a in sp for b in sp for s in (0, 1)]


def boundary_vectors():
    grid = boundary_grid(F32)
    vec = [(a, b, 0) for a in grid for b in grid]
    # Targeted cases: ties to even (1 + 2^-24 stays 1, 1+ulp + 2^-24 rounds up),
    # carry out of the significand, overflow at max + half ulp, cancellation to
    # zero and to subnormals, the subnormal/normal border.
    one, ulp_half = 0x3F800000, 0x33800000
    vec += [
        (one, ulp_half, 0), (one | 1, ulp_half, 0), (one, ulp_half | 1, 0),
        (0x3FFFFFFF, ulp_half, 0), (0x3FFFFFFF, 0x34000000, 0),
        (0x7F7FFFFF, 0x73000000, 0), (0x7F7FFFFF, 0x72FFFFFF, 0), (0x7F7FFFFF, 0x7F7FFFFF, 0),
        (0x7F7FFFFF, 0x73000000, 1), (0xFF7FFFFF, 0x73000000, 0),
        (one, one, 1), (0x80000000, 0x80000000, 0), (0x80000000, 0x00000000, 1),
        (0x00800000, 0x00000001, 1), (0x00800000, 0x007FFFFF, 1), (0x007FFFFF, 0x00000001, 0),
        (0x00800001, 0x00800000, 1), (0x3F800001, 0x3F800000, 1), (0x3F800000, 0x3F7FFFFF, 1),
    ]
    return vec


def random_vectors(n, rng):
    """Exponents uniform over 0..255; half the pairs get exponents within 3 of
    each other and a quarter differ by a few ulps so cancellation happens."""
    vec = []
    for _ in range(n):
        a = F32.random_value(rng)
        r = rng.random()
        if r < 0.5:
            b = F32.random_value(rng)
        elif r < 0.75:
            ea = (a >> 23) & 0xFF
            b = F32.random_value(rng, max(0, ea - 3), min(255, ea + 3))
        else:
            mag = (a & 0x7FFFFFFF) + rng.randint(-4, 4)
            b = (rng.getrandbits(1) << 31) | min(max(mag, 0), 0x7FFFFFFF)
        vec.append((a, b, rng.getrandbits(1)))
    return vec


# The four tests every unit bench runs: specials, boundaries, random, back to back.
globals().update(vector_tests(TB, special_vectors, boundary_vectors, random_vectors,
                              random_seed=1003))
