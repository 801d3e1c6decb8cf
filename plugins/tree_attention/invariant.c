/* Row-invariant tree attention for the CPU, in float32 (see plugins/tree_attention/native.py).
 *
 * A query row's output is a function of its logical key sequence alone: the prefix slots [0, L) in order, then the
 * tree slots its mask row shows, in slot order (a node's ancestors, root first). Plain decoding attends that same
 * sequence as slots [0, L + depth], contiguous. Every reduction below runs in that logical order, in a shape that
 * does not depend on N, on where the tree slots sit, or on the other rows:
 *   score_t = scale * dot(q, k_t)       the dot's association depends on D alone (16-lane partial sums over D:
 *                                       float32 multiply-adds, or bf16 pair dot products where the CPU has
 *                                       AVX512-BF16; then a fixed pairwise lane sum);
 *   m       = max_t score_t              exact, any order;
 *   e_t     = exp(score_t - m)           one elementwise vector routine (`vexp`) for every t: no scalar tail that
 *                                       could round otherwise than the vector body;
 *   z       = sum_t e_t                  lane t mod 16 accumulates t, blocks in order, then the fixed lane sum;
 *   out     = (sum_t e_t v_t) / z        sequential over t, 16 lanes of D at a time.
 * Rows are worked in tiles of (row, head) pairs that share the prefix's loads, never arithmetic: each pair runs the
 * same statements in every tile size. So a tree step's row equals, bit for bit, the one-token step that later
 * decodes the same path (tests/plugins/test_native.py checks it across tile sizes). Fused multiply-adds are fine:
 * GCC contracts a * b + c per statement, the same in every instantiation. No -ffast-math: it would let the compiler
 * reassociate the sums.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_DPBF16 1 /* AVX512-BF16: a bf16 pair dot product per lane in one instruction */
#else
#define HAVE_DPBF16 0
#endif

#define LANES 16
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint16_t vh2 __attribute__((vector_size(2 * LANES * sizeof(uint16_t)))); /* 32 bf16: one dot step */
typedef uint16_t vh2_unaligned __attribute__((vector_size(2 * LANES * sizeof(uint16_t)), aligned(sizeof(uint16_t))));

static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline vf pick(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* The sum of the 16 lanes as one fixed pairwise tree. */
static inline float lane_sum(vf v) {
    float a[LANES];
    memcpy(a, &v, sizeof a);
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) a[i] = a[i] + a[i + w];
    return a[0];
}

/* exp(x) for x <= 0: Cephes' single-precision polynomial (~1 ulp); exactly 0 below -87 (and for -inf). */
static inline vf vexp(vf x) {
    const vf lo = splat(-87.0f);
    vi under = x < lo;
    x = pick(under, lo, x);
    vf t = x * splat(1.44269504088896341f) + splat(0.5f);
    vi n = __builtin_convertvector(t, vi);
    n = n + (__builtin_convertvector(n, vf) > t); /* truncation toward zero -> floor */
    vf fn = __builtin_convertvector(n, vf);
    vf r = x - fn * splat(0.693359375f);
    r = r - fn * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    vf out = p * (vf)((n + 127) << 23);
    return (vf)((vi)out & ~under);
}

typedef float vf_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float))));
typedef uint16_t vh_unaligned __attribute__((vector_size(LANES * sizeof(uint16_t)), aligned(sizeof(uint16_t))));

/* Elements [c * 16, c * 16 + 16) of a row of `d` values (float32, or bfloat16 as uint16), zero past its end, as
 * float32. Inlined with constant d and bf16, it is one load (and a widening shift). */
static inline __attribute__((always_inline)) vf load(const void *base, int64_t offset, int64_t c, int64_t d,
                                                     int bf16) {
    const int64_t left = d - c * LANES;
    if (bf16) {
        const uint16_t *row = (const uint16_t *)base + offset + c * LANES;
        vh x = {0};
        if (left >= LANES)
            x = *(const vh_unaligned *)row;
        else
            memcpy(&x, row, (size_t)left * sizeof(uint16_t));
        return (vf)(__builtin_convertvector(x, vi) << 16);
    }
    const float *row = (const float *)base + offset + c * LANES;
    if (left >= LANES) return *(const vf_unaligned *)row;
    vf x = {0};
    memcpy(&x, row, (size_t)left * sizeof(float));
    return x;
}

