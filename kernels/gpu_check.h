// One macro for every CUDA runtime, cuBLAS/cuBLASLt and NCCL call: a failure becomes an
// absl::Status carrying the expression, file:line and the library's own message, and returns
// from the calling function (which must return absl::Status or absl::StatusOr). Nothing here
// exits or aborts the process: a worker turns the status into a failed generation and rejoins.
//
//   LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, stream));
//   LOCKSTEP_GPU_RETURN_IF_ERROR(ncclAllReduce(...));   // ncclInProgress is not an error
#ifndef LOCKSTEP_KERNELS_GPU_CHECK_H_
#define LOCKSTEP_KERNELS_GPU_CHECK_H_

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/status/status.h"

namespace lockstep::kernels {

// OK for success (and for ncclInProgress, the normal state of a nonblocking communicator);
// otherwise a status whose message is "EXPR failed at FILE:LINE: LIBRARY MESSAGE". The code
// says what the caller should do: RESOURCE_EXHAUSTED for out-of-memory, FAILED_PRECONDITION
// for a missing or unusable device or driver, INTERNAL for the rest (NCCL's remote and system
// errors are UNAVAILABLE: a peer or the network went away, the generation must be re-formed).
absl::Status GpuStatus(cudaError_t result, const char* expr, const char* file, int line);
absl::Status GpuStatus(cublasStatus_t result, const char* expr, const char* file, int line);
absl::Status GpuStatus(ncclResult_t result, const char* expr, const char* file, int line);

}  // namespace lockstep::kernels

#define LOCKSTEP_GPU_RETURN_IF_ERROR(expr)                                 \
  do {                                                                     \
    ::absl::Status lockstep_gpu_status_ =                                  \
        ::lockstep::kernels::GpuStatus((expr), #expr, __FILE__, __LINE__); \
    if (!lockstep_gpu_status_.ok()) return lockstep_gpu_status_;           \
  } while (false)

#endif  // LOCKSTEP_KERNELS_GPU_CHECK_H_
