/* A llama.cpp context as a target executor for tree verification (plugins/llama_cpp/__init__.py loads it).
 *
 * Compiled against the llama.h of the llama.cpp build it links (scripts/setup-llama-cpp.sh, BUILD_SHARED_LIBS=ON),
 * so the structs passed by value here always match that build; Python sees only these plain C functions.
 *
 * One context with a unified KV cache of n_ctx cells shared by n_seq sequences: a token attends to the cached
 * tokens that share one of its sequences and sit at a position not after its own, which is how a tree of drafted
 * tokens is verified in one llama_decode (each root-to-leaf path of the tree is a sequence; a node belongs to
 * every sequence whose leaf lies under it). Flash attention is off: ggml's CPU flash-attention kernel takes a
 * different route for one query row, for many, and for long caches, where the matmul + softmax route computes
 * every row the same way whatever the batch holds (see plugins/llama_cpp/__init__.py for the whole argument). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

typedef struct {
    struct llama_model *model;
    struct llama_context *ctx;
    struct llama_batch batch;
    int32_t n_batch;
    int32_t n_seq;
    int32_t n_vocab;
    int32_t n_embd;
    int32_t embeddings;
} st_exec;

static void quiet_log(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

/* NULL on failure, with the reason in err. */
/* embeddings != 0: each output token's final-norm hidden state too (the input of lm_head). */
st_exec *st_open(const char *path, int32_t n_ctx, int32_t n_batch, int32_t n_seq, int32_t n_threads,
                 int32_t embeddings, int32_t verbose, char *err, int32_t err_len) {
    if (!verbose) llama_log_set(quiet_log, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    /* Repacked weights (extra buffer types) multiply one row with a GEMV kernel and several with a GEMM kernel:
     * two summation orders. The plain buffers go through one kernel for every batch of two rows or more. */
    mp.use_extra_bufts = false;
    struct llama_model *model = llama_model_load_from_file(path, mp);
    if (!model) {
        snprintf(err, (size_t)err_len, "llama.cpp could not load %s", path);
        return NULL;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)n_ctx;
    cp.n_batch = (uint32_t)n_batch;
    cp.n_ubatch = (uint32_t)n_batch;
    cp.n_seq_max = (uint32_t)n_seq;
    cp.n_threads = n_threads;
    cp.n_threads_batch = n_threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.kv_unified = true;
    cp.no_perf = true;
    cp.embeddings = embeddings != 0;
    cp.pooling_type = LLAMA_POOLING_TYPE_NONE;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        llama_model_free(model);
        snprintf(err, (size_t)err_len, "llama.cpp could not make a context (n_ctx %d, n_batch %d, n_seq %d)",
                 n_ctx, n_batch, n_seq);
        return NULL;
    }
    st_exec *e = calloc(1, sizeof *e);
    if (!e) {
        llama_free(ctx);
        llama_model_free(model);
        snprintf(err, (size_t)err_len, "out of memory");
        return NULL;
    }
    e->model = model;
    e->ctx = ctx;
    e->n_batch = n_batch;
    e->n_seq = n_seq;
    e->batch = llama_batch_init(n_batch, 0, n_seq);
    e->n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    e->n_embd = llama_model_n_embd(model);
    e->embeddings = embeddings != 0;
    return e;
}

int32_t st_n_vocab(const st_exec *e) { return e->n_vocab; }

int32_t st_n_ctx(const st_exec *e) { return (int32_t)llama_n_ctx(e->ctx); }

int32_t st_n_embd(const st_exec *e) { return e->n_embd; }

/* Decode n tokens. Token i sits at pos[i] and belongs to the sequences seq_ids[seq_start[i] .. seq_start[i+1]);
 * out[i] != 0 asks for its logits, copied row after row into logits (n_out x n_vocab floats), and, where the
 * context was opened with embeddings and hidden is not NULL, its hidden state into hidden (n_out x n_embd).
 * Returns llama_decode's status (0: done; 1: no room in the KV cache; negative: an error). */
int32_t st_decode(st_exec *e, int32_t n, const int32_t *tokens, const int32_t *pos, const int32_t *seq_start,
                  const int32_t *seq_ids, const int8_t *out, float *logits, float *hidden) {
    if (n <= 0 || n > e->n_batch) return -100;
    if (hidden && !e->embeddings) return -103;
    struct llama_batch *b = &e->batch;
    for (int32_t i = 0; i < n; i++) {
        int32_t k = seq_start[i + 1] - seq_start[i];
        if (k <= 0 || k > e->n_seq) return -101;
        b->token[i] = tokens[i];
        b->pos[i] = pos[i];
        b->n_seq_id[i] = k;
        for (int32_t j = 0; j < k; j++) b->seq_id[i][j] = seq_ids[seq_start[i] + j];
        b->logits[i] = out[i];
    }
    b->n_tokens = n;
    int32_t status = llama_decode(e->ctx, *b);
    if (status != 0) return status;
    int32_t row = 0;
    for (int32_t i = 0; i < n; i++) {
        if (!out[i]) continue;
        const float *src = llama_get_logits_ith(e->ctx, i);
        if (!src) return -102;
        memcpy(logits + (size_t)row * (size_t)e->n_vocab, src, sizeof(float) * (size_t)e->n_vocab);
        if (hidden) {
            const float *h = llama_get_embeddings_ith(e->ctx, i);
            if (!h) return -104;
            memcpy(hidden + (size_t)row * (size_t)e->n_embd, h, sizeof(float) * (size_t)e->n_embd);
        }
        row++;
    }
    return 0;
}

/* Remove sequence seq's tokens at positions [p0, p1) (seq < 0: every sequence; p1 < 0: to the end). */
int32_t st_seq_rm(st_exec *e, int32_t seq, int32_t p0, int32_t p1) {
    return llama_memory_seq_rm(llama_get_memory(e->ctx), seq, p0, p1) ? 1 : 0;
}

/* Sequence dst also holds src's tokens at positions [p0, p1). */
void st_seq_cp(st_exec *e, int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    llama_memory_seq_cp(llama_get_memory(e->ctx), src, dst, p0, p1);
}

int32_t st_seq_pos_max(st_exec *e, int32_t seq) { return llama_memory_seq_pos_max(llama_get_memory(e->ctx), seq); }

void st_clear(st_exec *e) { llama_memory_clear(llama_get_memory(e->ctx), true); }

void st_close(st_exec *e) {
    if (!e) return;
    llama_batch_free(e->batch);
    llama_free(e->ctx);
    llama_model_free(e->model);
    free(e);
}
