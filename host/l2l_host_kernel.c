/* The fused one-pass host optimizer kernel of the CPU EPS.
 *
 * One pass per tile: load the gradient (fp32, bf16 or fp16), multiply by the inverse
 * loss scale, record whether any value is non-finite, update fp32 p, m, v by the rule of
 * l2l_hw/eps/golden.py::apply_rule (docs/NUMERICS.md), canonicalize every NaN written,
 * and write the bf16/fp16 working copy (or none). LAMB and LARS first run a pass that writes
 * nothing (l2l_host_norms: the tensor's sums of squares of p and of LAMB's update direction
 * or LARS's gradient, in float64 in golden.sum_of_squares' fixed order), from which the
 * binding makes the tensor's trust scalar (golden.with_trust) for the step. m and v may be
 * kept as fp32, bf16 or block-wise 8-bit codes (golden.apply_rule_stored: decoded, updated
 * and encoded in the same pass). Sources and destinations may differ (double-buffered
 * state) or be equal (in place); partial overlap is refused by the Python binding
 * (l2l_hw/eps/host_kernel.py), which is the only caller.
 *
 * One algorithm, three instruction sets. This file is read once as itself (the ABI, the
 * per-block 8-bit decisions, the thread pool, the entry points) and then includes itself
 * once per ISA, with VEC_ISA set: scalar (one lane), AVX2 + F16C (8 lanes) and AVX-512
 * F/DQ/BW/VL (16 lanes). Each of those reads compiles a small vector layer (the vector
 * types, loads and stores of every element format, lane masks) and, over it, the
 * algorithm: the update rule, the state formats, the non-finite flag and the loops,
 * written once (the shape of DeepSpeed's csrc/includes/simd.h, with the arithmetic as C
 * operators on GCC vector types). The ISA is chosen at run time; each instance is compiled
 * under its own `#pragma GCC target`, so nothing here needs -march=native. A vector
 * instance sees only whole vectors (whole 8-bit blocks); the ragged end of a tensor runs on
 * the one-lane instance.
 *
 * Bit-identity with the golden rule on every ISA rests on:
 *   - each operator on vf is one IEEE binary32 operation on every lane: the build passes
 *     -ffp-contract=off (GCC contracts even vector mul+add into FMA without it) and
 *     -fno-fast-math; the tests compare every path bit for bit with the golden rule;
 *   - sqrt and div are the IEEE instructions (sqrtps/divps), never rsqrt/rcp; the one
 *     exception is the AVX-512 division by bias_correction2_sqrt, which the same divisor in
 *     every element makes an FMA quotient where a check proves it exact (div_bc2);
 *   - MXCSR: every thread that runs tiles (the caller included) saves its MXCSR, sets
 *     0x1F80 (round to nearest even, FTZ and DAZ off, exceptions masked) and restores it
 *     afterwards, so a caller that enabled flush-to-zero (torch.set_flush_denormal(True)
 *     sets FTZ|DAZ on its thread) still gets subnormals kept;
 *   - fp16 conversions: F16C/AVX-512 vcvtps2ph with imm8 = round-to-nearest-even, and
 *     exact integer code on one lane; bf16 by integer round-to-nearest-even, or on an
 *     AVX512_BF16 CPU by vcvtneps2bf16 (the same rounding) for vectors without a
 *     subnormal (which it would read as zero).
 *
 * Threads: a small pthread pool of its own, NOT OpenMP. PyTorch runs its intra-op work
 * on an OpenMP team; a second OpenMP runtime (or nested use of torch's) in this library
 * could clash with it (two runtimes in one process, nested teams oversubscribing the
 * cores). Our workers sleep on a condition variable between calls, so they take no CPU
 * while torch computes. Each thread runs a contiguous share of the tiles, then helps the
 * others (see run_tiles). One call uses the pool at a time; a concurrent second caller
 * runs its tiles on its own thread rather than waiting.
 */
#ifndef VEC_ISA /* ==================================================== the file as itself */
#include <immintrin.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

enum { L2L_ADAMW = 0, L2L_ADAM = 1, L2L_SGD = 2, L2L_LAMB = 3, L2L_LARS = 4 };
enum { L2L_DT_NONE = -1, L2L_DT_F32 = 0, L2L_DT_BF16 = 1, L2L_DT_F16 = 2 };
/* The AVX-512 bf16 working copy by the CPU's own conversion (AVX512_BF16), which rounds
 * to nearest even as round_bf16 does but reads subnormals as zero: vectors with a
 * subnormal are converted again by round_bf16. Chosen at run time; never passed in. */
enum { L2L_DT_BF16_NATIVE = 3 };
#define L2L_ISA_SCALAR 0 /* macros, not an enum: they select an instance's vector layer (#if) */
#define L2L_ISA_AVX2 1
#define L2L_ISA_AVX512 2
enum { L2L_STATE_F32 = 0, L2L_STATE_BF16 = 1, L2L_STATE_8BIT = 2 };
enum { L2L_OK = 0, L2L_E_ARG = -1, L2L_E_ISA = -2, L2L_E_THREAD = -3, L2L_E_MEMORY = -4 };

/* Elements per tile, the unit of work a thread takes off a share's counter. 16 Ki
 * elements = 64 KiB per fp32 stream: big enough that taking a tile costs nothing, small
 * enough that two threads stay balanced on tensors of a few hundred thousand elements.
 * A multiple of 16 (only the last tile has a ragged end) and of the 8-bit block. */
#define L2L_TILE 16384
#define L2L_MAX_THREADS 256
#define MXCSR_IEEE 0x1F80u /* all exceptions masked, round to nearest, FTZ = DAZ = 0 */

/* Per-step scalars, each an exact float32 value from golden.step_scalars. The layout
 * is mirrored by host_kernel.py's ctypes Structure. `trust` (LAMB: lr x the tensor's trust
 * ratio, LARS: the ratio) comes from golden.with_trust over the sums of l2l_host_norms. */
typedef struct {
    int32_t optimizer, nesterov;
    float inv_scale, lr, weight_decay, decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
        step_size, bias_correction2_sqrt, eps, momentum, dampening_complement, bias_correction1, trust;
} l2l_scalars;

/* An 8-bit code book as golden.Code8 defines it (the binding passes golden's). */
typedef struct { int32_t exp_bits, man_bits, is_signed; } l2l_codebook;
typedef struct { l2l_codebook m, v; } l2l_codebooks;

/* A code book with the constants of its encode and decode derived once. */
typedef struct {
    uint32_t drop;            /* 23 - man_bits: float32 mantissa bits a code does not keep */
    uint32_t smallest_normal; /* float32 bits of the code's smallest normal value */
    uint32_t max_magnitude, mag_mask, sign_mask;
    float unbias;             /* 2^(127 - bias): (magnitude code << drop) as float32 bits, times this, is its value */
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
    double *ssq;        /* l2l_host_norms: per block, the sums of squares of p and of LAMB's u or LARS's g */
} l2l_job;

static inline uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

#define INLINE static inline __attribute__((always_inline))
/* g * 1 is g, bits and flag alike (a signalling NaN stays a NaN, canonical once written):
 * the loops skip the multiply without loss scaling. */
#define UNSCALE(s) ((s).inv_scale != 1.0f)

