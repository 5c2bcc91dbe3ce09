/*
 * Shared-memory collectives for the tensor-parallel ranks of one host (wrapped by
 * tokenloom/distributed/shm_comm.py; callable from C by the native decode step): an in-place all-reduce (sum)
 * of bf16 or float32 tensors and an all-gather of bytes, without a socket or a syscall on the fast path.
 *
 * Segment (created zero-filled by one rank, mapped by all; `shm_comm_bytes` gives its size):
 *   flag[world]                 one uint64 per rank, each on its own 64-byte cache line
 *   slot[2][world][slot_bytes]  data slots, double-buffered by the parity of the sequence number
 *
 * One round, on every rank (the ranks call the same collectives with the same sizes in the same order):
 *   seq += 1 (per process); copy my piece into slot[seq & 1][rank]; store-release flag[rank] = seq;
 *   wait until every flag >= seq (load-acquire); read slot[seq & 1][*] (sum, or copy out).
 * Tensors larger than a slot go in slot-sized pieces, one round each.
 *
 * Why reusing a slot is safe: rank r writes parity p at round s and next at round s + 2. Before that it has
 * finished round s + 1, which means it saw every flag >= s + 1: every rank had started round s + 1, so had
 * finished reading round s's slots. A rank that is one round ahead is harmless (the wait is `>=`, and it writes
 * the other parity); two rounds ahead is impossible (it would need the laggard's flag at s + 1). So no slot
 * is overwritten while a peer can still read it, and no lock is needed. The flags only grow (64 bits).
 *
 * Determinism: every rank sums the contributions in rank order (0, 1, ...) in float32 from the same slot
 * bytes and rounds to bf16 once (round to nearest even), element by element, whatever the thread split, so
 * every rank gets a bit-identical result (the ranks sample the same tokens from it). The sum is element-wise,
 * so it equals torch's float32 sum of the ranks' tensors taken in rank order.
 *
 * Waiting spins with a pause instruction for a short while, then calls sched_yield() between checks (the
 * ranks may share two cores with other work: pure spinning would starve the very peer being waited for),
 * reading the clock every few checks. A wait that lasts longer than timeout_s returns -1, records the lowest
 * rank that had not arrived and poisons the handle (its sequence is now out of step with the peers): every
 * later call returns -1. Return codes: 0 success, -1 timeout, -2 bad arguments.
 */
#include "bf16_common.h"
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SHM_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define SHM_PAUSE() __asm__ __volatile__("yield")
#else
#define SHM_PAUSE() ((void)0)
#endif

#define SHM_LINE 64               /* bytes per flag: one cache line each, so ranks never share a line */
#define SHM_MAX_WORLD 1024
#define SHM_SPIN_CHECKS 2048      /* checks with a pause before the wait starts yielding the core */
#define SHM_CLOCK_EVERY 64        /* checks between two reads of the clock */
#define SHM_PARALLEL_BYTES 262144 /* pieces below this are copied/summed by one thread (fork cost) */
#define SHM_BLOCK 64              /* elements summed per block (the float32 accumulators of one block) */

typedef struct tl_shm_comm {
    uint8_t *base;      /* the mapped segment */
    int rank, world;
    int64_t slot_bytes; /* a positive multiple of SHM_LINE */
    double timeout_s;
    uint64_t seq;       /* rounds done by this process */
    int broken;         /* a wait timed out: the handle is unusable */
    int missing;        /* the lowest rank that had not arrived at the timeout, else -1 */
} tl_shm_comm;

static inline uint64_t *shm_flag(const tl_shm_comm *c, int r) {
    return (uint64_t *)(c->base + (int64_t)r * SHM_LINE);
}

static inline uint8_t *shm_slot(const tl_shm_comm *c, uint64_t seq, int r) {
    return c->base + (int64_t)c->world * SHM_LINE + ((int64_t)(seq & 1) * c->world + r) * c->slot_bytes;
}

static double shm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int shm_threads(int64_t bytes, int threads) {
    return (threads > 1 && bytes >= SHM_PARALLEL_BYTES) ? threads : 1;
}

KERNEL_API int64_t shm_comm_bytes(int world, int64_t slot_bytes) {
    if (world < 1 || world > SHM_MAX_WORLD || slot_bytes <= 0 || slot_bytes % SHM_LINE ||
        slot_bytes > ((int64_t)1 << 40))
        return -2;
    return (int64_t)world * SHM_LINE + 2 * (int64_t)world * slot_bytes;
}

