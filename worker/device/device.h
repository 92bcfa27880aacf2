// The device a worker owns. For cuda:N the GPU is selected before any other CUDA call, so the
// process never creates a context on another GPU (the classic cause of every rank landing on
// GPU 0, and of out-of-memory errors after a move to DDP).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace lockstep::worker {

struct DeviceInfo {
  std::string device;             // "cpu" or "cuda:N", as given
  int cuda_index = -1;            // N for cuda:N
  std::string name;               // e.g. "NVIDIA H200"; "cpu" for CPU workers
  int64_t free_memory_bytes = 0;  // device memory, or the host's MemAvailable for CPU workers
  int64_t total_memory_bytes = 0;
  std::string uuid;               // the GPU's UUID ("GPU-8a5d3e1f-..."); empty for CPU workers
};

// A GPU's 16-byte UUID as nvidia-smi and NVML write it: "GPU-" and 32 lowercase hex digits in
// groups of 8-4-4-4-12.
std::string GpuUuidString(const unsigned char (&bytes)[16]);

// Parses and opens `device`. Errors say what is wrong with the flag, in words a user can act
// on: INVALID_ARGUMENT for a malformed value ("gpu0"), FAILED_PRECONDITION for a device this
// host or build does not have ("cuda:7: this host has 2 GPUs (cuda:0 to cuda:1)", no CUDA
// driver, no CUDA support in this build).
absl::StatusOr<DeviceInfo> OpenDevice(const std::string& device);

}  // namespace lockstep::worker
