/* The fused one-pass host optimizer kernel of the CPU EPS.
 *
 * One pass per tile: load the gradient (fp32, bf16 or fp16), multiply by the inverse
 * loss scale, record whether any value is non-finite, update fp32 p, m, v by the rule of
 * l2l_hw/eps/golden.py::apply_rule (docs/NUMERICS.md), canonicalize every NaN written,
 * and write the bf16/fp16 working copy (or none). m and v may be kept as fp32, bf16 or
 * block-wise 8-bit codes (golden.apply_rule_stored: decoded, updated and encoded in the
 * same pass). Sources and destinations may differ (double-buffered state) or be equal
 * (in place); partial overlap is refused by the Python binding
 * (l2l_hw/eps/host_kernel.py), which is the only caller.
 *
 * Bit-identity with the golden rule on every ISA path rests on:
 *   - each statement below is one IEEE binary32 operation: the build passes
 *     -ffp-contract=off (GCC contracts even intrinsic mul+add into FMA without it) and
 *     -fno-fast-math; the tests compare every path bit for bit with the golden rule;
 *   - sqrt and div are the IEEE instructions (sqrtps/divps), never rsqrt/rcp; the one
 *     exception is the AVX-512 path's division by bias_correction2_sqrt, which the same
 *     divisor in every element makes an FMA quotient where a check proves it exact (div_bc2);
 *   - MXCSR: every thread that runs tiles (the caller included) saves its MXCSR, sets
 *     0x1F80 (round to nearest even, FTZ and DAZ off, exceptions masked) and restores it
 *     afterwards, so a caller that enabled flush-to-zero (torch.set_flush_denormal(True)
 *     sets FTZ|DAZ on its thread) still gets subnormals kept;
 *   - fp16 conversions: F16C/AVX-512 vcvtps2ph with imm8 = round-to-nearest-even, and
 *     exact integer code on the scalar path; bf16 by integer round-to-nearest-even, or on
 *     an AVX512_BF16 CPU by vcvtneps2bf16 (the same rounding) for vectors without a
 *     subnormal (which it would read as zero).
 *
 * ISA: scalar, AVX2 (+F16C) and AVX-512 (F, DQ, BW, VL), each compiled with a
 * per-function target attribute and chosen at run time (__builtin_cpu_supports);
 * nothing here needs -march=native.
 *
 * Threads: a small pthread pool of its own, NOT OpenMP. PyTorch runs its intra-op work
 * on an OpenMP team; a second OpenMP runtime (or nested use of torch's) in this library
 * could clash with it (two runtimes in one process, nested teams oversubscribing the
 * cores). Our workers sleep on a condition variable between calls, so they take no CPU
 * while torch computes. Each thread runs a contiguous share of the tiles, then helps the
 * others (see run_tiles). One call uses the pool at a time; a concurrent second caller
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
/* The AVX-512 path's bf16 working copy by the CPU's own conversion (AVX512_BF16), which
 * rounds to nearest even as bf16_round16 does but reads subnormals as zero: vectors with
 * a subnormal are converted by bf16_round16. Chosen at run time; never passed in. */
enum { L2L_DT_BF16_NATIVE = 3 };
enum { L2L_ISA_SCALAR = 0, L2L_ISA_AVX2 = 1, L2L_ISA_AVX512 = 2 };
enum { L2L_STATE_F32 = 0, L2L_STATE_BF16 = 1, L2L_STATE_8BIT = 2 };
enum { L2L_OK = 0, L2L_E_ARG = -1, L2L_E_ISA = -2, L2L_E_THREAD = -3 };

/* Elements per tile, the unit of work a thread takes off a share's counter. 16 Ki
 * elements = 64 KiB per fp32 stream: big enough that taking a tile costs nothing, small
 * enough that two threads stay balanced on tensors of a few hundred thousand elements.
 * A multiple of 16 (only the last tile has a scalar tail) and of the 8-bit block. */
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

/* An 8-bit code book as golden.Code8 defines it (the binding passes golden's). */
typedef struct { int32_t exp_bits, man_bits, is_signed; } l2l_codebook;
typedef struct { l2l_codebook m, v; } l2l_codebooks;

/* A code book with the constants of its encode and decode derived once. */
typedef struct {
    uint32_t man_bits, drop, rebase, smallest_normal, max_magnitude, mag_mask, sign_mask;
    float sub_scale, sub_unit; /* 2^subnormal_shift and its inverse */
    float unbias;              /* 2^(127 - bias): (magnitude code << drop) as float32 bits, times this, is its value */
    uint32_t bias;
} l2l_code;

/* One call: what every tile needs. m/v are float32, bf16 bits or 8-bit codes by `format`;
 * the 8-bit scales are one float32 per L2L_BLOCK elements. */
typedef struct {
    l2l_scalars s;
    int32_t g_dtype, w_dtype, format, uses_m, uses_v;
    const void *g;
    const float *p_src;
    float *p_dst;
    void *w_dst;
    const void *m_src, *v_src;
    void *m_dst, *v_dst;
    const float *m_scale_src, *v_scale_src;
    float *m_scale_dst, *v_scale_dst;
    l2l_code m_code, v_code;
    int32_t bc2_by_fma; /* AVX-512: sqrt(v) / bias_correction2_sqrt by div_bc2's FMA quotient */
} l2l_job;

static inline uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

#define INLINE static inline __attribute__((always_inline))
/* g * 1 is g, bits and flag alike (a signalling NaN stays a NaN, canonical once written):
 * the vector loops skip the multiply without loss scaling. */
#define UNSCALE(s) ((s).inv_scale != 1.0f)

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

static inline float load_grad(const l2l_job *j, int64_t i) {
    switch (j->g_dtype) {
    case L2L_DT_BF16: return u2f((uint32_t)((const uint16_t *)j->g)[i] << 16);
    case L2L_DT_F16: return f16_to_f32(((const uint16_t *)j->g)[i]);
    default: return ((const float *)j->g)[i];
    }
}

static inline void store_working(const l2l_job *j, int64_t i, float p) {
    if (j->w_dtype == L2L_DT_BF16 || j->w_dtype == L2L_DT_BF16_NATIVE) ((uint16_t *)j->w_dst)[i] = f32_to_bf16(p);
    else if (j->w_dtype == L2L_DT_F16) ((uint16_t *)j->w_dst)[i] = f32_to_f16(p);
}

/* golden.apply_rule on one element, statement by statement; g is already unscaled.
 * Returns the new p; *m and *v are updated where the optimizer has them. */
static inline float rule1(const l2l_scalars *s, float g, float p, float *m, float *v) {
    if (s->optimizer == L2L_SGD) {
        if (s->weight_decay != 0) g = g + p * s->weight_decay;
        if (s->momentum != 0) {
            *m = *m * s->momentum + g * s->dampening_complement;
            g = s->nesterov ? g + *m * s->momentum : *m;
        }
        return p - g * s->lr;
    }
    if (s->optimizer == L2L_ADAM && s->weight_decay != 0) g = g + p * s->weight_decay;
    if (s->optimizer == L2L_ADAMW && s->weight_decay != 0) p = p * s->decay;
    *m = *m + (g - *m) * s->one_minus_beta1;
    *v = *v * s->beta2 + (g * s->one_minus_beta2) * g;
    float denom = __builtin_sqrtf(*v) / s->bias_correction2_sqrt + s->eps;
    return p - (*m * s->step_size) / denom;
}

static inline int is_nonfinite(float x) { return (f2u(x) & 0x7F800000u) == 0x7F800000u; }