KERNEL_API tl_shm_comm *shm_comm_open(void *base, int rank, int world, int64_t slot_bytes, double timeout_s) {
    if (base == NULL || ((uintptr_t)base % SHM_LINE) || shm_comm_bytes(world, slot_bytes) < 0 || rank < 0 ||
        rank >= world || !(timeout_s > 0))
        return NULL;
    tl_shm_comm *c = malloc(sizeof *c);
    if (c == NULL) return NULL;
    c->base = base;
    c->rank = rank;
    c->world = world;
    c->slot_bytes = slot_bytes;
    c->timeout_s = timeout_s;
    c->seq = 0;
    c->broken = 0;
    c->missing = -1;
    return c;
}

KERNEL_API void shm_comm_close(tl_shm_comm *c) { free(c); }

KERNEL_API int shm_comm_missing_rank(const tl_shm_comm *c) { return c == NULL ? -1 : c->missing; }

/* The lowest rank whose flag is still below seq, or -1 when every rank has arrived. */
static int shm_first_absent(const tl_shm_comm *c, uint64_t seq) {
    for (int r = 0; r < c->world; ++r)
        if (__atomic_load_n(shm_flag(c, r), __ATOMIC_ACQUIRE) < seq) return r;
    return -1;
}

/* Publish this rank's piece of round c->seq and wait for every peer's. 0, or -1 on timeout (handle poisoned). */
static int shm_arrive_and_wait(tl_shm_comm *c) {
    const uint64_t seq = c->seq;
    __atomic_store_n(shm_flag(c, c->rank), seq, __ATOMIC_RELEASE);
    int absent = shm_first_absent(c, seq);
    if (absent < 0) return 0;
    double deadline = -1.0;
    for (uint64_t checks = 1;; ++checks) {
        if (checks < SHM_SPIN_CHECKS) SHM_PAUSE();
        else sched_yield();
        /* resume at the rank absent last time: flags only grow, so the ranks before it stay arrived */
        while (absent < c->world && __atomic_load_n(shm_flag(c, absent), __ATOMIC_ACQUIRE) >= seq) ++absent;
        if (absent == c->world) return 0;
        if (checks % SHM_CLOCK_EVERY == 1) {
            double now = shm_now();
            if (deadline < 0) deadline = now + c->timeout_s;
            else if (now > deadline) {
                int missing = shm_first_absent(c, seq);
                if (missing < 0) return 0; /* the last one arrived just now */
                c->broken = 1;
                c->missing = missing;
                return -1;
            }
        }
    }
}

static void shm_copy(void *dst, const void *src, int64_t bytes, int threads) {
    int parts = shm_threads(bytes, threads);
    if (parts == 1) {
        memcpy(dst, src, (size_t)bytes);
        return;
    }
    _Pragma("omp parallel for schedule(static) num_threads(parts)")
    for (int p = 0; p < parts; ++p) {
        /* split at cache-line boundaries so two threads never write one line */
        int64_t lo = bytes * p / parts / SHM_LINE * SHM_LINE;
        int64_t hi = p == parts - 1 ? bytes : bytes * (p + 1) / parts / SHM_LINE * SHM_LINE;
        memcpy((uint8_t *)dst + lo, (const uint8_t *)src + lo, (size_t)(hi - lo));
    }
}

/* Round `seq`'s result for elements [lo, hi) of the piece: out[i] = bf16(float(slot_0[i]) + float(slot_1[i])
 * + ...), summed in rank order in float32, in blocks of SHM_BLOCK so the inner loops vectorize. */
static void shm_sum_bf16(const tl_shm_comm *c, uint64_t seq, void *out_, int64_t lo, int64_t hi) {
    uint16_t *out = out_;
    for (int64_t b = lo; b < hi; b += SHM_BLOCK) {
        int64_t len = hi - b < SHM_BLOCK ? hi - b : SHM_BLOCK;
        float acc[SHM_BLOCK];
        const uint16_t *s0 = (const uint16_t *)shm_slot(c, seq, 0) + b;
        for (int64_t j = 0; j < len; ++j) acc[j] = bf16_to_f32(s0[j]);
        for (int r = 1; r < c->world; ++r) {
            const uint16_t *s = (const uint16_t *)shm_slot(c, seq, r) + b;
            for (int64_t j = 0; j < len; ++j) acc[j] += bf16_to_f32(s[j]);
        }
        for (int64_t j = 0; j < len; ++j) out[b + j] = f32_to_bf16(acc[j]);
    }
}

