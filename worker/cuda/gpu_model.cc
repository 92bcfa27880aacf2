#include "worker/cuda/gpu_model.h"

#include "kernels/gpu_check.h"

namespace lockstep::worker {

absl::Status GpuModel::CopyAndWait(void* to, const void* from, size_t bytes, cudaMemcpyKind kind,
                                   cudaStream_t stream) {
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpyAsync(to, from, bytes, kind, stream));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

}  // namespace lockstep::worker
