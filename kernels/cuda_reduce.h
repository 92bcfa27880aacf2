// Sums over the rows of a row-major matrix by column, in a fixed order, for the CUDA kernel
// files (internal to kernels/*.cu): a block of kSumColumns columns by kSumGroups row groups.
// Thread (x, y) sums column x's rows y, y + kSumGroups, ... in order; AddGroups then adds the
// groups' sums in group order. The same bits every run (no atomics), with the rows spread
// over 1024 threads instead of one, but not a single row-order sum's bits.
#ifndef LOCKSTEP_KERNELS_CUDA_REDUCE_H_
#define LOCKSTEP_KERNELS_CUDA_REDUCE_H_

#include <cuda_runtime.h>

namespace lockstep::kernels::cuda {

inline constexpr int kSumColumns = 32, kSumGroups = 32;

// a + b rounded once (no contraction into a neighbouring multiply).
__device__ inline float AddRounded(float a, float b) { return __fadd_rn(a, b); }
__device__ inline double AddRounded(double a, double b) { return __dadd_rn(a, b); }

// The total of the block's group sums for column threadIdx.x, in group order (valid in row
// group 0). All of the block's threads take part.
template <typename T>
__device__ T AddGroups(T partial) {
  __shared__ T sums[kSumGroups][kSumColumns + 1];
  sums[threadIdx.y][threadIdx.x] = partial;
  __syncthreads();
  T total = 0;
  if (threadIdx.y == 0) {
    for (int g = 0; g < kSumGroups; ++g) total = AddRounded(total, sums[g][threadIdx.x]);
  }
  __syncthreads();  // the array is reused by the next call
  return total;
}

}  // namespace lockstep::kernels::cuda

#endif  // LOCKSTEP_KERNELS_CUDA_REDUCE_H_