/* One element with fp32 state. Returns 1 when the unscaled gradient is not finite. */
static inline int step_one(const l2l_job *j, int64_t i) {
    float g = load_grad(j, i) * j->s.inv_scale, m = 0, v = 0;
    if (j->uses_m) m = ((const float *)j->m_src)[i];
    if (j->uses_v) v = ((const float *)j->v_src)[i];
    float p = canon_nan(rule1(&j->s, g, j->p_src[i], &m, &v));
    if (j->uses_m) ((float *)j->m_dst)[i] = canon_nan(m);
    if (j->uses_v) ((float *)j->v_dst)[i] = canon_nan(v);
    j->p_dst[i] = p;
    store_working(j, i, p);
    return is_nonfinite(g);
}

static int step_range_scalar(const void *ctx, int64_t begin, int64_t end) {
    int bad = 0;
    for (int64_t i = begin; i < end; i++) bad |= step_one((const l2l_job *)ctx, i);
    return bad;
}

/* ---------------------------------------------------------------- compressed state, scalar
 * m and v kept as bf16 or as block-wise 8-bit codes (golden.py, "state formats"). Per block
 * of L2L_BLOCK elements, in one pass: decode m and v (exact; 8-bit: then one multiply by the
 * block's power-of-two scale), apply the rule, write p and the working copy; bf16 state is
 * encoded on the spot, 8-bit state goes to fp32 buffers on the stack (L1) and is encoded
 * once the block's largest magnitude is known: integer rounding of the bits after one
 * exact multiply by 2^-k. */

#define L2L_BLOCK 256 /* golden.QUANT_BLOCK; L2L_TILE is a multiple, so tiles hold whole blocks */
#define SCALE_EXP_LIMIT 126

static int codebook_valid(l2l_codebook b, int is_signed) {
    return b.exp_bits >= 1 && b.exp_bits <= 6 && b.man_bits >= 1 && b.is_signed == is_signed &&
           b.exp_bits + b.man_bits + is_signed == 8;
}

static l2l_code make_code(l2l_codebook b) {
    uint32_t bias = (1u << b.exp_bits) - 1, man_bits = (uint32_t)b.man_bits, shift = bias - 1 + man_bits;
    return (l2l_code){man_bits, 23 - man_bits, (127 - bias) << 23, (128 - bias) << 23,
                      (1u << (b.exp_bits + man_bits)) - 1, b.is_signed ? 0x7Fu : 0xFFu, b.is_signed ? 0x80u : 0,
                      u2f((127 + shift) << 23), u2f((127 - shift) << 23), u2f((254 - bias) << 23), bias};
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

static inline uint32_t magnitude_max(const float *x, int64_t begin, int64_t end, uint32_t absmax) {
    for (int64_t i = begin; i < end; i++) {
        uint32_t mag = f2u(x[i]) & 0x7FFFFFFFu;
        absmax = mag > absmax ? mag : absmax;
    }
    return absmax;
}

/* The block-wide part of encoding: scale 2^k, or for a block holding Inf/NaN scale NaN and
 * codes 0. Returns the inverse scale 2^-k, or 0 when the block is written already. */
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

/* Element b of a block starting at b0 (compressed state): decode, rule, write p, the
 * working copy and (bf16) the state; 8-bit state goes to mbuf/vbuf[b]. */
static inline int state_one(const l2l_job *j, int64_t b0, int64_t b, float m_scale, float v_scale, float *mbuf,
                            float *vbuf) {
    int64_t i = b0 + b;
    float g = load_grad(j, i) * j->s.inv_scale, m = 0, v = 0;
    int bf16 = j->format == L2L_STATE_BF16;
    if (j->uses_m) m = bf16 ? u2f((uint32_t)((const uint16_t *)j->m_src)[i] << 16)
                            : decode_one(((const uint8_t *)j->m_src)[i], &j->m_code) * m_scale;
    if (j->uses_v) v = bf16 ? u2f((uint32_t)((const uint16_t *)j->v_src)[i] << 16)
                            : decode_one(((const uint8_t *)j->v_src)[i], &j->v_code) * v_scale;
    float p = canon_nan(rule1(&j->s, g, j->p_src[i], &m, &v));
    j->p_dst[i] = p;
    store_working(j, i, p);
    m = canon_nan(m);
    v = canon_nan(v);
    if (bf16) {
        if (j->uses_m) ((uint16_t *)j->m_dst)[i] = f32_to_bf16(m);
        if (j->uses_v) ((uint16_t *)j->v_dst)[i] = f32_to_bf16(v);
    } else {
        mbuf[b] = m;
        vbuf[b] = v;
    }
    return is_nonfinite(g);
}

/* Encode buf[done..len) after the vector part [0, done) (already in absmax and codes). */
typedef float (*encode_fn)(const float *buf, int64_t len, uint32_t absmax, uint8_t *codes, float *scale,
                           const l2l_code *c);

static float encode_block_scalar(const float *buf, int64_t len, uint32_t absmax, uint8_t *codes, float *scale,
                                 const l2l_code *c) {
    float inv = block_scale(magnitude_max(buf, 0, len, absmax), codes, scale, len, c);
    if (inv != 0)
        for (int64_t i = 0; i < len; i++) codes[i] = encode_one(buf[i] * inv, c);
    return inv;
}

static int state_range_scalar(const void *ctx, int64_t begin, int64_t end) {
    const l2l_job *j = ctx;
    float mbuf[L2L_BLOCK], vbuf[L2L_BLOCK];
    int bad = 0;
    for (int64_t b0 = begin; b0 < end; b0 += L2L_BLOCK) {
        int64_t len = end - b0 < L2L_BLOCK ? end - b0 : L2L_BLOCK, blk = b0 / L2L_BLOCK;
        int q8 = j->format == L2L_STATE_8BIT;
        float ms = q8 && j->uses_m ? j->m_scale_src[blk] : 0, vs = q8 && j->uses_v ? j->v_scale_src[blk] : 0;
        for (int64_t b = 0; b < len; b++) bad |= state_one(j, b0, b, ms, vs, mbuf, vbuf);
        if (q8 && j->uses_m) encode_block_scalar(mbuf, len, 0, (uint8_t *)j->m_dst + b0, j->m_scale_dst + blk, &j->m_code);
        if (q8 && j->uses_v) encode_block_scalar(vbuf, len, 0, (uint8_t *)j->v_dst + b0, j->v_scale_dst + blk, &j->v_code);
    }
    return bad;
}

/* ---------------------------------------------------------------- AVX2 + F16C path */

#define AVX2 __attribute__((target("avx2,f16c")))

typedef struct {
    __m256 inv_scale, lr, wd, decay, b1c, b2, b2c, step_size, bc2, eps, mom, damp_c;
} rule8_k;

AVX2 INLINE rule8_k rule8_k_of(const l2l_scalars *s) {
    return (rule8_k){_mm256_set1_ps(s->inv_scale), _mm256_set1_ps(s->lr), _mm256_set1_ps(s->weight_decay),
                     _mm256_set1_ps(s->decay), _mm256_set1_ps(s->one_minus_beta1), _mm256_set1_ps(s->beta2),
                     _mm256_set1_ps(s->one_minus_beta2), _mm256_set1_ps(s->step_size),
                     _mm256_set1_ps(s->bias_correction2_sqrt), _mm256_set1_ps(s->eps), _mm256_set1_ps(s->momentum),
                     _mm256_set1_ps(s->dampening_complement)};
}

AVX2 INLINE __m256 canon_nan8(__m256 x) {
    return _mm256_blendv_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

AVX2 INLINE __m256i nonfinite8(__m256 g) {
    const __m256i exp_mask = _mm256_set1_epi32(0x7F800000);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(g), exp_mask), exp_mask);
}

