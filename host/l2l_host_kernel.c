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
    int64_t n, tiles;
    int64_t next_tile;    /* atomic */
    int nonfinite;        /* atomic */
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
            .wake = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

/* Take tiles off the shared counter until none is left, under the IEEE MXCSR. */
static void run_tiles(range_fn fn, const void *ctx, int64_t n, int64_t tiles, int64_t *next, int *flag) {
    unsigned int saved = _mm_getcsr();
    _mm_setcsr(MXCSR_IEEE);
    int bad = 0;
    for (int64_t t; (t = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED)) < tiles;) {
        int64_t end = (t + 1) * L2L_TILE;
        bad |= fn(ctx, t * L2L_TILE, end < n ? end : n);
    }
    _mm_setcsr(saved);
    if (bad) __atomic_store_n(flag, 1, __ATOMIC_RELAXED);
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
        run_tiles(pool.fn, pool.ctx, pool.n, pool.tiles, &pool.next_tile, &pool.nonfinite);
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
    int64_t tiles = (n + L2L_TILE - 1) / L2L_TILE, next = 0;
    int flag = 0;
    if (threads > tiles) threads = (int)tiles;
    if (threads <= 1 || pthread_mutex_trylock(&pool.busy) != 0) { /* small call, or pool in use */
        run_tiles(fn, ctx, n, tiles, &next, &flag);
        return flag;
    }
    if (pool_grow(threads - 1) != 0 && pool.started + 1 < threads) threads = pool.started + 1; /* fewer workers than asked */
    pthread_mutex_lock(&pool.mu);
    pool.fn = fn; pool.ctx = ctx; pool.n = n; pool.tiles = tiles;
    pool.next_tile = 0; pool.nonfinite = 0;
    pool.active = pool.remaining = threads - 1;
    pool.generation++;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    run_tiles(fn, ctx, n, tiles, &pool.next_tile, &pool.nonfinite); /* the caller takes tiles too */
    pthread_mutex_lock(&pool.mu);
    while (pool.remaining > 0) pthread_cond_wait(&pool.done, &pool.mu);
    flag = pool.nonfinite;
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.busy);
    return flag;
}

/* ---------------------------------------------------------------- entry points */

EXPORT int l2l_host_tile(void) { return L2L_TILE; }

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

/* One optimizer step over n elements. m/v pointers are unused (may be NULL) where the
 * optimizer has no such state (v for SGD; m for SGD without momentum); w_dst is unused
 * for w_dtype = -1. Returns 1 when a gradient value times inv_scale is not finite, 0
 * when all are finite, or a negative error code. */
EXPORT int l2l_host_step(const l2l_scalars *s, int64_t n, const void *g, int g_dtype,
                         const float *p_src, float *p_dst, const float *m_src, float *m_dst,
                         const float *v_src, float *v_dst, void *w_dst, int w_dtype,
                         int isa, int threads) {
    if (n < 0 || s->optimizer < L2L_ADAMW || s->optimizer > L2L_SGD || g_dtype < L2L_DT_F32 ||
        g_dtype > L2L_DT_F16 || w_dtype < L2L_DT_NONE || w_dtype == L2L_DT_F32 || w_dtype > L2L_DT_F16)
        return L2L_E_ARG;
    range_fn fn = pick(isa, step_range_scalar, step_range_avx2, step_range_avx512);
    if (fn == NULL) return L2L_E_ISA;
    if (n == 0) return 0;
    l2l_step job = {*s, g, g_dtype, w_dtype, p_src, m_src, v_src, p_dst, m_dst, v_dst, w_dst};
    return parallel_tiles(fn, &job, n, threads < L2L_MAX_THREADS ? threads : L2L_MAX_THREADS);
}

EXPORT int l2l_host_stream(int64_t n, const uint16_t *g, float *p, float *m, float *v, uint16_t *w,
                           int isa, int threads) {
    range_fn fn = pick(isa, stream_range_scalar, stream_range_avx2, stream_range_avx512);
    if (fn == NULL) return L2L_E_ISA;
    if (n <= 0) return 0;
    l2l_stream job = {g, p, m, v, w};
    return parallel_tiles(fn, &job, n, threads < L2L_MAX_THREADS ? threads : L2L_MAX_THREADS);
}
