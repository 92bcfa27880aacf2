#include "kernels/device_memory.h"

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace lockstep::kernels::cuda {
namespace {

struct Ledger {
  absl::Mutex mu;
  absl::flat_hash_map<void*, size_t> sizes ABSL_GUARDED_BY(mu);
  int64_t in_use ABSL_GUARDED_BY(mu) = 0;
};

Ledger& TheLedger() {
  static Ledger* ledger = new Ledger();  // never destroyed: frees may run at exit
  return *ledger;
}

}  // namespace

cudaError_t DeviceMallocBytes(void** ptr, size_t bytes) {
  const cudaError_t e = cudaMalloc(ptr, bytes);
  if (e != cudaSuccess) return e;
  Ledger& ledger = TheLedger();
  absl::MutexLock lock(&ledger.mu);
  ledger.sizes[*ptr] = bytes;
  ledger.in_use += static_cast<int64_t>(bytes);
  return e;
}

cudaError_t DeviceFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  {
    Ledger& ledger = TheLedger();
    absl::MutexLock lock(&ledger.mu);
    if (auto it = ledger.sizes.find(ptr); it != ledger.sizes.end()) {
      ledger.in_use -= static_cast<int64_t>(it->second);
      ledger.sizes.erase(it);
    }
  }
  return cudaFree(ptr);
}

int64_t DeviceBytesInUse() {
  Ledger& ledger = TheLedger();
  absl::MutexLock lock(&ledger.mu);
  return ledger.in_use;
}

}  // namespace lockstep::kernels::cuda
