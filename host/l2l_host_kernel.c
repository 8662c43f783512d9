/* The fused one-pass host optimizer kernel of the CPU EPS.
 *
 * One pass per tile: load the gradient (fp32, bf16 or fp16), multiply by the inverse
 * loss scale, record whether any value is non-finite, update fp32 p, m, v by the rule of
 * l2l_hw/eps/golden.py::apply_rule (docs/NUMERICS.md), canonicalize every NaN written,
 * and write the bf16/fp16 working copy (or none). Sources and destinations may differ
 * (double-buffered state) or be equal (in place); partial overlap is refused by the
 * Python binding (l2l_hw/eps/host_kernel.py), which is the only caller.
 *
 * Bit-identity with the golden rule on every ISA path rests on:
 *   - each statement below is one IEEE binary32 operation: the build passes
 *     -ffp-contract=off (GCC contracts even intrinsic mul+add into FMA without it) and
 *     -fno-fast-math; the tests compare every path bit for bit with the golden rule;
 *   - sqrt and div are the IEEE instructions (sqrtps/divps), never rsqrt/rcp;
 *   - MXCSR: every thread that runs tiles (the caller included) saves its MXCSR, sets
 *     0x1F80 (round to nearest even, FTZ and DAZ off, exceptions masked) and restores it
 *     afterwards, so a caller that enabled flush-to-zero (torch.set_flush_denormal(True)
 *     sets FTZ|DAZ on its thread) still gets subnormals kept;
 *   - fp16 conversions: F16C/AVX-512 vcvtps2ph with imm8 = round-to-nearest-even, and
 *     exact integer code on the scalar path; bf16 by integer round-to-nearest-even.
 *
 * ISA: scalar, AVX2 (+F16C) and AVX-512F, each compiled with a per-function target
 * attribute and chosen at run time (__builtin_cpu_supports); nothing here needs
 * -march=native.
 *
 * Threads: a small pthread pool of its own, NOT OpenMP. PyTorch runs its intra-op work
 * on an OpenMP team; a second OpenMP runtime (or nested use of torch's) in this library
 * could clash with it (two runtimes in one process, nested teams oversubscribing the
 * cores). Our workers sleep on a condition variable between calls, so they take no CPU
 * while torch computes. One call uses the pool at a time; a concurrent second caller
 * runs its tiles on its own thread rather than waiting.
 */
#include <immintrin.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

enum { L2L_ADAMW = 0, L2L_ADAM = 1, L2L_SGD = 2 };
enum { L2L_DT_NONE = -1, L2L_DT_F32 = 0, L2L_DT_BF16 = 1, L2L_DT_F16 = 2 };
enum { L2L_ISA_SCALAR = 0, L2L_ISA_AVX2 = 1, L2L_ISA_AVX512 = 2 };
enum { L2L_STATE_F32 = 0, L2L_STATE_BF16 = 1, L2L_STATE_8BIT = 2 };
enum { L2L_OK = 0, L2L_E_ARG = -1, L2L_E_ISA = -2, L2L_E_THREAD = -3 };

/* Elements per tile, the unit of work a thread takes from the shared counter. 16 Ki
 * elements = 64 KiB per fp32 stream: big enough that taking a tile costs nothing, small
 * enough that two threads stay balanced on tensors of a few hundred thousand elements.
 * A multiple of 16 so only the last tile has a scalar tail. */
#define L2L_TILE 16384
#define L2L_MAX_THREADS 256
#define MXCSR_IEEE 0x1F80u /* all exceptions masked, round to nearest, FTZ = DAZ = 0 */

/* Per-step scalars, each an exact float32 value from golden.step_scalars. The layout
 * is mirrored by host_kernel.py's ctypes Structure. */
typedef struct {
    int32_t optimizer, nesterov;
    float inv_scale, lr, weight_decay, decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
        step_size, bias_correction2_sqrt, eps, momentum, dampening_complement;
} l2l_scalars;

typedef struct {
    l2l_scalars s;
    const void *g;
    int32_t g_dtype, w_dtype;
    const float *p_src, *m_src, *v_src;
    float *p_dst, *m_dst, *v_dst;
    void *w_dst;
} l2l_step;

static inline uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* ---------------------------------------------------------------- scalar path */

static inline float canon_nan(float x) { return x != x ? u2f(0x7FC00000u) : x; }

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return u2f(sign | 0x7F800000u | (m << 13));
    if (e == 0) return u2f(sign | f2u((float)m * 5.9604644775390625e-8f)); /* m * 2^-24, exact */
    return u2f(sign | ((e + 112) << 23) | (m << 13));
}