AVX2 INLINE __m256 load_g8(const void *g, int64_t i, int g_dtype) {
    if (g_dtype == L2L_DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)g + i))), 16));
    if (g_dtype == L2L_DT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)g + i)));
    return _mm256_loadu_ps((const float *)g + i);
}

AVX2 INLINE __m128i bf16_round8(__m256 x) { /* x canonical */
    __m256i u = _mm256_castps_si256(x);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                                   _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

AVX2 INLINE void store_w8(void *w, int64_t i, __m256 p, int w_dtype) {
    if (w_dtype == L2L_DT_BF16) _mm_storeu_si128((__m128i *)((uint16_t *)w + i), bf16_round8(p));
    else if (w_dtype == L2L_DT_F16) _mm_storeu_si128((__m128i *)((uint16_t *)w + i), _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
}

AVX2 INLINE __m256 bf16_load8(const void *h, int64_t i) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)h + i))), 16));
}

/* golden.apply_rule on 8 lanes, as rule1. */
AVX2 INLINE __m256 rule8(const l2l_scalars *s, const rule8_k *k, __m256 g, __m256 p, __m256 *m, __m256 *v) {
    if (s->optimizer == L2L_SGD) {
        if (s->weight_decay != 0) g = _mm256_add_ps(g, _mm256_mul_ps(p, k->wd));
        if (s->momentum != 0) {
            *m = _mm256_add_ps(_mm256_mul_ps(*m, k->mom), _mm256_mul_ps(g, k->damp_c));
            g = s->nesterov ? _mm256_add_ps(g, _mm256_mul_ps(*m, k->mom)) : *m;
        }
        return _mm256_sub_ps(p, _mm256_mul_ps(g, k->lr));
    }
    if (s->optimizer == L2L_ADAM && s->weight_decay != 0) g = _mm256_add_ps(g, _mm256_mul_ps(p, k->wd));
    if (s->optimizer == L2L_ADAMW && s->weight_decay != 0) p = _mm256_mul_ps(p, k->decay);
    *m = _mm256_add_ps(*m, _mm256_mul_ps(_mm256_sub_ps(g, *m), k->b1c));
    *v = _mm256_add_ps(_mm256_mul_ps(*v, k->b2), _mm256_mul_ps(_mm256_mul_ps(g, k->b2c), g));
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(*v), k->bc2), k->eps);
    return _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(*m, k->step_size), denom));
}

AVX2 INLINE int step_loop_avx2(const l2l_job *j, int64_t begin, int64_t end, int g_dtype, int w_dtype) {
    const l2l_scalars s = j->s;
    const rule8_k k = rule8_k_of(&s);
    const void *g = j->g;
    const float *p_src = j->p_src, *m_src = j->m_src, *v_src = j->v_src;
    float *p_dst = j->p_dst, *m_dst = j->m_dst, *v_dst = j->v_dst;
    void *w_dst = j->w_dst;
    const int uses_m = j->uses_m, uses_v = j->uses_v, unscale = UNSCALE(s);
    __m256i bad = _mm256_setzero_si256();
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256 gv = load_g8(g, i, g_dtype);
        if (unscale) gv = _mm256_mul_ps(gv, k.inv_scale);
        bad = _mm256_or_si256(bad, nonfinite8(gv));
        __m256 m = uses_m ? _mm256_loadu_ps(m_src + i) : _mm256_setzero_ps();
        __m256 v = uses_v ? _mm256_loadu_ps(v_src + i) : _mm256_setzero_ps();
        __m256 p = canon_nan8(rule8(&s, &k, gv, _mm256_loadu_ps(p_src + i), &m, &v));
        if (uses_m) _mm256_storeu_ps(m_dst + i, canon_nan8(m));
        if (uses_v) _mm256_storeu_ps(v_dst + i, canon_nan8(v));
        _mm256_storeu_ps(p_dst + i, p);
        store_w8(w_dst, i, p, w_dtype);
    }
    return (!_mm256_testz_si256(bad, bad)) | step_range_scalar(j, i, end);
}

/* One 8-bit code book's constants on 8 lanes. */
typedef struct {
    __m256i mag_mask, sign_mask, smallest_normal, round_base, offset, max_mag;
    __m256 unbias;
    __m128i drop;
} code8_k;

AVX2 INLINE code8_k code8_k_of(const l2l_code *c) {
    return (code8_k){_mm256_set1_epi32((int)c->mag_mask), _mm256_set1_epi32((int)c->sign_mask),
                     _mm256_set1_epi32((int)c->smallest_normal), _mm256_set1_epi32((int)(c->drop << 23)),
                     _mm256_set1_epi32((int)(c->smallest_normal >> c->drop)), _mm256_set1_epi32((int)c->max_magnitude),
                     _mm256_set1_ps(c->unbias), _mm_cvtsi32_si128((int)c->drop)};
}

/* codes -> values: the magnitude code shifted into place is a float32 whose exponent field
 * is the code's e (a subnormal float32 for e = 0); times 2^(127 - bias) it is the code's
 * value exactly; then the sign, then times the scale (golden's one rounding). */
AVX2 INLINE __m256 decode8(const code8_k *c, const uint8_t *codes, __m256 scale) {
    __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    __m256i mag = _mm256_and_si256(code, c->mag_mask);
    __m256 x = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_sll_epi32(mag, c->drop)), c->unbias);
    x = _mm256_or_ps(x, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(code, c->sign_mask), 24)));
    return _mm256_mul_ps(x, scale);
}

/* As encode16: one float add rounds |y| onto the code's grid, subnormal codes included. */
AVX2 INLINE void encode8(const code8_k *c, __m256 x, __m256 inv, uint8_t *codes) {
    __m256i bits = _mm256_castps_si256(_mm256_mul_ps(x, inv));
    __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i exp = _mm256_max_epu32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7F800000)), c->smallest_normal);
    __m256i base = _mm256_add_epi32(exp, c->round_base);
    __m256i steps = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(mag),
                                                                       _mm256_castsi256_ps(base))), base);
    __m256i q = _mm256_add_epi32(steps, _mm256_sub_epi32(_mm256_srl_epi32(exp, c->drop), c->offset));
    q = _mm256_min_epu32(q, c->max_mag);
    q = _mm256_or_si256(q, _mm256_and_si256(_mm256_srli_epi32(bits, 24), c->sign_mask));
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64((__m128i *)codes, _mm_packus_epi16(w, w));
}

AVX2 INLINE uint32_t max8(__m256i x) {
    uint32_t lanes[8], m = 0;
    _mm256_storeu_si256((__m256i *)lanes, x);
    for (int k = 0; k < 8; k++) m = lanes[k] > m ? lanes[k] : m;
    return m;
}

AVX2 static float encode_block_avx2(const float *buf, int64_t len, uint32_t absmax, uint8_t *codes, float *scale,
                                    const l2l_code *c) {
    int64_t vec = len & ~(int64_t)7;
    float inv = block_scale(magnitude_max(buf, vec, len, absmax), codes, scale, len, c);
    if (inv == 0) return 0;
    const code8_k k = code8_k_of(c);
    const __m256 inv8 = _mm256_set1_ps(inv);
    for (int64_t i = 0; i < vec; i += 8) encode8(&k, _mm256_load_ps(buf + i), inv8, codes + i);
    for (int64_t i = vec; i < len; i++) codes[i] = encode_one(buf[i] * inv, c);
    return inv;
}

