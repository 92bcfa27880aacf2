// What a generation borrows from the worker's device. A backend budgets a job on the device and
// attaches what runs its steps there (an engine, a collective group of the device's own) for one
// generation; the attachment gives them back when it is destroyed, before the generation's
// communicators go. The CPU backend attaches nothing: the trainer's own CPU engine runs the
// steps over the generation's Gloo (or shared-memory) communicator. The CUDA backend
// (cuda_backend.cc, the worker's only CUDA file outside worker/cuda, chosen by CMake) gives the
// trainer its GPU step (kept across generations) and attaches the generation's NCCL
// communicator, which the trainer hands the step where it heals and begins. A job kind that
// runs no built-in engine is one more backend, not a branch in the generation.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lockstep/v1/job.pb.h"
#include "lockstep/v1/worker.pb.h"
#include "worker/comm/abort_signal.h"
#include "worker/comm/store_client.h"
#include "worker/device/device.h"
#include "worker/train/trainer.h"

namespace lockstep::worker {

// Held for one generation; destroying it closes what Attach opened (after the generation's
// training ended: the engine holds the group only between its Begin and End).
class DeviceAttachment {
 public:
  virtual ~DeviceAttachment() = default;
  // The device's own collective group for this generation (null: none).
  virtual DeviceGroup* group() { return nullptr; }
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  // The device, as opened (OpenDevice).
  virtual const DeviceInfo& info() const = 0;
  // What this device lets the coordinator do, registered with the worker (e.g. several ranks
  // of a group on one GPU).
  virtual std::vector<std::string> capabilities() const = 0;
  // For assignment `a`: sets `trainer`'s memory budget from what the device has free, and
  // attaches the device's engine and collectives (formed through `store`, watching `abort`).
  // Errors carry the codes of worker/generation.h's IsFatal rule.
  virtual absl::StatusOr<std::unique_ptr<DeviceAttachment>> Attach(
      const v1::Assignment& a, Trainer& trainer, StoreClient& store,
      const std::shared_ptr<AbortSignal>& abort) = 0;
};

// The backend of an opened device: the CPU's, or (in a build with CUDA) the GPU's.
// FAILED_PRECONDITION for a GPU in a build without CUDA.
absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeDeviceBackend(const DeviceInfo& device);

// Shared by the backends: lets the trainer plan with the memory free now, less
// `margin_percent` (what the estimate does not count: the allocator's rounding and
// fragmentation, the runtimes' own buffers; on a CPU worker, everything else on the host), and
// logs when its share goes through in micro-batches (gradient accumulation).
void SetMemoryBudget(Trainer& trainer, const v1::JobSpec& spec, const v1::Assignment& a,
                     int64_t free_bytes, int margin_percent);

// The CPU's backend (every build has it).
std::unique_ptr<DeviceBackend> MakeCpuBackend(DeviceInfo device);

// In device/cuda_backend.cc, or device/no_cuda.cc in a build without CUDA (CMake picks one).
// Opens cuda:N into `info` (device and cuda_index set): FAILED_PRECONDITION saying why not.
absl::Status OpenCudaDevice(DeviceInfo& info);
absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeCudaBackend(DeviceInfo device);

}  // namespace lockstep::worker
