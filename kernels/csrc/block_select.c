/* Fused block scoring + top-K selection for entropic KV pruning on CPU (see kernels/block_select.py).
 *
 * One call per attention layer and step does, for every pruned row p (its query read in place from the layer's):
 *   score[w] = bias[p,w] + scale * max_{h in KV heads, g in group} sum_c max(q c * kmax c, q c * kmin c)
 * over its W logical blocks (physical ids physical[p,w]; summaries [KVH, NB, 2D] = (kmax | kmin), float32
 * or bf16: block_summary.c keeps them in the cache's dtype, and bf16 ones halve what each layer reads),
 * keeps the keep[p] highest (the +inf bias of the sink and current block puts them in; -inf past
 * the row's blocks keeps those out), and writes their physical ids, in ascending logical order, into
 * row rows[p] of vLLM's block table. The torch path needs ~12 tensor ops (and their allocations)
 * per layer for the same thing; this is one pass over the summaries with no allocation.
 *
 * Plain C with no torch headers so it builds in about a second with the system compiler
 * (kernels/cbuild.py builds it on first use or at install). Rows are spread over the engine's threads with
 * OpenMP where the build has it: the pool torch and vLLM's kernels run on (torch's libgomp, loaded under the
 * same soname), not a second runtime fighting it for the cores (see decode_attention.c). The dot products
 * use AVX512-BF16 where the query and summaries are bf16 and the caller found the CPU has it, else AVX2/FMA when
 * the build machine has them (kernels/cbuild.py picks the flags), else scalar C.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define MAX_W 8192
#define MAX_GD 4096
#define PREFETCH 8 /* blocks ahead */
/* into L2 (prefetcht1): with cold summaries, 8 blocks ahead into L2 was the fastest of the distances (4-16) and
 * hints tried, 4 ahead into L1 (as before) the slowest; the whole change, timed by loadtest/bench_cpu_kernels.py's
 * selection column: docs/results/cpu-kernels-selection-* */
#define PREFETCH_LOCALITY 2

/* The k-th largest value (k >= 1) of a[0..n), reordering a (Hoare quickselect). */
static float kth_largest(float *a, int n, int k) {
    int lo = 0, hi = n - 1, target = k - 1;
    while (lo < hi) {
        float pivot = a[(lo + hi) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) { float t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (target <= j) hi = j;
        else if (target >= i) lo = i;
        else return a[target];
    }
    return a[target];
}

/* max over g < group of sq[g] . s, the rows sq[g] being n floats apart. The group's dot products share
 * each load of s and run as independent FMA chains (one per query head, two per head when the group is
 * small), so the core's FMA units stay busy instead of waiting on one chain's latency, as they did with
 * one dot product after another. GROUP is a constant at every call site, so the accumulators live in
 * registers. */
#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum256(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}

/* 8 summary values from c on, as floats (bf16: its bits are a float's upper half) */
static inline __attribute__((always_inline)) __m256 load8(const void *s, int c, const int BF16) {
    if (!BF16) return _mm256_loadu_ps((const float *)s + c);
    __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)s + c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

static inline __attribute__((always_inline)) float max_dot_fixed(const float *sq, const void *s, int n,
                                                                 const int GROUP, const int BF16) {
    __m256 even[8], odd[8];
    for (int g = 0; g < GROUP; g++) even[g] = odd[g] = _mm256_setzero_ps();
    for (int c = 0; c < n; c += 16) {
        __m256 s0 = load8(s, c, BF16), s1 = load8(s, c + 8, BF16);
        for (int g = 0; g < GROUP; g++) {
            even[g] = _mm256_fmadd_ps(_mm256_loadu_ps(sq + g * n + c), s0, even[g]);
            odd[g] = _mm256_fmadd_ps(_mm256_loadu_ps(sq + g * n + c + 8), s1, odd[g]);
        }
    }
    float best = -INFINITY;
    for (int g = 0; g < GROUP; g++) {
        float v = hsum256(_mm256_add_ps(even[g], odd[g]));
        if (v > best) best = v;
    }
    return best;
}
#endif

/* one block's summary (block_bytes from at) */
static inline void prefetch_summary(const char *at, int64_t block_bytes) {
    for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch(at + line, 0, PREFETCH_LOCALITY);
}

/* The first PREFETCH blocks' summaries of each KV head of row p: the scoring loops prefetch PREFETCH blocks ahead
 * within a head, so without this each of a row's heads would start on blocks not yet asked for. */
static void prefetch_row_start(const char *summaries, int64_t num_blocks, int64_t block_bytes, int kv_heads,
                               const int64_t *phys, int width) {
    for (int h = 0; h < kv_heads; h++)
        for (int w = 0; w < PREFETCH && w < width; w++)
            prefetch_summary(summaries + ((int64_t)h * num_blocks + phys[w]) * block_bytes, block_bytes);
}

/* element i of a float32 or bf16 array */
static inline float value_at(const void *row, int bf16, int64_t i) {
    if (!bf16) return ((const float *)row)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)row)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX2__) && defined(__FMA__)