AVX2 INLINE int state_loop_avx2(const l2l_job *j, int64_t begin, int64_t end, int g_dtype, int w_dtype, int format) {
    const l2l_scalars s = j->s;
    const rule8_k k = rule8_k_of(&s);
    const code8_k mk = code8_k_of(&j->m_code), vk = code8_k_of(&j->v_code);
    const __m256i mag_mask = _mm256_set1_epi32(0x7FFFFFFF);
    const int uses_m = j->uses_m, uses_v = j->uses_v, unscale = UNSCALE(s);
    float mbuf[L2L_BLOCK] __attribute__((aligned(32))), vbuf[L2L_BLOCK] __attribute__((aligned(32)));
    int bad = 0;
    for (int64_t b0 = begin; b0 < end; b0 += L2L_BLOCK) {
        int64_t len = end - b0 < L2L_BLOCK ? end - b0 : L2L_BLOCK, blk = b0 / L2L_BLOCK, b = 0;
        const int q8 = format == L2L_STATE_8BIT;
        float ms = q8 && uses_m ? j->m_scale_src[blk] : 0, vs = q8 && uses_v ? j->v_scale_src[blk] : 0;
        const __m256 ms8 = _mm256_set1_ps(ms), vs8 = _mm256_set1_ps(vs);
        __m256i bad8 = _mm256_setzero_si256(), mmax = _mm256_setzero_si256(), vmax = _mm256_setzero_si256();
        for (; b + 8 <= len; b += 8) {
            int64_t i = b0 + b;
            __m256 gv = load_g8(j->g, i, g_dtype);
            if (unscale) gv = _mm256_mul_ps(gv, k.inv_scale);
            bad8 = _mm256_or_si256(bad8, nonfinite8(gv));
            __m256 m = _mm256_setzero_ps(), v = _mm256_setzero_ps();
            if (uses_m) m = q8 ? decode8(&mk, (const uint8_t *)j->m_src + i, ms8) : bf16_load8(j->m_src, i);
            if (uses_v) v = q8 ? decode8(&vk, (const uint8_t *)j->v_src + i, vs8) : bf16_load8(j->v_src, i);
            __m256 p = canon_nan8(rule8(&s, &k, gv, _mm256_loadu_ps(j->p_src + i), &m, &v));
            _mm256_storeu_ps(j->p_dst + i, p);
            store_w8(j->w_dst, i, p, w_dtype);
            m = canon_nan8(m);
            v = canon_nan8(v);
            if (q8) {
                _mm256_store_ps(mbuf + b, m);
                _mm256_store_ps(vbuf + b, v);
                mmax = _mm256_max_epu32(mmax, _mm256_and_si256(_mm256_castps_si256(m), mag_mask));
                vmax = _mm256_max_epu32(vmax, _mm256_and_si256(_mm256_castps_si256(v), mag_mask));
            } else {
                if (uses_m) _mm_storeu_si128((__m128i *)((uint16_t *)j->m_dst + i), bf16_round8(m));
                if (uses_v) _mm_storeu_si128((__m128i *)((uint16_t *)j->v_dst + i), bf16_round8(v));
            }
        }
        bad |= !_mm256_testz_si256(bad8, bad8);
        for (; b < len; b++) bad |= state_one(j, b0, b, ms, vs, mbuf, vbuf);
        if (q8 && uses_m) encode_block_avx2(mbuf, len, max8(mmax), (uint8_t *)j->m_dst + b0, j->m_scale_dst + blk, &j->m_code);
        if (q8 && uses_v) encode_block_avx2(vbuf, len, max8(vmax), (uint8_t *)j->v_dst + b0, j->v_scale_dst + blk, &j->v_code);
    }
    return bad;
}

/* ---------------------------------------------------------------- AVX-512 path (F, DQ, BW, VL) */

#define AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))

typedef struct {
    __m512 inv_scale, lr, wd, decay, b1c, b2, b2c, step_size, bc2, eps, mom, damp_c, bc2_inv;
    int bc2_by_fma;
} rule16_k;

AVX512 INLINE rule16_k rule16_k_of(const l2l_job *j) {
    const l2l_scalars *s = &j->s;
    return (rule16_k){_mm512_set1_ps(s->inv_scale), _mm512_set1_ps(s->lr), _mm512_set1_ps(s->weight_decay),
                      _mm512_set1_ps(s->decay), _mm512_set1_ps(s->one_minus_beta1), _mm512_set1_ps(s->beta2),
                      _mm512_set1_ps(s->one_minus_beta2), _mm512_set1_ps(s->step_size),
                      _mm512_set1_ps(s->bias_correction2_sqrt), _mm512_set1_ps(s->eps), _mm512_set1_ps(s->momentum),
                      _mm512_set1_ps(s->dampening_complement), _mm512_set1_ps(1.0f / s->bias_correction2_sqrt),
                      j->bc2_by_fma}; /* under the IEEE MXCSR, as in fma_quotient_misses */
}

AVX512 INLINE __m512 canon_nan16(__m512 x) {
    return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}

AVX512 INLINE __mmask16 nonfinite16(__m512 g) {
    const __m512i exp_mask = _mm512_set1_epi32(0x7F800000);
    return _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(g), exp_mask), exp_mask);
}

AVX512 INLINE __m512 load_g16(const void *g, int64_t i, int g_dtype) {
    if (g_dtype == L2L_DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i))), 16));
    if (g_dtype == L2L_DT_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i)));
    return _mm512_loadu_ps((const float *)g + i);
}

AVX512 INLINE __m256i bf16_round16(__m512 x) { /* x canonical */
    __m512i u = _mm512_castps_si512(x);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                   _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    return _mm512_cvtepi32_epi16(r);
}

/* The working copy of 16 weights. The native bf16 conversion reads a subnormal as zero: it
 * returns the lanes that hold one, whose vectors the loop rewrites (rewrite16). */
AVX512 INLINE __mmask16 store_w16(void *w, int64_t i, __m512 p, int w_dtype) {
    if (w_dtype == L2L_DT_BF16_NATIVE) {
        __m256i h;
        __asm__("vcvtneps2bf16 %1, %0" : "=v"(h) : "v"(p)); /* no target attribute needed for the pool's callers */
        _mm256_storeu_si256((__m256i *)((uint16_t *)w + i), h);
        return _mm512_fpclass_ps_mask(p, 0x20 /* subnormal */);
    }
    if (w_dtype == L2L_DT_BF16) _mm256_storeu_si256((__m256i *)((uint16_t *)w + i), bf16_round16(p));
    else if (w_dtype == L2L_DT_F16) _mm256_storeu_si256((__m256i *)((uint16_t *)w + i), _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
    return 0;
}

/* The loops below write NaN as the arithmetic made it and the working copy by the native
 * conversion, and only note where a vector held a NaN or a subnormal weight; this pass then
 * rewrites the whole vectors of [begin, end): NaN made canonical in p (and in fp32 m and v,
 * which are NULL otherwise) and the working copy from p by integer rounding. Both cases are
 * rare; testing and fixing each vector in the loop cost more. */
AVX512 INLINE void rewrite16(float *p, float *m, float *v, void *w, int w_dtype, int64_t begin, int64_t end) {
    const int exact = w_dtype == L2L_DT_BF16_NATIVE ? L2L_DT_BF16 : w_dtype;
    for (int64_t i = begin; i + 16 <= end; i += 16) {
        __m512 x = canon_nan16(_mm512_loadu_ps(p + i));
        _mm512_storeu_ps(p + i, x);
        store_w16(w, i, x, exact);
        if (m) _mm512_storeu_ps(m + i, canon_nan16(_mm512_loadu_ps(m + i)));
        if (v) _mm512_storeu_ps(v + i, canon_nan16(_mm512_loadu_ps(v + i)));
    }
}

AVX512 INLINE __m512 bf16_load16(const void *h, int64_t i) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)h + i))), 16));
}