/* Round to nearest even; NaN -> 0x7E00 (x is already canonical). */
static inline uint16_t f32_to_f16(float x) {
    uint32_t u = f2u(x), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0x7E00;
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520 rounds to Inf */
    if (a >= 0x38800000u) {                                    /* normal half: >= 2^-14 */
        uint32_t r = a - (112u << 23);
        r += 0xFFFu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    if (a <= 0x33000000u) return (uint16_t)sign; /* <= 2^-25: half of the least subnormal, ties to 0 */
    uint32_t mant = (a & 0x7FFFFFu) | 0x800000u, shift = 126u - (a >> 23); /* 14..24 */
    uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    q += rem > half || (rem == half && (q & 1u));
    return (uint16_t)(sign | q);
}

static inline uint16_t f32_to_bf16(float x) { /* x canonical: no NaN payload to keep */
    uint32_t u = f2u(x);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float load_grad(const l2l_step *j, int64_t i) {
    switch (j->g_dtype) {
    case L2L_DT_BF16: return u2f((uint32_t)((const uint16_t *)j->g)[i] << 16);
    case L2L_DT_F16: return f16_to_f32(((const uint16_t *)j->g)[i]);
    default: return ((const float *)j->g)[i];
    }
}

/* One element, statement by statement as golden.apply_rule. Returns 1 when the
 * unscaled gradient is not finite. */
static inline int step_one(const l2l_step *j, int64_t i) {
    const l2l_scalars *s = &j->s;
    float g = load_grad(j, i) * s->inv_scale;
    int bad = (f2u(g) & 0x7F800000u) == 0x7F800000u;
    float p = j->p_src[i];
    if (s->optimizer == L2L_SGD) {
        if (s->weight_decay != 0) g = g + p * s->weight_decay;
        if (s->momentum != 0) {
            float m = j->m_src[i] * s->momentum + g * s->dampening_complement;
            g = s->nesterov ? g + m * s->momentum : m;
            j->m_dst[i] = canon_nan(m);
        }
        p = p - g * s->lr;
    } else {
        if (s->optimizer == L2L_ADAM && s->weight_decay != 0) g = g + p * s->weight_decay;
        if (s->optimizer == L2L_ADAMW && s->weight_decay != 0) p = p * s->decay;
        float m = j->m_src[i], v = j->v_src[i];
        m = m + (g - m) * s->one_minus_beta1;
        v = v * s->beta2 + (g * s->one_minus_beta2) * g;
        float denom = __builtin_sqrtf(v) / s->bias_correction2_sqrt + s->eps;
        p = p - (m * s->step_size) / denom;
        j->m_dst[i] = canon_nan(m);
        j->v_dst[i] = canon_nan(v);
    }
    p = canon_nan(p);
    j->p_dst[i] = p;
    if (j->w_dtype == L2L_DT_BF16) ((uint16_t *)j->w_dst)[i] = f32_to_bf16(p);
    else if (j->w_dtype == L2L_DT_F16) ((uint16_t *)j->w_dst)[i] = f32_to_f16(p);
    return bad;
}

static int step_range_scalar(const void *ctx, int64_t begin, int64_t end) {
    int bad = 0;
    for (int64_t i = begin; i < end; i++) bad |= step_one((const l2l_step *)ctx, i);
    return bad;
}

/* ---------------------------------------------------------------- AVX2 + F16C path */

#define AVX2 __attribute__((target("avx2,f16c")))

AVX2 static inline __m256 canon_nan8(__m256 x) {
    return _mm256_blendv_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

AVX2 static int step_range_avx2(const void *ctx, int64_t begin, int64_t end) {
    const l2l_step *j = ctx;
    const l2l_scalars *s = &j->s;
    const __m256i exp_mask = _mm256_set1_epi32(0x7F800000);
    const __m256 inv_scale = _mm256_set1_ps(s->inv_scale), lr = _mm256_set1_ps(s->lr),
                 wd = _mm256_set1_ps(s->weight_decay), decay = _mm256_set1_ps(s->decay),
                 b1c = _mm256_set1_ps(s->one_minus_beta1), b2 = _mm256_set1_ps(s->beta2),
                 b2c = _mm256_set1_ps(s->one_minus_beta2), step_size = _mm256_set1_ps(s->step_size),
                 bc2 = _mm256_set1_ps(s->bias_correction2_sqrt), eps = _mm256_set1_ps(s->eps),
                 mom = _mm256_set1_ps(s->momentum), damp_c = _mm256_set1_ps(s->dampening_complement);
    const int has_wd = s->weight_decay != 0, has_mom = s->momentum != 0;
    __m256i bad = _mm256_setzero_si256();
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256 g;
        if (j->g_dtype == L2L_DT_BF16)
            g = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)j->g + i))), 16));
        else if (j->g_dtype == L2L_DT_F16)
            g = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)j->g + i)));
        else
            g = _mm256_loadu_ps((const float *)j->g + i);
        g = _mm256_mul_ps(g, inv_scale);
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(g), exp_mask), exp_mask));
        __m256 p = _mm256_loadu_ps(j->p_src + i);
        if (s->optimizer == L2L_SGD) {
            if (has_wd) g = _mm256_add_ps(g, _mm256_mul_ps(p, wd));
            if (has_mom) {
                __m256 m = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(j->m_src + i), mom), _mm256_mul_ps(g, damp_c));
                g = s->nesterov ? _mm256_add_ps(g, _mm256_mul_ps(m, mom)) : m;
                _mm256_storeu_ps(j->m_dst + i, canon_nan8(m));
            }
            p = _mm256_sub_ps(p, _mm256_mul_ps(g, lr));
        } else {
            if (s->optimizer == L2L_ADAM && has_wd) g = _mm256_add_ps(g, _mm256_mul_ps(p, wd));
            if (s->optimizer == L2L_ADAMW && has_wd) p = _mm256_mul_ps(p, decay);
            __m256 m = _mm256_loadu_ps(j->m_src + i), v = _mm256_loadu_ps(j->v_src + i);
            m = _mm256_add_ps(m, _mm256_mul_ps(_mm256_sub_ps(g, m), b1c));
            v = _mm256_add_ps(_mm256_mul_ps(v, b2), _mm256_mul_ps(_mm256_mul_ps(g, b2c), g));
            __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
            p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(m, step_size), denom));
            _mm256_storeu_ps(j->m_dst + i, canon_nan8(m));
            _mm256_storeu_ps(j->v_dst + i, canon_nan8(v));
        }
        p = canon_nan8(p);
        _mm256_storeu_ps(j->p_dst + i, p);
        if (j->w_dtype == L2L_DT_BF16) {
            __m256i u = _mm256_castps_si256(p);
            __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                                           _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
            _mm_storeu_si128((__m128i *)((uint16_t *)j->w_dst + i),
                             _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
        } else if (j->w_dtype == L2L_DT_F16) {
            _mm_storeu_si128((__m128i *)((uint16_t *)j->w_dst + i), _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
        }
    }
    int flag = !_mm256_testz_si256(bad, bad);
    return flag | step_range_scalar(ctx, i, end);
}

