/* One categorical draw from each row's softmax, by inverse CDF (see kernels/cpu_sample.py).
 *
 * For row r with m = max x, e_i = exp(x_i - m) and A = sum e: the token is the first i whose running sum of
 * e passes u * A, for one uniform u in [0, 1) made from seeds[r] by SplitMix64. That is an exact draw from
 * softmax(x) up to float rounding, as vLLM's Gumbel-max is; it takes one exp per token where Gumbel-max
 * takes a random number and two logs per token.
 *
 * Two passes and one exp per token: pass one finds m; pass two sums e over blocks of BLOCK tokens and keeps
 * each block's sum (in ``block_sums``, vocab / BLOCK floats per call, given by the caller); then the block
 * sums are walked in double up to u * A, and only the block where the running sum passes it has its
 * weights computed again (by the same code) and added one by one. The running sum over blocks adds the very block sums A was added from, in
 * the same order, so it reaches A at the last block: with u < 1 the walk always ends in a block. Inside
 * it, float rounding between the block's sum and its terms added one by one can leave u * A unpassed; the
 * block's last token with a nonzero weight is then taken. Tokens whose weight is 0 (-inf logits: masked,
 * and everything below exp's range under the max) are never taken.
 *
 * exp is the polynomial of simd_exp.h, as in entropy.c. Single-threaded, like entropy.c. AVX2/FMA when the build
 * machine has them (kernels/cbuild.py picks the flags), else scalar C.
 */
#include <stdlib.h>
#include <string.h>

#include "simd_exp.h"

#define BLOCK 16

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

static uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The uniform in [0, 1) that ``seed`` makes. */
static inline double uniform(uint64_t seed) { return (double)(splitmix64(seed) >> 11) * 0x1.0p-53; }

/* The block where the running sum of ``block_sums`` passes ``target`` (the last block at most), with the sum
 * of the blocks before it in ``run``. */
static inline int64_t walk_blocks(const float *block_sums, int64_t blocks, double target, double *run) {
    int64_t b = 0;
    *run = 0.0;
    while (b < blocks - 1 && *run + block_sums[b] <= target) *run += block_sums[b++];
    return b;
}

/* The row's max, or nan where some logit is nan (exp would weigh it 0 and the draw go on as if it were masked:
 * the callers decline such a row instead). */
static float row_max(const float *x, int64_t vocab) {
    float m = -INFINITY;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 a = _mm256_set1_ps(-INFINITY), b = a, nan = _mm256_setzero_ps();
    for (; i + 16 <= vocab; i += 16) {
        const __m256 u = _mm256_loadu_ps(x + i), v = _mm256_loadu_ps(x + i + 8);
        a = _mm256_max_ps(a, u);
        b = _mm256_max_ps(b, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(u, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    m = hmax256(_mm256_max_ps(a, b));
#endif
    for (; i < vocab; i++) {
        if (isnan(x[i])) return NAN;
        m = x[i] > m ? x[i] : m;
    }
    return m;
}

/* The weights exp(x_i - m) of tokens [start, end), end - start <= BLOCK, into e; returns their sum, added
 * in a fixed order. Pass two and the walk both call it, so a block's weights are the same in each. */
static inline float block_weights(const float *x, int64_t start, int64_t end, float m, float *e) {
#if defined(__AVX2__) && defined(__FMA__)
    if (end - start == BLOCK) {
        const __m256 vm = _mm256_set1_ps(m);
        __m256 e0 = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + start), vm));
        __m256 e1 = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + start + 8), vm));
        _mm256_storeu_ps(e, e0);
        _mm256_storeu_ps(e + 8, e1);
        return hsum256(_mm256_add_ps(e0, e1));
    }
#endif
    float s = 0.0f;
    for (int64_t i = start; i < end; i++) s += (e[i - start] = exp_scalar(x[i] - m));
    return s;
}

/* Returns 0, or -1 when some row has no distribution to draw from (every logit -inf, a +inf or a nan):
 * the caller then leaves the batch to vLLM's sampler. */
