/* One pre-norm decoder layer of the CPU target forward in one call (plugins/decoder_layer/native.py says why):
 *
 *   h   = rms_norm(x)                         rowwise.c
 *   qkv = h @ Wqkv^T (+ b)                    stream_linear.c
 *   q,k = rope(q, k)                          rowwise.c; k and v stored in the layer's KV cache at [length, length + n)
 *   a   = tree_attention(q, cache)            tree_attention/invariant.c, rounded to the dtype
 *   x1  = x + a @ Wo^T (+ b)
 *   out = x1 + down(silu_mul(rms_norm(x1) @ Wgu^T (+ b)))
 *
 * The kernels are those the torch route of runtime/model.py calls, passed in as function pointers from their own
 * libraries, so the two routes give the same bits: only the glue is here (the cache write, the transposes, the
 * residual adds: a bfloat16 sum of two bfloat16 values rounded once from float32, as torch adds them). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../bf16.h"

typedef void (*rms_norm_fn)(const void *x, int64_t rows, int64_t hidden, int64_t x_row_stride, const void *weight,
                            float eps, void *out, int bf16);
typedef void (*rope_fn)(const void *x, int64_t batch, int64_t tokens, int64_t heads, int64_t dim, int64_t xs_b,
                        int64_t xs_n, int64_t xs_h, const void *cos, const void *sin, int64_t cs_b, int64_t cs_n,
                        void *out, int64_t os_b, int64_t os_n, int64_t os_h, int bf16);
typedef void (*silu_mul_fn)(const void *gu, int64_t rows, int64_t inter, int64_t gu_row_stride, void *out, int bf16);
typedef int (*linear_fn)(const void *x, int x_bf16, int64_t rows, int64_t in, int64_t x_stride, int fmt,
                         const void *wdata, const float *scale, int64_t out, const float *bias, void *y, int y_bf16);
typedef int (*attention_fn)(const void *q, int64_t q_sb, int64_t q_sh, int64_t q_sn, const void *k, int64_t k_sb,
                            int64_t k_sh, int64_t k_ss, const void *v, int64_t v_sb, int64_t v_sh, int64_t v_ss,
                            const int32_t *mask, int64_t words, float *out, int64_t batch, int64_t hq, int64_t hkv,
                            int64_t n, int64_t s, int64_t d, float scale, int bf16);

typedef struct {
    int32_t fmt;           /* stream_linear.c FMT_* */
    int32_t pad;
    const void *data;      /* the weight, or its blocks */
    const float *scale;    /* FMT_Q8's packed scales (FMT_Q4 keeps its own in its panels) */
    const float *bias;     /* float32 [out], or NULL */
    int64_t out;
} matrix_t;

typedef struct {
    int64_t rows, hidden, hq, hkv, head_dim, inter;
    int32_t bf16;       /* activations, norm weights and cos / sin: bfloat16 (else float32) */
    int32_t cache_bf16; /* the cache: bfloat16 (else float32: bfloat16 activations' keys and values widened, exactly) */
    float eps, scale;
    const void *x;      /* [rows, hidden] */
    void *out;          /* [rows, hidden] */
    const void *input_norm, *post_norm;  /* [hidden] */
    matrix_t qkv, o, gate_up, down;
    const void *cos, *sin;  /* [rows, head_dim] */
    void *k_cache, *v_cache;  /* this layer's [hkv, capacity, head_dim] (batch 1) */
    int64_t capacity, length;
    const int32_t *mask;  /* [rows, words] */
    int64_t words;
    rms_norm_fn rms_norm;
    rope_fn rope;
    silu_mul_fn silu_mul;
    linear_fn linear;
    attention_fn attention;
} layer_t;


static int matmul(const layer_t *a, const matrix_t *m, const void *x, int64_t in, void *y) {
    return a->linear(x, a->bf16, a->rows, in, in, m->fmt, m->data, m->scale, m->out, m->bias, y, a->bf16);
}

