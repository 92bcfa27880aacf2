// Device memory that the process allocates through these instead of cudaMalloc / cudaFree is
// counted, so a GPU worker knows what its kept state holds: the memory budget of a later
// generation is what is free plus what the worker itself already holds (it reuses that).
// Thread-safe.
#ifndef LOCKSTEP_KERNELS_DEVICE_MEMORY_H_
#define LOCKSTEP_KERNELS_DEVICE_MEMORY_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace lockstep::kernels::cuda {

// cudaMalloc and cudaFree, counted (a null pointer frees nothing, as cudaFree).
cudaError_t DeviceMallocBytes(void** ptr, size_t bytes);
cudaError_t DeviceFree(void* ptr);
template <typename T>
cudaError_t DeviceMalloc(T** ptr, size_t bytes) {
  return DeviceMallocBytes(reinterpret_cast<void**>(ptr), bytes);
}
// Bytes allocated through DeviceMalloc and not yet freed, in this process, on every device.
int64_t DeviceBytesInUse();

}  // namespace lockstep::kernels::cuda

#endif  // LOCKSTEP_KERNELS_DEVICE_MEMORY_H_
