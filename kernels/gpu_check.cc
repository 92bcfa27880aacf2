#include "kernels/gpu_check.h"

#include "absl/strings/str_cat.h"

namespace lockstep::kernels {
namespace {

std::string Where(const char* expr, const char* file, int line) {
  return absl::StrCat(expr, " failed at ", file, ":", line, ": ");
}

}  // namespace

absl::Status GpuStatus(cudaError_t result, const char* expr, const char* file, int line) {
  if (result == cudaSuccess) return absl::OkStatus();
  // The runtime also keeps the error as the thread's last error, where the next kernel launch
  // check would find it and blame that kernel. Reported here, so cleared (a sticky error, one
  // that broke the context, comes back from every later call anyway).
  cudaGetLastError();
  const std::string message = absl::StrCat(Where(expr, file, line), cudaGetErrorName(result), ": ",
                                           cudaGetErrorString(result));
  switch (result) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorDeviceUninitialized:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status GpuStatus(cublasStatus_t result, const char* expr, const char* file, int line) {
  if (result == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message = absl::StrCat(Where(expr, file, line), cublasGetStatusName(result),
                                           ": ", cublasGetStatusString(result));
  if (result == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  if (result == CUBLAS_STATUS_NOT_INITIALIZED || result == CUBLAS_STATUS_ARCH_MISMATCH) {
    return absl::FailedPreconditionError(message);
  }
  return absl::InternalError(message);
}

absl::Status GpuStatus(ncclResult_t result, const char* expr, const char* file, int line) {
  if (result == ncclSuccess || result == ncclInProgress) return absl::OkStatus();
  const std::string message = absl::StrCat(Where(expr, file, line), ncclGetErrorString(result),
                                           " (", ncclGetLastError(nullptr), ")");
  switch (result) {
    case ncclRemoteError:
    case ncclSystemError:
      return absl::UnavailableError(message);
    default:
      // ncclInvalidArgument and ncclInvalidUsage too: a misuse of NCCL or a broken
      // communicator (it can follow a peer's failure), not a spec no group could run.
      return absl::InternalError(message);
  }
}

}  // namespace lockstep::kernels
