/*
 * KV-index building on the CPU (wrapped by tokenloom/layers/kv_indices.py, backend "native"):
 *
 *   out[indptr[i] + j] = (int64) table[rows[i] * stride + starts[i] + j]   for j < indptr[i+1] - indptr[i]
 *
 * i.e. each request's slice of `req_to_token` widened to int64 and laid end to end, which is what the
 * per-request Python loop computes with thousands of tiny tensor ops and what the Triton kernel does on CUDA.
 * Here it is one widening copy per request: the bytes are read and written once.
 *
 * Invariants: every slice is checked against the table (row in [0, n_rows), start >= 0, start + len <= width,
 * len >= 0, indptr non-decreasing) before anything is written; a bad request returns -(its index + 1) and
 * leaves `out` untouched (batches stay far below 2^31 requests). With several threads, the output (not the requests) is split into equal ranges and
 * each thread finds its first request by binary search, so one long request does not serialize the copy.
 */
#include "bf16_common.h"
#include <stdint.h>

#define KV_INDEX_PARALLEL_MIN 65536 /* output elements below which one thread copies everything */

static inline void widen_i32(const int32_t *src, int64_t *dst, int64_t n) {
    for (int64_t j = 0; j < n; ++j) dst[j] = src[j];
}

/* The request whose output range holds element k (the last i with indptr[i] <= k). */
static int64_t request_at(const int64_t *indptr, int64_t batch, int64_t k) {
    int64_t lo = 0, hi = batch - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (indptr[mid] <= k) lo = mid; else hi = mid - 1;
    }
    return lo;
}

KERNEL_API int build_kv_indices_i32(const int32_t *table, int64_t n_rows, int64_t width, int64_t stride,
                                        const int64_t *rows, const int64_t *starts, const int64_t *indptr,
                                        int64_t batch, int64_t *out, int threads) {
    for (int64_t i = 0; i < batch; ++i) {
        int64_t len = indptr[i + 1] - indptr[i], start = starts ? starts[i] : 0;
        if (len < 0 || rows[i] < 0 || rows[i] >= n_rows || start < 0 || start + len > width) return (int)-(i + 1);
    }
    int64_t total = batch > 0 ? indptr[batch] - indptr[0] : 0;
    int parts = (total >= KV_INDEX_PARALLEL_MIN && threads > 1) ? threads : 1;
    _Pragma("omp parallel for schedule(static, 1) num_threads(parts)")
    for (int p = 0; p < parts; ++p) {
        int64_t lo = indptr[0] + total * p / parts, hi = indptr[0] + total * (p + 1) / parts;
        if (lo >= hi) continue;
        for (int64_t i = request_at(indptr, batch, lo); i < batch && indptr[i] < hi; ++i) {
            int64_t first = indptr[i] > lo ? indptr[i] : lo, last = indptr[i + 1] < hi ? indptr[i + 1] : hi;
            if (first >= last) continue;
            const int32_t *src = table + rows[i] * stride + (starts ? starts[i] : 0) + (first - indptr[i]);
            widen_i32(src, out + (first - indptr[0]), last - first);
        }
    }
    return 0;
}

/*
 * A decode step's table work in one call (one token per request, at position seq_lens[i] - 1):
 *
 *   table[rows[i] * stride + seq_lens[i] - 1] = (int32) out_loc[i]      the new token's slot, stored
 *   indptr[0] = 0, indptr[i + 1] = indptr[i] + seq_lens[i]              each request's whole KV
 *   out[indptr[i] + j] = (int64) table[rows[i] * stride + j]            for j < seq_lens[i]
 *
 * which is `req_to_token[rows, seq_lens - 1] = out_loc` followed by `build_kv_indices_i32`, without the
 * tensor ops that build the index and offsets in between. Every request is checked first (row in
 * [0, n_rows), 1 <= seq_len <= width, 0 <= out_loc < 2^31) and the lengths must sum to `total` (the size of
 * `out`): a bad request returns -(its index + 1), a wrong total -(batch + 1); nothing is written then.
 */
KERNEL_API int decode_store_and_build_i32(int32_t *table, int64_t n_rows, int64_t width, int64_t stride,
                                          const int64_t *rows, const int64_t *seq_lens, const int64_t *out_loc,
                                          int64_t batch, int64_t total, int64_t *indptr, int64_t *out,
                                          int threads) {
    int64_t sum = 0;
    for (int64_t i = 0; i < batch; ++i) {
        int64_t len = seq_lens[i];
        if (rows[i] < 0 || rows[i] >= n_rows || len < 1 || len > width || out_loc[i] < 0 || out_loc[i] > INT32_MAX)
            return (int)-(i + 1);
        sum += len;
    }
    if (sum != total) return (int)-(batch + 1);
    indptr[0] = 0;
    for (int64_t i = 0; i < batch; ++i) {
        table[rows[i] * stride + seq_lens[i] - 1] = (int32_t)out_loc[i];
        indptr[i + 1] = indptr[i] + seq_lens[i];
    }
    return build_kv_indices_i32(table, n_rows, width, stride, rows, NULL, indptr, batch, out, threads);
}