/* Sixteen vectors' lane sums as one vector (lane j: the sum of p[j]'s lanes), each by the same pairwise tree as
 * lane_sum, whichever lane its vector lands in. */
static inline vf lane_sums16(const vf p[LANES]) {
    const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vi lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vi lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = __builtin_shuffle(p[2 * i], p[2 * i + 1], lo8) + __builtin_shuffle(p[2 * i], p[2 * i + 1], hi8);
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo4) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi4);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
    return __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
}

/* Elements [0, 32 * steps) of a bf16 row, as dot steps. */
static inline __attribute__((always_inline)) void load_steps(vh2 *out, const void *base, int64_t offset,
                                                             int64_t steps) {
    const uint16_t *row = (const uint16_t *)base + offset;
    for (int64_t c = 0; c < steps; c++) out[c] = *(const vh2_unaligned *)(row + c * 2 * LANES);
}

/* A bf16 dot product's 16-lane partial sums, 32 elements a step (lane l adds elements 2l and 2l + 1 of each step);
 * only called where HAVE_DPBF16. */
static inline __attribute__((always_inline)) vf dot_steps(const vh2 *a, const vh2 *b, int64_t steps) {
#if HAVE_DPBF16
    __m512 p = _mm512_setzero_ps();
    for (int64_t c = 0; c < steps; c++) p = _mm512_dpbf16_ps(p, (__m512bh)a[c], (__m512bh)b[c]);
    return (vf)p;
#else
    (void)a, (void)b, (void)steps;
    return (vf){0};
#endif
}

/* Accumulator vectors a tile keeps (its pairs x the head's 16-lane chunks): within the 32 vector registers. */
#define TILE_VECTORS 24
#define MAX_TILE 6 /* TILE_VECTORS / 4: the widest tile (head size 64) */

/* One tile: up to MAX_TILE (query row, head) pairs of one kv head, which share the prefix keys: each prefix key and
 * value is loaded once for all of them. Pair i's logical keys: the prefix [0, prefix), then path[i][0 .. total[i] -
 * prefix). Every pair's arithmetic is the same sequence of operations whatever the tile holds (tiles only share
 * loads), so its result depends on its own row alone. `tile` and `chunks` are constants where this is inlined. */