/* ---------------------------------------------------------------- AVX-512F path */

#define AVX512 __attribute__((target("avx512f")))

AVX512 static inline __m512 canon_nan16(__m512 x) {
    return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}

AVX512 static int step_range_avx512(const void *ctx, int64_t begin, int64_t end) {
    const l2l_step *j = ctx;
    const l2l_scalars *s = &j->s;
    const __m512i exp_mask = _mm512_set1_epi32(0x7F800000);
    const __m512 inv_scale = _mm512_set1_ps(s->inv_scale), lr = _mm512_set1_ps(s->lr),
                 wd = _mm512_set1_ps(s->weight_decay), decay = _mm512_set1_ps(s->decay),
                 b1c = _mm512_set1_ps(s->one_minus_beta1), b2 = _mm512_set1_ps(s->beta2),
                 b2c = _mm512_set1_ps(s->one_minus_beta2), step_size = _mm512_set1_ps(s->step_size),
                 bc2 = _mm512_set1_ps(s->bias_correction2_sqrt), eps = _mm512_set1_ps(s->eps),
                 mom = _mm512_set1_ps(s->momentum), damp_c = _mm512_set1_ps(s->dampening_complement);
    const int has_wd = s->weight_decay != 0, has_mom = s->momentum != 0;
    __mmask16 bad = 0;
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
        __m512 g;
        if (j->g_dtype == L2L_DT_BF16)
            g = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)j->g + i))), 16));
        else if (j->g_dtype == L2L_DT_F16)
            g = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)j->g + i)));
        else
            g = _mm512_loadu_ps((const float *)j->g + i);
        g = _mm512_mul_ps(g, inv_scale);
        bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(g), exp_mask), exp_mask);
        __m512 p = _mm512_loadu_ps(j->p_src + i);
        if (s->optimizer == L2L_SGD) {
            if (has_wd) g = _mm512_add_ps(g, _mm512_mul_ps(p, wd));
            if (has_mom) {
                __m512 m = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(j->m_src + i), mom), _mm512_mul_ps(g, damp_c));
                g = s->nesterov ? _mm512_add_ps(g, _mm512_mul_ps(m, mom)) : m;
                _mm512_storeu_ps(j->m_dst + i, canon_nan16(m));
            }
            p = _mm512_sub_ps(p, _mm512_mul_ps(g, lr));
        } else {
            if (s->optimizer == L2L_ADAM && has_wd) g = _mm512_add_ps(g, _mm512_mul_ps(p, wd));
            if (s->optimizer == L2L_ADAMW && has_wd) p = _mm512_mul_ps(p, decay);
            __m512 m = _mm512_loadu_ps(j->m_src + i), v = _mm512_loadu_ps(j->v_src + i);
            m = _mm512_add_ps(m, _mm512_mul_ps(_mm512_sub_ps(g, m), b1c));
            v = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(g, b2c), g));
            __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
            p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(m, step_size), denom));
            _mm512_storeu_ps(j->m_dst + i, canon_nan16(m));
            _mm512_storeu_ps(j->v_dst + i, canon_nan16(v));
        }
        p = canon_nan16(p);
        _mm512_storeu_ps(j->p_dst + i, p);
        if (j->w_dtype == L2L_DT_BF16) {
            __m512i u = _mm512_castps_si512(p);
            __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
            _mm256_storeu_si256((__m256i *)((uint16_t *)j->w_dst + i), _mm512_cvtepi32_epi16(r));
        } else if (j->w_dtype == L2L_DT_F16) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)j->w_dst + i), _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
        }
    }
    return (bad != 0) | step_range_scalar(ctx, i, end);
}

/* ---------------------------------------------------------------- compressed optimizer state
 * m and v kept as bf16 or as block-wise 8-bit codes (golden.py, "state formats"). Per block
 * of L2L_BLOCK elements: decode the block's m and v into fp32 buffers on the stack (L1),
 * run this ISA's fp32 update above on the block with m/v pointing at those buffers, encode
 * the new m and v. One pass over memory; the update itself is the fp32 code, so the rule
 * is unchanged. Decoding is exact (8-bit: then one multiply by the block's power-of-two
 * scale); encoding is integer rounding of the bits plus one exact multiply. */

#define L2L_BLOCK 256 /* golden.QUANT_BLOCK; L2L_TILE is a multiple, so tiles hold whole blocks */
#define SCALE_EXP_LIMIT 126

/* An 8-bit code book as golden.Code8 defines it (the binding passes golden's). */
typedef struct { int32_t exp_bits, man_bits, is_signed; } l2l_codebook;
typedef struct { l2l_codebook m, v; } l2l_codebooks;

static int codebook_valid(l2l_codebook b) {
    return b.exp_bits >= 1 && b.man_bits >= 1 && b.exp_bits + b.man_bits + (b.is_signed != 0) == 8 && b.exp_bits <= 6;
}

/* A code book with the constants of its encode and decode derived once. */
typedef struct {
    uint32_t man_bits, drop, rebase, smallest_normal, max_magnitude, mag_mask, sign_mask;
    float sub_scale, sub_unit; /* 2^subnormal_shift and its inverse */
} l2l_code;