/* Returns 0, or -1 when memory could not be allocated. */
int spectree_decoder_layer(const layer_t *a) {
    const int64_t n = a->rows, h = a->hidden, hq = a->hq, hkv = a->hkv, d = a->head_dim, inter = a->inter;
    const int64_t width = (hq + 2 * hkv) * d, es = a->bf16 ? 2 : 4;
    const int64_t need = n * (h + width + (hq + hkv) * d + hq * d + h + 2 * inter + inter + h);
    char *buf = malloc((size_t)need * (size_t)es + (size_t)(2 * n * hq * d) * sizeof(float));
    if (!buf) return -1;
    char *p = buf;
    void *normed = p; p += n * h * es;
    void *qkv = p; p += n * width * es;
    void *qk = p; p += n * (hq + hkv) * d * es;
    void *att = p; p += n * hq * d * es;
    void *x1 = p; p += n * h * es;
    void *gu = p; p += n * 2 * inter * es;
    void *act = p; p += n * inter * es;
    void *proj = p; p += n * h * es;
    float *att32 = (float *)p, *q32 = att32 + n * hq * d;
    int rc = 0;

    a->rms_norm(a->x, n, h, h, a->input_norm, a->eps, normed, a->bf16);
    if ((rc = matmul(a, &a->qkv, normed, h, qkv))) goto done;
    /* q and k rotated together as hq + hkv heads, laid out [n, heads, d] */
    a->rope(qkv, 1, n, hq + hkv, d, n * width, width, d, a->cos, a->sin, n * d, d, qk, n * (hq + hkv) * d,
            (hq + hkv) * d, d, a->bf16);
    const int cb = a->cache_bf16;
    for (int64_t g = 0; g < hkv; g++) /* the new keys and values at slots [length, length + n), in the cache's dtype */
        for (int64_t t = 0; t < n; t++) {
            const int64_t slot = (g * a->capacity + a->length + t) * d;
            const int64_t ko = (t * (hq + hkv) + hq + g) * d, vo = t * width + (hq + hkv) * d + g * d;
            for (int64_t i = 0; i < d; i++) {
                elem_store(a->k_cache, slot + i, elem_load(qk, ko + i, a->bf16), cb);
                elem_store(a->v_cache, slot + i, elem_load(qkv, vo + i, a->bf16), cb);
            }
        }
    /* the queries in the cache's dtype (widened where it is float32); q32 rows as qk's: [n, hq (+ hkv), d] */
    const void *queries = qk;
    if (a->bf16 && !cb) {
        for (int64_t t = 0; t < n; t++)
            for (int64_t i = 0; i < hq * d; i++) q32[t * hq * d + i] = elem_load(qk, t * (hq + hkv) * d + i, 1);
        queries = q32;
    }
    const int64_t q_sn = queries == qk ? (hq + hkv) * d : hq * d;
    rc = a->attention(queries, n * q_sn, d, q_sn, a->k_cache, hkv * a->capacity * d, a->capacity * d, d, a->v_cache,
                      hkv * a->capacity * d, a->capacity * d, d, a->mask, a->words, att32, 1, hq, hkv, n,
                      a->length + n, d, a->scale, cb);
    if (rc) goto done;
    for (int64_t head = 0; head < hq; head++) /* [hq, n, d] float32 -> [n, hq * d] in the dtype */
        for (int64_t t = 0; t < n; t++)
            for (int64_t i = 0; i < d; i++)
                elem_store(att, (t * hq + head) * d + i, att32[(head * n + t) * d + i], a->bf16);
    if ((rc = matmul(a, &a->o, att, hq * d, proj))) goto done;
    for (int64_t i = 0; i < n * h; i++)
        elem_store(x1, i, elem_load(a->x, i, a->bf16) + elem_load(proj, i, a->bf16), a->bf16);
    a->rms_norm(x1, n, h, h, a->post_norm, a->eps, normed, a->bf16);
    if ((rc = matmul(a, &a->gate_up, normed, h, gu))) goto done;
    a->silu_mul(gu, n, inter, 2 * inter, act, a->bf16);
    if ((rc = matmul(a, &a->down, act, inter, proj))) goto done;
    for (int64_t i = 0; i < n * h; i++)
        elem_store(a->out, i, elem_load(x1, i, a->bf16) + elem_load(proj, i, a->bf16), a->bf16);
done:
    free(buf);
    return rc ? -1 : 0;
}

/* Layers[0 .. count) in sequence, one call for a forward's stack (or the run of it between two feature layers): layer
 * i reads x (i = 0) or layer i - 1's output and writes out (the last) or a scratch row block; its cache is
 * k_cache / v_cache + i * cache_stride bytes ([hkv, capacity, head_dim] each, in the cache's dtype). The per-call
 * fields of each layer's block are set here from the arguments. Returns 0, or -1 when memory could not be
 * allocated. */
int spectree_decoder_stack(layer_t *const *layers, int64_t count, int64_t rows, const void *x, void *out,
                           const void *cos, const void *sin, char *k_cache, char *v_cache, int64_t cache_stride,
                           int64_t capacity, int64_t length, int cache_bf16, const int32_t *mask, int64_t words) {
    if (count <= 0) return 0;
    const layer_t *first = layers[0];
    void *scratch[2] = {out, NULL};
    if (count > 1) {
        scratch[1] = malloc((size_t)(rows * first->hidden) * (first->bf16 ? 2 : 4));
        if (!scratch[1]) return -1;
    }
    const void *in = x;
    int rc = 0;
    for (int64_t i = 0; i < count && !rc; i++) {
        layer_t *a = layers[i];
        void *dst = scratch[(count - 1 - i) % 2]; /* the last layer writes out */
        a->rows = rows;
        a->x = in;
        a->out = dst;
        a->cos = cos;
        a->sin = sin;
        a->k_cache = k_cache + i * cache_stride;
        a->v_cache = v_cache + i * cache_stride;
        a->capacity = capacity;
        a->length = length;
        a->cache_bf16 = cache_bf16;
        a->mask = mask;
        a->words = words;
        rc = spectree_decoder_layer(a);
        in = dst;
    }
    free(scratch[1]);
    return rc;
}