static inline __attribute__((always_inline)) void attend_tile(
    const void *q, const int64_t *qo, const void *k, int64_t ko, int64_t ks, const void *v, int64_t vo, int64_t vs,
    int64_t prefix, const int64_t *const *path, const int64_t *total, float *w, int64_t padded, float *const *o,
    int64_t d, int64_t chunks, int64_t tile, float scale, int bf16) {
    /* bf16 with AVX512-BF16 and whole 32-element steps: dots straight from bf16 (each lane adds two exact products
     * per step, in one fixed instruction sequence); otherwise float32 multiply-adds over 16-element chunks */
    const int dot_bf16 = HAVE_DPBF16 && bf16 && d % (2 * LANES) == 0;
    const int64_t steps = dot_bf16 ? d / (2 * LANES) : 1;
    vf qv[tile][chunks], acc[tile][chunks], part[tile][LANES], top[tile];
    vh2 qh[tile][steps];
    float z[tile];
    int64_t most = 0;
    for (int64_t i = 0; i < tile; i++) {
        if (dot_bf16)
            load_steps(qh[i], q, qo[i], steps);
        else
            for (int64_t c = 0; c < chunks; c++) qv[i][c] = load(q, qo[i], c, d, bf16);
        most = total[i] > most ? total[i] : most;
        top[i] = splat(-INFINITY); /* lane-wise running max; the max is exact in any order */
    }
    const vf lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

    /* scores, 16 logical keys at a time: each key's dot as 16-lane partial sums over D, then its lane sum */
    for (int64_t blk = 0; blk * LANES < most; blk++) {
        for (int64_t j = 0; j < LANES; j++) {
            const int64_t t = blk * LANES + j;
            if (t < prefix) {
                if (dot_bf16) {
                    vh2 kh[steps];
                    load_steps(kh, k, ko + t * ks, steps);
                    for (int64_t i = 0; i < tile; i++) part[i][j] = dot_steps(qh[i], kh, steps);
                } else {
                    vf kc[chunks];
                    for (int64_t c = 0; c < chunks; c++) kc[c] = load(k, ko + t * ks, c, d, bf16);
                    for (int64_t i = 0; i < tile; i++) {
                        vf p = {0};
                        for (int64_t c = 0; c < chunks; c++) p = qv[i][c] * kc[c] + p;
                        part[i][j] = p;
                    }
                }
            } else {
                for (int64_t i = 0; i < tile; i++) {
                    vf p = {0};
                    if (t < total[i]) {
                        const int64_t off = ko + path[i][t - prefix] * ks;
                        if (dot_bf16) {
                            vh2 kh[steps];
                            load_steps(kh, k, off, steps);
                            p = dot_steps(qh[i], kh, steps);
                        } else {
                            for (int64_t c = 0; c < chunks; c++) p = qv[i][c] * load(k, off, c, d, bf16) + p;
                        }
                    }
                    part[i][j] = p;
                }
            }
        }
        for (int64_t i = 0; i < tile; i++) {
            if (blk * LANES >= total[i]) continue;
            vf sc = lane_sums16(part[i]) * splat(scale);
            sc = pick(lane + splat((float)(blk * LANES)) < splat((float)total[i]), sc, splat(-INFINITY));
            memcpy(w + i * padded + blk * LANES, &sc, sizeof sc);
            top[i] = pick(sc > top[i], sc, top[i]);
        }
    }
    /* weights: exp(score - max), summed lane t mod 16 over the blocks in order, then the fixed lane sum */
    for (int64_t i = 0; i < tile; i++) {
        float m = -INFINITY;
        for (int64_t j = 0; j < LANES; j++) m = top[i][j] > m ? top[i][j] : m;
        const vf mv = splat(m);
        vf zl = {0};
        for (int64_t blk = 0; blk * LANES < total[i]; blk++) {
            vf e;
            memcpy(&e, w + i * padded + blk * LANES, sizeof e);
            e = vexp(e - mv);
            memcpy(w + i * padded + blk * LANES, &e, sizeof e);
            zl = zl + e;
        }
        z[i] = lane_sum(zl);
        for (int64_t c = 0; c < chunks; c++) acc[i][c] = (vf){0};
    }
    /* the weighted sum of values in logical order, 16 lanes of D at a time; divided by z at the end */
    for (int64_t t = 0; t < most; t++) {
        if (t < prefix) {
            vf vc[chunks];
            for (int64_t c = 0; c < chunks; c++) vc[c] = load(v, vo + t * vs, c, d, bf16);
            for (int64_t i = 0; i < tile; i++) {
                const vf p = splat(w[i * padded + t]);
                for (int64_t c = 0; c < chunks; c++) acc[i][c] = p * vc[c] + acc[i][c];
            }
        } else {
            for (int64_t i = 0; i < tile; i++) {
                if (t >= total[i]) continue;
                const int64_t off = vo + path[i][t - prefix] * vs;
                const vf p = splat(w[i * padded + t]);
                for (int64_t c = 0; c < chunks; c++) acc[i][c] = p * load(v, off, c, d, bf16) + acc[i][c];
            }
        }
    }
    for (int64_t i = 0; i < tile; i++)
        for (int64_t c = 0; c < chunks; c++) {
            const vf r = z[i] > 0.0f ? acc[i][c] / splat(z[i]) : (vf){0}; /* a row that sees nothing: zeros */
            const int64_t left = d - c * LANES;
            memcpy(o[i] + c * LANES, &r, (size_t)(left < LANES ? left : LANES) * sizeof(float));
        }
}

/* attend_tile with the tile size a constant (1 .. TILE_VECTORS / chunks) */
#define TILES(D, CHUNKS, BF16)                                                                                      \
    switch (tile) {                                                                                                \
    case 1: attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, prefix, path, total, w, padded, o, D, CHUNKS, 1, scale,    \
                        BF16); break;                                                                              \
    case 2: attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, prefix, path, total, w, padded, o, D, CHUNKS, 2, scale,    \
                        BF16); break;                                                                              \
    case 3: attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, prefix, path, total, w, padded, o, D, CHUNKS, 3, scale,    \
                        BF16); break;                                                                              \
    case 4: attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, prefix, path, total, w, padded, o, D, CHUNKS, 4, scale,    \
                        BF16); break;                                                                              \
    case 5: attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, prefix, path, total, w, padded, o, D, CHUNKS, 5, scale,    \
                        BF16); break;                                                                              \
    default: attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, prefix, path, total, w, padded, o, D, CHUNKS, 6, scale,   \
                         BF16); break;                                                                             \
    }