/* The float32 version: out[i] = slot_0[i] + slot_1[i] + ..., in rank order. */
static void shm_sum_f32(const tl_shm_comm *c, uint64_t seq, void *out_, int64_t lo, int64_t hi) {
    float *out = out_;
    for (int64_t b = lo; b < hi; b += SHM_BLOCK) {
        int64_t len = hi - b < SHM_BLOCK ? hi - b : SHM_BLOCK;
        float acc[SHM_BLOCK];
        const float *s0 = (const float *)shm_slot(c, seq, 0) + b;
        for (int64_t j = 0; j < len; ++j) acc[j] = s0[j];
        for (int r = 1; r < c->world; ++r) {
            const float *s = (const float *)shm_slot(c, seq, r) + b;
            for (int64_t j = 0; j < len; ++j) acc[j] += s[j];
        }
        for (int64_t j = 0; j < len; ++j) out[b + j] = acc[j];
    }
}

typedef void (*shm_sum_fn)(const tl_shm_comm *, uint64_t, void *, int64_t, int64_t);

/* A round's sum over n elements, split into block-aligned ranges over the threads when the piece is large
 * (small pieces skip the OpenMP region: its fork costs more than the sum). Element-wise, so the split cannot
 * change a result. */
static void shm_sum(const tl_shm_comm *c, uint64_t seq, void *out, int64_t n, int elem, int threads,
                    shm_sum_fn sum) {
    int parts = shm_threads(n * elem, threads);
    if (parts == 1) {
        sum(c, seq, out, 0, n);
        return;
    }
    int64_t blocks = (n + SHM_BLOCK - 1) / SHM_BLOCK;
    _Pragma("omp parallel for schedule(static) num_threads(parts)")
    for (int p = 0; p < parts; ++p) {
        int64_t lo = blocks * p / parts * SHM_BLOCK, hi = blocks * (p + 1) / parts * SHM_BLOCK;
        sum(c, seq, out, lo, hi < n ? hi : n);
    }
}

/* The all-reduce of n elements of `elem` bytes, in slot-sized rounds; `sum` writes a round's result. */
static int shm_allreduce(tl_shm_comm *c, void *data, int64_t n, int elem, int threads, shm_sum_fn sum) {
    if (c == NULL || n < 0 || (data == NULL && n > 0)) return -2;
    if (c->broken) return -1;
    const int64_t per_round = c->slot_bytes / elem;
    for (int64_t off = 0; off < n; off += per_round) {
        int64_t len = n - off < per_round ? n - off : per_round;
        uint8_t *piece = (uint8_t *)data + off * elem;
        c->seq += 1;
        shm_copy(shm_slot(c, c->seq, c->rank), piece, len * elem, threads);
        if (shm_arrive_and_wait(c)) return -1;
        shm_sum(c, c->seq, piece, len, elem, threads, sum);
    }
    return 0;
}

KERNEL_API int shm_allreduce_bf16(tl_shm_comm *c, uint16_t *data, int64_t n, int threads) {
    return shm_allreduce(c, data, n, 2, threads, shm_sum_bf16);
}

KERNEL_API int shm_allreduce_f32(tl_shm_comm *c, float *data, int64_t n, int threads) {
    return shm_allreduce(c, data, n, 4, threads, shm_sum_f32);
}

/* out[r * bytes + i] = rank r's in[i]. `in` may be out + rank * bytes (in place) but must not overlap the
 * rest of `out`. */
KERNEL_API int shm_allgather(tl_shm_comm *c, const void *in, int64_t bytes, void *out, int threads) {
    if (c == NULL || bytes < 0 || ((in == NULL || out == NULL) && bytes > 0)) return -2;
    if (c->broken) return -1;
    for (int64_t off = 0; off < bytes; off += c->slot_bytes) {
        int64_t len = bytes - off < c->slot_bytes ? bytes - off : c->slot_bytes;
        c->seq += 1;
        shm_copy(shm_slot(c, c->seq, c->rank), (const uint8_t *)in + off, len, threads);
        if (shm_arrive_and_wait(c)) return -1;
        for (int r = 0; r < c->world; ++r)
            shm_copy((uint8_t *)out + r * bytes + off, shm_slot(c, c->seq, r), len, threads);
    }
    return 0;
}
