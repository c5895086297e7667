/* Decode attention over vLLM's CPU paged KV cache ("vec" layout, bf16 or float32), for steps in which every row
 * has one query token (kernels/cpu_decode_attention.py says when the backend calls it).
 *
 * Cache: [blocks, KV heads, 2 * block_size * D] bf16 or float32, per block and KV head the keys channel-major
 * ([D, block_size]) and then the values token-major ([block_size, D]): vLLM's "vec" ISA layout (pinned by
 * tests/test_vllm_pins.py). Row r attends to seq_lens[r] tokens, those of the blocks table[r, 0..] in order
 * (a pruned row's compacted table reads the same way).
 *
 * Why a kernel of our own: vLLM's "vec" kernel is a general tile GEMM in float32 (each bf16 key and value
 * converted, QK into a logits buffer, softmax, PV, partial outputs reduced afterwards). For one query token per
 * row, the G query heads of a KV head against a block are small enough for registers: here AVX512-BF16 dot
 * products (two bf16 products per float32 lane and instruction, no conversion) read each block's keys and
 * values once for all G heads, and the softmax is online (running max and sum), so nothing is reduced
 * afterwards. Scores, softmax and sums are float32; the probabilities are rounded to bf16 for the products with
 * the values, as vLLM's AMX kernel does. A float32 cache (the engine's dtype where the CPU has no AVX512-BF16)
 * gets the same structure with AVX2 FMA, all in float32. Rows and KV heads are spread over the engine's threads
 * with OpenMP where the build has it (kernels/cbuild.py adds -fopenmp): the process's libgomp is torch's,
 * already loaded under the same soname, so this is the pool (and the core binding) vLLM's own kernels run on,
 * not a second one competing with it. Built with the AVX2 flags of kernels/cbuild.py; the AVX-512 functions
 * carry their own target and run only where the CPU has them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd_exp.h"

#define MAX_D 256
#define MAX_G 16
#define MAX_BS 256

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DISPATCH_HEADS(nh, call)                                   \
    switch (nh) {                                                  \
    case 1: { const int n_ = 1; call; } break;                     \
    case 2: { const int n_ = 2; call; } break;                     \
    case 3: { const int n_ = 3; call; } break;                     \
    default: { const int n_ = 4; call; } break;                    \
    }

/* One block of the online softmax: s[0..valid) (scaled scores) become exp(s - running max), the running max *m
 * and sum *l take the block in; returns the factor the values accumulated so far must be multiplied by. */
static float softmax_block(float *s, int valid, float *m, float *l) {
    __m256 vtop = _mm256_set1_ps(*m);
    int t = 0;
    for (; t + 8 <= valid; t += 8) vtop = _mm256_max_ps(vtop, _mm256_loadu_ps(s + t));
    float top = hmax256(vtop);
    for (; t < valid; t++) top = s[t] > top ? s[t] : top;
    float rescale = exp_scalar(*m - top), sum = 0.0f;
    for (t = 0; t + 8 <= valid; t += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(top)));
        _mm256_storeu_ps(s + t, e);
        float lanes[8];
        _mm256_storeu_ps(lanes, e);
        for (int j = 0; j < 8; j++) sum += lanes[j];
    }
    for (; t < valid; t++) sum += (s[t] = exp_scalar(s[t] - top));
    *l = *l * rescale + sum;
    *m = top;
    return rescale;
}

#define BF16_DOT __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* Lane k of unpacklo/hi_epi16 on 512 bits holds, for 128-bit lane L = k / 4, element 8L + k % 4 (lo) or
 * 8L + 4 + k % 4 (hi) of its sources; these index vectors put 16 of them back in order (permutex2var:
 * 0..15 from lo, 16..31 from hi). */