#define GROUP_CASES(BF16)                                                 \
    switch (group) {                                                      \
        case 1: return max_dot_fixed(sq, s, n, 1, BF16);                  \
        case 2: return max_dot_fixed(sq, s, n, 2, BF16);                  \
        case 3: return max_dot_fixed(sq, s, n, 3, BF16);                  \
        case 4: return max_dot_fixed(sq, s, n, 4, BF16);                  \
        case 5: return max_dot_fixed(sq, s, n, 5, BF16);                  \
        case 6: return max_dot_fixed(sq, s, n, 6, BF16);                  \
        case 7: return max_dot_fixed(sq, s, n, 7, BF16);                  \
        case 8: return max_dot_fixed(sq, s, n, 8, BF16);                  \
        default: break;                                                   \
    }
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define BF16_DOT __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* max over g < GROUP of sq[g] . s with bf16 [q+ | q-] rows and a bf16 summary: one AVX512-BF16 dot product per 32
 * channels and head (pairs of exact bf16 products summed in float32), where the float path converts each summary
 * value to float and needs four times the instructions. n % 32 == 0. */
static inline __attribute__((always_inline)) BF16_DOT float max_dot_bf16(const uint16_t *sq, const uint16_t *s,
                                                                         int n, const int GROUP) {
    __m512 acc[8];
    for (int g = 0; g < GROUP; g++) acc[g] = _mm512_setzero_ps();
    for (int c = 0; c < n; c += 32) {
        __m512bh sv = (__m512bh)_mm512_loadu_si512(s + c);
        for (int g = 0; g < GROUP; g++)
            acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_loadu_si512(sq + g * n + c), sv);
    }
    float best = -INFINITY;
    for (int g = 0; g < GROUP; g++) {
        float v = _mm512_reduce_add_ps(acc[g]);
        if (v > best) best = v;
    }
    return best;
}

/* scores[w] = max(scores[w], max_g sq[g] . summary) over one KV head's blocks, those bias forces in or out
 * skipped; sh: the head's summaries, phys[w] the physical id of logical block w. GROUP is a constant at each call
 * (groups over 8 take one head at a time). */
static inline __attribute__((always_inline)) BF16_DOT void score_head_bf16_fixed(
        const uint16_t *sq, const char *sh, const int64_t *phys, const float *b, int width, int group, int n,
        float *scores, const int GROUP) {
    const int64_t block_bytes = (int64_t)n * 2;
    for (int w = 0; w < width; w++) {
        if (w + PREFETCH < width) prefetch_summary(sh + phys[w + PREFETCH] * block_bytes, block_bytes);
        if (isinf(b[w])) continue;
        const uint16_t *s = (const uint16_t *)(sh + phys[w] * block_bytes);
        float acc = -INFINITY;
        for (int g = 0; g < group; g += GROUP) {
            float v = max_dot_bf16(sq + (int64_t)g * n, s, n, GROUP);
            if (v > acc) acc = v;
        }
        if (acc > scores[w]) scores[w] = acc;
    }
}

static BF16_DOT void score_head_bf16(const uint16_t *sq, const char *sh, const int64_t *phys, const float *b,
                                     int width, int group, int n, float *scores) {
    switch (group) {
        case 1: score_head_bf16_fixed(sq, sh, phys, b, width, group, n, scores, 1); break;
        case 2: score_head_bf16_fixed(sq, sh, phys, b, width, group, n, scores, 2); break;
        case 3: score_head_bf16_fixed(sq, sh, phys, b, width, group, n, scores, 3); break;
        case 4: score_head_bf16_fixed(sq, sh, phys, b, width, group, n, scores, 4); break;
        case 5: score_head_bf16_fixed(sq, sh, phys, b, width, group, n, scores, 5); break;
        case 6: score_head_bf16_fixed(sq, sh, phys, b, width, group, n, scores, 6); break;
        case 7: score_head_bf16_fixed(sq, sh, phys, b, width, group, n, scores, 7); break;
        case 8: score_head_bf16_fixed(sq, sh, phys, b, width, group, n, scores, 8); break;
        default: score_head_bf16_fixed(sq, sh, phys, b, width, group, n, scores, 1); break;
    }
}
#endif

static float max_dot(const float *sq, const void *s, int s_bf16, int group, int n) {
#if defined(__AVX2__) && defined(__FMA__)
    if ((n & 15) == 0) { /* every head size vLLM serves: 2 * d with d a multiple of 8 */
        if (s_bf16) {
            GROUP_CASES(1)
        } else {
            GROUP_CASES(0)
        }
    }
#endif
    float best = -INFINITY;
    for (int g = 0; g < group; g++) {
        float acc = 0.f;
        for (int c = 0; c < n; c++) acc += sq[g * n + c] * value_at(s, s_bf16, c);
        if (acc > best) best = acc;
    }
    return best;
}

