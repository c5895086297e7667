/* vLLM's repetition, frequency and presence penalties on CPU logits rows, in place (see kernels/cpu_penalties.py).
 *
 * vLLM's CPU path (vllm/model_executor/layers/utils.py apply_penalties, pinned by tests/test_vllm_pins.py)
 * builds two [rows, vocab + 1] int64 count tensors by scatter and then passes over every logit four times,
 * although only the tokens of each row's prompt and output can change. This touches those alone, with the
 * same float operations in the same order, so every logit comes out with the bits vLLM's would have:
 *   x = x * (x > 0 ? 1 / repetition : repetition)    for a token in the prompt or the output
 *   x = x - frequency * count                         count: the token's occurrences in the output
 *   x = x - presence * (count > 0)
 * (a token in neither is left as it is, where vLLM multiplies it by 1 and subtracts 0s; a row whose three
 * penalties are 1, 0 and 0 likewise). Token ids outside [0, vocab) are skipped: vLLM pads the prompt rows
 * with vocab and fills not-yet-known output ids with -1, neither of which is a token.
 *
 * Built with -std=c11, so GCC does not contract a product and a difference into one FMA, which would round
 * once where vLLM's separate tensor operations round twice.
 */
#include <stdint.h>
#include <stdlib.h>

/* Returns 0, or -2 when out of memory (nothing changed then). */
int entropic_apply_penalties(float *logits, int64_t rows, int64_t vocab, int64_t stride, const int64_t *prompt,
                             int64_t prompt_cols, const int64_t *output, const int64_t *output_offsets,
                             const float *presence, const float *frequency, const float *repetition) {
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = output_offsets[r + 1] - output_offsets[r];
        longest = n > longest ? n : longest;
    }
    /* stamp[t] == r + 1: token t was met in row r, and count[t] / in_prompt[t] are that row's */
    int64_t *stamp = calloc((size_t)vocab, sizeof(int64_t));
    int32_t *count = malloc((size_t)vocab * sizeof(int32_t));
    int32_t *touched = malloc((size_t)(prompt_cols + longest + 1) * sizeof(int32_t));
    if (!stamp || !count || !touched) {
        free(stamp);
        free(count);
        free(touched);
        return -2;
    }
    for (int64_t r = 0; r < rows; r++) {
        const float rep = repetition[r], freq = frequency[r], pres = presence[r];
        if (rep == 1.0f && freq == 0.0f && pres == 0.0f) continue;
        const int64_t tag = r + 1;
        int64_t n = 0;
        for (int64_t j = 0; j < prompt_cols; j++) {
            const int64_t t = prompt[r * prompt_cols + j];
            if (t < 0 || t >= vocab || stamp[t] == tag) continue;
            stamp[t] = tag;
            count[t] = 0;
            touched[n++] = (int32_t)t;
        }
        for (int64_t j = output_offsets[r]; j < output_offsets[r + 1]; j++) {
            const int64_t t = output[j];
            if (t < 0 || t >= vocab) continue;
            if (stamp[t] != tag) {
                stamp[t] = tag;
                count[t] = 0;
                touched[n++] = (int32_t)t;
            }
            count[t]++;
        }
        const float inverse = 1.0f / rep;
        float *x = logits + r * stride;
        for (int64_t j = 0; j < n; j++) {
            const int32_t t = touched[j];
            float v = x[t];
            v = v * (v > 0.0f ? inverse : rep);
            const float by_count = freq * (float)count[t];
            v = v - by_count;
            const float by_presence = pres * (count[t] > 0 ? 1.0f : 0.0f);
            v = v - by_presence;
            x[t] = v;
        }
    }
    free(stamp);
    free(count);
    free(touched);
    return 0;
}