int entropic_sample_rows(const float *logits, int64_t rows, int64_t vocab, int64_t stride, const uint64_t *seeds,
                         float *block_sums, int64_t *out) {
    const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * stride;
        const float m = row_max(x, vocab);
        if (!(m > -INFINITY) || m == INFINITY) return -1;
        float e[BLOCK];
        double total = 0.0;
        for (int64_t b = 0; b < blocks; b++) {
            int64_t start = b * BLOCK, end = start + BLOCK < vocab ? start + BLOCK : vocab;
            block_sums[b] = block_weights(x, start, end, m, e);
            total += block_sums[b];
        }
        if (!(total > 0.0) || !isfinite(total)) return -1;
        const double target = uniform(seeds[r]) * total;
        double run;
        const int64_t b = walk_blocks(block_sums, blocks, target, &run);
        int64_t start = b * BLOCK, end = start + BLOCK < vocab ? start + BLOCK : vocab, pick = -1;
        block_weights(x, start, end, m, e);
        for (int64_t i = start; i < end; i++) {
            if (e[i - start] > 0.0f) {
                pick = i;
                run += e[i - start];
                if (run > target) break;
            }
        }
        if (pick < 0) return -1; /* cannot happen: this block's sum was positive */
        out[r] = pick;
    }
    return 0;
}

/* ---- Min-p, top-k and top-p (entropic_sample_rows_filtered) ----
 *
 * vLLM's rule (MinPLogitsProcessor, then apply_top_k_top_p_pytorch, pinned by tests/test_vllm_pins.py), without
 * its softmax for min-p and its sort of the whole vocabulary: min-p keeps every token with probability at least
 * min_p times the row's largest, i.e. x >= m + ln(min_p) (the floor; the two forms can differ by a rounding
 * for a token at the floor); top-k keeps, of those, every token whose logit is at least the k-th largest (ties
 * with it included; every one where fewer than k are left, as vLLM's top-k does over -inf); top-p then keeps,
 * of those, every token whose logit is below tokens that together carry less than p of their mass,
 * renormalized. So each row keeps the tokens with x >= tau for one threshold tau, which this finds; a tie
 * group at the top-p boundary is kept whole, where vLLM's sort keeps an arbitrary part of it. Tokens below the
 * floor weigh 0 from the start, so every mass below is the renormalized min-p distribution's.
 *
 * Finding tau: the tokens that can matter (x >= lo) go into NBINS bins by (m - x) * NBINS / (m - lo), in
 * their order (rounded subtraction and multiplication are monotone), with a count and a mass per bin.
 * Walking the bins from the top finds the bin where the k-th token lies, or where the mass passes p; only
 * that bin's tokens are sorted. lo: for top-p alone, m + ln((1 - p) * A / vocab) - 1 with A
 * the row's total weight, since the tokens below it weigh less than (1 - p) * A / e in all, so the nucleus
 * lies above it; with top-k, the highest of m - 2, m - 4, ..., m - 256 with at least k tokens at or above
 * it (else the row's smallest finite logit), which holds the whole top-k set, and so the nucleus within it;
 * in either case at least the floor, as nothing below it is kept.
 * Bins can merge two close logits but never swap them, and ties always share a bin. */

#define NBINS 2048

typedef struct {
    float x;
    int32_t i;
} cand_t;

static int cand_desc(const void *a, const void *b) {
    const cand_t *p = a, *q = b;
    if (p->x != q->x) return p->x > q->x ? -1 : 1;
    return (p->i > q->i) - (p->i < q->i);
}

/* w[i] = exp(x_i - m) for the whole row, 0 where x_i < floor_x (min-p); returns their sum. */
static double row_weights(const float *x, int64_t vocab, float m, float floor_x, float *w) {
    double total = 0.0;
    const int floored = floor_x > -INFINITY;
    for (int64_t start = 0; start < vocab; start += BLOCK) {
        int64_t end = start + BLOCK < vocab ? start + BLOCK : vocab;
        float s = block_weights(x, start, end, m, w + start);
        if (floored) {
            int64_t i = start;
#if defined(__AVX2__) && defined(__FMA__)
            if (end - start == BLOCK) {
                const __m256 vf = _mm256_set1_ps(floor_x);
                const __m256 a = _mm256_and_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vf, _CMP_GE_OQ),
                                               _mm256_loadu_ps(w + i));
                const __m256 c = _mm256_and_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i + 8), vf, _CMP_GE_OQ),
                                               _mm256_loadu_ps(w + i + 8));
                _mm256_storeu_ps(w + i, a);
                _mm256_storeu_ps(w + i + 8, c);
                s = hsum256(_mm256_add_ps(a, c));
                i = end;
            }
#endif
            if (i < end) {
                s = 0.0f;
                for (; i < end; i++) s += (w[i] = x[i] >= floor_x ? w[i] : 0.0f);
            }
        }
        total += s;
    }
    return total;
}

static int64_t count_at_least(const float *x, int64_t vocab, float lo) {
    int64_t n = 0, i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vlo = _mm256_set1_ps(lo);
    for (; i + 8 <= vocab; i += 8)
        n += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vlo, _CMP_GE_OQ)));
#endif
    for (; i < vocab; i++) n += x[i] >= lo;
    return n;
}

