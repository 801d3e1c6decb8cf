/* A weight-streaming matmul for the CPU runtime's linear layers (plugins/matmul/native.py says why):
 *
 *   y[r, o] = bias[o] + sum_i x[r, i] * w[o, i]      x [rows, in] float32, w [out, in] float32 or bfloat16, y float32
 *
 * Each weight row is read from memory once per call whatever `rows` is (it stays in L1 while every block of rows
 * multiplies into it), so a call over a few rows costs about what one row costs until the cores' multiply-adds are
 * the limit. Output rows are split between threads, never a reduction.
 *
 * Row-invariant by construction: y[r, o] is the same sequence of operations on the same values whether x has 1 row
 * or 64, whichever block r falls in and however many threads run:
 *   two accumulators of LANES lanes, acc[c % 2] += x[r, chunk c] * w[o, chunk c] for the chunks c of LANES inputs in
 *   order (the last chunk zero-padded), then acc[0] + acc[1], then a fixed pairwise sum of the lanes, then + bias.
 * So a tree step's rows equal, bit for bit, the one-token steps that later decode the same tokens (the reason a
 * float32 or bfloat16 model's greedy speculative output is plain decoding's). LANES is 16 where the compiler targets
 * AVX-512 and 8 elsewhere: the sums differ between those builds, never between calls of one build. Multiply-adds may
 * be fused; GCC contracts them per statement, the same in every use. No -ffast-math. */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#define ROW_BLOCK 8 /* rows multiplied into a weight chunk at once: 2 accumulators each, within 32 registers */
#else
#define LANES 8
#define ROW_BLOCK 4 /* within AVX2's 16 registers */
#endif

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef float vf_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float))));
typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint16_t vh_unaligned __attribute__((vector_size(LANES * sizeof(uint16_t)), aligned(sizeof(uint16_t))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

/* Inputs [c * LANES, c * LANES + LANES) of a row of `in` values, zero past its end, as float32. */
static inline __attribute__((always_inline)) vf load_x(const float *row, int64_t c, int64_t in) {
    const int64_t left = in - c * LANES;
    if (left >= LANES) return *(const vf_unaligned *)(row + c * LANES);
    vf v = {0};
    memcpy(&v, row + c * LANES, (size_t)left * sizeof(float));
    return v;
}

static inline __attribute__((always_inline)) vf load_w(const void *w, int64_t offset, int64_t c, int64_t in,
                                                       int bf16) {
    const int64_t left = in - c * LANES;
    if (bf16) {
        const uint16_t *row = (const uint16_t *)w + offset + c * LANES;
        vh h = {0};
        if (left >= LANES)
            h = *(const vh_unaligned *)row;
        else
            memcpy(&h, row, (size_t)left * sizeof(uint16_t));
        return (vf)(__builtin_convertvector(h, vi) << 16); /* bf16 -> float32 exactly */
    }
    return load_x((const float *)w + offset, c, in);
}

static inline float lane_sum(vf v) {
    float a[LANES];
    memcpy(a, &v, sizeof a);
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) a[i] = a[i] + a[i + width];
    return a[0];
}

/* y[r, o] for the `m` rows (m <= ROW_BLOCK, a constant where inlined) of x starting at xb, one weight row. */
static inline __attribute__((always_inline)) void block(const float *xb, int64_t x_stride, int64_t m, const void *w,
                                                        int64_t offset, int64_t in, int bf16, float bias, float *yb,
                                                        int64_t y_stride) {
    vf acc[ROW_BLOCK][2];
    for (int64_t r = 0; r < m; r++) acc[r][0] = acc[r][1] = (vf){0};
    const int64_t chunks = (in + LANES - 1) / LANES;
    for (int64_t c = 0; c < chunks; c++) {
        const vf wc = load_w(w, offset, c, in, bf16);
        for (int64_t r = 0; r < m; r++) acc[r][c & 1] = load_x(xb + r * x_stride, c, in) * wc + acc[r][c & 1];
    }
    for (int64_t r = 0; r < m; r++) yb[r * y_stride] = lane_sum(acc[r][0] + acc[r][1]) + bias;
}

#define BLOCK(M) block(x + r0 * x_stride, x_stride, M, w, o * in, in, bf16, b, y + r0 * y_stride + o, y_stride)

static inline __attribute__((always_inline)) void run(const float *x, int64_t rows, int64_t in, int64_t x_stride, const void *w, int bf16, int64_t out,
                const float *bias, float *y, int64_t y_stride) {
#pragma omp parallel for schedule(static) if (out * in >= 65536)
    for (int64_t o = 0; o < out; o++) {
        const float b = bias ? bias[o] : 0.0f;
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
            switch (rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK) {
            case 1: BLOCK(1); break;
            case 2: BLOCK(2); break;
            case 3: BLOCK(3); break;
#if ROW_BLOCK > 4
            case 4: BLOCK(4); break;
            case 5: BLOCK(5); break;
            case 6: BLOCK(6); break;
            case 7: BLOCK(7); break;
#endif
            default: BLOCK(ROW_BLOCK); break;
            }
        }
    }
}

/* y [rows, out] (row stride y_stride) = x [rows, in] (row stride x_stride) times w [out, in] (contiguous; bfloat16 as
 * uint16 where w_bf16) transposed, plus bias [out] (float32, or NULL). */
void spectree_linear(const float *x, int64_t rows, int64_t in, int64_t x_stride, const void *w, int w_bf16,
                     int64_t out, const float *bias, float *y, int64_t y_stride) {
    if (w_bf16)
        run(x, rows, in, x_stride, w, 1, out, bias, y, y_stride);
    else
        run(x, rows, in, x_stride, w, 0, out, bias, y, y_stride);
}

/* The vector width this build sums in (LANES). */
int spectree_linear_lanes(void) { return LANES; }
