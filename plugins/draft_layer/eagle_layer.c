/* One EAGLE draft layer forward on int8 weights, in one call (plugins/draft_layer/native.py says why).

   EAGLE-1 (fc given; its layer 0 has no input norm):
     x0 = fc([embeds | features]);  a = x0;  residual = x0
   EAGLE-3 (no fc: the "midlayer", attention over 2H):
     a = [input_norm(embeds) | hidden_norm(features)];  residual = features (or hidden_norm(features))
   then, both:
     x1 = residual + o(attention(rope(q(a)), cache + rope(k(a)), cache + v(a)))
     out = x1 + down(silu(gate(norm(x1))) * up(norm(x1)))

   Weights are int8 with one float scale per output row (runtime.model.Int8Weight: w ~= scale[o] * q[o, i]).
   Activations stay float32 throughout (the torch route rounds to bf16 between ops); the new keys and values are
   written to the head's KV cache in its dtype and read back from it, as the torch route does. A row attends to
   every cache slot below `base` and to the slots [base, length + n) its row of `vis` marks. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../bf16.h"

#define LANES 16 /* the chunk `in` is a multiple of (with 2x: WIDTH_MULTIPLE in native.py); one or two vectors */


#define ROWS 4  /* rows a weight chunk is multiplied into at once (independent accumulators) */

/* One vector type for the routes below: VL float32 lanes. AVX-512 where the CPU has it, else AVX2 + FMA, else the
   portable loops. Which route runs changes draft bits only within rounding, never what verification accepts. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfmadd _mm512_fmadd_ps
#define vadd _mm512_add_ps
#define vset1 _mm512_set1_ps
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
static inline vec load_i8(const int8_t *p) {  /* VL int8 weights as float32 */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vec load_cache(const void *base, int is_bf16, int64_t idx) {  /* VL cache values as float32 */
    if (is_bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + idx);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfmadd _mm256_fmadd_ps
#define vadd _mm256_add_ps
#define vset1 _mm256_set1_ps
static inline float vsum(vec a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vec load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vec load_cache(const void *base, int is_bf16, int64_t idx) {
    if (is_bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + idx));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + idx);
}
#endif

#ifdef VL
/* sum_i x[i] * w[i] for one row, `in` a multiple of LANES; four accumulators */
static inline float dot_row(const float *x, const int8_t *w, int64_t in) {
    vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    int64_t i = 0;
    for (; i + 4 * VL <= in; i += 4 * VL) {
        a0 = vfmadd(vload(x + i), load_i8(w + i), a0);
        a1 = vfmadd(vload(x + i + VL), load_i8(w + i + VL), a1);
        a2 = vfmadd(vload(x + i + 2 * VL), load_i8(w + i + 2 * VL), a2);
        a3 = vfmadd(vload(x + i + 3 * VL), load_i8(w + i + 3 * VL), a3);
    }
    for (; i < in; i += VL) a0 = vfmadd(vload(x + i), load_i8(w + i), a0);
    return vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
}

/* out[r] = sum_i x[r * in + i] * w[i] for R rows at once (two accumulators a row), `in` a multiple of 2 * LANES */
#define DOT_ROWS(R)                                                                                          \
    static inline void dot_rows_##R(const float *x, const int8_t *w, int64_t in, float *out) {               \
        vec a[R][2];                                                                                         \
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = vzero();                                             \
        for (int64_t i = 0; i < in; i += 2 * VL) {                                                           \
            vec w0 = load_i8(w + i), w1 = load_i8(w + i + VL);                                               \
            for (int r = 0; r < R; r++) {                                                                    \
                a[r][0] = vfmadd(vload(x + r * in + i), w0, a[r][0]);                                        \
                a[r][1] = vfmadd(vload(x + r * in + i + VL), w1, a[r][1]);                                   \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++) out[r] = vsum(vadd(a[r][0], a[r][1]));                                   \
    }
DOT_ROWS(2)
DOT_ROWS(3)
DOT_ROWS(4)
#else
static inline float dot_row(const float *x, const int8_t *w, int64_t in) {
    float acc[LANES] = {0};
    for (int64_t i = 0; i < in; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[i + l] * (float)w[i + l];
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

static inline void dot_rows_n(const float *x, const int8_t *w, int64_t in, float *out, int rows) {
    for (int r = 0; r < rows; r++) out[r] = dot_row(x + r * in, w, in);
}
#define dot_rows_2(x, w, in, out) dot_rows_n(x, w, in, out, 2)
#define dot_rows_3(x, w, in, out) dot_rows_n(x, w, in, out, 3)
#define dot_rows_4(x, w, in, out) dot_rows_n(x, w, in, out, 4)
#endif

/* y[r, o] = scale[o] * sum_i x[r, i] * w[o, i] (+ bias[o]); x [rows, in], w [out, in] int8, y [rows, out]; `in` a
   multiple of 2 * LANES. Each weight row is read once per ROWS rows of x, while it sits in L1. */
static void qmatmul(const float *x, int64_t rows, int64_t in, const int8_t *w, const float *scale,
                    const float *bias, int64_t out, float *y) {
    #pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const int8_t *wr = w + o * in;
        float b = bias ? bias[o] : 0.f;
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
            int64_t m = rows - r0 < ROWS ? rows - r0 : ROWS;
            const float *xb = x + r0 * in;
            float s[ROWS];
            switch (m) {
            case 1: s[0] = dot_row(xb, wr, in); break;
            case 2: dot_rows_2(xb, wr, in, s); break;
            case 3: dot_rows_3(xb, wr, in, s); break;
            default: dot_rows_4(xb, wr, in, s); break;
            }
            for (int64_t r = 0; r < m; r++) y[(r0 + r) * out + o] = s[r] * scale[o] + b;
        }
    }
}

