/*
 * GGUF k-quant types (Q4_K, Q5_K, Q6_K: 256-element super-blocks) for csrc/quant_gemm.c: per-type dot
 * kernels against int8 activations (quant_common.h), exact dequantize, optional same-size re-layout.
 *
 * Built inside kernels.c, after quant_common.h. `tl_kquant_type(type)` is the family's table lookup: the
 * type's functions, or NULL when this family does not handle the type.
 */
#include "quant_common.h"
#include <stddef.h>

static const tl_quant_type *tl_kquant_type(int type) {
    (void)type;
    return NULL; /* the family's kernels land here */
}