static l2l_code make_code(l2l_codebook b) {
    uint32_t bias = (1u << b.exp_bits) - 1, man_bits = (uint32_t)b.man_bits, shift = bias - 1 + man_bits;
    return (l2l_code){man_bits, 23 - man_bits, (127 - bias) << 23, (128 - bias) << 23,
                      (1u << (b.exp_bits + man_bits)) - 1, b.is_signed ? 0x7Fu : 0xFFu, b.is_signed ? 0x80u : 0,
                      u2f((127 + shift) << 23), u2f((127 - shift) << 23)};
}

/* golden.block_exponent: k of the scale 2^k from the block's largest |x| bits. */
static inline int32_t block_exponent(uint32_t absmax, const l2l_code *c) {
    int32_t k = (int32_t)((absmax + (1u << (c->drop - 1)) - 1 + ((absmax >> c->drop) & 1u)) >> 23) - 127;
    return k < -SCALE_EXP_LIMIT ? -SCALE_EXP_LIMIT : k > SCALE_EXP_LIMIT ? SCALE_EXP_LIMIT : k;
}

static inline float exp2_bits(int32_t k) { return u2f((uint32_t)(k + 127) << 23); }

static inline uint8_t encode_one(float y, const l2l_code *c) {
    uint32_t bits = f2u(y), mag = bits & 0x7FFFFFFFu, q;
    if (mag < c->smallest_normal) {
        q = (uint32_t)_mm_cvtss_si32(_mm_set_ss(u2f(mag) * c->sub_scale)); /* exact product; RNE by our MXCSR */
    } else {
        uint32_t r = mag - c->rebase;
        q = (r + (1u << (c->drop - 1)) - 1 + ((r >> c->drop) & 1u)) >> c->drop;
    }
    return (uint8_t)((q < c->max_magnitude ? q : c->max_magnitude) | ((bits >> 24) & c->sign_mask));
}

static inline float decode_one(uint8_t code, const l2l_code *c) {
    uint32_t mag = code & c->mag_mask;
    float x = (mag >> c->man_bits) == 0 ? (float)mag * c->sub_unit : u2f((mag << c->drop) + c->rebase);
    return u2f(f2u(x) | ((uint32_t)(code & c->sign_mask) << 24));
}

/* The whole-block steps that are not per element: a non-finite block gets scale NaN and
 * codes 0. Returns 0 when the block was written that way, else the inverse scale 2^-k. */
static inline float block_scale(uint32_t absmax, uint8_t *codes, float *scale, int64_t len, const l2l_code *c) {
    if (absmax >= 0x7F800000u) {
        memset(codes, 0, (size_t)len);
        *scale = u2f(0x7FC00000u);
        return 0;
    }
    int32_t k = block_exponent(absmax, c);
    *scale = exp2_bits(k);
    return exp2_bits(-k);
}

static void quantize_scalar(const float *x, uint8_t *codes, float *scale, int64_t len, const l2l_code *c) {
    uint32_t absmax = 0;
    for (int64_t i = 0; i < len; i++) {
        uint32_t mag = f2u(x[i]) & 0x7FFFFFFFu;
        absmax = mag > absmax ? mag : absmax;
    }
    float inv = block_scale(absmax, codes, scale, len, c);
    if (inv != 0)
        for (int64_t i = 0; i < len; i++) codes[i] = encode_one(x[i] * inv, c);
}

static void dequantize_scalar(const uint8_t *codes, float scale, float *x, int64_t len, const l2l_code *c) {
    for (int64_t i = 0; i < len; i++) x[i] = decode_one(codes[i], c) * scale;
}

static void bf16_decode_scalar(const uint16_t *h, float *x, int64_t len) {
    for (int64_t i = 0; i < len; i++) x[i] = u2f((uint32_t)h[i] << 16);
}

static void bf16_encode_scalar(const float *x, uint16_t *h, int64_t len) { /* x canonical */
    for (int64_t i = 0; i < len; i++) h[i] = f32_to_bf16(x[i]);
}

AVX2 static void quantize_avx2(const float *x, uint8_t *codes, float *scale, int64_t len, const l2l_code *c) {
    const __m256i mag_mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i vmax = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= len; i += 8)
        vmax = _mm256_max_epu32(vmax, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), mag_mask));
    uint32_t lanes[8], absmax = 0;
    _mm256_storeu_si256((__m256i *)lanes, vmax);
    for (int k = 0; k < 8; k++) absmax = lanes[k] > absmax ? lanes[k] : absmax;
    for (int64_t t = i; t < len; t++) {
        uint32_t mag = f2u(x[t]) & 0x7FFFFFFFu;
        absmax = mag > absmax ? mag : absmax;
    }
    float inv_s = block_scale(absmax, codes, scale, len, c);
    if (inv_s == 0) return;
    const __m256 inv = _mm256_set1_ps(inv_s), sub_scale = _mm256_set1_ps(c->sub_scale);
    const __m256i smallest_normal = _mm256_set1_epi32((int)c->smallest_normal), rebase = _mm256_set1_epi32((int)c->rebase),
                  half_m1 = _mm256_set1_epi32((int)((1u << (c->drop - 1)) - 1)), one = _mm256_set1_epi32(1),
                  max_mag = _mm256_set1_epi32((int)c->max_magnitude), sign_mask = _mm256_set1_epi32((int)c->sign_mask);
    const __m128i drop = _mm_cvtsi32_si128((int)c->drop);
    for (i = 0; i + 8 <= len; i += 8) {
        __m256i bits = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
        __m256i mag = _mm256_and_si256(bits, mag_mask);
        __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(mag), sub_scale));
        __m256i r = _mm256_sub_epi32(mag, rebase);
        __m256i normal = _mm256_srl_epi32(_mm256_add_epi32(_mm256_add_epi32(r, half_m1),
                                                           _mm256_and_si256(_mm256_srl_epi32(r, drop), one)), drop);
        __m256i is_sub = _mm256_cmpgt_epi32(smallest_normal, mag); /* both below 2^31 */
        __m256i q = _mm256_min_epu32(_mm256_blendv_epi8(normal, sub, is_sub), max_mag);
        q = _mm256_or_si256(q, _mm256_and_si256(_mm256_srli_epi32(bits, 24), sign_mask));
        __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i *)(codes + i), _mm_packus_epi16(w, w));
    }
    for (; i < len; i++) codes[i] = encode_one(x[i] * inv_s, c);
}

