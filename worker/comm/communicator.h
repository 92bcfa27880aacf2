// The collective operations a training step needs, independent of the transport (Gloo over
// TCP, shared memory between ranks on one host). One communicator serves one generation of one
// job. A device's own group (a GPU's NCCL communicator, which sums device memory) is a
// DeviceGroup beside it, used only by that device's step engine.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace lockstep::worker {

// Calls on one communicator must come from one thread at a time, in the same order on every
// rank. Errors: UNAVAILABLE when a peer is gone or the transport failed, DEADLINE_EXCEEDED when
// an operation outlived the collective timeout; either way the generation is over.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In-place sum over all ranks.
  virtual absl::Status AllreduceSum(float* data, size_t count) = 0;
  virtual absl::Status AllreduceSum(double* data, size_t count) = 0;
  virtual absl::Status AllreduceSum(int64_t* data, size_t count) = 0;
  // Copies `bytes` from `root` to every rank.
  virtual absl::Status Broadcast(void* data, size_t bytes, int root) = 0;
  virtual absl::Status Barrier() = 0;
  // Optional zero-copy sums of one int64 buffer in pieces (deterministic mode's gradient):
  // StagingInt64(count) returns memory for `count` values that this rank fills with its
  // contribution, or nullptr when the transport has no such memory (then use AllreduceSum).
  // SumStagedInt64(offset, n) sums [offset, offset + n) over every rank's staging memory into
  // StagedResultInt64()[offset, offset + n). The staging memory may be rewritten, and the
  // result read, until the next call of any collective on this communicator: every rank
  // must issue the same sequence of sums. Other collectives may reuse both memories.
  virtual int64_t* StagingInt64(size_t count) { return nullptr; }
  virtual absl::Status SumStagedInt64(size_t offset, size_t count) {
    return absl::UnimplementedError("no staged sums on this transport");
  }
  virtual const int64_t* StagedResultInt64() const { return nullptr; }
  // Makes operations blocked on peers return ABORTED as soon as the transport allows (Gloo
  // cannot be interrupted: its operations end at their timeout). Any thread may call it.
  virtual void Abort() {}
};

// A device's own collective group for one generation (worker/cuda/nccl_communicator.h): made
// by the device's backend, handed to the device's step engine where it begins and where it
// heals (worker/step/step_engine.h); nothing else looks inside.
class DeviceGroup {
 public:
  virtual ~DeviceGroup() = default;
};

}  // namespace lockstep::worker