/* ---------------------------------------------------------------- block-wise 8-bit state
 * m and v kept as bf16 or as block-wise 8-bit codes (golden.py, "state formats"). Per block
 * of L2L_BLOCK elements, in one pass: decode m and v (exact; 8-bit: then one rounding by the
 * block's power-of-two scale), apply the rule, write p and the working copy; bf16 state is
 * encoded on the spot, 8-bit state goes to fp32 buffers on the stack (L1) and is encoded
 * once the block's largest magnitude is known. What is decided once per block lives here;
 * the per-element work is in the algorithm below. */

#define L2L_BLOCK 256 /* golden.QUANT_BLOCK; L2L_TILE is a multiple, so tiles hold whole blocks */
#define SCALE_EXP_LIMIT 126

static int codebook_valid(l2l_codebook b, int is_signed) {
    return b.exp_bits >= 1 && b.exp_bits <= 6 && b.man_bits >= 1 && b.is_signed == is_signed &&
           b.exp_bits + b.man_bits + is_signed == 8;
}

static l2l_code make_code(l2l_codebook b) {
    uint32_t bias = (1u << b.exp_bits) - 1, man_bits = (uint32_t)b.man_bits;
    return (l2l_code){23 - man_bits, (128 - bias) << 23, (1u << (b.exp_bits + man_bits)) - 1,
                      b.is_signed ? 0x7Fu : 0xFFu, b.is_signed ? 0x80u : 0, u2f((254 - bias) << 23), bias};
}

/* golden.block_exponent: k of the scale 2^k from the block's largest |x| bits. */
static inline int32_t block_exponent(uint32_t absmax, const l2l_code *c) {
    int32_t k = (int32_t)((absmax + (1u << (c->drop - 1)) - 1 + ((absmax >> c->drop) & 1u)) >> 23) - 127;
    return k < -SCALE_EXP_LIMIT ? -SCALE_EXP_LIMIT : k > SCALE_EXP_LIMIT ? SCALE_EXP_LIMIT : k;
}

static inline float exp2_bits(int32_t k) { return u2f((uint32_t)(k + 127) << 23); }

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

/* v of a block whose stored scale has its sign bit clear is +0, positive or NaN: its codes
 * are unsigned, the decode multiplies them by that scale, and the rule adds g * g terms.
 * (Our encoder writes only such scales; a checkpoint could hold others.) */
static inline int v_positive(float v_scale) { return (f2u(v_scale) >> 31) == 0; }

/* ---------------------------------------------------------------- memory stream
 * The bandwidth reference of `l2l bench eps`: the byte mix of a step (streams read,
 * streams updated in place, streams written, each with its bytes per element), moved with
 * no arithmetic (updated vectors get one integer add, written ones a constant), all streams
 * in lock step as the step moves them. Stores are plain or non-temporal (streaming, no read
 * for ownership); the bench takes the faster at the best thread count, so the figure bounds
 * what any implementation of the same bytes reaches. Each ISA moves whole groups of LINE
 * elements (stream_range); the rest goes byte by byte. */

#define L2L_STREAMS 8
#define LINE 64

typedef struct {
    int32_t reads, updates, writes, nontemporal;
    int32_t size[L2L_STREAMS]; /* bytes per element of each stream: reads, then updates, then writes */
    void *ptr[L2L_STREAMS];
} l2l_stream;

static volatile uint64_t stream_sink; /* keeps the loads of read-only streams alive */

/* Elements [begin, end) of every stream, a byte at a time. */
static int stream_bytes(const l2l_stream *t, int64_t begin, int64_t end) {
    uint64_t acc = 0;
    for (int k = 0; k < t->reads + t->updates + t->writes; k++) {
        uint8_t *b = t->ptr[k];
        for (int64_t x = begin * t->size[k]; x < end * t->size[k]; x++) {
            if (k < t->reads) acc += b[x];
            else if (k < t->reads + t->updates) b[x] += 1;
            else b[x] = 1;
        }
    }
    stream_sink = acc;
    return 0;
}

/* ---------------------------------------------------------------- the instances
 * Every name the vector layer and the algorithm define stands for that name with the
 * instance's suffix (rule -> rule_avx2), so that the three instances live side by side.
 * The first part of the list is the vector layer's interface: what each ISA provides. */

#define VEC(name) VEC_PASTE(name, VEC_SUFFIX)
#define VEC_PASTE(name, suffix) VEC_PASTE_(name, suffix)
#define VEC_PASTE_(name, suffix) name##_##suffix

/* LANES lanes of float32 (vf) and of uint32 (vi): +, -, *, / and the bit operators act on
 * every lane (GCC vector types; the one-lane layer's are float and uint32_t). */
#define vf VEC(vf)
#define vi VEC(vi)
#define vmask VEC(vmask)           /* a lane mask: combined with |, tested by any() */
#define vset VEC(vset)             /* float32 to every lane */
#define iset VEC(iset)             /* uint32 to every lane */
#define vsqrt VEC(vsqrt)           /* IEEE square root */
#define imax VEC(imax)             /* unsigned max, min */
#define imin VEC(imin)
#define vnan VEC(vnan)             /* the lanes that hold a NaN */
#define ieq VEC(ieq)               /* the lanes where a == b */
#define vwhere VEC(vwhere)         /* per lane: mask ? yes : no */
#define any VEC(any)               /* whether the mask has a lane set */
#define load_u16 VEC(load_u16)     /* 16-bit values, zero-extended */
#define store_u16 VEC(store_u16)   /* the low 16 bits of each lane (values below 2^16) */
#define load_f16 VEC(load_f16)     /* fp16 to float32, exact */
#define store_f16 VEC(store_f16)   /* float32 to fp16, round to nearest even */
#define load_u8 VEC(load_u8)       /* 8-bit codes, zero- or sign-extended */
#define load_s8 VEC(load_s8)
#define store_u8 VEC(store_u8)     /* the low 8 bits of each lane (values below 2^8) */
#define hmax VEC(hmax)             /* the largest lane, unsigned */
#define store_nt VEC(store_nt)     /* a non-temporal store of one vi */
#define vload VEC(vload)           /* unaligned loads and stores of whole vectors */
#define vstore VEC(vstore)
#define iload VEC(iload)
#define istore VEC(istore)
#define as_int VEC(as_int)         /* the bits of a vf, and back */
#define as_float VEC(as_float)
#define vd VEC(vd)                 /* LANES lanes of float64 */
#define ssq_add VEC(ssq_add)       /* *acc + x * x in float64 (x widened exactly; the square is exact) */
#define vraw VEC(vraw)             /* x86: the intrinsics' own types */
#define vhalf VEC(vhalf)
#define load_half VEC(load_half)
#define load_quarter VEC(load_quarter)
#define fma_quotient VEC(fma_quotient)           /* AVX-512 only (VEC_FMA_QUOTIENT) */
#define fma_quotient_misses VEC(fma_quotient_misses)
#define store_bf16_native VEC(store_bf16_native) /* AVX-512 with AVX512_BF16 only (VEC_NATIVE_BF16) */
/* the algorithm */
#define rule_k VEC(rule_k)
#define rule_k_of VEC(rule_k_of)
#define canon_nan VEC(canon_nan)
#define nonfinite VEC(nonfinite)
#define load_bf16 VEC(load_bf16)
#define round_bf16 VEC(round_bf16)
#define load_grad VEC(load_grad)
#define store_working VEC(store_working)
#define rewrite VEC(rewrite)
#define div_bc2 VEC(div_bc2)
#define rule VEC(rule)
#define adam_moments VEC(adam_moments)
#define lamb_update VEC(lamb_update)
#define load_moment VEC(load_moment)
#define ssq_fold VEC(ssq_fold)
#define norm_loop VEC(norm_loop)
#define norm_dtypes VEC(norm_dtypes)
#define norm_range VEC(norm_range)
#define step_loop VEC(step_loop)
#define code_k VEC(code_k)
#define code_k_of VEC(code_k_of)
#define block_k VEC(block_k)
#define block_k_of VEC(block_k_of)
#define decode VEC(decode)
#define encode VEC(encode)
#define absmax VEC(absmax)
#define encode_block VEC(encode_block)
#define nonfinite_block VEC(nonfinite_block)
#define state_loop VEC(state_loop)
#define working_dtype VEC(working_dtype)
#define step_dtypes VEC(step_dtypes)
#define state_dtypes VEC(state_dtypes)
#define step_range VEC(step_range)
#define state_range VEC(state_range)
#define stream_range VEC(stream_range)