AVX2 static void dequantize_avx2(const uint8_t *codes, float scale, float *x, int64_t len, const l2l_code *c) {
    const __m256 s = _mm256_set1_ps(scale), sub_unit = _mm256_set1_ps(c->sub_unit);
    const __m256i mag_mask = _mm256_set1_epi32((int)c->mag_mask), sign_mask = _mm256_set1_epi32((int)c->sign_mask),
                  rebase = _mm256_set1_epi32((int)c->rebase), zero = _mm256_setzero_si256();
    const __m128i drop = _mm_cvtsi32_si128((int)c->drop), man_bits = _mm_cvtsi32_si128((int)c->man_bits);
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i)));
        __m256i mag = _mm256_and_si256(code, mag_mask);
        __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), sub_unit);
        __m256i normal = _mm256_add_epi32(_mm256_sll_epi32(mag, drop), rebase);
        __m256i is_sub = _mm256_cmpeq_epi32(_mm256_srl_epi32(mag, man_bits), zero);
        __m256i v = _mm256_blendv_epi8(normal, _mm256_castps_si256(sub), is_sub);
        v = _mm256_or_si256(v, _mm256_slli_epi32(_mm256_and_si256(code, sign_mask), 24));
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_castsi256_ps(v), s));
    }
    dequantize_scalar(codes + i, scale, x + i, len - i, c);
}

AVX2 static void bf16_decode_avx2(const uint16_t *h, float *x, int64_t len) {
    int64_t i = 0;
    for (; i + 8 <= len; i += 8)
        _mm256_storeu_si256((__m256i *)(x + i), _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i))), 16));
    bf16_decode_scalar(h + i, x + i, len - i);
}

AVX2 static void bf16_encode_avx2(const float *x, uint16_t *h, int64_t len) {
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        __m256i u = _mm256_loadu_si256((const __m256i *)(x + i));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                                       _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
        _mm_storeu_si128((__m128i *)(h + i), _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
    }
    bf16_encode_scalar(x + i, h + i, len - i);
}

AVX512 static void quantize_avx512(const float *x, uint8_t *codes, float *scale, int64_t len, const l2l_code *c) {
    const __m512i mag_mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i vmax = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 <= len; i += 16)
        vmax = _mm512_max_epu32(vmax, _mm512_and_si512(_mm512_loadu_si512(x + i), mag_mask));
    uint32_t absmax = (uint32_t)_mm512_reduce_max_epu32(vmax);
    for (int64_t t = i; t < len; t++) {
        uint32_t mag = f2u(x[t]) & 0x7FFFFFFFu;
        absmax = mag > absmax ? mag : absmax;
    }
    float inv_s = block_scale(absmax, codes, scale, len, c);
    if (inv_s == 0) return;
    const __m512 inv = _mm512_set1_ps(inv_s), sub_scale = _mm512_set1_ps(c->sub_scale);
    const __m512i smallest_normal = _mm512_set1_epi32((int)c->smallest_normal), rebase = _mm512_set1_epi32((int)c->rebase),
                  half_m1 = _mm512_set1_epi32((int)((1u << (c->drop - 1)) - 1)), one = _mm512_set1_epi32(1),
                  max_mag = _mm512_set1_epi32((int)c->max_magnitude), sign_mask = _mm512_set1_epi32((int)c->sign_mask);
    const __m128i drop = _mm_cvtsi32_si128((int)c->drop);
    for (i = 0; i + 16 <= len; i += 16) {
        __m512i bits = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
        __m512i mag = _mm512_and_si512(bits, mag_mask);
        __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(mag), sub_scale));
        __m512i r = _mm512_sub_epi32(mag, rebase);
        __m512i normal = _mm512_srl_epi32(_mm512_add_epi32(_mm512_add_epi32(r, half_m1),
                                                           _mm512_and_si512(_mm512_srl_epi32(r, drop), one)), drop);
        __m512i q = _mm512_mask_mov_epi32(normal, _mm512_cmplt_epu32_mask(mag, smallest_normal), sub);
        q = _mm512_min_epu32(q, max_mag);
        q = _mm512_or_si512(q, _mm512_and_si512(_mm512_srli_epi32(bits, 24), sign_mask));
        _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(q));
    }
    for (; i < len; i++) codes[i] = encode_one(x[i] * inv_s, c);
}

