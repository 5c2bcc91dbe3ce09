"""A pytest plugin (`-p tests.avx2_only_cpu`) for runs whose kernels are built for AVX2 on a CPU that has
AVX-512 (TOKENLOOM_CPU_KERNELS_ISA=avx2): it stands oneDNN's bf16 matmul out, as on a CPU with AVX2 alone,
so that the bf16 linear layers take the AVX2 kernel there too."""

from tokenloom.layers import cpu_gemm

cpu_gemm._onednn_bf16 = lambda: False