/* Each loop is inlined once per (gradient dtype, working dtype[, state format]), so the
 * loop body has no run-time dtype tests. The native bf16 working copy only where the
 * instance has it. */
#define DTYPE_CASES(LOOP, w, ...)                                                                 \
    if (VEC_NATIVE_BF16 && (w) == L2L_DT_BF16_NATIVE) switch (j->g_dtype) {                        \
        case L2L_DT_F32: return LOOP(j, begin, end, L2L_DT_F32, L2L_DT_BF16_NATIVE, ##__VA_ARGS__);  \
        case L2L_DT_BF16: return LOOP(j, begin, end, L2L_DT_BF16, L2L_DT_BF16_NATIVE, ##__VA_ARGS__); \
        default: return LOOP(j, begin, end, L2L_DT_F16, L2L_DT_BF16_NATIVE, ##__VA_ARGS__);          \
    }                                                                                             \
    switch (j->g_dtype * 3 + ((w) == L2L_DT_NONE ? 0 : (w))) {                                     \
    case 0: return LOOP(j, begin, end, L2L_DT_F32, L2L_DT_NONE, ##__VA_ARGS__);                    \
    case 1: return LOOP(j, begin, end, L2L_DT_F32, L2L_DT_BF16, ##__VA_ARGS__);                    \
    case 2: return LOOP(j, begin, end, L2L_DT_F32, L2L_DT_F16, ##__VA_ARGS__);                     \
    case 3: return LOOP(j, begin, end, L2L_DT_BF16, L2L_DT_NONE, ##__VA_ARGS__);                   \
    case 4: return LOOP(j, begin, end, L2L_DT_BF16, L2L_DT_BF16, ##__VA_ARGS__);                   \
    case 5: return LOOP(j, begin, end, L2L_DT_BF16, L2L_DT_F16, ##__VA_ARGS__);                    \
    case 6: return LOOP(j, begin, end, L2L_DT_F16, L2L_DT_NONE, ##__VA_ARGS__);                    \
    case 7: return LOOP(j, begin, end, L2L_DT_F16, L2L_DT_BF16, ##__VA_ARGS__);                    \
    default: return LOOP(j, begin, end, L2L_DT_F16, L2L_DT_F16, ##__VA_ARGS__);                    \
    }

/* The one-lane instance first: the others run the ragged ends of tensors on it. */
#define VEC_ISA L2L_ISA_SCALAR
#define VEC_SUFFIX scalar
#include "l2l_host_kernel.c"
#undef VEC_ISA
#undef VEC_SUFFIX

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#define VEC_ISA L2L_ISA_AVX2
#define VEC_SUFFIX avx2
#include "l2l_host_kernel.c"
#undef VEC_ISA
#undef VEC_SUFFIX
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl")
#define VEC_ISA L2L_ISA_AVX512
#define VEC_SUFFIX avx512
#include "l2l_host_kernel.c"
#undef VEC_ISA
#undef VEC_SUFFIX
#pragma GCC pop_options

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
    int exact = parallel_tiles(fma_quotient_misses_avx512, &b, (int64_t)1 << 23, threads) == 0;
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

/* The job of a call, checked: the error code, or 0. */
static int prepare(l2l_job *job, const l2l_scalars *s, int64_t n, const l2l_buffers *b, int g_dtype, int state_format,
                   const l2l_codebooks *codes, int w_dtype, int isa, int threads) {
    if (n < 0 || s->optimizer < L2L_ADAMW || s->optimizer > L2L_LARS || g_dtype < L2L_DT_F32 ||
        g_dtype > L2L_DT_F16 || w_dtype < L2L_DT_NONE || w_dtype == L2L_DT_F32 || w_dtype > L2L_DT_F16 ||
        state_format < L2L_STATE_F32 || state_format > L2L_STATE_8BIT ||
        (state_format == L2L_STATE_8BIT && !(codebook_valid(codes->m, 1) && codebook_valid(codes->v, 0))))
        return L2L_E_ARG;
    if (!l2l_host_isa_supported(isa)) return L2L_E_ISA;
    int uses_v = s->optimizer != L2L_SGD && s->optimizer != L2L_LARS, uses_m = uses_v || s->momentum != 0;
    if (!uses_m) state_format = L2L_STATE_F32; /* no state to keep */
    *job = (l2l_job){.s = *s, .g_dtype = g_dtype, .w_dtype = w_dtype, .format = state_format, .uses_m = uses_m,
                     .uses_v = uses_v, .g = b->g, .p_src = b->p_src, .p_dst = b->p_dst, .w_dst = b->w_dst,
                     .m_src = b->m_src, .v_src = b->v_src, .m_dst = b->m_dst, .v_dst = b->v_dst,
                     .m_scale_src = b->m_scale_src, .v_scale_src = b->v_scale_src, .m_scale_dst = b->m_scale_dst,
                     .v_scale_dst = b->v_scale_dst};
    if (isa == L2L_ISA_AVX512 && w_dtype == L2L_DT_BF16 && native_bf16)
        job->w_dtype = L2L_DT_BF16_NATIVE;
    if (isa == L2L_ISA_AVX512 && uses_v) job->bc2_by_fma = bc2_by_fma(s->bias_correction2_sqrt, n, threads);
    if (state_format == L2L_STATE_8BIT) {
        job->m_code = make_code(codes->m);
        job->v_code = make_code(codes->v);
    }
    return 0;
}

/* One optimizer step over n elements. Returns 1 when a gradient value times inv_scale is
 * not finite, 0 when all are finite, or a negative error code. LAMB and LARS: pass 2, with
 * the tensor's trust scalar in s (l2l_host_norms gives its sums). */
EXPORT int l2l_host_step(const l2l_scalars *s, int64_t n, const l2l_buffers *b, int g_dtype, int state_format,
                         const l2l_codebooks *codes, int w_dtype, int isa, int threads) {
    l2l_job job;
    int rc = prepare(&job, s, n, b, g_dtype, state_format, codes, w_dtype, isa, threads);
    if (rc != 0 || n == 0) return rc;
    range_fn fn = job.format == L2L_STATE_F32 ? pick(isa, step_range_scalar, step_range_avx2, step_range_avx512)
                                              : pick(isa, state_range_scalar, state_range_avx2, state_range_avx512);
    return parallel_tiles(fn, &job, n, threads);
}

/* Pass 1 of a LAMB or LARS step over n elements (what l2l_host_step reads; nothing is
 * written): sums[0] = the sum of p^2, sums[1] = that of LAMB's u or LARS's unscaled g, in
 * float64, in golden.sum_of_squares' order (per block on the threads, then the blocks in
 * order here; no block sum is subnormal, so the caller's MXCSR cannot change them). Returns 0
 * or a negative error code. */
EXPORT int l2l_host_norms(const l2l_scalars *s, int64_t n, const l2l_buffers *b, int g_dtype, int state_format,
                          const l2l_codebooks *codes, int isa, int threads, double *sums) {
    l2l_job job;
    int rc = prepare(&job, s, n, b, g_dtype, state_format, codes, L2L_DT_NONE, isa, threads);
    if (rc == 0 && s->optimizer != L2L_LAMB && s->optimizer != L2L_LARS) rc = L2L_E_ARG;
    sums[0] = sums[1] = 0;
    if (rc != 0 || n == 0) return rc;
    int64_t blocks = (n + L2L_BLOCK - 1) / L2L_BLOCK;
    job.ssq = malloc((size_t)blocks * 2 * sizeof(double));
    if (job.ssq == NULL) return L2L_E_MEMORY;
    parallel_tiles(pick(isa, norm_range_scalar, norm_range_avx2, norm_range_avx512), &job, n, threads);
    for (int64_t blk = 0; blk < blocks; blk++) {
        sums[0] = sums[0] + job.ssq[2 * blk];
        sums[1] = sums[1] + job.ssq[2 * blk + 1];
    }
    free(job.ssq);
    return 0;
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

#else /* VEC_ISA ============================================ one instance: vector layer, algorithm */

/* ---------------------------------------------------------------- vector layer: one lane */
#if VEC_ISA == L2L_ISA_SCALAR
#define LANES 1
#define VEC_FMA_QUOTIENT 0
#define VEC_NATIVE_BF16 0

typedef float vf;
typedef uint32_t vi;
typedef int vmask;
typedef double vd;

static inline vf vset(float x) { return x; }
static inline vi iset(uint32_t x) { return x; }
static inline vf vsqrt(vf x) { return __builtin_sqrtf(x); }
static inline void ssq_add(vd *acc, vf x) { *acc = *acc + (double)x * (double)x; }
static inline vi imax(vi a, vi b) { return a > b ? a : b; }
static inline vi imin(vi a, vi b) { return a < b ? a : b; }
static inline vmask vnan(vf x) { return x != x; }
static inline vmask ieq(vi a, vi b) { return a == b; }
static inline vf vwhere(vmask m, vf yes, vf no) { return m ? yes : no; }
static inline int any(vmask m) { return m != 0; }
static inline vi load_u16(const uint16_t *h) { return *h; }
static inline void store_u16(uint16_t *h, vi x) { *h = (uint16_t)x; }
static inline vi load_u8(const uint8_t *c) { return *c; }
static inline vi load_s8(const uint8_t *c) { return (uint32_t)(int32_t)(int8_t)*c; }
static inline void store_u8(uint8_t *c, vi x) { *c = (uint8_t)x; }
static inline uint32_t hmax(vi x) { return x; }
static inline void store_nt(void *a, vi x) { _mm_stream_si32(a, (int)x); }

static inline vf load_f16(const uint16_t *h) {
    uint32_t sign = (uint32_t)(*h & 0x8000u) << 16, e = (*h >> 10) & 0x1Fu, m = *h & 0x3FFu;
    if (e == 0x1F) return u2f(sign | 0x7F800000u | (m << 13));
    if (e == 0) return u2f(sign | f2u((float)m * 5.9604644775390625e-8f)); /* m * 2^-24, exact */
    return u2f(sign | ((e + 112) << 23) | (m << 13));
}

/* Round to nearest even; any NaN -> 0x7E00. */
static inline void store_f16(uint16_t *h, vf x) {
    uint32_t u = f2u(x), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) { *h = 0x7E00; return; }
    if (a >= 0x477FF000u) { *h = (uint16_t)(sign | 0x7C00u); return; } /* >= 65520 rounds to Inf */
    if (a >= 0x38800000u) {                                              /* normal half: >= 2^-14 */
        uint32_t r = a - (112u << 23);
        r += 0xFFFu + ((r >> 13) & 1u);
        *h = (uint16_t)(sign | (r >> 13));
        return;
    }
    if (a <= 0x33000000u) { *h = (uint16_t)sign; return; } /* <= 2^-25: half of the least subnormal, ties to 0 */
    uint32_t mant = (a & 0x7FFFFFu) | 0x800000u, shift = 126u - (a >> 23); /* 14..24 */
    uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    q += rem > half || (rem == half && (q & 1u));
    *h = (uint16_t)(sign | q);
}

#else /* ---------------------------------------------------------------- vector layer: x86 */
/* MM(op) is the intrinsic of the instance's width: _mm256_op (AVX2) or _mm512_op (AVX-512).
 * vraw is the intrinsics' integer vector, vhalf the one of half its width (16-bit lanes). */
#define MM(op) VEC_PASTE(VEC_MM, op)

#if VEC_ISA == L2L_ISA_AVX2
#define LANES 8
#define VEC_MM _mm256
#define VEC_FMA_QUOTIENT 0 /* the FMA quotient was slower than vdivps ymm on an AVX2 CPU measured */
#define VEC_NATIVE_BF16 0
typedef float vf __attribute__((vector_size(32)));
typedef __m256i vraw;
typedef __m128i vhalf;
typedef uint32_t vi __attribute__((vector_size(32)));
typedef int32_t vmask __attribute__((vector_size(32))); /* all ones in a lane that is set */

static inline vmask vnan(vf x) { return (vmask)_mm256_cmp_ps(x, x, _CMP_UNORD_Q); }
static inline vmask ieq(vi a, vi b) { return (vmask)_mm256_cmpeq_epi32((__m256i)a, (__m256i)b); }
static inline vf vwhere(vmask m, vf yes, vf no) { return _mm256_blendv_ps(no, yes, (__m256)m); }
static inline int any(vmask m) { return !_mm256_testz_si256((__m256i)m, (__m256i)m); }
static inline __m128i load_quarter(const uint8_t *c) { return _mm_loadl_epi64((const __m128i *)c); }

static inline void store_u16(uint16_t *h, vi lanes) {
    __m256i x = (__m256i)lanes;
    _mm_storeu_si128((__m128i *)h, _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
}

static inline void store_u8(uint8_t *c, vi lanes) {
    __m256i x = (__m256i)lanes;
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64((__m128i *)c, _mm_packus_epi16(w, w));
}

static inline uint32_t hmax(vi x) {
    uint32_t m = 0;
    for (int k = 0; k < 8; k++) m = x[k] > m ? x[k] : m;
    return m;
}

static inline void store_nt(void *a, vi x) { _mm256_stream_si256(a, (__m256i)x); }

#else /* AVX-512 */
#define LANES 16
#define VEC_MM _mm512
#define VEC_FMA_QUOTIENT 1
#define VEC_NATIVE_BF16 1
typedef float vf __attribute__((vector_size(64)));
typedef __m512i vraw;
typedef __m256i vhalf;
typedef uint32_t vi __attribute__((vector_size(64)));
typedef __mmask16 vmask;

static inline vmask vnan(vf x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }
static inline vmask ieq(vi a, vi b) { return _mm512_cmpeq_epi32_mask((__m512i)a, (__m512i)b); }
static inline vf vwhere(vmask m, vf yes, vf no) { return _mm512_mask_mov_ps(no, m, yes); }
static inline int any(vmask m) { return m != 0; }
static inline __m128i load_quarter(const uint8_t *c) { return _mm_loadu_si128((const __m128i *)c); }
static inline void store_u16(uint16_t *h, vi x) { _mm256_storeu_si256((__m256i *)h, _mm512_cvtepi32_epi16((__m512i)x)); }
static inline void store_u8(uint8_t *c, vi x) { _mm_storeu_si128((__m128i *)c, _mm512_cvtepi32_epi8((__m512i)x)); }
static inline uint32_t hmax(vi x) { return (uint32_t)_mm512_reduce_max_epu32((__m512i)x); }
static inline void store_nt(void *a, vi x) { _mm512_stream_si512(a, (__m512i)x); }

/* The working copy by vcvtneps2bf16 (no target attribute needed for the pool's callers).
 * Returns the lanes that hold a subnormal, which it read as zero. */
static inline vmask store_bf16_native(uint16_t *h, vf x) {
    __m256i r;
    __asm__("vcvtneps2bf16 %1, %0" : "=v"(r) : "v"(x));
    _mm256_storeu_si256((__m256i *)h, r);
    return _mm512_fpclass_ps_mask(x, 0x20 /* subnormal */);
}

/* a / b rounded once, for y = 1/b rounded, where fma_quotient_misses found it so for b:
 * Markstein's q = a y, r = a - q b (one FMA), q + r y (one FMA). Lanes where a is +-0,
 * +-Inf or NaN keep q = a y, which is a / b there (the correction would turn Inf into NaN). */
static inline vf fma_quotient(vf a, vf b, vf y) {
    vf q = _mm512_mul_ps(a, y);
    vf r = _mm512_fnmadd_ps(q, b, a);
    __mmask16 special = _mm512_fpclass_ps_mask(a, 0x9F); /* QNaN, +-0, +-Inf, SNaN */
    return _mm512_mask3_fmadd_ps(r, y, q, _knot_mask16(special));
}

/* The check that lets a call take fma_quotient for the divisor *ctx: over the
 * significands [begin, end) of a in [1, 2), returns 1 at the first a where it differs from
 * the division. Markstein's theorem (y within half an ulp of 1/b, q within one ulp of a/b)
 * says it never does; the check does not rely on it. */
static int fma_quotient_misses(const void *ctx, int64_t begin, int64_t end) {
    const float b = *(const float *)ctx;
    const vf bv = _mm512_set1_ps(b), y = _mm512_set1_ps(1.0f / b); /* under the IEEE MXCSR, as rule_k_of */
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t f = begin; f < end; f += 16) { /* begin and end are multiples of 16 */
        vf a = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_set1_epi32((int)(0x3F800000 + f)), lane));
        if (_mm512_cmp_ps_mask(fma_quotient(a, bv, y), _mm512_div_ps(a, bv), _CMP_NEQ_UQ)) return 1;
    }
    return 0;
}
#endif /* AVX-512 */

static inline vf vset(float x) { return MM(set1_ps)(x); }
static inline vi iset(uint32_t x) { return (vi)MM(set1_epi32)((int)x); }
static inline vf vsqrt(vf x) { return MM(sqrt_ps)(x); }
typedef double vd __attribute__((vector_size(LANES * 8)));
/* by pointer: a vd of 16 doubles passed by value would cross the ABI in memory (-Wpsabi) */
static inline void ssq_add(vd *acc, vf x) {
    vd d = __builtin_convertvector(x, vd);
    *acc = *acc + d * d;
}
static inline vi imax(vi a, vi b) { return (vi)MM(max_epu32)((vraw)a, (vraw)b); }
static inline vi imin(vi a, vi b) { return (vi)MM(min_epu32)((vraw)a, (vraw)b); }

static inline vhalf load_half(const uint16_t *h) { vhalf x; memcpy(&x, h, sizeof x); return x; }
static inline vi load_u16(const uint16_t *h) { return (vi)MM(cvtepu16_epi32)(load_half(h)); }
static inline vf load_f16(const uint16_t *h) { return MM(cvtph_ps)(load_half(h)); }
static inline void store_f16(uint16_t *h, vf x) {
    vhalf r = MM(cvtps_ph)(x, _MM_FROUND_TO_NEAREST_INT);
    memcpy(h, &r, sizeof r);
}
static inline vi load_u8(const uint8_t *c) { return (vi)MM(cvtepu8_epi32)(load_quarter(c)); }
static inline vi load_s8(const uint8_t *c) { return (vi)MM(cvtepi8_epi32)(load_quarter(c)); }
#endif /* x86 */

/* ---------------------------------------------------------------- the algorithm
 * Written once over the vector layer above. Each operator on vf is one IEEE binary32
 * operation per lane, in the order written. */

static inline vf vload(const float *x) { vf r; memcpy(&r, x, sizeof r); return r; }
static inline void vstore(float *x, vf a) { memcpy(x, &a, sizeof a); }
static inline vi iload(const void *x) { vi r; memcpy(&r, x, sizeof r); return r; }
static inline void istore(void *x, vi a) { memcpy(x, &a, sizeof a); }
static inline vi as_int(vf x) { vi r; memcpy(&r, &x, sizeof r); return r; }
static inline vf as_float(vi x) { vf r; memcpy(&r, &x, sizeof r); return r; }

/* The step's scalars on every lane. */
typedef struct {
    vf inv_scale, lr, wd, decay, b1c, b2, b2c, step_size, bc2, eps, mom, damp_c, bc2_inv, bc1, trust;
    int bc2_by_fma;
} rule_k;

INLINE rule_k rule_k_of(const l2l_job *j) {
    const l2l_scalars *s = &j->s;
    return (rule_k){vset(s->inv_scale), vset(s->lr), vset(s->weight_decay), vset(s->decay),
                    vset(s->one_minus_beta1), vset(s->beta2), vset(s->one_minus_beta2), vset(s->step_size),
                    vset(s->bias_correction2_sqrt), vset(s->eps), vset(s->momentum),
                    vset(s->dampening_complement), vset(1.0f / s->bias_correction2_sqrt), /* under the IEEE MXCSR */
                    vset(s->bias_correction1), vset(s->trust), VEC_FMA_QUOTIENT && j->bc2_by_fma};
}

INLINE vf canon_nan(vf x) { return vwhere(vnan(x), vset(u2f(0x7FC00000u)), x); }

INLINE vmask nonfinite(vf g) { return ieq(as_int(g) & 0x7F800000u, iset(0x7F800000u)); }

INLINE vf load_bf16(const uint16_t *h) { return as_float(load_u16(h) << 16); }

/* Round to nearest even, in integers. A NaN keeps its payload's top bits: the loops
 * rewrite a vector that held one from its canonical form (rewrite). */
INLINE vi round_bf16(vf x) {
    vi u = as_int(x);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

INLINE vf load_grad(const void *g, int64_t i, int g_dtype) {
    if (g_dtype == L2L_DT_BF16) return load_bf16((const uint16_t *)g + i);
    if (g_dtype == L2L_DT_F16) return load_f16((const uint16_t *)g + i);
    return vload((const float *)g + i);
}

/* The working copy of LANES weights. The native bf16 conversion reads a subnormal as zero:
 * it returns the lanes that hold one, whose vectors the loop rewrites (rewrite). */
INLINE vmask store_working(void *w, int64_t i, vf p, int w_dtype) {
#if VEC_NATIVE_BF16
    if (w_dtype == L2L_DT_BF16_NATIVE) return store_bf16_native((uint16_t *)w + i, p);
#endif
    if (w_dtype == L2L_DT_BF16) store_u16((uint16_t *)w + i, round_bf16(p));
    else if (w_dtype == L2L_DT_F16) store_f16((uint16_t *)w + i, p);
    return (vmask){0};
}

/* The loops below write NaN as the arithmetic made it and the working copy by the native
 * conversion, and only note where a vector held a NaN or a subnormal weight; this pass then
 * rewrites the whole vectors of [begin, end): NaN made canonical in p (and in fp32 m and v,
 * which are NULL otherwise) and the working copy from p by integer rounding. Both cases are
 * rare; testing and fixing each vector in the loop cost more. */
INLINE void rewrite(float *p, float *m, float *v, void *w, int w_dtype, int64_t begin, int64_t end) {
    const int exact = w_dtype == L2L_DT_BF16_NATIVE ? L2L_DT_BF16 : w_dtype;
    for (int64_t i = begin; i < end; i += LANES) {
        vf x = canon_nan(vload(p + i));
        vstore(p + i, x);
        store_working(w, i, x, exact);
        if (m) vstore(m + i, canon_nan(vload(m + i)));
        if (v) vstore(v + i, canon_nan(vload(v + i)));
    }
}

/* a / bias_correction2_sqrt, rounded once, for a = sqrt(v). The divisor is the same in
 * every element of a call, so where the call proved it (bc2_by_fma) the quotient is
 * Markstein's (fma_quotient), +8-12% per core in cache. */
INLINE vf div_bc2(const rule_k *k, vf a) {
#if VEC_FMA_QUOTIENT
    if (k->bc2_by_fma) return fma_quotient(a, k->bc2, k->bc2_inv);
#endif
    return a / k->bc2;
}

/* golden.adam_moments: *m and *v updated; returns the denominator of the step. */
INLINE vf adam_moments(const rule_k *k, vf g, vf *m, vf *v) {
    *m = *m + (g - *m) * k->b1c;
    *v = *v * k->b2 + (g * k->b2c) * g;
    return div_bc2(k, vsqrt(*v)) + k->eps;
}

/* golden.lamb_update: LAMB's direction before the trust ratio. */
INLINE vf lamb_update(const l2l_scalars *s, const rule_k *k, vf g, vf p, vf *m, vf *v) {
    vf denom = adam_moments(k, g, m, v);
    vf u = (*m / k->bc1) / denom;
    return s->weight_decay != 0 ? u + p * k->wd : u;
}

/* golden.apply_rule on LANES elements, statement by statement; g is already unscaled.
 * Returns the new p; *m and *v are updated where the optimizer has them. */
INLINE vf rule(const l2l_scalars *s, const rule_k *k, vf g, vf p, vf *m, vf *v) {
    if (s->optimizer == L2L_SGD || s->optimizer == L2L_LARS) {
        if (s->weight_decay != 0) g = g + p * k->wd;
        if (s->optimizer == L2L_LARS) g = g * k->trust;
        if (s->momentum != 0) {
            *m = *m * k->mom + g * k->damp_c;
            g = s->nesterov ? g + *m * k->mom : *m;
        }
        return p - g * k->lr;
    }
    if (s->optimizer == L2L_LAMB) return p - lamb_update(s, k, g, p, m, v) * k->trust;
    if (s->optimizer == L2L_ADAM && s->weight_decay != 0) g = g + p * k->wd;
    if (s->optimizer == L2L_ADAMW && s->weight_decay != 0) p = p * k->decay;
    vf denom = adam_moments(k, g, m, v);
    return p - (*m * k->step_size) / denom;
}

/* fp32 state: [begin, end) in whole vectors. Returns 1 when a gradient is not finite. */
INLINE int step_loop(const l2l_job *j, int64_t begin, int64_t end, int g_dtype, int w_dtype) {
    const l2l_scalars s = j->s;
    const rule_k k = rule_k_of(j);
    /* the job's pointers in locals: a store through one of them could otherwise be taken to
     * change the job, and every field be loaded again after it */
    const void *g = j->g;
    const float *p_src = j->p_src, *m_src = j->m_src, *v_src = j->v_src;
    float *p_dst = j->p_dst, *m_dst = j->m_dst, *v_dst = j->v_dst;
    void *w_dst = j->w_dst;
    const int uses_m = j->uses_m, uses_v = j->uses_v, unscale = UNSCALE(s);
    vmask bad = (vmask){0}, redo = (vmask){0};
    for (int64_t i = begin; i < end; i += LANES) {
        vf gv = load_grad(g, i, g_dtype);
        if (unscale) gv = gv * k.inv_scale;
        bad |= nonfinite(gv);
        vf m = uses_m ? vload(m_src + i) : vset(0), v = uses_v ? vload(v_src + i) : vset(0);
        vf p = rule(&s, &k, gv, vload(p_src + i), &m, &v);
        redo |= vnan(p); /* a NaN in m or v makes p NaN too (rule) */
        if (uses_m) vstore(m_dst + i, m);
        if (uses_v) vstore(v_dst + i, v);
        vstore(p_dst + i, p);
        redo |= store_working(w_dst, i, p, w_dtype);
    }
    if (any(redo)) rewrite(p_dst, uses_m ? m_dst : NULL, uses_v ? v_dst : NULL, w_dst, w_dtype, begin, end);
    return any(bad);
}

/* One 8-bit code book's constants on every lane. */
typedef struct {
    vi code_mask, exp_min, round_base, offset, max_mag;
    uint32_t drop;
} code_k;

INLINE code_k code_k_of(const l2l_code *c) {
    return (code_k){iset(c->sign_mask ? 0x80000000u | (c->mag_mask << c->drop) : 0xFFFFFFFFu),
                    iset(c->smallest_normal), iset(c->drop << 23), iset(c->smallest_normal >> c->drop),
                    iset(c->max_magnitude), c->drop};
}

/* One block's decode factors: the code's value (exact) times the scale (one rounding) is
 * one multiply by 2^(127 - bias + k) when the scale is a power of two 2^k with k <= bias
 * (the factor is then a normal float: the same rounding), or by NaN for a NaN scale;
 * otherwise two multiplies, by 2^(127 - bias) and by the scale. */
typedef struct { vf first, second; int two; } block_k;

INLINE block_k block_k_of(const l2l_code *c, float scale) {
    uint32_t bits = f2u(scale), e = bits >> 23;
    if (scale != scale) return (block_k){vset(scale), vset(scale), 0};
    if ((bits & 0x007FFFFFu) == 0 && e >= 1 && e <= 127 + c->bias)
        return (block_k){vset(u2f((e + 127 - c->bias) << 23)), vset(scale), 0};
    return (block_k){vset(c->unbias), vset(scale), 1};
}

/* codes -> values. The code shifted into place is a float32 whose exponent field is the
 * code's e (a subnormal float32 for e = 0); a signed code is loaded sign-extended, so the
 * shift puts copies of its sign above the magnitude, and the mask keeps the one in bit 31. */
INLINE vf decode(const code_k *c, const block_k *b, const uint8_t *codes, int is_signed) {
    vi bits = (is_signed ? load_s8(codes) : load_u8(codes)) << c->drop;
    if (is_signed) bits = bits & c->code_mask;
    vf x = as_float(bits) * b->first;
    return b->two ? x * b->second : x;
}

/* values scaled into the code's range (y = x * 2^-k) -> codes, as golden.encode_codes: the
 * float add |y| + M, M = 2^(E + drop) with E the exponent of |y| but at least the code's
 * smallest normal exponent, rounds |y| to the code's grid there (round to nearest even),
 * and bits(|y| + M) - bits(M) counts grid steps: 2^man_bits + f for a normal code, f for
 * a subnormal one; the exponent of M gives the rest of the code. */
INLINE void encode(const code_k *c, vf x, vf inv, uint8_t *codes, int is_signed, int saturate, int positive) {
    vi bits = as_int(x * inv);
    vi mag = positive ? bits : bits & 0x7FFFFFFFu;
    vi exp = imax(bits & 0x7F800000u, c->exp_min);
    vi base = exp + c->round_base;
    vi steps = as_int(as_float(mag) + as_float(base)) - base;
    vi q = steps + ((exp >> c->drop) - c->offset);
    if (saturate) q = imin(q, c->max_mag);
    if (is_signed) q = q | ((bits >> 24) & 0x80u);
    store_u8(codes, q);
}

/* Largest |x| bits so far (integer order of |x| bits is the order of |x|; NaN above Inf).
 * `positive`: every x is +0, positive or NaN, whose bits are then |x| or (NaN) at least
 * 0x7F800000 either way, so the block is found non-finite all the same. */
INLINE vi absmax(vi acc, vf x, int positive) {
    return imax(acc, positive ? as_int(x) : as_int(x) & 0x7FFFFFFFu);
}

/* A block whose scale exponent k was not clamped to SCALE_EXP_LIMIT cannot round past the
 * largest code (golden.block_exponent rounds the block maximum first): no saturation. */
INLINE void encode_block(const float *buf, int64_t len, uint32_t max_bits, uint8_t *codes, float *scale,
                         const l2l_code *c, const code_k *k, int is_signed, int positive) {
    float inv = block_scale(max_bits, codes, scale, len, c);
    if (inv == 0) return;
    const int saturate = f2u(inv) == (uint32_t)(127 - SCALE_EXP_LIMIT) << 23;
    const vf inv_v = vset(inv);
    for (int64_t i = 0; i < len; i += LANES) /* the loop is unswitched on the flags (-O3) */
        encode(k, vload(buf + i), inv_v, codes + i, is_signed, saturate, positive);
}

/* One vector of m or v as the update reads it, from its state format (8-bit: `b` is its block's). */
INLINE vf load_moment(const void *src, int64_t i, int format, const code_k *c, const block_k *b, int is_signed) {
    if (format == L2L_STATE_8BIT) return decode(c, b, (const uint8_t *)src + i, is_signed);
    if (format == L2L_STATE_BF16) return load_bf16((const uint16_t *)src + i);
    return vload((const float *)src + i);
}

INLINE int nonfinite_block(const void *g, int64_t b0, int64_t len, int g_dtype, vf inv_scale, int unscale) {
    vmask bad = (vmask){0};
    for (int64_t b = 0; b < len; b += LANES) {
        vf gv = load_grad(g, b0 + b, g_dtype);
        bad |= nonfinite(unscale ? gv * inv_scale : gv);
    }
    return any(bad);
}

/* bf16 or 8-bit state: [begin, end) in blocks of whole vectors (8-bit: whole blocks, but
 * for the last block of a tensor on the one-lane instance). */
INLINE int state_loop(const l2l_job *j, int64_t begin, int64_t end, int g_dtype, int w_dtype, int format) {
    const l2l_scalars s = j->s;
    const rule_k k = rule_k_of(j);
    const code_k mk = code_k_of(&j->m_code), vk = code_k_of(&j->v_code);
    const int uses_m = j->uses_m, uses_v = j->uses_v, unscale = UNSCALE(s);
    const int q8 = format == L2L_STATE_8BIT;
    /* 8-bit state (always with m: l2l_host_step sends a step without state to the fp32
     * loops): a gradient that is not finite makes m or v of its element not finite (v for
     * Adam, m for SGD with momentum), so only a block whose state max is not finite has its
     * gradients checked. */
    const int check_each = !q8;
    const void *g = j->g, *m_src = j->m_src, *v_src = j->v_src; /* in locals, as in step_loop */
    const float *p_src = j->p_src;
    float *p_dst = j->p_dst;
    void *w_dst = j->w_dst, *m_dst = j->m_dst, *v_dst = j->v_dst;
    float mbuf[L2L_BLOCK] __attribute__((aligned(64))), vbuf[L2L_BLOCK] __attribute__((aligned(64)));
    int bad = 0;
    for (int64_t b0 = begin; b0 < end; b0 += L2L_BLOCK) {
        int64_t len = end - b0 < L2L_BLOCK ? end - b0 : L2L_BLOCK, blk = b0 / L2L_BLOCK;
        float ms = q8 && uses_m ? j->m_scale_src[blk] : 0, vs = q8 && uses_v ? j->v_scale_src[blk] : 0;
        const block_k mb = block_k_of(&j->m_code, ms), vb = block_k_of(&j->v_code, vs);
        const int v_pos = v_positive(vs);
        vi mmax = iset(0), vmax = iset(0);
        vmask bad_lanes = (vmask){0}, redo = (vmask){0};
        for (int64_t b = 0; b < len; b += LANES) {
            int64_t i = b0 + b;
            vf gv = load_grad(g, i, g_dtype);
            if (unscale) gv = gv * k.inv_scale;
            if (check_each) bad_lanes |= nonfinite(gv);
            vf m = vset(0), v = vset(0);
            if (uses_m) m = load_moment(m_src, i, format, &mk, &mb, 1);
            if (uses_v) v = load_moment(v_src, i, format, &vk, &vb, 0);
            vf p = rule(&s, &k, gv, vload(p_src + i), &m, &v);
            vstore(p_dst + i, p);
            redo |= vnan(p) | store_working(w_dst, i, p, w_dtype);
            if (q8) { /* a NaN needs no canonical form here: it makes its block NaN */
                vstore(mbuf + b, m);
                vstore(vbuf + b, v);
                mmax = absmax(mmax, m, 0);
                vmax = absmax(vmax, v, v_pos);
            } else {
                if (uses_m) store_u16((uint16_t *)m_dst + i, round_bf16(canon_nan(m)));
                if (uses_v) store_u16((uint16_t *)v_dst + i, round_bf16(canon_nan(v)));
            }
        }
        if (any(redo)) rewrite(p_dst, NULL, NULL, w_dst, w_dtype, b0, b0 + len);
        bad |= any(bad_lanes);
        if (q8) {
            uint32_t m_abs = hmax(mmax), v_abs = hmax(vmax);
            if (!check_each && (m_abs >= 0x7F800000u || v_abs >= 0x7F800000u))
                bad |= nonfinite_block(g, b0, len, g_dtype, k.inv_scale, unscale);
            if (uses_m) encode_block(mbuf, len, m_abs, (uint8_t *)m_dst + b0, j->m_scale_dst + blk, &j->m_code, &mk, 1, 0);
            if (uses_v) encode_block(vbuf, len, v_abs, (uint8_t *)v_dst + b0, j->v_scale_dst + blk, &j->v_code, &vk, 0, v_pos);
        }
    }
    return bad;
}

/* ---------------------------------------------------------------- LAMB and LARS: the norms
 * Pass 1 of a LAMB or LARS step (l2l_host_norms): per block of L2L_BLOCK elements, the sums
 * of squares of p and of the trust ratio's other operand, LAMB's u (the rule's statements on
 * the decoded state; nothing is written) or LARS's unscaled g, in float64 (the square of a
 * float32 is exact there) in golden.sum_of_squares' order: element i of a block goes to lane
 * i % 16, rows are added in order, the 16 lanes folded by a fixed tree. A vector instance
 * holds the 16 lanes in NORM_VECTORS vectors of LANES doubles. Pass 2 is the ordinary step
 * with the tensor's trust scalar (rule). */
#define NORM_VECTORS (16 / LANES)

/* golden.sum_of_squares' fold: lane l + lane l + 8, then + 4, + 2, + 1. */
INLINE double ssq_fold(const vd *acc) {
    double lane[16];
    memcpy(lane, acc, sizeof lane);
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] = lane[l] + lane[l + w];
    return lane[0];
}

INLINE int norm_loop(const l2l_job *j, int64_t begin, int64_t end, int g_dtype, int format) {
    const l2l_scalars s = j->s;
    const rule_k k = rule_k_of(j);
    const code_k mk = code_k_of(&j->m_code), vk = code_k_of(&j->v_code);
    const int lamb = s.optimizer == L2L_LAMB, unscale = UNSCALE(s), q8 = format == L2L_STATE_8BIT;
    const void *g = j->g, *m_src = j->m_src, *v_src = j->v_src; /* in locals, as in step_loop */
    const float *p_src = j->p_src;
    double *ssq = j->ssq;
    for (int64_t b0 = begin; b0 < end; b0 += L2L_BLOCK) {
        int64_t len = end - b0 < L2L_BLOCK ? end - b0 : L2L_BLOCK, blk = b0 / L2L_BLOCK;
        const block_k mb = block_k_of(&j->m_code, q8 ? j->m_scale_src[blk] : 0);
        const block_k vb = block_k_of(&j->v_code, q8 ? j->v_scale_src[blk] : 0);
        vd p_acc[NORM_VECTORS], x_acc[NORM_VECTORS];
        for (int r = 0; r < NORM_VECTORS; r++) p_acc[r] = x_acc[r] = (vd){0};
        for (int64_t b = 0; b < len; b += LANES) {
            int64_t i = b0 + b;
            vf gv = load_grad(g, i, g_dtype);
            if (unscale) gv = gv * k.inv_scale;
            vf p = vload(p_src + i), x = gv;
            if (lamb) {
                vf m = load_moment(m_src, i, format, &mk, &mb, 1), v = load_moment(v_src, i, format, &vk, &vb, 0);
                x = lamb_update(&s, &k, gv, p, &m, &v);
            }
            const int r = (int)(b / LANES) % NORM_VECTORS;
            ssq_add(&p_acc[r], p);
            ssq_add(&x_acc[r], x);
        }
        ssq[2 * blk] = ssq_fold(p_acc);
        ssq[2 * blk + 1] = ssq_fold(x_acc);
    }
    return 0;
}

/* ---------------------------------------------------------------- dispatch */

/* The job's working dtype; the native bf16 conversion only where this instance has it. */
INLINE int working_dtype(const l2l_job *j) {
    return !VEC_NATIVE_BF16 && j->w_dtype == L2L_DT_BF16_NATIVE ? L2L_DT_BF16 : j->w_dtype;
}

static int step_dtypes(const l2l_job *j, int64_t begin, int64_t end) {
    const int w = working_dtype(j);
    DTYPE_CASES(step_loop, w)
}

static int state_dtypes(const l2l_job *j, int64_t begin, int64_t end) {
    const int w = working_dtype(j);
    if (j->format == L2L_STATE_BF16) { DTYPE_CASES(state_loop, w, L2L_STATE_BF16) }
    DTYPE_CASES(state_loop, w, L2L_STATE_8BIT)
}

/* LARS reads no state in pass 1: one loop per gradient dtype; LAMB one per state format too. */
static int norm_dtypes(const l2l_job *j, int64_t begin, int64_t end) {
    const int f = j->s.optimizer == L2L_LAMB ? j->format : L2L_STATE_F32;
    switch (j->g_dtype * 3 + f) {
    case 0: return norm_loop(j, begin, end, L2L_DT_F32, L2L_STATE_F32);
    case 1: return norm_loop(j, begin, end, L2L_DT_F32, L2L_STATE_BF16);
    case 2: return norm_loop(j, begin, end, L2L_DT_F32, L2L_STATE_8BIT);
    case 3: return norm_loop(j, begin, end, L2L_DT_BF16, L2L_STATE_F32);
    case 4: return norm_loop(j, begin, end, L2L_DT_BF16, L2L_STATE_BF16);
    case 5: return norm_loop(j, begin, end, L2L_DT_BF16, L2L_STATE_8BIT);
    case 6: return norm_loop(j, begin, end, L2L_DT_F16, L2L_STATE_F32);
    case 7: return norm_loop(j, begin, end, L2L_DT_F16, L2L_STATE_BF16);
    default: return norm_loop(j, begin, end, L2L_DT_F16, L2L_STATE_8BIT);
    }
}

/* A tile of the norm pass: whole blocks here (a block's lanes are one set of sums), the
 * block of the ragged end on one lane. */
static int norm_range(const void *ctx, int64_t begin, int64_t end) {
    const int64_t unit = LANES > 1 ? L2L_BLOCK : 1;
    const int64_t whole = end - (end - begin) % unit;
    if (whole > begin) norm_dtypes(ctx, begin, whole);
    if (whole < end) norm_range_scalar(ctx, whole, end);
    return 0;
}

/* A tile of a call: whole vectors here, the ragged end of the tensor on one lane. */
static int step_range(const void *ctx, int64_t begin, int64_t end) {
    const int64_t whole = end - (end - begin) % LANES;
    int bad = whole > begin ? step_dtypes(ctx, begin, whole) : 0;
    return whole < end ? bad | step_range_scalar(ctx, whole, end) : bad;
}

/* As step_range; with 8-bit state the block of the ragged end runs on one lane whole. */
static int state_range(const void *ctx, int64_t begin, int64_t end) {
    const l2l_job *j = ctx;
    const int64_t unit = j->format == L2L_STATE_8BIT && LANES > 1 ? L2L_BLOCK : LANES;
    const int64_t whole = end - (end - begin) % unit;
    int bad = whole > begin ? state_dtypes(j, begin, whole) : 0;
    return whole < end ? bad | state_range_scalar(ctx, whole, end) : bad;
}

/* The memory stream: whole groups of LINE elements, each stream moving size[k] lines of
 * vectors per group; the rest byte by byte. */
static int stream_range(const void *ctx, int64_t begin, int64_t end) {
    const l2l_stream *t = ctx;
    const int r = t->reads, u = r + t->updates, w = u + t->writes, nt = t->nontemporal;
    const vi one = iset(0x01010101u);
    vi acc = iset(0);
    int64_t i = begin;
    for (; i + LINE <= end; i += LINE) {
        for (int k = 0; k < w; k++) {
            char *b = (char *)t->ptr[k] + i * t->size[k];
            for (int l = 0; l < t->size[k] * LINE; l += (int)sizeof(vi)) {
                if (k < r) acc = acc + iload(b + l);
                else {
                    vi x = k < u ? iload(b + l) + one : one;
                    if (nt) store_nt(b + l, x);
                    else istore(b + l, x);
                }
            }
        }
    }
    if (nt) _mm_sfence();
    stream_sink = hmax(acc);
    return stream_bytes(t, i, end);
}

#undef LANES
#undef NORM_VECTORS
#undef VEC_FMA_QUOTIENT
#undef VEC_NATIVE_BF16
#undef VEC_MM
#undef MM
#endif /* VEC_ISA */