AVX512 static void dequantize_avx512(const uint8_t *codes, float scale, float *x, int64_t len, const l2l_code *c) {
    const __m512 s = _mm512_set1_ps(scale), sub_unit = _mm512_set1_ps(c->sub_unit);
    const __m512i mag_mask = _mm512_set1_epi32((int)c->mag_mask), sign_mask = _mm512_set1_epi32((int)c->sign_mask),
                  rebase = _mm512_set1_epi32((int)c->rebase), min_normal_code = _mm512_set1_epi32(1 << c->man_bits);
    const __m128i drop = _mm_cvtsi32_si128((int)c->drop);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i)));
        __m512i mag = _mm512_and_si512(code, mag_mask);
        __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), sub_unit);
        __m512i v = _mm512_add_epi32(_mm512_sll_epi32(mag, drop), rebase);
        v = _mm512_mask_mov_epi32(v, _mm512_cmplt_epu32_mask(mag, min_normal_code), _mm512_castps_si512(sub));
        v = _mm512_or_si512(v, _mm512_slli_epi32(_mm512_and_si512(code, sign_mask), 24));
        _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_castsi512_ps(v), s));
    }
    dequantize_scalar(codes + i, scale, x + i, len - i, c);
}

AVX512 static void bf16_decode_avx512(const uint16_t *h, float *x, int64_t len) {
    int64_t i = 0;
    for (; i + 16 <= len; i += 16)
        _mm512_storeu_si512(x + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + i))), 16));
    bf16_decode_scalar(h + i, x + i, len - i);
}

AVX512 static void bf16_encode_avx512(const float *x, uint16_t *h, int64_t len) {
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        __m512i u = _mm512_loadu_si512(x + i);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
        _mm256_storeu_si256((__m256i *)(h + i), _mm512_cvtepi32_epi16(r));
    }
    bf16_encode_scalar(x + i, h + i, len - i);
}

/* One ISA's pieces of the compressed-state update. */
typedef struct {
    int (*update)(const void *step, int64_t begin, int64_t end); /* the fp32 update */
    void (*quantize)(const float *, uint8_t *, float *, int64_t, const l2l_code *);
    void (*dequantize)(const uint8_t *, float, float *, int64_t, const l2l_code *);
    void (*bf16_decode)(const uint16_t *, float *, int64_t);
    void (*bf16_encode)(const float *, uint16_t *, int64_t);
} l2l_codec;

static const l2l_codec CODECS[] = {
    [L2L_ISA_SCALAR] = {step_range_scalar, quantize_scalar, dequantize_scalar, bf16_decode_scalar, bf16_encode_scalar},
    [L2L_ISA_AVX2] = {step_range_avx2, quantize_avx2, dequantize_avx2, bf16_decode_avx2, bf16_encode_avx2},
    [L2L_ISA_AVX512] = {step_range_avx512, quantize_avx512, dequantize_avx512, bf16_decode_avx512, bf16_encode_avx512},
};

/* A step with compressed m (and v): `step` holds scalars, g, p and w; m/v are set per block. */
typedef struct {
    l2l_step step;
    int32_t format, uses_m, uses_v;
    const l2l_codec *codec;
    l2l_code m_code, v_code;
    const void *m_src, *v_src;
    void *m_dst, *v_dst;
    const float *m_scale_src, *v_scale_src;
    float *m_scale_dst, *v_scale_dst;
} l2l_state_step;

static void decode_block(const l2l_state_step *j, const void *src, const float *scale_src, const l2l_code *c,
                         int64_t b0, int64_t len, float *out) {
    if (j->format == L2L_STATE_BF16) j->codec->bf16_decode((const uint16_t *)src + b0, out, len);
    else j->codec->dequantize((const uint8_t *)src + b0, scale_src[b0 / L2L_BLOCK], out, len, c);
}

static void encode_block(const l2l_state_step *j, void *dst, float *scale_dst, const l2l_code *c,
                         int64_t b0, int64_t len, const float *in) {
    if (j->format == L2L_STATE_BF16) j->codec->bf16_encode(in, (uint16_t *)dst + b0, len);
    else j->codec->quantize(in, (uint8_t *)dst + b0, scale_dst + b0 / L2L_BLOCK, len, c);
}

static int state_step_range(const void *ctx, int64_t begin, int64_t end) {
    const l2l_state_step *j = ctx;
    float m[L2L_BLOCK] __attribute__((aligned(64))), v[L2L_BLOCK] __attribute__((aligned(64)));
    size_t g_size = j->step.g_dtype == L2L_DT_F32 ? 4 : 2;
    int bad = 0;
    for (int64_t b0 = begin; b0 < end; b0 += L2L_BLOCK) {
        int64_t len = end - b0 < L2L_BLOCK ? end - b0 : L2L_BLOCK;
        l2l_step block = j->step; /* the block's elements, from index 0 */
        block.g = (const char *)j->step.g + b0 * g_size;
        block.p_src = j->step.p_src + b0;
        block.p_dst = j->step.p_dst + b0;
        block.w_dst = j->step.w_dst ? (char *)j->step.w_dst + b0 * 2 : NULL;
        block.m_src = block.m_dst = m;
        block.v_src = block.v_dst = v;
        if (j->uses_m) decode_block(j, j->m_src, j->m_scale_src, &j->m_code, b0, len, m);
        if (j->uses_v) decode_block(j, j->v_src, j->v_scale_src, &j->v_code, b0, len, v);
        bad |= j->codec->update(&block, 0, len);
        if (j->uses_m) encode_block(j, j->m_dst, j->m_scale_dst, &j->m_code, b0, len, m);
        if (j->uses_v) encode_block(j, j->v_dst, j->v_scale_dst, &j->v_code, b0, len, v);
    }
    return bad;
}

/* ---------------------------------------------------------------- memory stream
 * The bandwidth reference of `l2l bench eps`: the same bytes as a bf16-gradient step
 * (read g16, p, m, v; write p, m, v in place and a 16-bit copy) with one add per
 * stream, so it is bound by memory and nothing else. */