static float row_min_finite(const float *x, int64_t vocab) {
    float lo = INFINITY;
    for (int64_t i = 0; i < vocab; i++)
        if (x[i] > -INFINITY && x[i] < lo) lo = x[i];
    return lo;
}

static inline int bin_of(float x, float m, float scale) {
    const float t = (m - x) * scale; /* >= 0; nan or huge only for logits near -FLT_MAX: the last bin */
    return t < (float)(NBINS - 1) ? (int)t : NBINS - 1;
}

/* Tokens of bin ``b`` with x >= floor_x, from the ``n_live`` indices in ``live``, sorted by logit (highest
 * first, then by index) into ``cand``; returns how many. */
static int64_t bin_sorted(const float *x, const int32_t *live, const int16_t *bin, int64_t n_live, int b,
                          float floor_x, cand_t *cand) {
    int64_t n = 0;
    for (int64_t j = 0; j < n_live; j++) {
        const float v = x[live[j]];
        if (bin[j] == b && v >= floor_x) cand[n++] = (cand_t){v, live[j]};
    }
    qsort(cand, (size_t)n, sizeof(cand_t), cand_desc);
    return n;
}

typedef struct {
    float *w;       /* [vocab] */
    int32_t *live;  /* [vocab]: the tokens with x >= lo */
    int16_t *bin;   /* [vocab]: the bin of live[j] */
    cand_t *cand;   /* [vocab] */
    int32_t count[NBINS];
    double mass[NBINS];
} work_t;

/* The threshold tau of one row (above): at least ``floor_x``; ``total`` is the sum of the row's weights in ws->w,
 * those below the floor 0. */
static float row_threshold(const float *x, int64_t vocab, float m, int64_t k, float p, float floor_x, double total,
                           work_t *ws) {
    const int use_k = k > 0 && k < vocab, use_p = p < 1.0f;
    if (!use_k && !use_p) return floor_x;
    float lo;
    if (use_k) {
        float r = 2.0f;
        while (count_at_least(x, vocab, m - r) < k && r <= 256.0f) r *= 2.0f;
        lo = r <= 256.0f ? m - r : row_min_finite(x, vocab);
    } else {
        lo = m + logf((1.0f - p) * (float)total / (float)vocab) - 1.0f;
    }
    if (floor_x > lo) lo = floor_x;
    const float range = m - lo;
    const float scale = range > 0.0f ? (float)NBINS / range : 0.0f; /* 0: every live token ties with the max */
    memset(ws->count, 0, sizeof ws->count);
    memset(ws->mass, 0, sizeof ws->mass);
    int64_t n_live = 0, i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vlo = _mm256_set1_ps(lo);
    for (; i + 8 <= vocab; i += 8) {
        for (int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vlo, _CMP_GE_OQ)); bits;
             bits &= bits - 1)
            ws->live[n_live++] = (int32_t)(i + __builtin_ctz(bits));
    }
#endif
    for (; i < vocab; i++)
        if (x[i] >= lo) ws->live[n_live++] = (int32_t)i;
    for (int64_t j = 0; j < n_live; j++) {
        const int b = bin_of(x[ws->live[j]], m, scale);
        ws->bin[j] = (int16_t)b;
        ws->count[b]++;
        ws->mass[b] += ws->w[ws->live[j]];
    }
    float tau = -INFINITY;
    int bk = NBINS; /* bins above bk lie wholly in the top-k set, bin bk in part */
    double kept = total;
    if (use_k) {
        int64_t above = 0;
        double mass_above = 0.0;
        int b = 0;
        for (; b < NBINS && above + ws->count[b] < k; b++) {
            above += ws->count[b];
            mass_above += ws->mass[b];
        }
        if (b < NBINS) { /* else fewer than k finite logits: vLLM keeps them all */
            const int64_t n = bin_sorted(x, ws->live, ws->bin, n_live, b, -INFINITY, ws->cand);
            tau = ws->cand[k - above - 1].x;
            kept = mass_above;
            for (int64_t j = 0; j < n && ws->cand[j].x >= tau; j++) kept += ws->w[ws->cand[j].i];
            bk = b;
        }
    }
    if (use_p) {
        const double target = (double)p * kept;
        int last = NBINS - 1;
        while (last > 0 && ws->count[last] == 0) last--;
        double before = 0.0;
        int b = 0;
        for (;; b++) {
            if (b == bk || b == last) break;
            if (ws->count[b] == 0) continue;
            if (before + ws->mass[b] >= target) break;
            before += ws->mass[b];
        }
        const int64_t n = bin_sorted(x, ws->live, ws->bin, n_live, b, tau, ws->cand);
        double run = before;
        for (int64_t j = 0; j < n && run < target;) { /* a group of equal logits at a time */
            const float v = ws->cand[j].x;
            while (j < n && ws->cand[j].x == v) run += ws->w[ws->cand[j++].i];
            tau = v;
        }
    }
    return tau > floor_x ? tau : floor_x;
}

