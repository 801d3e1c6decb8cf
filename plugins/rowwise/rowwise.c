/* Row-wise layer ops for the CPU runtime: RMSNorm, rotary embeddings and the MLP's silu(gate) * up, one call each
 * instead of the small torch ops that compute them (native.py says why).
 *
 * Arithmetic: what the torch expressions in runtime/model.py (RMSNorm) and runtime/rope.py (apply_rope) compute, op
 * by op, each result rounded to the tensor dtype as torch rounds it (bfloat16: round to nearest even from float32).
 * Build with -ffp-contract=off: a fused multiply-add would round once where torch rounds twice.
 * - rope is bit-identical to apply_rope: every op is an exactly rounded product or sum of two values.
 * - rms_norm differs from the torch expression in one place only: the mean of squares is summed in double, in row
 *   order (torch sums float32 in a vectorised order), so its float32 result may differ from torch's in the last bit.
 *   Every row's result depends on that row alone, whatever the other rows are.
 * - silu_mul takes exp from a polynomial where torch takes its own vectorised exp, so a silu may differ from torch's
 *   in the last float32 bits (and, rarely, its bf16 rounding): the runtime's CPU routes all call this one function.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../bf16.h"

static inline float bf16_rounded(float f) {
    uint32_t u = (uint32_t)f32_to_bf16(f) << 16;
    float r;
    memcpy(&r, &u, sizeof r);
    return r;
}

/* out[r] = weight * to_dtype(x[r] * rsqrt(mean(x[r]^2) + eps)), the squares and the scaling in float32.
 * x: rows of `hidden` elements, row r at x + r * x_row_stride (elements); out and weight contiguous. */
void spectree_rms_norm(const void *x, int64_t rows, int64_t hidden, int64_t x_row_stride, const void *weight,
                       float eps, void *out, int bf16) {
#pragma omp parallel for schedule(static) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * x_row_stride;
        double sum = 0.0;
        for (int64_t i = 0; i < hidden; i++) {
            float v = elem_load(x, base + i, bf16);
            float sq = v * v;
            sum += (double)sq;
        }
        float variance = (float)(sum / (double)hidden);
        float scale = 1.0f / sqrtf(variance + eps);
        for (int64_t i = 0; i < hidden; i++) {
            float y = elem_load(x, base + i, bf16) * scale;
            if (bf16) y = bf16_rounded(y);
            elem_store(out, r * hidden + i, elem_load(weight, i, bf16) * y, bf16);
        }
    }
}

/* x * cos + rotate_half(x) * sin over the first `heads` heads of each token (rotate-half layout: element i pairs
 * with i + dim/2), each product and the sum rounded to the dtype.
 * x: [batch, tokens, >= heads, dim] by strides (elements; the last dimension contiguous);
 * cos, sin: [batch, tokens, dim] by strides; out: [batch, tokens, heads, dim] by strides (the last contiguous). */
void spectree_rope(const void *x, int64_t batch, int64_t tokens, int64_t heads, int64_t dim, int64_t xs_b,
                   int64_t xs_n, int64_t xs_h, const void *cos, const void *sin, int64_t cs_b, int64_t cs_n,
                   void *out, int64_t os_b, int64_t os_n, int64_t os_h, int bf16) {
    int64_t half = dim / 2;
    int64_t count = batch * tokens;
#pragma omp parallel for schedule(static) if (count * heads >= 2048)
    for (int64_t bn = 0; bn < count; bn++) {
        int64_t b = bn / tokens, n = bn % tokens;
        int64_t cbase = b * cs_b + n * cs_n;
        for (int64_t h = 0; h < heads; h++) {
            int64_t xbase = b * xs_b + n * xs_n + h * xs_h;
            int64_t obase = b * os_b + n * os_n + h * os_h;
            for (int64_t i = 0; i < dim; i++) {
                float v = elem_load(x, xbase + i, bf16);
                float rot = i < half ? -elem_load(x, xbase + i + half, bf16) : elem_load(x, xbase + i - half, bf16);
                float a = v * elem_load(cos, cbase + i, bf16);
                float c = rot * elem_load(sin, cbase + i, bf16);
                if (bf16) {
                    a = bf16_rounded(a);
                    c = bf16_rounded(c);
                }
                elem_store(out, obase + i, a + c, bf16);
            }
        }
    }
}

/* 8 float32 lanes (GCC vector extensions: one AVX2 register, two SSE ones) for silu_mul. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline v8 v8_pick(v8i mask, v8 a, v8 b) { return (v8)((mask & (v8i)a) | (~mask & (v8i)b)); }

/* exp(x) lane-wise, Cephes' single-precision polynomial (~1 ulp), x clamped to [-87, 88] (exp(88) is finite in
 * float32); every element takes this one routine (the tail too, padded), so its value does not depend on where it
 * sits. NaN lanes give NaN. */
static inline v8 v8_exp(v8 x) {
    const v8 lo = {-87, -87, -87, -87, -87, -87, -87, -87}, hi = {88, 88, 88, 88, 88, 88, 88, 88};
    v8 c = v8_pick(x < lo, lo, v8_pick(x > hi, hi, x));
    v8 t = c * 1.44269504088896341f + 0.5f;
    v8i n = __builtin_convertvector(t, v8i);
    n = n + (__builtin_convertvector(n, v8) > t); /* truncation toward zero -> floor */
    v8 fn = __builtin_convertvector(n, v8);
    v8 r = c - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    v8 out = p * (v8)((n + 127) << 23);
    return v8_pick(x != x, x, out);
}

/* silu(g) * u for 8 lanes, each rounded as the dtype rounds it (bf16: to nearest even; NaN as torch's 0x7FC0). */
static inline v8 v8_silu_mul(v8 g, v8 u, int bf16) {
    v8 s = g / (1.0f + v8_exp(-g));
    if (bf16) {
        v8u b = (v8u)s;
        b = ((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16) << 16;
        s = v8_pick(s != s, s, (v8)b);
    }
    return s * u;
}

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i]: the MLP's gate (the first `inter` columns of the fused gate/up
 * output) and up (the next `inter`), silu in float32 as x / (1 + exp(-x)), the silu and the product each rounded to
 * the dtype (as torch's F.silu(gate) * up rounds); exp by `v8_exp`. gu: rows of 2 * inter elements, row r at
 * gu + r * gu_row_stride; out: [rows, inter] contiguous. */
void spectree_silu_mul(const void *gu, int64_t rows, int64_t inter, int64_t gu_row_stride, void *out, int bf16) {
#pragma omp parallel for schedule(static) if (rows * inter >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * gu_row_stride;
        for (int64_t i0 = 0; i0 < inter; i0 += 8) {
            const int lanes = inter - i0 < 8 ? (int)(inter - i0) : 8;
            v8 g = {0}, u = {0};
            for (int l = 0; l < lanes; l++) {
                g[l] = elem_load(gu, base + i0 + l, bf16);
                u[l] = elem_load(gu, base + inter + i0 + l, bf16);
            }
            const v8 y = v8_silu_mul(g, u, bf16);
            for (int l = 0; l < lanes; l++) elem_store(out, r * inter + i0 + l, y[l], bf16);
        }
    }
}