typedef struct { const uint16_t *g; float *p, *m, *v; uint16_t *w; } l2l_stream;

static int stream_range_scalar(const void *ctx, int64_t begin, int64_t end) {
    const l2l_stream *t = ctx;
    for (int64_t i = begin; i < end; i++) {
        float g = u2f((uint32_t)t->g[i] << 16);
        t->p[i] += g; t->m[i] += g; t->v[i] += g;
        t->w[i] = (uint16_t)(f2u(t->p[i]) >> 16);
    }
    return 0;
}

AVX2 static int stream_range_avx2(const void *ctx, int64_t begin, int64_t end) {
    const l2l_stream *t = ctx;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256 g = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(t->g + i))), 16));
        __m256 p = _mm256_add_ps(_mm256_loadu_ps(t->p + i), g);
        _mm256_storeu_ps(t->p + i, p);
        _mm256_storeu_ps(t->m + i, _mm256_add_ps(_mm256_loadu_ps(t->m + i), g));
        _mm256_storeu_ps(t->v + i, _mm256_add_ps(_mm256_loadu_ps(t->v + i), g));
        __m256i r = _mm256_srli_epi32(_mm256_castps_si256(p), 16);
        _mm_storeu_si128((__m128i *)(t->w + i), _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
    }
    return stream_range_scalar(ctx, i, end);
}

AVX512 static int stream_range_avx512(const void *ctx, int64_t begin, int64_t end) {
    const l2l_stream *t = ctx;
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
        __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(t->g + i))), 16));
        __m512 p = _mm512_add_ps(_mm512_loadu_ps(t->p + i), g);
        _mm512_storeu_ps(t->p + i, p);
        _mm512_storeu_ps(t->m + i, _mm512_add_ps(_mm512_loadu_ps(t->m + i), g));
        _mm512_storeu_ps(t->v + i, _mm512_add_ps(_mm512_loadu_ps(t->v + i), g));
        _mm256_storeu_si256((__m256i *)(t->w + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16)));
    }
    return stream_range_scalar(ctx, i, end);
}

/* ---------------------------------------------------------------- thread pool */

typedef int (*range_fn)(const void *ctx, int64_t begin, int64_t end);

/* One thread's contiguous share of the tiles; its own cache line, as threads count on it. */
typedef struct { int64_t next, end; } __attribute__((aligned(64))) l2l_share;

static struct {
    pthread_mutex_t busy; /* held by the call that owns the pool */
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    int started;          /* worker threads running */
    int active;           /* workers taking part in the current call */
    int remaining;        /* of those, still working */
    unsigned long generation;
    unsigned long born[L2L_MAX_THREADS]; /* generation when worker i was started */
    /* the current call */
    range_fn fn;
    const void *ctx;
    int64_t n;
    int parts;            /* threads taking part, the caller included */
    l2l_share share[L2L_MAX_THREADS];
    int nonfinite;        /* atomic */
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
            .wake = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

/* Thread `self` runs the tiles of its own contiguous share in order (one long stream per
 * array keeps the hardware prefetchers ahead, as a static split does), then helps the
 * others by taking tiles off their counters: a thread slowed by a neighbour's load is
 * helped instead of waited for. All under the IEEE MXCSR. */
static void run_tiles(range_fn fn, const void *ctx, int64_t n, l2l_share *share, int parts, int self, int *flag) {
    unsigned int saved = _mm_getcsr();
    _mm_setcsr(MXCSR_IEEE);
    int bad = 0;
    for (int k = 0; k < parts; k++) {
        l2l_share *s = &share[(self + k) % parts];
        for (int64_t t; (t = __atomic_fetch_add(&s->next, 1, __ATOMIC_RELAXED)) < s->end;) {
            int64_t end = (t + 1) * L2L_TILE;
            bad |= fn(ctx, t * L2L_TILE, end < n ? end : n);
        }
    }
    _mm_setcsr(saved);
    if (bad) __atomic_store_n(flag, 1, __ATOMIC_RELAXED);
}

/* Tiles [0, tiles) split into `parts` contiguous shares. */
static void split_tiles(l2l_share *share, int parts, int64_t tiles) {
    for (int k = 0; k < parts; k++) {
        share[k].next = tiles * k / parts;
        share[k].end = tiles * (k + 1) / parts;
    }
}

static void *worker_main(void *arg) {
    int index = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.mu);
    /* Not pool.generation: the call that started us may have moved it on already. */
    unsigned long seen = pool.born[index];
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.mu);
        seen = pool.generation;
        if (index >= pool.active) continue;
        pthread_mutex_unlock(&pool.mu);
        run_tiles(pool.fn, pool.ctx, pool.n, pool.share, pool.parts, index + 1, &pool.nonfinite);
        pthread_mutex_lock(&pool.mu);
        if (--pool.remaining == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* A forked child has none of the parent's workers: start from an empty pool. */
static void pool_after_fork_child(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.started = pool.active = pool.remaining = 0;
}

__attribute__((constructor)) static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork_child); }

/* Start workers up to `want`; they block every signal so Python's handlers run on the
 * main thread. Called with pool.busy held. */
static int pool_grow(int want) {
    if (pool.started >= want) return 0;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = 0;
    while (pool.started < want) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool.born[pool.started] = pool.generation; /* no call is under way: we hold pool.busy */
        rc = pthread_create(&th, &attr, worker_main, (void *)(intptr_t)pool.started);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc == 0 ? 0 : L2L_E_THREAD;
}

