// Causal attention on bf16 tensor cores: the kernels behind cuda_transformer.h's bf16
// CausalAttentionForward/Backward (precision "bf16"). Internal to kernels/: the public
// functions check the shape and call these.
//
// Flash attention's tiling (FlashAttention-2's loop order): a block of 4 warps takes 64 rows
// of one (sequence, head) and walks the other side's rows in tiles of 64 through shared
// memory, so the T x T scores never exist in global memory. Each warp owns 16 of the block's
// rows. Products run as 16x16x16 WMMA fragments, bf16 inputs with FP32 sums:
//  - forward: S = Q K^T, the online softmax over S in FP32 (running maximum and sum per row),
//    O += P V with P rounded to bf16 (as PyTorch's flash kernels do); out = O / sum in bf16,
//    lse = maximum + log(sum) in FP32;
//  - backward, as two kernels with no atomics (each gradient element is summed by one warp in
//    a fixed order, so the same bits every run): per tile of keys, dV += P^T dO and
//    dK += dS^T Q over the queries that see them; per tile of queries, dQ += dS K over the
//    keys they see. P is recomputed from lse; dO is rounded to bf16 for the products, and
//    dS = P (dO.V - D) scale with D = dO.O per query in FP32 (from the same rounded dO).
// Shared memory per block: up to 121 KiB (head size 128), which sm_90 has; GPUs with less
// (sm_86 and sm_89 have 99 KiB) get the launch's error as a Status.
// Head sizes are padded with zeros to 32, 64 or 128 columns in shared memory. Exponentials
// are taken in base 2 (exp2f, one special-function instruction) on scores scaled by log2(e);
// lse goes out in natural log, as the CPU twin's.
#ifndef LOCKSTEP_KERNELS_CUDA_FLASH_ATTENTION_H_
#define LOCKSTEP_KERNELS_CUDA_FLASH_ATTENTION_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "kernels/bf16.h"

namespace lockstep::kernels::cuda {

// A checked shape: heads divides c, hs = c / heads is at most 128, batch and heads at most
// 65,535, T > 0 and batch > 0; scale is the CPU twin's 1 / sqrt(hs).
struct FlashAttentionShape {
  int batch, T, c, heads, hs;
  float scale;
};

absl::Status FlashAttentionForward(const Bf16* qkv, const FlashAttentionShape& shape, Bf16* out,
                                   float* lse, cudaStream_t stream);
absl::Status FlashAttentionBackward(const float* dout, const Bf16* qkv, const Bf16* out,
                                    const float* lse, const FlashAttentionShape& shape,
                                    float* dqkv, cudaStream_t stream);

}  // namespace lockstep::kernels::cuda

#endif  // LOCKSTEP_KERNELS_CUDA_FLASH_ATTENTION_H_
