/*
 * The AMX tile unit on Linux: whether this build has it (HAVE_AMX), the once-per-process permission request,
 * and the one tile configuration every AMX kernel here uses (8 tiles of 16 rows x 64 bytes).
 */
#ifndef TOKENLOOM_AMX_COMMON_H
#define TOKENLOOM_AMX_COMMON_H

#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Linux hands out AMX tile state only on request (once per process); 1 when granted. */
static int amx_permitted(void) {
    static int state = 0; /* 0 unknown, 1 granted, -1 refused; a benign race: every caller finds the same */
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state == 1;
}

/* Load the all-16x64 tile configuration on the calling thread (other code, e.g. oneDNN, may change it). */
static void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}
#else
#define HAVE_AMX 0
#endif

#endif