static int parallel_tiles(range_fn fn, const void *ctx, int64_t n, int threads) {
    int64_t tiles = (n + L2L_TILE - 1) / L2L_TILE;
    int flag = 0;
    if (threads > tiles) threads = (int)tiles;
    if (threads <= 1 || pthread_mutex_trylock(&pool.busy) != 0) { /* small call, or pool in use */
        l2l_share own;
        split_tiles(&own, 1, tiles);
        run_tiles(fn, ctx, n, &own, 1, 0, &flag);
        return flag;
    }
    if (pool_grow(threads - 1) != 0 && pool.started + 1 < threads) threads = pool.started + 1; /* fewer workers than asked */
    pthread_mutex_lock(&pool.mu);
    pool.fn = fn; pool.ctx = ctx; pool.n = n; pool.parts = threads;
    split_tiles(pool.share, threads, tiles);
    pool.nonfinite = 0;
    pool.active = pool.remaining = threads - 1;
    pool.generation++;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    run_tiles(fn, ctx, n, pool.share, threads, 0, &pool.nonfinite); /* the caller runs share 0 */
    pthread_mutex_lock(&pool.mu);
    while (pool.remaining > 0) pthread_cond_wait(&pool.done, &pool.mu);
    flag = pool.nonfinite;
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.busy);
    return flag;
}

/* ---------------------------------------------------------------- entry points */

EXPORT int l2l_host_tile(void) { return L2L_TILE; }

EXPORT int l2l_host_block(void) { return L2L_BLOCK; }

EXPORT int l2l_host_isa_supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
    case L2L_ISA_SCALAR: return 1;
    case L2L_ISA_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case L2L_ISA_AVX512: return __builtin_cpu_supports("avx512f");
    default: return 0;
    }
}

EXPORT int l2l_host_best_isa(void) {
    return l2l_host_isa_supported(L2L_ISA_AVX512) ? L2L_ISA_AVX512
         : l2l_host_isa_supported(L2L_ISA_AVX2)   ? L2L_ISA_AVX2 : L2L_ISA_SCALAR;
}

/* MXCSR of the calling thread, for diagnostics: the kernel does not depend on it. */
EXPORT unsigned int l2l_host_caller_mxcsr(void) { return _mm_getcsr(); }

static range_fn pick(int isa, range_fn scalar, range_fn avx2, range_fn avx512) {
    if (!l2l_host_isa_supported(isa)) return NULL;
    return isa == L2L_ISA_AVX512 ? avx512 : isa == L2L_ISA_AVX2 ? avx2 : scalar;
}

/* Where one step reads and writes. m/v (and their scales) are unused (may be NULL) where
 * the optimizer has no such state (v for SGD; m for SGD without momentum); w_dst is unused
 * for w_dtype = -1. m/v are float32, bf16 bits or 8-bit codes by the state format; the
 * 8-bit scales are one float32 per L2L_BLOCK elements (the last block may be short). */
typedef struct {
    const void *g;
    const float *p_src;
    float *p_dst;
    const void *m_src, *v_src;
    void *m_dst, *v_dst;
    const float *m_scale_src, *v_scale_src;
    float *m_scale_dst, *v_scale_dst;
    void *w_dst;
} l2l_buffers;

/* One optimizer step over n elements. Returns 1 when a gradient value times inv_scale is
 * not finite, 0 when all are finite, or a negative error code. */
EXPORT int l2l_host_step(const l2l_scalars *s, int64_t n, const l2l_buffers *b, int g_dtype, int state_format,
                         const l2l_codebooks *codes, int w_dtype, int isa, int threads) {
    if (n < 0 || s->optimizer < L2L_ADAMW || s->optimizer > L2L_SGD || g_dtype < L2L_DT_F32 ||
        g_dtype > L2L_DT_F16 || w_dtype < L2L_DT_NONE || w_dtype == L2L_DT_F32 || w_dtype > L2L_DT_F16 ||
        state_format < L2L_STATE_F32 || state_format > L2L_STATE_8BIT ||
        (state_format == L2L_STATE_8BIT && !(codebook_valid(codes->m) && codebook_valid(codes->v))))
        return L2L_E_ARG;
    if (!l2l_host_isa_supported(isa)) return L2L_E_ISA;
    if (n == 0) return 0;
    threads = threads < L2L_MAX_THREADS ? threads : L2L_MAX_THREADS;
    int uses_v = s->optimizer != L2L_SGD, uses_m = uses_v || s->momentum != 0;
    l2l_step step = {*s, b->g, g_dtype, w_dtype, b->p_src, b->m_src, b->v_src, b->p_dst, b->m_dst, b->v_dst, b->w_dst};
    if (state_format == L2L_STATE_F32 || !uses_m) return parallel_tiles(CODECS[isa].update, &step, n, threads);
    l2l_state_step job = {step, state_format, uses_m, uses_v, &CODECS[isa], make_code(codes->m), make_code(codes->v),
                          b->m_src, b->v_src, b->m_dst, b->v_dst, b->m_scale_src, b->v_scale_src,
                          b->m_scale_dst, b->v_scale_dst};
    return parallel_tiles(state_step_range, &job, n, threads);
}

EXPORT int l2l_host_stream(int64_t n, const uint16_t *g, float *p, float *m, float *v, uint16_t *w,
                           int isa, int threads) {
    range_fn fn = pick(isa, stream_range_scalar, stream_range_avx2, stream_range_avx512);
    if (fn == NULL) return L2L_E_ISA;
    if (n <= 0) return 0;
    l2l_stream job = {g, p, m, v, w};
    return parallel_tiles(fn, &job, n, threads < L2L_MAX_THREADS ? threads : L2L_MAX_THREADS);
}
