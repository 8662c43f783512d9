"""fp32_sqrt against SoftFloat f32_sqrt, bit-exact with flags."""

import softfloatpy as sf

from fp_common import vector_tests, F32, FpTB, boundary_grid


class TB(FpTB):
    OPERAND_PORTS = ("a",)

    async def check_ops(self, name, operands, stall=True):
        await self.check(name, sf.f32_sqrt, (F32,), F32, operands, stall)


def special_vectors():
    return [(a,) for a in F32.specials()]


def boundary_vectors():
    vec = [(a,) for a in boundary_grid(F32)]
    # Perfect squares (exact roots, inexact clear) in every binade parity,
    # their neighbours, and subnormal squares.
    for r in (1, 3, 5, 0xFFF, 0xABC, 0x800, 0xFFFFF >> 8):
        for e in (1, 2, 100, 127, 128, 200, 253, 254):
            sq = r * r
            shift = sq.bit_length() - 24
            if shift <= 0:
                sig = sq << -shift
                vec.append((((e << 23) | (sig & 0x7FFFFF)),))
    vec += [(x,) for x in (0x3F800000, 0x40800000, 0x00000004, 0x00000010, 0x00000009,
                           0x3F7FFFFF, 0x3F800001, 0x7F7FFFFF, 0x00000001, 0x007FFFFF)]
    return vec


def random_vectors(n, rng):
    """Exponents uniform over 0..255, 90% positive; a tenth are exact squares
    of 12-bit significands."""
    vec = []
    for _ in range(n):
        if rng.random() < 0.1:
            # r^2 of a 12-bit r has at most 24 bits: left-align it as a significand
            r = rng.getrandbits(12) | 0x800
            sig = (r * r) << (24 - (r * r).bit_length())
            vec.append((((rng.randint(1, 254) << 23) | (sig & 0x7FFFFF)),))
        else:
            vec.append((F32.random_value(rng, sign=int(rng.random() < 0.1)),))
    return vec


# The four tests every unit bench runs: specials, boundaries, random, back to back.
globals().update(vector_tests(TB, special_vectors, boundary_vectors, random_vectors,
                              random_seed=4003))