static const int32_t UNPACK_ORDER[2][16] = {
    {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
    {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31},
};

/* scores[h][t0..t0+32] = q[h] . k[:, t]: channel pairs of 32 tokens interleaved into bf16 pairs, one dot
 * product instruction per head and 16 tokens. qp: per head, d/2 bf16 pairs (q[2c], q[2c+1]). pf (or NULL): keys
 * of the block to come, of the same shape, two of whose lines each step prefetches (bs/32 calls x d/2 steps x 2
 * lines cover its bs*d*2 bytes). */
static inline __attribute__((always_inline)) BF16_DOT void dot_score32(int nh, const uint32_t *qp,
                                                                       const uint16_t *keys, int64_t bs, int64_t t0,
                                                                       int d, float scale, float *scores,
                                                                       const char *pf) {
    __m512 lo[4], hi[4];
    for (int h = 0; h < nh; h++) lo[h] = hi[h] = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 2) {
        if (pf) {
            const char *line = pf + ((t0 / 32) * (d / 2) + c / 2) * 128;
            _mm_prefetch(line, _MM_HINT_T1);
            _mm_prefetch(line + 64, _MM_HINT_T1);
        }
        __m512i a = _mm512_loadu_si512(keys + c * bs + t0), b = _mm512_loadu_si512(keys + (c + 1) * bs + t0);
        __m512bh pl = (__m512bh)_mm512_unpacklo_epi16(a, b), ph = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int h = 0; h < nh; h++) {
            __m512bh q2 = (__m512bh)_mm512_set1_epi32((int)qp[h * (MAX_D / 2) + c / 2]);
            lo[h] = _mm512_dpbf16_ps(lo[h], pl, q2);
            hi[h] = _mm512_dpbf16_ps(hi[h], ph, q2);
        }
    }
    __m512i first = _mm512_loadu_si512(UNPACK_ORDER[0]), second = _mm512_loadu_si512(UNPACK_ORDER[1]);
    __m512 s = _mm512_set1_ps(scale);
    for (int h = 0; h < nh; h++) {
        _mm512_storeu_ps(scores + h * MAX_BS + t0, _mm512_mul_ps(_mm512_permutex2var_ps(lo[h], first, hi[h]), s));
        _mm512_storeu_ps(scores + h * MAX_BS + t0 + 16,
                         _mm512_mul_ps(_mm512_permutex2var_ps(lo[h], second, hi[h]), s));
    }
}

/* acc[h] (channels in unpack order, 32 per pair of vectors) += sum_t p[h][t] v[t] over the first `valid` tokens:
 * token pairs interleaved, pp: per head, bs/2 bf16 pairs (p[2i], p[2i+1]). Rows past `valid` are never read:
 * a block's unwritten slots may hold anything, and 0 x nan is nan. pf (or NULL): values of the block to come, two
 * lines prefetched per step as in dot_score32. */
static inline __attribute__((always_inline)) BF16_DOT void dot_accumulate32(int nh, const uint32_t *pp,
                                                                            const uint16_t *values, int valid, int d,
                                                                            int c0, __m512 *acc, int bs,
                                                                            const char *pf) {
    __m512 a0[4], a1[4];
    for (int h = 0; h < nh; h++) {
        a0[h] = acc[h * (MAX_D / 16) + c0 / 16];
        a1[h] = acc[h * (MAX_D / 16) + c0 / 16 + 1];
    }
    for (int i = 0; 2 * i < valid; i++) {
        if (pf) {
            const char *line = pf + ((c0 / 32) * (bs / 2) + i) * 128;
            _mm_prefetch(line, _MM_HINT_T1);
            _mm_prefetch(line + 64, _MM_HINT_T1);
        }
        __m512i x = _mm512_loadu_si512(values + (int64_t)(2 * i) * d + c0);
        __m512i y = 2 * i + 1 < valid ? _mm512_loadu_si512(values + (int64_t)(2 * i + 1) * d + c0)
                                      : _mm512_setzero_si512();
        __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(x, y), vh = (__m512bh)_mm512_unpackhi_epi16(x, y);
        for (int h = 0; h < nh; h++) {
            __m512bh p2 = (__m512bh)_mm512_set1_epi32((int)pp[h * (MAX_BS / 2) + i]);
            a0[h] = _mm512_dpbf16_ps(a0[h], vl, p2);
            a1[h] = _mm512_dpbf16_ps(a1[h], vh, p2);
        }
    }
    for (int h = 0; h < nh; h++) {
        acc[h * (MAX_D / 16) + c0 / 16] = a0[h];
        acc[h * (MAX_D / 16) + c0 / 16 + 1] = a1[h];
    }
}

/* One row and KV head over its n tokens, with bf16 keys, values and query (the cache's and the model's dtype):
 * bf16 dot products, float32 scores, softmax and sums; the probabilities are rounded to bf16 for the values'
 * products, as vLLM's AMX kernel does. Needs d % 32 == 0 and bs % 32 == 0. */