/* The angles of one position: cs[i] = cos(pos * inv_freq[i]), cs[half + i] = sin(...), i < half = d / 2. */
static void rope_angles(float *cs, int64_t half, int64_t pos, const float *inv_freq) {
    for (int64_t i = 0; i < half; i++) {
        float angle = (float)pos * inv_freq[i];
        cs[i] = cosf(angle);
        cs[half + i] = sinf(angle);
    }
}

/* y [n, hidden] = RMSNorm of each row of x (row stride x_stride) with weight w, into y's rows (stride y_stride). */
static void rms_rows(const float *x, int64_t x_stride, int64_t n, int64_t hidden, const float *w, float eps, float *y,
                     int64_t y_stride) {
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * x_stride;
        float ss = 0.f;
        for (int64_t i = 0; i < hidden; i++) ss += xr[i] * xr[i];
        float inv = 1.f / sqrtf(ss / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++) y[r * y_stride + i] = xr[i] * inv * w[i];
    }
}

/* Rotate-half RoPE of one head vector x [d] in place, by its position's angles cs [d] (rope_angles). */
static void rope(float *x, int64_t d, const float *cs) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        float c = cs[i], s = cs[half + i];
        float a = x[i], b = x[i + half];
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

int spectree_eagle_layer(
    const float *x_in, int64_t n, int64_t hidden,            /* [n, 2 * hidden]: embeddings | features */
    const int64_t *positions, const float *inv_freq,          /* [n], [head_dim / 2] */
    const int8_t *fc_w, const float *fc_s, const float *fc_b, /* EAGLE-1: [hidden, 2 hidden]; fc_b may be NULL;
                                                                 NULL: EAGLE-3 (in_norm_w, hid_norm_w) */
    const float *in_norm_w, const float *hid_norm_w,          /* EAGLE-3: the embeddings' and features' RMSNorms */
    int norm_before_residual,                                 /* EAGLE-3: the residual is the features' norm */
    const int8_t *qkv_w, const float *qkv_s, const float *qkv_b, /* [(hq + 2 hkv) d, hidden or 2 hidden]; bias may
                                                                    be NULL */
    const int8_t *o_w, const float *o_s,                      /* [hidden, hq d] */
    const float *norm_w, float eps,                           /* post-attention RMSNorm [hidden]; every norm's eps */
    const int8_t *gu_w, const float *gu_s, int64_t inter,     /* [2 inter, hidden]: gate | up */
    const int8_t *down_w, const float *down_s,                /* [hidden, inter] */
    int64_t hq, int64_t hkv, int64_t d, float scale,
    void *k_cache, void *v_cache, int64_t stride_h, int64_t stride_s, int is_bf16, /* layer's [Hkv, slots, D] */
    int64_t length, int64_t base, const uint8_t *vis, int64_t vis_stride, /* vis [n, length + n - base] */
    float *out)                                               /* [n, hidden] */
{
    int64_t qkv_out = (hq + 2 * hkv) * d, keys = length + n, group = hq / hkv;
    const int64_t a_width = fc_w ? hidden : 2 * hidden; /* the attention's input width */
    float *a = malloc(sizeof(float) * n * a_width);
    float *res = malloc(sizeof(float) * n * hidden);
    float *qkv = malloc(sizeof(float) * n * qkv_out);
    float *att = malloc(sizeof(float) * n * hq * d);
    float *x1 = malloc(sizeof(float) * n * hidden);
    float *h = malloc(sizeof(float) * n * hidden);
    float *gu = malloc(sizeof(float) * n * 2 * inter);
    float *act = malloc(sizeof(float) * n * inter);
    float *scores = malloc(sizeof(float) * n * hq * keys);
    float *cs = malloc(sizeof(float) * d);
    if (!a || !res || !qkv || !att || !x1 || !h || !gu || !act || !scores || !cs) {
        free(a); free(res); free(qkv); free(att); free(x1); free(h); free(gu); free(act); free(scores); free(cs);
        return 1;
    }
    if (fc_w) {
        qmatmul(x_in, n, 2 * hidden, fc_w, fc_s, fc_b, hidden, a);
        memcpy(res, a, sizeof(float) * n * hidden);
    } else {
        rms_rows(x_in, 2 * hidden, n, hidden, in_norm_w, eps, a, 2 * hidden);
        rms_rows(x_in + hidden, 2 * hidden, n, hidden, hid_norm_w, eps, a + hidden, 2 * hidden);
        for (int64_t r = 0; r < n; r++) {
            const float *from = norm_before_residual ? a + r * 2 * hidden + hidden : x_in + r * 2 * hidden + hidden;
            memcpy(res + r * hidden, from, sizeof(float) * hidden);
        }
    }
    qmatmul(a, n, a_width, qkv_w, qkv_s, qkv_b, qkv_out, qkv);
    for (int64_t r = 0; r < n; r++) {  /* RoPE on q and k heads; k and v into the cache at slot length + r */
        float *row = qkv + r * qkv_out;
        rope_angles(cs, d / 2, positions[r], inv_freq);  /* once per row, for all its q and k heads */
        for (int64_t hh = 0; hh < hq + hkv; hh++) rope(row + hh * d, d, cs);
        for (int64_t g = 0; g < hkv; g++)
            for (int64_t i = 0; i < d; i++) {
                int64_t at = g * stride_h + (length + r) * stride_s + i;
                elem_store(k_cache, at, row[(hq + g) * d + i], is_bf16);
                elem_store(v_cache, at, row[(hq + hkv + g) * d + i], is_bf16);
            }
    }
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < n * hq; p++) {
        int64_t r = p / hq, hh = p % hq, g = hh / group;
        const float *q = qkv + r * qkv_out + hh * d;
        float *s = scores + p * keys, *o = att + r * hq * d + hh * d;
        const uint8_t *vrow = vis + r * vis_stride;
        float mx = -INFINITY;
        for (int64_t j = 0; j < keys; j++) {
            if (j >= base && !vrow[j - base]) { s[j] = -INFINITY; continue; }
            int64_t at = g * stride_h + j * stride_s;
            float acc = 0.f;
#ifdef VL
            if (d % VL == 0) {
                vec a = vzero();
                for (int64_t i = 0; i < d; i += VL) a = vfmadd(vload(q + i), load_cache(k_cache, is_bf16, at + i), a);
                acc = vsum(a);
            } else
#endif
            for (int64_t i = 0; i < d; i++) acc += q[i] * elem_load(k_cache, at + i, is_bf16);
            s[j] = acc * scale;
            if (s[j] > mx) mx = s[j];
        }
        float sum = 0.f;
        for (int64_t i = 0; i < d; i++) o[i] = 0.f;
        if (mx == -INFINITY) continue;  /* nothing visible: zeros, as the reference */
        for (int64_t j = 0; j < keys; j++) {
            if (s[j] == -INFINITY) continue;
            float w = expf(s[j] - mx);
            sum += w;
            int64_t at = g * stride_h + j * stride_s;
#ifdef VL
            if (d % VL == 0) {
                vec wv = vset1(w);
                for (int64_t i = 0; i < d; i += VL)
                    vstore(o + i, vfmadd(wv, load_cache(v_cache, is_bf16, at + i), vload(o + i)));
                continue;
            }
#endif
            for (int64_t i = 0; i < d; i++) o[i] += w * elem_load(v_cache, at + i, is_bf16);
        }
        for (int64_t i = 0; i < d; i++) o[i] /= sum;
    }
    qmatmul(att, n, hq * d, o_w, o_s, NULL, hidden, x1);
    for (int64_t i = 0; i < n * hidden; i++) x1[i] += res[i];
    rms_rows(x1, hidden, n, hidden, norm_w, eps, h, hidden);
    qmatmul(h, n, hidden, gu_w, gu_s, NULL, 2 * inter, gu);
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < inter; i++) {
            float g = gu[r * 2 * inter + i], u = gu[r * 2 * inter + inter + i];
            act[r * inter + i] = g / (1.f + expf(-g)) * u;
        }
    qmatmul(act, n, inter, down_w, down_s, NULL, hidden, out);
    for (int64_t i = 0; i < n * hidden; i++) out[i] += x1[i];
    free(a); free(res); free(qkv); free(att); free(x1); free(h); free(gu); free(act); free(scores); free(cs);
    return 0;
}

/* y [rows, out] = x [rows, in] times an int8 weight [out, in] (scale per output row, bias optional): the draft
   output layer's logits. `in` a multiple of 2 * LANES. */
void spectree_qmatmul(const float *x, int64_t rows, int64_t in, const int8_t *w, const float *scale,
                      const float *bias, int64_t out, float *y) {
    qmatmul(x, rows, in, w, scale, bias, out, y);
}
