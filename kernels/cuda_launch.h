// What the CUDA kernel files share to launch their kernels: the block size, a grid size for
// grid-stride loops, and the status of a launch. Internal to kernels/*.cu.
#ifndef LOCKSTEP_KERNELS_CUDA_LAUNCH_H_
#define LOCKSTEP_KERNELS_CUDA_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/status.h"
#include "kernels/gpu_check.h"

namespace lockstep::kernels::cuda {

inline constexpr int kThreads = 256;
// Enough blocks to fill an H200 (132 SMs) several times over; grid-stride loops do the rest.
inline constexpr int kMaxBlocks = 132 * 16;

// Blocks of kThreads for n elements, at least 1 and at most kMaxBlocks.
inline int Blocks(size_t n) {
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < kMaxBlocks ? (blocks == 0 ? 1 : blocks) : kMaxBlocks);
}

// Launch errors (a bad configuration, no device) surface here, named after the kernel;
// execution errors surface at the stream's next synchronization, as for every asynchronous
// CUDA call.
inline absl::Status LaunchStatus(const char* kernel) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return absl::OkStatus();
  return GpuStatus(error, kernel, __FILE__, __LINE__);
}

}  // namespace lockstep::kernels::cuda

#endif  // LOCKSTEP_KERNELS_CUDA_LAUNCH_H_
