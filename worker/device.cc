#include "worker/device.h"

#include <cstring>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#ifdef LOCKSTEP_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace lockstep::worker {
namespace {

// A /proc/meminfo field ("MemAvailable:", "MemTotal:") in bytes; 0 when absent.
int64_t MeminfoBytes(const std::string& field) {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (meminfo >> key >> kib >> unit) {
    if (key == field) return kib * 1024;
  }
  return 0;
}

}  // namespace

std::string GpuUuidString(const unsigned char (&bytes)[16]) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    out += kHex[bytes[i] >> 4];
    out += kHex[bytes[i] & 0xf];
  }
  return out;
}

absl::StatusOr<DeviceInfo> OpenDevice(const std::string& device) {
  DeviceInfo info;
  info.device = device;
  if (device == "cpu") {
    info.name = "cpu";
    info.free_memory_bytes = MeminfoBytes("MemAvailable:");
    info.total_memory_bytes = MeminfoBytes("MemTotal:");
    return info;
  }
  int index = -1;
  if (!absl::StartsWith(device, "cuda:") || !absl::SimpleAtoi(device.substr(5), &index) ||
      index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device=", device, ": expected cpu or cuda:N (N = 0, 1, ...)"));
  }
  info.cuda_index = index;
#ifndef LOCKSTEP_HAVE_CUDA
  return absl::FailedPreconditionError(
      absl::StrCat("--device=", device,
                   ": this build has no CUDA support (no CUDA compiler when it was built)"));
#else
  // cudaGetDeviceCount creates no context; cudaSetDevice makes N the device of every later
  // runtime call in this process, before anything else touches the GPU.
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device=", device, ": no usable CUDA driver on this host (", cudaGetErrorString(e), ")"));
  }
  if (count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device=", device, ": this host has no GPU"));
  }
  if (index >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device=", device, ": this host has ", count, count == 1 ? " GPU" : " GPUs",
                     " (cuda:0", count == 1 ? "" : absl::StrCat(" to cuda:", count - 1), ")"));
  }
  if (cudaError_t e = cudaSetDevice(index); e != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device=", device, ": cannot select it (", cudaGetErrorString(e), ")"));
  }
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaError_t e = cudaMemGetInfo(&free_bytes, &total_bytes); e != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--device=", device, ": cannot create a context on it (", cudaGetErrorString(e), ")"));
  }
  cudaDeviceProp props{};
  if (cudaGetDeviceProperties(&props, index) == cudaSuccess) {
    info.name = props.name;
    unsigned char uuid[16];
    static_assert(sizeof(props.uuid.bytes) == sizeof(uuid));
    std::memcpy(uuid, props.uuid.bytes, sizeof(uuid));
    info.uuid = GpuUuidString(uuid);
  }
  info.free_memory_bytes = static_cast<int64_t>(free_bytes);
  info.total_memory_bytes = static_cast<int64_t>(total_bytes);
  return info;
#endif
}

}  // namespace lockstep::worker