static BF16_DOT void dot_attend(int g, const uint16_t *query, const char *cache_head, const int32_t *blocks, int n,
                                int64_t block_span, int bs, int d, float scale, uint16_t *out, const char *after) {
    /* after (or NULL): the next unit's first block, prefetched while this unit's last one computes */
    uint32_t qp[MAX_G * MAX_D / 2], pp[MAX_G * MAX_BS / 2];
    float scores[MAX_G * MAX_BS], m[MAX_G], l[MAX_G];
    __m512 acc[MAX_G * MAX_D / 16];
    for (int h = 0; h < g; h++) {
        memcpy(qp + h * (MAX_D / 2), query + (int64_t)h * d, sizeof(uint16_t) * d);
        for (int j = 0; j < d / 16; j++) acc[h * (MAX_D / 16) + j] = _mm512_setzero_ps();
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    for (int b = 0; b * bs < n; b++) {
        const uint16_t *keys = (const uint16_t *)(cache_head + (int64_t)blocks[b] * block_span * 2);
        const uint16_t *values = keys + (int64_t)bs * d;
        int valid = n - b * bs < bs ? n - b * bs : bs;
        /* the next block of this KV head (16 KiB at block 64, head size 64) is fetched into L2 two lines per
         * inner step, while this one computes: a kept block is a short run at a scattered address, which the
         * hardware prefetchers do not reach ahead of, and all of it requested at once (L1 hint) stalls on the
         * miss buffers. Measured by loadtest/bench_cpu_kernels.py (docs/results/cpu-kernels-*). */
        const char *next = b * bs + bs < n ? cache_head + (int64_t)blocks[b + 1] * block_span * 2 : after;
        for (int h0 = 0; h0 < g; h0 += 4) {
            int nh = g - h0 < 4 ? g - h0 : 4;
            for (int t0 = 0; t0 < valid; t0 += 32)
                DISPATCH_HEADS(nh, dot_score32(n_, qp + h0 * (MAX_D / 2), keys, bs, t0, d, scale,
                                               scores + h0 * MAX_BS, h0 == 0 ? next : NULL))
        }
        int padded = (valid + 31) & ~31;
        for (int h = 0; h < g; h++) {
            float *s = scores + h * MAX_BS;
            float rescale = softmax_block(s, valid, m + h, l + h);
            for (int t = valid; t < padded; t++) s[t] = 0.0f; /* past the sequence: weigh nothing */
            __m512 r = _mm512_set1_ps(rescale);
            for (int j = 0; j < d / 16; j++) acc[h * (MAX_D / 16) + j] = _mm512_mul_ps(acc[h * (MAX_D / 16) + j], r);
            for (int t = 0; t < padded; t += 32) {
                __m512bh p = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + t + 16), _mm512_loadu_ps(s + t));
                _mm512_storeu_si512(pp + h * (MAX_BS / 2) + t / 2, (__m512i)p);
            }
        }
        for (int h0 = 0; h0 < g; h0 += 4) {
            int nh = g - h0 < 4 ? g - h0 : 4;
            for (int c0 = 0; c0 < d; c0 += 32)
                DISPATCH_HEADS(nh, dot_accumulate32(n_, pp + h0 * (MAX_BS / 2), values, valid, d, c0,
                                                    acc + h0 * (MAX_D / 16), bs,
                                                    h0 == 0 && next ? next + (int64_t)bs * d * 2 : NULL))
        }
    }
    __m512i first = _mm512_loadu_si512(UNPACK_ORDER[0]), second = _mm512_loadu_si512(UNPACK_ORDER[1]);
    for (int h = 0; h < g; h++) {
        __m512 inv = _mm512_set1_ps(l[h] > 0.0f ? 1.0f / l[h] : 0.0f);
        for (int c0 = 0; c0 < d; c0 += 32) {
            __m512 lo = acc[h * (MAX_D / 16) + c0 / 16], hi = acc[h * (MAX_D / 16) + c0 / 16 + 1];
            __m512bh o = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv),
                                             _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv));
            _mm512_storeu_si512(out + (int64_t)h * d + c0, (__m512i)o);
        }
    }
}
/* float32 cache and query (the engine's dtype on CPUs without AVX512-BF16, where bf16 is emulated): AVX2 FMA.
 * scores[h][t0..t0+16] = q[h] . k[:, t] for up to 4 heads in registers; pf (or NULL): keys of the block to come,
 * one of whose lines each step prefetches (bs/16 calls x d steps cover its bs*d*4 bytes). */