/* One draw from the weights of the tokens with x >= tau, by inverse CDF as entropic_sample_rows does. */
static int64_t draw_above(const float *x, const float *w, int64_t vocab, float tau, uint64_t seed, float *block_sums) {
    const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t start = b * BLOCK, end = start + BLOCK < vocab ? start + BLOCK : vocab;
        float s = 0.0f;
        int64_t i = start;
#if defined(__AVX2__) && defined(__FMA__)
        if (end - start == BLOCK) {
            const __m256 vt = _mm256_set1_ps(tau);
            __m256 a = _mm256_and_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vt, _CMP_GE_OQ), _mm256_loadu_ps(w + i));
            __m256 c = _mm256_and_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i + 8), vt, _CMP_GE_OQ),
                                     _mm256_loadu_ps(w + i + 8));
            s = hsum256(_mm256_add_ps(a, c));
            i = end;
        }
#endif
        for (; i < end; i++) s += x[i] >= tau ? w[i] : 0.0f;
        block_sums[b] = s;
        total += s;
    }
    const double target = uniform(seed) * total;
    double run;
    const int64_t b = walk_blocks(block_sums, blocks, target, &run);
    const int64_t start = b * BLOCK, end = start + BLOCK < vocab ? start + BLOCK : vocab;
    int64_t pick = -1;
    for (int64_t i = start; i < end; i++) {
        if (x[i] >= tau && w[i] > 0.0f) {
            pick = i;
            run += w[i];
            if (run > target) break;
        }
    }
    return pick;
}

/* As entropic_sample_rows, after min-p, top-k and top-p (above): min_p [rows] (<= 0: off), top_k [rows] (k <= 0
 * or k >= vocab: off) and top_p [rows] (p >= 1: off), each NULL when no row uses it. Writes each row's threshold
 * into ``thresholds`` (-inf where the row keeps everything). Returns 0; -1 as entropic_sample_rows (also for a
 * min_p above 1 or nan); -2 when out of memory. */
int entropic_sample_rows_filtered(const float *logits, int64_t rows, int64_t vocab, int64_t stride,
                                  const uint64_t *seeds, const float *min_p, const int64_t *top_k,
                                  const float *top_p, float *block_sums, float *thresholds, int64_t *out) {
    work_t *ws = malloc(sizeof(work_t));
    float *w = malloc((size_t)vocab * sizeof(float));
    int32_t *live = malloc((size_t)vocab * sizeof(int32_t));
    int16_t *bin = malloc((size_t)vocab * sizeof(int16_t));
    cand_t *cand = malloc((size_t)vocab * sizeof(cand_t));
    int status = 0;
    if (!ws || !w || !live || !bin || !cand) {
        status = -2;
        goto done;
    }
    ws->w = w;
    ws->live = live;
    ws->bin = bin;
    ws->cand = cand;
    for (int64_t r = 0; r < rows && status == 0; r++) {
        const float *x = logits + r * stride;
        const int64_t k = top_k ? top_k[r] : vocab;
        const float p = top_p ? top_p[r] : 1.0f;
        const float mp = min_p ? min_p[r] : 0.0f;
        thresholds[r] = -INFINITY;
        if ((k <= 0 || k >= vocab) && !(p < 1.0f) && !(mp > 0.0f)) {
            status = entropic_sample_rows(x, 1, vocab, stride, seeds + r, block_sums, out + r);
            continue;
        }
        const float m = row_max(x, vocab);
        if (!(m > -INFINITY) || m == INFINITY || !(p > 0.0f) || !(mp <= 1.0f)) {
            status = -1;
            break;
        }
        const float floor_x = mp > 0.0f ? m + logf(mp) : -INFINITY;
        const double total = row_weights(x, vocab, m, floor_x, w);
        if (!(total > 0.0) || !isfinite(total)) {
            status = -1;
            break;
        }
        const float tau = row_threshold(x, vocab, m, k, p, floor_x, total, ws);
        const int64_t pick = draw_above(x, w, vocab, tau, seeds[r], block_sums);
        if (pick < 0) {
            status = -1;
            break;
        }
        thresholds[r] = tau;
        out[r] = pick;
    }
done:
    free(ws);
    free(w);
    free(live);
    free(bin);
    free(cand);
    return status;
}
