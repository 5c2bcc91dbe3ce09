/*
 * The one native library of tokenloom's CPU kernels (built by tokenloom/kernels/cpu_build.py): every kernel
 * source in one translation unit, so the native decode step and the Python wrappers call the same code.
 */
#define _DEFAULT_SOURCE /* syscall() for the AMX permission request (paged_attention.c) */
#include "cpu_ops.c"
#include "paged_attention.c"
#include "paged_attention_fp8.c"
#include "small_gemm.c"
#include "pair_gemm.c"
#include "amx_gemm.c"
#include "quant_legacy.c"
#include "quant_kquants.c"
#include "quant_q5.c"
#include "quant_gemm.c"
#include "moe_avx2.c"
#include "quant_moe.c"
#include "extend_attention.c"
#include "shm_allreduce.c"
#include "decode_native.c"
#include "kv_indices.c"
#include "omp_team.c"