static inline __attribute__((always_inline)) void f32_score16(int nh, const float *q, const float *keys, int64_t bs,
                                                              int t0, int d, float scale, float *scores,
                                                              const char *pf) {
    __m256 s0[4], s1[4];
    for (int h = 0; h < nh; h++) s0[h] = s1[h] = _mm256_setzero_ps();
    for (int c = 0; c < d; c++) {
        if (pf) _mm_prefetch(pf + ((int64_t)(t0 / 16) * d + c) * 64, _MM_HINT_T1);
        __m256 k0 = _mm256_loadu_ps(keys + c * bs + t0), k1 = _mm256_loadu_ps(keys + c * bs + t0 + 8);
        for (int h = 0; h < nh; h++) {
            __m256 qc = _mm256_broadcast_ss(q + h * MAX_D + c);
            s0[h] = _mm256_fmadd_ps(k0, qc, s0[h]);
            s1[h] = _mm256_fmadd_ps(k1, qc, s1[h]);
        }
    }
    __m256 sc = _mm256_set1_ps(scale);
    for (int h = 0; h < nh; h++) {
        _mm256_storeu_ps(scores + h * MAX_BS + t0, _mm256_mul_ps(s0[h], sc));
        _mm256_storeu_ps(scores + h * MAX_BS + t0 + 8, _mm256_mul_ps(s1[h], sc));
    }
}

/* acc[h][c0..c0+16] += sum_t p[h][t] v[t][c0..c0+16] over the first `valid` tokens (rows past it never read);
 * pf (or NULL): values of the block to come, one line per step as in f32_score16. */
static inline __attribute__((always_inline)) void f32_accumulate16(int nh, const float *p, const float *values,
                                                                   int valid, int d, int c0, float *acc, int bs,
                                                                   const char *pf) {
    __m256 a0[4], a1[4];
    for (int h = 0; h < nh; h++) {
        a0[h] = _mm256_loadu_ps(acc + h * MAX_D + c0);
        a1[h] = _mm256_loadu_ps(acc + h * MAX_D + c0 + 8);
    }
    for (int t = 0; t < valid; t++) {
        if (pf) _mm_prefetch(pf + ((int64_t)(c0 / 16) * bs + t) * 64, _MM_HINT_T1);
        const float *row = values + (int64_t)t * d + c0;
        __m256 v0 = _mm256_loadu_ps(row), v1 = _mm256_loadu_ps(row + 8);
        for (int h = 0; h < nh; h++) {
            __m256 pt = _mm256_broadcast_ss(p + h * MAX_BS + t);
            a0[h] = _mm256_fmadd_ps(v0, pt, a0[h]);
            a1[h] = _mm256_fmadd_ps(v1, pt, a1[h]);
        }
    }
    for (int h = 0; h < nh; h++) {
        _mm256_storeu_ps(acc + h * MAX_D + c0, a0[h]);
        _mm256_storeu_ps(acc + h * MAX_D + c0 + 8, a1[h]);
    }
}

/* One row and KV head over its n tokens, all float32, the same online softmax as dot_attend. Needs d % 16 == 0
 * and bs % 16 == 0. after: as in dot_attend. */
static void f32_attend(int g, const float *query, const char *cache_head, const int32_t *blocks, int n,
                       int64_t block_span, int bs, int d, float scale, float *out, const char *after) {
    float q[MAX_G * MAX_D], scores[MAX_G * MAX_BS], acc[MAX_G * MAX_D], m[MAX_G], l[MAX_G];
    for (int h = 0; h < g; h++) {
        memcpy(q + h * MAX_D, query + (int64_t)h * d, sizeof(float) * d);
        memset(acc + h * MAX_D, 0, sizeof(float) * d);
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    for (int b = 0; b * bs < n; b++) {
        const float *keys = (const float *)(cache_head + (int64_t)blocks[b] * block_span * 4);
        const float *values = keys + (int64_t)bs * d;
        int valid = n - b * bs < bs ? n - b * bs : bs;
        const char *next = b * bs + bs < n ? cache_head + (int64_t)blocks[b + 1] * block_span * 4 : after;
        for (int h0 = 0; h0 < g; h0 += 4) {
            int nh = g - h0 < 4 ? g - h0 : 4;
            for (int t0 = 0; t0 < valid; t0 += 16)
                DISPATCH_HEADS(nh, f32_score16(n_, q + h0 * MAX_D, keys, bs, t0, d, scale, scores + h0 * MAX_BS,
                                               h0 == 0 ? next : NULL))
        }
        for (int h = 0; h < g; h++) {
            float rescale = softmax_block(scores + h * MAX_BS, valid, m + h, l + h);
            for (int c = 0; c < d; c++) acc[h * MAX_D + c] *= rescale;
        }
        for (int h0 = 0; h0 < g; h0 += 4) {
            int nh = g - h0 < 4 ? g - h0 : 4;
            for (int c0 = 0; c0 < d; c0 += 16)
                DISPATCH_HEADS(nh, f32_accumulate16(n_, scores + h0 * MAX_BS, values, valid, d, c0, acc + h0 * MAX_D,
                                                    bs, h0 == 0 && next ? next + (int64_t)bs * d * 4 : NULL))
        }
    }
    for (int h = 0; h < g; h++) {
        float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int c = 0; c < d; c++) out[(int64_t)h * d + c] = acc[h * MAX_D + c] * inv;
    }
}
#endif

