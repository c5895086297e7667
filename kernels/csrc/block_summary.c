/* Key summaries of whole KV blocks for entropic KV pruning on CPU (see kernels/block_select.py).
 *
 * For each listed block b and KV head h: per channel c, the max and min of the key over the block's
 * tokens, written to summaries[h, b] as (max[0..D) | min[0..D)), read straight from vLLM's paged CPU
 * cache in the layout of the kernel vLLM chose:
 *   VEC: a block's keys per head are [D, block_size] (channel-major);
 *   AMX: [block_size / 16, D / 2, 16, 2] (AMX B tiles: 16 tokens, each a 4-byte pair of bf16 channels).
 * The torch path gathers the blocks, converts them to float and reduces (tensor ops that allocate the
 * gathered copy); this reads each key once where it lies. Blocks are spread over the engine's OpenMP threads
 * where the build has OpenMP, as in block_select.c.
 *
 * The summaries are stored in the cache's dtype: the extremes of bf16 keys are bf16 values, so nothing
 * is rounded, and selection, which reads every kept row's summaries in every layer and step, reads
 * half the bytes of float32 ones.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };
enum { LAYOUT_VEC = 0, LAYOUT_AMX = 1 };

#define MAX_D 512
#define AMX_TOKENS 16

static inline float f32_at(const float *p, int64_t i) { return p[i]; }
static inline float bf16_at(const uint16_t *p, int64_t i) {
    uint32_t bits = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* VEC: channel c's tokens are contiguous. They are reduced lane-wise in runs of LANES (an elementwise
 * max the compiler vectorizes, which a single running max is not without -ffast-math), then across
 * the lanes. */
#define LANES 16
#define DEFINE_VEC(NAME, T, AT)                                                               \
    static void NAME(const T *keys, int block_size, int d, float *mx, float *mn) {            \
        const int whole = block_size - block_size % LANES;                                    \
        for (int c = 0; c < d; c++) {                                                         \
            const T *row = keys + (int64_t)c * block_size;                                    \
            float hi[LANES], lo[LANES];                                                       \
            for (int i = 0; i < LANES; i++) { hi[i] = -INFINITY; lo[i] = INFINITY; }          \
            for (int t = 0; t < whole; t += LANES)                                            \
                for (int i = 0; i < LANES; i++) {                                             \
                    float v = AT(row, t + i);                                                 \
                    hi[i] = v > hi[i] ? v : hi[i];                                            \
                    lo[i] = v < lo[i] ? v : lo[i];                                            \
                }                                                                             \
            for (int t = whole; t < block_size; t++) {                                        \
                float v = AT(row, t);                                                         \
                hi[0] = v > hi[0] ? v : hi[0];                                                \
                lo[0] = v < lo[0] ? v : lo[0];                                                \
            }                                                                                 \
            float h = hi[0], l = lo[0];                                                       \
            for (int i = 1; i < LANES; i++) {                                                 \
                h = hi[i] > h ? hi[i] : h;                                                    \
                l = lo[i] < l ? lo[i] : l;                                                    \
            }                                                                                 \
            mx[c] = h;                                                                        \
            mn[c] = l;                                                                        \
        }                                                                                     \
    }

/* AMX: a (token group, channel pair) is 2 * 16 contiguous values, (token, channel of the pair) in
 * order. Reduce those runs elementwise over the token groups first (contiguous, vectorized), then each
 * run's 16 tokens per channel. */
#define DEFINE_AMX(NAME, T, AT)                                                               \
    static void NAME(const T *keys, int block_size, int d, float *mx, float *mn) {            \
        const int run = 2 * AMX_TOKENS, pairs = d / 2, groups = block_size / AMX_TOKENS;      \
        float hi[MAX_D / 2][2 * AMX_TOKENS], lo[MAX_D / 2][2 * AMX_TOKENS];                   \
        for (int j = 0; j < pairs; j++)                                                       \
            for (int i = 0; i < run; i++) { hi[j][i] = -INFINITY; lo[j][i] = INFINITY; }      \
        for (int g = 0; g < groups; g++)                                                      \
            for (int j = 0; j < pairs; j++) {                                                 \
                const T *src = keys + ((int64_t)g * pairs + j) * run;                         \
                for (int i = 0; i < run; i++) {                                               \
                    float v = AT(src, i);                                                     \
                    hi[j][i] = v > hi[j][i] ? v : hi[j][i];                                   \
                    lo[j][i] = v < lo[j][i] ? v : lo[j][i];                                   \
                }                                                                             \
            }                                                                                 \
        for (int j = 0; j < pairs; j++)                                                       \
            for (int p = 0; p < 2; p++) {                                                     \
                float h = -INFINITY, l = INFINITY;                                            \
                for (int t = 0; t < AMX_TOKENS; t++) {                                        \
                    h = hi[j][2 * t + p] > h ? hi[j][2 * t + p] : h;                          \
                    l = lo[j][2 * t + p] < l ? lo[j][2 * t + p] : l;                          \
                }                                                                             \
                mx[2 * j + p] = h;                                                            \
                mn[2 * j + p] = l;                                                            \
            }                                                                                 \
    }

DEFINE_VEC(vec_f32, float, f32_at)
DEFINE_VEC(vec_bf16, uint16_t, bf16_at)
DEFINE_AMX(amx_bf16, uint16_t, bf16_at)

/* A bf16 value held as a float (every value these kernels compare is one) back to its bits: exact. */
static void store_bf16(const float *from, uint16_t *to, int n) {
    for (int i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, from + i, sizeof bits);
        to[i] = (uint16_t)(bits >> 16);
    }
}

/* cache: vLLM's [num_blocks, kv_heads, block_size, 2 * d] tensor (keys first in each block and head);
 * block_stride, head_stride in elements. summaries: [kv_heads, num_blocks, 2 * d] in the cache's dtype.
 * Returns -1 (nothing written) for a dtype, layout or shape this file does not handle. */
int entropic_summarize_blocks(const void *cache, int dtype, int layout, int64_t block_stride, int64_t head_stride,
                              int kv_heads, int block_size, int d, const int64_t *block_ids, int64_t count,
                              void *summaries, int64_t num_blocks, int threads) {
    if (d <= 0 || d > MAX_D || d % 2 || block_size <= 0) return -1;
    if (layout == LAYOUT_AMX && (dtype != DTYPE_BF16 || block_size % AMX_TOKENS)) return -1;
    if (layout != LAYOUT_VEC && layout != LAYOUT_AMX) return -1;
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return -1;
    for (int64_t n = 0; n < count; n++)
        if (block_ids[n] < 0 || block_ids[n] >= num_blocks) return -1;
    (void)threads;
    /* a request's first pruned step summarizes all its blocks at once (hundreds): worth the threads */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && count > 1)
    for (int64_t n = 0; n < count; n++) {
        float both[2 * MAX_D];
        const int64_t b = block_ids[n];
        for (int h = 0; h < kv_heads; h++) {
            const int64_t offset = b * block_stride + h * head_stride, at = ((int64_t)h * num_blocks + b) * 2 * d;
            if (dtype == DTYPE_F32) {
                float *out = (float *)summaries + at;
                vec_f32((const float *)cache + offset, block_size, d, out, out + d);
                continue;
            }
            if (layout == LAYOUT_VEC)
                vec_bf16((const uint16_t *)cache + offset, block_size, d, both, both + d);
            else
                amx_bf16((const uint16_t *)cache + offset, block_size, d, both, both + d);
            store_bf16(both, (uint16_t *)summaries + at, 2 * d);
        }
    }
    return 0;
}
