// A build without CUDA (CMake compiles this file instead of cuda_backend.cc): no GPU opens.
#include "absl/strings/str_cat.h"
#include "worker/device/backend.h"

namespace lockstep::worker {

absl::Status OpenCudaDevice(DeviceInfo& info) {
  return absl::FailedPreconditionError(
      absl::StrCat("--device=", info.device,
                   ": this build has no CUDA support (no CUDA compiler when it was built)"));
}

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend(DeviceInfo device) {
  return OpenCudaDevice(device);
}

}  // namespace lockstep::worker
