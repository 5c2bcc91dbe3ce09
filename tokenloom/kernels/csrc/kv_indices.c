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