/* a / bias_correction2_sqrt, rounded once, for a = sqrt(v). The divisor is the same in
 * every element of a call, so where the call proved it (bc2_by_fma) the quotient is
 * Markstein's: q = a y with y = 1/bc2 rounded, r = a - q bc2 (one FMA), q + r y (one FMA);
 * see bc2_by_fma. Lanes where a is +-0, +-Inf or NaN keep q = a y, which is
 * a / bc2 there (the correction would turn Inf into NaN). */
AVX512 INLINE __m512 div_bc2(const rule16_k *k, __m512 a) {
    if (!k->bc2_by_fma) return _mm512_div_ps(a, k->bc2);
    __m512 q = _mm512_mul_ps(a, k->bc2_inv);
    __m512 r = _mm512_fnmadd_ps(q, k->bc2, a);
    __mmask16 special = _mm512_fpclass_ps_mask(a, 0x9F); /* QNaN, +-0, +-Inf, SNaN */
    return _mm512_mask3_fmadd_ps(r, k->bc2_inv, q, _knot_mask16(special));
}

/* The check that lets a call take div_bc2's FMA quotient for the divisor *ctx: over the
 * significands [begin, end) of a in [1, 2), returns 1 at the first a where it differs from
 * the division. Markstein's theorem (y within half an ulp of 1/b, q within one ulp of a/b)
 * says it never does; the check does not rely on it. */
AVX512 static int fma_quotient_misses(const void *ctx, int64_t begin, int64_t end) {
    const float b = *(const float *)ctx;
    const rule16_k k = {.bc2 = _mm512_set1_ps(b), .bc2_inv = _mm512_set1_ps(1.0f / b), .bc2_by_fma = 1};
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t f = begin; f < end; f += 16) { /* begin and end are multiples of 16 */
        __m512 a = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_set1_epi32((int)(0x3F800000 + f)), lane));
        if (_mm512_cmp_ps_mask(div_bc2(&k, a), _mm512_div_ps(a, k.bc2), _CMP_NEQ_UQ)) return 1;
    }
    return 0;
}

/* golden.apply_rule on 16 lanes, as rule1. */
AVX512 INLINE __m512 rule16(const l2l_scalars *s, const rule16_k *k, __m512 g, __m512 p, __m512 *m, __m512 *v) {
    if (s->optimizer == L2L_SGD) {
        if (s->weight_decay != 0) g = _mm512_add_ps(g, _mm512_mul_ps(p, k->wd));
        if (s->momentum != 0) {
            *m = _mm512_add_ps(_mm512_mul_ps(*m, k->mom), _mm512_mul_ps(g, k->damp_c));
            g = s->nesterov ? _mm512_add_ps(g, _mm512_mul_ps(*m, k->mom)) : *m;
        }
        return _mm512_sub_ps(p, _mm512_mul_ps(g, k->lr));
    }
    if (s->optimizer == L2L_ADAM && s->weight_decay != 0) g = _mm512_add_ps(g, _mm512_mul_ps(p, k->wd));
    if (s->optimizer == L2L_ADAMW && s->weight_decay != 0) p = _mm512_mul_ps(p, k->decay);
    *m = _mm512_add_ps(*m, _mm512_mul_ps(_mm512_sub_ps(g, *m), k->b1c));
    *v = _mm512_add_ps(_mm512_mul_ps(*v, k->b2), _mm512_mul_ps(_mm512_mul_ps(g, k->b2c), g));
    __m512 denom = _mm512_add_ps(div_bc2(k, _mm512_sqrt_ps(*v)), k->eps);
    return _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(*m, k->step_size), denom));
}

AVX512 INLINE int step_loop_avx512(const l2l_job *j, int64_t begin, int64_t end, int g_dtype, int w_dtype) {
    const l2l_scalars s = j->s;
    const rule16_k k = rule16_k_of(j);
    const void *g = j->g;
    const float *p_src = j->p_src, *m_src = j->m_src, *v_src = j->v_src;
    float *p_dst = j->p_dst, *m_dst = j->m_dst, *v_dst = j->v_dst;
    void *w_dst = j->w_dst;
    const int uses_m = j->uses_m, uses_v = j->uses_v, unscale = UNSCALE(s);
    __mmask16 bad = 0, redo = 0;
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
        __m512 gv = load_g16(g, i, g_dtype);
        if (unscale) gv = _mm512_mul_ps(gv, k.inv_scale);
        bad |= nonfinite16(gv);
        __m512 m = uses_m ? _mm512_loadu_ps(m_src + i) : _mm512_setzero_ps();
        __m512 v = uses_v ? _mm512_loadu_ps(v_src + i) : _mm512_setzero_ps();
        __m512 p = rule16(&s, &k, gv, _mm512_loadu_ps(p_src + i), &m, &v);
        redo |= _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q); /* a NaN in m or v makes p NaN too (rule16) */
        if (uses_m) _mm512_storeu_ps(m_dst + i, m);
        if (uses_v) _mm512_storeu_ps(v_dst + i, v);
        _mm512_storeu_ps(p_dst + i, p);
        redo |= store_w16(w_dst, i, p, w_dtype);
    }
    if (redo) rewrite16(p_dst, uses_m ? m_dst : NULL, uses_v ? v_dst : NULL, w_dst, w_dtype, begin, i);
    return (bad != 0) | step_range_scalar(j, i, end);
}

typedef struct {
    __m512i code_mask, exp_min, round_base, offset, max_mag;
    __m128i drop;
} code16_k;

AVX512 INLINE code16_k code16_k_of(const l2l_code *c) {
    return (code16_k){_mm512_set1_epi32((int)(c->sign_mask ? 0x80000000u | (c->mag_mask << c->drop) : 0xFFFFFFFFu)),
                      _mm512_set1_epi32((int)c->smallest_normal), _mm512_set1_epi32((int)(c->drop << 23)),
                      _mm512_set1_epi32((int)(c->smallest_normal >> c->drop)), _mm512_set1_epi32((int)c->max_magnitude),
                      _mm_cvtsi32_si128((int)c->drop)};
}

/* One block's decode factors: the code's value (exact) times the scale (one rounding) is
 * one multiply by 2^(127 - bias + k) when the scale is a power of two 2^k with k <= bias
 * (the factor is then a normal float: the same rounding), or by NaN for a NaN scale;
 * otherwise two multiplies, by 2^(127 - bias) and by the scale. */
typedef struct { __m512 first, second; int two; } block16_k;

AVX512 INLINE block16_k block16_k_of(const l2l_code *c, float scale) {
    uint32_t bits = f2u(scale), e = bits >> 23;
    if (scale != scale) return (block16_k){_mm512_set1_ps(scale), _mm512_set1_ps(scale), 0};
    if ((bits & 0x007FFFFFu) == 0 && e >= 1 && e <= 127 + c->bias)
        return (block16_k){_mm512_set1_ps(u2f((e + 127 - c->bias) << 23)), _mm512_set1_ps(scale), 0};
    return (block16_k){_mm512_set1_ps(c->unbias), _mm512_set1_ps(scale), 1};
}