/* Tree attention over q [B, Hq, N, D], k / v [B, Hkv, S, D] (S = L + N; the last dimension contiguous, the others
 * at the given strides in elements: batch, head, position), the packed mask [B, N, words] (contiguous) into out
 * [B, Hq, N, D] (contiguous float32). bf16: q, k and v hold bfloat16 (as uint16) rather than float32. Returns 0, or
 * -1 when scratch memory could not be allocated. */
int spectree_tree_attention(const void *q, int64_t q_sb, int64_t q_sh, int64_t q_sn, const void *k, int64_t k_sb,
                            int64_t k_sh, int64_t k_ss, const void *v, int64_t v_sb, int64_t v_sh, int64_t v_ss,
                            const int32_t *mask, int64_t words, float *out, int64_t batch, int64_t hq, int64_t hkv,
                            int64_t n, int64_t s, int64_t d, float scale, int bf16) {
    if (batch == 0 || hq == 0 || n == 0 || d == 0) return 0; /* no output element */
    const int64_t prefix = s - n, group = hq / hkv, chunks = (d + LANES - 1) / LANES;
    /* pairs (row, head) of one kv head, row-major, cut into tiles; the common head sizes get wide tiles */
    const int64_t widest = (d == 64 || d == 128) ? TILE_VECTORS / chunks : 1;
    const int64_t pairs = n * group, tile_max = widest < pairs ? widest : pairs;
    const int64_t tiles = (pairs + tile_max - 1) / tile_max;
    const int64_t padded = (s + LANES - 1) / LANES * LANES;
    int failed = 0;
#pragma omp parallel
    {
        /* at least one lane's worth each: aligned_alloc / malloc of 0 bytes may give NULL */
        float *w = aligned_alloc(sizeof(vf), (size_t)(tile_max * padded + LANES) * sizeof(float));
        int64_t *paths = malloc((size_t)(tile_max * n + 1) * sizeof(int64_t)); /* each pair's tree slots */
        if (!w || !paths) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < batch * hkv * tiles; item++) {
            if (failed) continue;
            const int64_t first = (item % tiles) * tile_max, g = (item / tiles) % hkv, b = item / (tiles * hkv);
            const int64_t tile = pairs - first < tile_max ? pairs - first : tile_max;
            int64_t qo[MAX_TILE], total[MAX_TILE];
            const int64_t *path[MAX_TILE];
            float *o[MAX_TILE];
            for (int64_t i = 0; i < tile; i++) {
                const int64_t row = (first + i) / group, h = g * group + (first + i) % group;
                const int32_t *bits = mask + (b * n + row) * words;
                int64_t *mine = paths + i * n, count = 0;
                for (int64_t j = 0; j < n; j++)
                    if ((bits[j >> 5] >> (j & 31)) & 1) mine[count++] = prefix + j;
                path[i] = mine;
                total[i] = prefix + count;
                qo[i] = b * q_sb + h * q_sh + row * q_sn;
                o[i] = out + ((b * hq + h) * n + row) * d;
            }
            const int64_t ko = b * k_sb + g * k_sh, vo = b * v_sb + g * v_sh;
            if (d == 64) {
                if (bf16) { TILES(64, 4, 1) } else { TILES(64, 4, 0) }
            } else if (d == 128) {
                if (bf16) { TILES(128, 8, 1) } else { TILES(128, 8, 0) }
            } else {
                if (bf16) attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, prefix, path, total, w, padded, o, d, chunks,
                                      1, scale, 1);
                else attend_tile(q, qo, k, ko, k_ss, v, vo, v_ss, prefix, path, total, w, padded, o, d, chunks, 1,
                                 scale, 0);
            }
        }
        free(w);
        free(paths);
    }
    return failed ? -1 : 0;
}