/* query: the layer's query, one row of kv_heads * group * d values per token (float32, or bf16 when
 * query_bf16), rows query_stride elements apart; row p's query is token query_tokens[p]. Read in place:
 * gathering and converting them in torch first cost more than the scoring. */
int entropic_select_blocks(const void *query, int query_bf16, int64_t query_stride, const int64_t *query_tokens,
                           const void *summaries, int summaries_bf16, int64_t num_blocks,
                           const int64_t *physical, const float *bias, const int64_t *keep,
                           int rows, int kv_heads, int group, int d, int width, float scale,
                           int32_t *table, int64_t table_stride, const int64_t *table_rows, int threads,
                           int bf16_dot) {
    if (width > MAX_W || group * 2 * d > MAX_GD) return -1;
    const int d2 = 2 * d;
#if defined(__AVX2__) && defined(__FMA__)
    bf16_dot = bf16_dot && query_bf16 && summaries_bf16 && d2 % 32 == 0;
#else
    bf16_dot = 0;
#endif
    /* rows: each writes its own table row; equal work but for the widths of their contexts */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && rows > 1)
    for (int p = 0; p < rows; p++) {
        float scores[MAX_W], work[MAX_W], signed_q[MAX_GD];
        uint16_t signed_q16[MAX_GD];
        const int64_t *phys = physical + (int64_t)p * width;
        const float *b = bias + (int64_t)p * width;
        for (int w = 0; w < width; w++) scores[w] = -INFINITY;
        const int64_t block_bytes = d2 * (summaries_bf16 ? 2 : 4);
        /* on one thread the rows run in order, so this row's start was asked for during the last one */
        if (threads > 1 || p == 0) prefetch_row_start(summaries, num_blocks, block_bytes, kv_heads, phys, width);
        if (threads <= 1 && p + 1 < rows)
            prefetch_row_start(summaries, num_blocks, block_bytes, kv_heads, phys + width, width);
        for (int h = 0; h < kv_heads; h++) {
            /* [q+ | q-] per query head of this KV head's group: max(q k_max, q k_min) channel-wise
             * is q+ k_max + q- k_min, one dot product against the packed (kmax | kmin) summary */
            const char *qrow = (const char *)query + query_tokens[p] * query_stride * (query_bf16 ? 2 : 4);
            const char *sh = (const char *)summaries + (int64_t)h * num_blocks * block_bytes;
#if defined(__AVX2__) && defined(__FMA__)
            if (bf16_dot) { /* the same split on the bf16 bits: exact, so the products are those of the float path */
                const uint16_t *q16 = (const uint16_t *)qrow + (int64_t)h * group * d;
                for (int g = 0; g < group; g++)
                    for (int c = 0; c < d; c++) {
                        uint16_t v = q16[g * d + c];
                        signed_q16[g * d2 + c] = v & 0x8000 ? 0 : v;
                        signed_q16[g * d2 + d + c] = v & 0x8000 ? v : 0;
                    }
                score_head_bf16(signed_q16, sh, phys, b, width, group, d2, scores);
                continue;
            }
#endif
            for (int g = 0; g < group; g++)
                for (int c = 0; c < d; c++) {
                    float v = value_at(qrow, query_bf16, (h * group + g) * d + c);
                    signed_q[g * d2 + c] = v > 0.f ? v : 0.f;
                    signed_q[g * d2 + d + c] = v < 0.f ? v : 0.f;
                }
            for (int w = 0; w < width; w++) {
                /* The blocks' summaries lie at scattered physical ids, usually out of cache (the step's
                 * weights streamed through since the last layer): ask for the one PREFETCH blocks
                 * ahead now, so its loads overlap this block's dot products instead of waiting */
                if (w + PREFETCH < width) prefetch_summary(sh + phys[w + PREFETCH] * block_bytes, block_bytes);
                if (isinf(b[w])) continue; /* forced in or out: no need to score */
                float acc = max_dot(signed_q, sh + phys[w] * block_bytes, summaries_bf16, group, d2);
                if (acc > scores[w]) scores[w] = acc;
            }
        }
        for (int w = 0; w < width; w++) scores[w] = isinf(b[w]) ? b[w] : b[w] + scale * scores[w];

        int k = (int)keep[p];
        if (k > width) k = width;
        memcpy(work, scores, sizeof(float) * width);
        float threshold = kth_largest(work, width, k);
        int above = 0;
        for (int w = 0; w < width; w++) above += scores[w] > threshold;
        int ties = k - above; /* blocks at exactly the threshold still to take, lowest index first */
        int32_t *out = table + table_rows[p] * table_stride;
        int n = 0;
        for (int w = 0; w < width && n < k; w++) {
            if (scores[w] > threshold || (scores[w] == threshold && ties-- > 0)) out[n++] = (int32_t)phys[w];
        }
    }
    return 0;
}