/* codes -> values. The code shifted into place is a float32 whose exponent field is the
 * code's e (a subnormal float32 for e = 0); a signed code is loaded sign-extended, so the
 * shift puts copies of its sign above the magnitude, and the mask keeps the one in bit 31. */
AVX512 INLINE __m512 decode16(const code16_k *c, const block16_k *b, const uint8_t *codes, int is_signed) {
    __m128i raw = _mm_loadu_si128((const __m128i *)codes);
    __m512i code = is_signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
    __m512i bits = _mm512_sll_epi32(code, c->drop);
    if (is_signed) bits = _mm512_and_si512(bits, c->code_mask);
    __m512 x = _mm512_mul_ps(_mm512_castsi512_ps(bits), b->first);
    return b->two ? _mm512_mul_ps(x, b->second) : x;
}

/* values scaled into the code's range (y = x * 2^-k) -> codes, as golden.encode_codes: the
 * float add |y| + M, M = 2^(E + drop) with E the exponent of |y| but at least the code's
 * smallest normal exponent, rounds |y| to the code's grid there (round to nearest even),
 * and bits(|y| + M) - bits(M) counts grid steps: 2^man_bits + f for a normal code, f for
 * a subnormal one; the exponent of M gives the rest of the code. */
AVX512 INLINE void encode16(const code16_k *c, __m512 x, __m512 inv, uint8_t *codes, int is_signed, int saturate,
                            int positive) {
    __m512i bits = _mm512_castps_si512(_mm512_mul_ps(x, inv));
    __m512i mag = positive ? bits : _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    __m512i exp = _mm512_max_epu32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7F800000)), c->exp_min);
    __m512i base = _mm512_add_epi32(exp, c->round_base);
    __m512i steps = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(mag),
                                                                       _mm512_castsi512_ps(base))), base);
    __m512i q = _mm512_add_epi32(steps, _mm512_sub_epi32(_mm512_srl_epi32(exp, c->drop), c->offset));
    if (saturate) q = _mm512_min_epu32(q, c->max_mag);
    if (is_signed) q = _mm512_ternarylogic_epi32(q, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), 0xF8);
    _mm_storeu_si128((__m128i *)codes, _mm512_cvtepi32_epi8(q));
}

/* Largest |x| bits so far (integer order of |x| bits is the order of |x|; NaN above Inf).
 * `positive`: every x is +0, positive or NaN, whose bits are then |x| or (NaN) at least
 * 0x7F800000 either way, so the block is found non-finite all the same. */
AVX512 INLINE __m512i absmax16(__m512i acc, __m512 x, int positive) {
    __m512i bits = _mm512_castps_si512(x);
    return _mm512_max_epu32(acc, positive ? bits : _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)));
}

/* v of a block whose stored scale has its sign bit clear is +0, positive or NaN: its codes
 * are unsigned, the decode multiplies them by that scale, and the rule adds g * g terms.
 * (Our encoder writes only such scales; a checkpoint could hold others.) */
static inline int v_positive(float v_scale) { return (f2u(v_scale) >> 31) == 0; }

/* A block whose scale exponent k was not clamped to SCALE_EXP_LIMIT cannot round past the
 * largest code (golden.block_exponent rounds the block maximum first): no saturation. */
AVX512 INLINE float encode_block_avx512(const float *buf, int64_t len, uint32_t absmax, uint8_t *codes, float *scale,
                                        const l2l_code *c, const code16_k *k, int is_signed, int positive) {
    int64_t vec = len & ~(int64_t)15;
    float inv = block_scale(magnitude_max(buf, vec, len, absmax), codes, scale, len, c);
    if (inv == 0) return 0;
    const int saturate = f2u(inv) == (uint32_t)(127 - SCALE_EXP_LIMIT) << 23;
    const __m512 inv16 = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < vec; i += 16) /* the loop is unswitched on the two flags (-O3) */
        encode16(k, _mm512_load_ps(buf + i), inv16, codes + i, is_signed, saturate, positive);
    for (int64_t i = vec; i < len; i++) codes[i] = encode_one(buf[i] * inv, c);
    return inv;
}

AVX512 INLINE int nonfinite_block16(const void *g, int64_t b0, int64_t len, int g_dtype, __m512 inv_scale, int unscale) {
    __mmask16 bad = 0;
    int64_t b = 0;
    for (; b + 16 <= len; b += 16) {
        __m512 gv = load_g16(g, b0 + b, g_dtype);
        bad |= nonfinite16(unscale ? _mm512_mul_ps(gv, inv_scale) : gv);
    }
    return bad != 0;
}

AVX512 INLINE int state_loop_avx512(const l2l_job *j, int64_t begin, int64_t end, int g_dtype, int w_dtype, int format) {
    const l2l_scalars s = j->s;
    const rule16_k k = rule16_k_of(j);
    const code16_k mk = code16_k_of(&j->m_code), vk = code16_k_of(&j->v_code);
    const int uses_m = j->uses_m, uses_v = j->uses_v, unscale = UNSCALE(s);
    const int q8 = format == L2L_STATE_8BIT;
    /* 8-bit state (always with m: l2l_host_step sends a step without state to the fp32
     * loops): a gradient that is not finite makes m or v of its element not finite (v for
     * Adam, m for SGD with momentum), so only a block whose state max is not finite has its
     * gradients checked. */
    const int check_each = !q8;
    /* the job's pointers in locals: a store through one of them could otherwise be taken to
     * change the job, and every field be loaded again after it */
    const void *g = j->g, *m_src = j->m_src, *v_src = j->v_src;
    const float *p_src = j->p_src;
    float *p_dst = j->p_dst;
    void *w_dst = j->w_dst, *m_dst = j->m_dst, *v_dst = j->v_dst;
    float mbuf[L2L_BLOCK] __attribute__((aligned(64))), vbuf[L2L_BLOCK] __attribute__((aligned(64)));
    int bad = 0;
    for (int64_t b0 = begin; b0 < end; b0 += L2L_BLOCK) {
        int64_t len = end - b0 < L2L_BLOCK ? end - b0 : L2L_BLOCK, blk = b0 / L2L_BLOCK, b = 0;
        float ms = q8 && uses_m ? j->m_scale_src[blk] : 0, vs = q8 && uses_v ? j->v_scale_src[blk] : 0;
        const block16_k mb = block16_k_of(&j->m_code, ms), vb = block16_k_of(&j->v_code, vs);
        const int v_pos = v_positive(vs);
        __m512i mmax = _mm512_setzero_si512(), vmax = _mm512_setzero_si512();
        __mmask16 bad16 = 0, redo = 0;
        for (; b + 16 <= len; b += 16) {
            int64_t i = b0 + b;
            __m512 gv = load_g16(g, i, g_dtype);
            if (unscale) gv = _mm512_mul_ps(gv, k.inv_scale);
            if (check_each) bad16 |= nonfinite16(gv);
            __m512 m = _mm512_setzero_ps(), v = _mm512_setzero_ps();
            if (uses_m) m = q8 ? decode16(&mk, &mb, (const uint8_t *)m_src + i, 1) : bf16_load16(m_src, i);
            if (uses_v) v = q8 ? decode16(&vk, &vb, (const uint8_t *)v_src + i, 0) : bf16_load16(v_src, i);
            __m512 p = rule16(&s, &k, gv, _mm512_loadu_ps(p_src + i), &m, &v);
            _mm512_storeu_ps(p_dst + i, p);
            redo |= _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q) | store_w16(w_dst, i, p, w_dtype);
            if (q8) { /* a NaN needs no canonical form here: it makes its block NaN */
                _mm512_store_ps(mbuf + b, m);
                _mm512_store_ps(vbuf + b, v);
                mmax = absmax16(mmax, m, 0);
                vmax = absmax16(vmax, v, v_pos);
            } else {
                if (uses_m) _mm256_storeu_si256((__m256i *)((uint16_t *)m_dst + i), bf16_round16(canon_nan16(m)));
                if (uses_v) _mm256_storeu_si256((__m256i *)((uint16_t *)v_dst + i), bf16_round16(canon_nan16(v)));
            }
        }
        int64_t vec = b;
        if (redo) rewrite16(p_dst, NULL, NULL, w_dst, w_dtype, b0, b0 + vec);
        for (; b < len; b++) bad |= state_one(j, b0, b, ms, vs, mbuf, vbuf);
        bad |= bad16 != 0;
        if (q8) {
            uint32_t m_abs = (uint32_t)_mm512_reduce_max_epu32(mmax), v_abs = (uint32_t)_mm512_reduce_max_epu32(vmax);
            if (!check_each && (m_abs >= 0x7F800000u || v_abs >= 0x7F800000u))
                bad |= nonfinite_block16(g, b0, vec, g_dtype, k.inv_scale, unscale);
            if (uses_m) encode_block_avx512(mbuf, len, m_abs, (uint8_t *)m_dst + b0, j->m_scale_dst + blk, &j->m_code, &mk, 1, 0);
            if (uses_v) encode_block_avx512(vbuf, len, v_abs, (uint8_t *)v_dst + b0, j->v_scale_dst + blk, &j->v_code, &vk, 0, v_pos);
        }
    }
    return bad;
}