/* 1 where this build spreads its work over threads (OpenMP), 0 where it runs on the calling thread only. */
int entropic_decode_attention_parallel(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* query [rows, heads, d] with row stride q_stride (elements), out likewise, in the cache's dtype; heads = kv_heads * g,
 * the heads of KV head k being k*g .. k*g+g-1 (vLLM's grouping). table: int32 with row stride table_stride. kind:
 * DECODE_BF16_DOT (bf16, where the caller found AVX512-BF16 and AVX512BW) or DECODE_F32 (float32, AVX2 and FMA,
 * which this build has wherever the host has them). threads: how many of the OpenMP pool's threads to use (the
 * engine's count; ignored by a serial build). Returns 0, or -1 (nothing written) where this build cannot or the
 * shapes are outside the limits. */
#define DECODE_BF16_DOT 1
#define DECODE_F32 2
int entropic_decode_attention(const void *query, int64_t q_stride, void *out, int64_t out_stride, const void *cache,
                              int64_t num_blocks, int kv_heads, int bs, int d, int g, const int32_t *table,
                              int64_t table_stride, const int32_t *seq_lens, int rows, float scale, int kind,
                              int threads) {
    const int lanes = kind == DECODE_BF16_DOT ? 32 : 16;
    if ((kind != DECODE_BF16_DOT && kind != DECODE_F32) || d > MAX_D || g > MAX_G || bs > MAX_BS || d < lanes ||
        g < 1 || bs < lanes || d % lanes || bs % lanes)
        return -1;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b * bs < seq_lens[r]; b++)
            if (table[(int64_t)r * table_stride + b] < 0 || table[(int64_t)r * table_stride + b] >= num_blocks)
                return -1;
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t elem = kind == DECODE_BF16_DOT ? 2 : 4;
    const int64_t head_span = 2 * (int64_t)bs * d, block_span = kv_heads * head_span;
    const int units = rows * kv_heads;
    /* dynamic: a unit's cost is its row's kept length, which differs between rows by up to the whole context */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && units > 1)
    for (int u = 0; u < units; u++) {
        const int r = u / kv_heads, kv = u % kv_heads;
        /* on one thread the units run in order, so the last block can fetch the next unit's first; on several,
         * which thread takes the next unit is not known */
        const char *after = NULL;
        if (threads <= 1 && u + 1 < units) {
            const int r1 = (u + 1) / kv_heads, kv1 = (u + 1) % kv_heads;
            if (seq_lens[r1] > 0)
                after = (const char *)cache + (kv1 * head_span + (int64_t)table[r1 * table_stride] * block_span) * elem;
        }
        const char *head = (const char *)cache + kv * head_span * elem;
        const int64_t q_at = r * q_stride + (int64_t)kv * g * d, out_at = r * out_stride + (int64_t)kv * g * d;
        if (kind == DECODE_BF16_DOT)
            dot_attend(g, (const uint16_t *)query + q_at, head, table + r * table_stride, seq_lens[r], block_span,
                       bs, d, scale, (uint16_t *)out + out_at, after);
        else
            f32_attend(g, (const float *)query + q_at, head, table + r * table_stride, seq_lens[r], block_span, bs,
                       d, scale, (float *)out + out_at, after);
    }
    return 0;
#else
    return -1;
#endif
}