/* ---------------------------------------------------------------- dispatch
 * Each loop above is inlined once per (gradient dtype, working dtype[, state format]), so
 * the loop body has no run-time dtype tests. */

#define DTYPE_CASES(LOOP, ...)                                                          \
    switch (j->g_dtype * 3 + (j->w_dtype == L2L_DT_NONE ? 0 : j->w_dtype)) {              \
    case 0: return LOOP(j, begin, end, L2L_DT_F32, L2L_DT_NONE, ##__VA_ARGS__);         \
    case 1: return LOOP(j, begin, end, L2L_DT_F32, L2L_DT_BF16, ##__VA_ARGS__);         \
    case 2: return LOOP(j, begin, end, L2L_DT_F32, L2L_DT_F16, ##__VA_ARGS__);          \
    case 3: return LOOP(j, begin, end, L2L_DT_BF16, L2L_DT_NONE, ##__VA_ARGS__);        \
    case 4: return LOOP(j, begin, end, L2L_DT_BF16, L2L_DT_BF16, ##__VA_ARGS__);        \
    case 5: return LOOP(j, begin, end, L2L_DT_BF16, L2L_DT_F16, ##__VA_ARGS__);         \
    case 6: return LOOP(j, begin, end, L2L_DT_F16, L2L_DT_NONE, ##__VA_ARGS__);         \
    case 7: return LOOP(j, begin, end, L2L_DT_F16, L2L_DT_BF16, ##__VA_ARGS__);         \
    default: return LOOP(j, begin, end, L2L_DT_F16, L2L_DT_F16, ##__VA_ARGS__);         \
    }

AVX2 static int step_range_avx2(const void *ctx, int64_t begin, int64_t end) {
    const l2l_job *j = ctx;
    DTYPE_CASES(step_loop_avx2)
}

AVX2 static int state_range_avx2(const void *ctx, int64_t begin, int64_t end) {
    const l2l_job *j = ctx;
    if (j->format == L2L_STATE_BF16) { DTYPE_CASES(state_loop_avx2, L2L_STATE_BF16) }
    DTYPE_CASES(state_loop_avx2, L2L_STATE_8BIT)
}

/* The AVX-512 loops also take the native bf16 working copy. */
#define DTYPE_CASES_512(LOOP, ...)                                                      \
    if (j->w_dtype == L2L_DT_BF16_NATIVE) switch (j->g_dtype) {                         \
        case L2L_DT_F32: return LOOP(j, begin, end, L2L_DT_F32, L2L_DT_BF16_NATIVE, ##__VA_ARGS__); \
        case L2L_DT_BF16: return LOOP(j, begin, end, L2L_DT_BF16, L2L_DT_BF16_NATIVE, ##__VA_ARGS__); \
        default: return LOOP(j, begin, end, L2L_DT_F16, L2L_DT_BF16_NATIVE, ##__VA_ARGS__); \
    }                                                                                   \
    DTYPE_CASES(LOOP, ##__VA_ARGS__)

AVX512 static int step_range_avx512(const void *ctx, int64_t begin, int64_t end) {
    const l2l_job *j = ctx;
    DTYPE_CASES_512(step_loop_avx512)
}

AVX512 static int state_range_avx512(const void *ctx, int64_t begin, int64_t end) {
    const l2l_job *j = ctx;
    if (j->format == L2L_STATE_BF16) { DTYPE_CASES_512(state_loop_avx512, L2L_STATE_BF16) }
    DTYPE_CASES_512(state_loop_avx512, L2L_STATE_8BIT)
}

/* ---------------------------------------------------------------- memory stream
 * The bandwidth reference of `l2l bench eps`: the byte mix of a step (streams read,
 * streams updated in place, streams written, each with its bytes per element), moved with
 * no arithmetic (updated vectors get one integer add, written ones a constant), all streams in lock step as the
 * step moves them. Stores are plain or non-temporal (streaming, no read for ownership);
 * the bench takes the faster at the best thread count, so the figure bounds what any
 * implementation of the same bytes reaches. */

#define L2L_STREAMS 8
#define LINE 64

typedef struct {
    int32_t reads, updates, writes, nontemporal;
    int32_t size[L2L_STREAMS]; /* bytes per element of each stream: reads, then updates, then writes */
    void *ptr[L2L_STREAMS];
} l2l_stream;

static volatile uint64_t stream_sink; /* keeps the loads of read-only streams alive */

/* Bytes [lo, hi) of every stream, scalar, 8 bytes at a time where whole. */
static int stream_bytes_scalar(const l2l_stream *t, int64_t begin, int64_t end) {
    uint64_t acc = 0;
    int k = 0;
    for (; k < t->reads + t->updates + t->writes; k++) {
        int64_t lo = begin * t->size[k], hi = end * t->size[k];
        uint8_t *b = t->ptr[k];
        for (int64_t x = lo; x < hi; x++) {
            if (k < t->reads) acc += b[x];
            else if (k < t->reads + t->updates) b[x] += 1;
            else b[x] = 1;
        }
    }
    stream_sink = acc;
    return 0;
}

static int stream_range_scalar(const void *ctx, int64_t begin, int64_t end) {
    return stream_bytes_scalar(ctx, begin, end);
}

/* Whole groups of LINE elements with vectors: each stream moves size[k] lines per group. */
AVX2 static int stream_range_avx2(const void *ctx, int64_t begin, int64_t end) {
    const l2l_stream *t = ctx;
    const int r = t->reads, u = r + t->updates, w = u + t->writes, nt = t->nontemporal;
    const __m256i one = _mm256_set1_epi8(1);
    __m256i acc = _mm256_setzero_si256();
    int64_t i = begin;
    for (; i + LINE <= end; i += LINE) {
        for (int k = 0; k < w; k++) {
            char *b = (char *)t->ptr[k] + i * t->size[k];
            for (int l = 0; l < t->size[k] * LINE; l += 32) {
                __m256i *a = (__m256i *)(b + l);
                if (k < r) acc = _mm256_add_epi32(acc, _mm256_loadu_si256(a));
                else {
                    __m256i x = k < u ? _mm256_add_epi8(_mm256_loadu_si256(a), one) : one;
                    if (nt) _mm256_stream_si256(a, x);
                    else _mm256_storeu_si256(a, x);
                }
            }
        }
    }
    if (nt) _mm_sfence();
    stream_sink = (uint64_t)_mm256_extract_epi64(acc, 0);
    return stream_bytes_scalar(t, i, end);
}

AVX512 static int stream_range_avx512(const void *ctx, int64_t begin, int64_t end) {
    const l2l_stream *t = ctx;
    const int r = t->reads, u = r + t->updates, w = u + t->writes, nt = t->nontemporal;
    const __m512i one = _mm512_set1_epi8(1);
    __m512i acc = _mm512_setzero_si512();
    int64_t i = begin;
    for (; i + LINE <= end; i += LINE) {
        for (int k = 0; k < w; k++) {
            char *b = (char *)t->ptr[k] + i * t->size[k];
            for (int l = 0; l < t->size[k] * LINE; l += 64) {
                void *a = b + l;
                if (k < r) acc = _mm512_add_epi32(acc, _mm512_loadu_si512(a));
                else {
                    __m512i x = k < u ? _mm512_add_epi32(_mm512_loadu_si512(a), one) : one;
                    if (nt) _mm512_stream_si512(a, x);
                    else _mm512_storeu_si512(a, x);
                }
            }
        }
    }
    if (nt) _mm_sfence();
    stream_sink = (uint64_t)_mm_cvtsi128_si64(_mm512_castsi512_si128(acc));
    return stream_bytes_scalar(t, i, end);
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

static int native_bf16; /* this CPU has AVX512_BF16 (the AVX-512 path's vcvtneps2bf16); set once at load */

__attribute__((constructor)) static void pool_init(void) {
    pthread_atfork(NULL, NULL, pool_after_fork_child);
    __builtin_cpu_init();
    native_bf16 = __builtin_cpu_supports("avx512bf16");
}

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
    if (threads > L2L_MAX_THREADS) threads = L2L_MAX_THREADS;
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

/* Whether a call's AVX-512 loops may divide sqrt(v) by b = bias_correction2_sqrt with
 * div_bc2's FMA quotient: only if it equals the division for every a in [1, 2), checked
 * exhaustively (2^23 significands, about 1.5 ms on one core) by the pool under the IEEE MXCSR.
 * Then it does for every a = sqrt(v) with v > 0 finite: such an a lies in [2^-75, 2^64],
 * and with b in [2^-20, 2^20] its q, r (zero or at least 2^-122) and result are normal, so
 * each is the one of a's significand times the same power of two. The verdict for the last
 * b is kept, as a step's calls share their b; a call of fewer than FMA_CHECK_MIN elements,
 * which the check would cost more than it saves, divides unless b has a verdict. */
#define FMA_CHECK_MIN ((int64_t)1 << 20)

static int bc2_by_fma(float b, int64_t n, int threads) {
    static uint64_t last; /* bit 40: set; bit 32: the verdict; bits 0-31: b */
    if (!(b >= 0x1p-20f && b <= 0x1p20f)) return 0;
    uint64_t seen = __atomic_load_n(&last, __ATOMIC_RELAXED);
    if (seen >> 40 && (uint32_t)seen == f2u(b)) return (int)(seen >> 32) & 1;
    if (n < FMA_CHECK_MIN) return 0;
    int exact = parallel_tiles(fma_quotient_misses, &b, (int64_t)1 << 23, threads) == 0;
    __atomic_store_n(&last, (uint64_t)1 << 40 | (uint64_t)exact << 32 | f2u(b), __ATOMIC_RELAXED);
    return exact;
}

EXPORT int l2l_host_tile(void) { return L2L_TILE; }

EXPORT int l2l_host_block(void) { return L2L_BLOCK; }

EXPORT int l2l_host_isa_supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
    case L2L_ISA_SCALAR: return 1;
    case L2L_ISA_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case L2L_ISA_AVX512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                                __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    default: return 0;
    }
}

EXPORT int l2l_host_best_isa(void) {
    return l2l_host_isa_supported(L2L_ISA_AVX512) ? L2L_ISA_AVX512
         : l2l_host_isa_supported(L2L_ISA_AVX2)   ? L2L_ISA_AVX2 : L2L_ISA_SCALAR;
}

/* Whether AVX-512 steps whose bias_correction2_sqrt is b take div_bc2's FMA quotient (b's
 * check runs now if it has not). */
EXPORT int l2l_host_bc2_by_fma(float b, int threads) {
    return l2l_host_isa_supported(L2L_ISA_AVX512) &&
           bc2_by_fma(b, FMA_CHECK_MIN, threads);
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
        (state_format == L2L_STATE_8BIT && !(codebook_valid(codes->m, 1) && codebook_valid(codes->v, 0))))
        return L2L_E_ARG;
    int uses_v = s->optimizer != L2L_SGD, uses_m = uses_v || s->momentum != 0;
    if (!uses_m) state_format = L2L_STATE_F32; /* no state to keep */
    range_fn fn = state_format == L2L_STATE_F32 ? pick(isa, step_range_scalar, step_range_avx2, step_range_avx512)
                                                : pick(isa, state_range_scalar, state_range_avx2, state_range_avx512);
    if (fn == NULL) return L2L_E_ISA;
    if (n == 0) return 0;
    l2l_job job = {*s, g_dtype, w_dtype, state_format, uses_m, uses_v, b->g, b->p_src, b->p_dst, b->w_dst,
                   b->m_src, b->v_src, b->m_dst, b->v_dst, b->m_scale_src, b->v_scale_src, b->m_scale_dst,
                   b->v_scale_dst, {0}, {0}, 0};
    if (isa == L2L_ISA_AVX512 && w_dtype == L2L_DT_BF16 && native_bf16)
        job.w_dtype = L2L_DT_BF16_NATIVE;
    if (isa == L2L_ISA_AVX512 && uses_v) job.bc2_by_fma = bc2_by_fma(s->bias_correction2_sqrt, n, threads);
    if (state_format == L2L_STATE_8BIT) {
        job.m_code = make_code(codes->m);
        job.v_code = make_code(codes->v);
    }
    return parallel_tiles(fn, &job, n, threads);
}

/* The memory reference (see "memory stream"): n elements of each stream. Non-temporal
 * stores need 64-byte aligned streams (the binding checks). */
EXPORT int l2l_host_stream(int64_t n, const l2l_stream *streams, int isa, int threads) {
    if (n < 0 || streams->reads < 0 || streams->updates < 0 || streams->writes < 0 ||
        streams->reads + streams->updates + streams->writes > L2L_STREAMS)
        return L2L_E_ARG;
    range_fn fn = pick(isa, stream_range_scalar, stream_range_avx2, stream_range_avx512);
    if (fn == NULL) return L2L_E_ISA;
    if (n == 0) return 0;
    return parallel_tiles(fn, streams, n, threads);
}
