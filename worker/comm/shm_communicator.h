// Intra-host fast path: float sums through a shared-memory segment when every rank of the
// group runs on this host (the common case of several workers per machine), with the Gloo
// group underneath for everything else. Loopback TCP moves about 1 GB/s here and costs two
// copies through the kernel per hop; shared memory needs one pass over each rank's data.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/comm/abort_signal.h"
#include "worker/comm/communicator.h"

namespace lockstep::worker {

class ShmCommunicator final : public Communicator {
 public:
  // Tries to map one segment shared by all ranks of `base` for float and int64 sums of up to
  // `max_bytes` per call. Every rank must call it (it uses `base` collectively). Returns `base`
  // itself when the ranks do not share a host (or /dev/shm), so callers need not care. A raised
  // `abort` (may be null) wakes every shared-memory wait (Abort()).
  //
  // The segment's name exists only while the ranks map it: rank 0 unlinks it as soon as every
  // rank has tried (the mappings outlive the name), and on every failure path. A name left by a
  // process killed inside that window is removed by SweepStaleSegments.
  static absl::StatusOr<std::unique_ptr<Communicator>> Wrap(
      std::unique_ptr<Communicator> base, size_t max_bytes, std::chrono::milliseconds timeout,
      std::shared_ptr<AbortSignal> abort = nullptr);
  // Unlinks /dev/shm/lockstep-PID-NS-* segments whose process is gone: PID is dead in this pid
  // namespace (NS, so a container sharing /dev/shm is never mistaken for dead), or the name is
  // older than any setup can take. Returns how many it removed. Called at worker start.
  static int SweepStaleSegments();
  ~ShmCommunicator() override;

  int rank() const override { return base_->rank(); }
  int size() const override { return base_->size(); }
  // Shared memory for up to max_bytes, Gloo beyond.
  absl::Status AllreduceSum(float* data, size_t count) override;
  absl::Status AllreduceSum(double* data, size_t count) override;
  absl::Status AllreduceSum(int64_t* data, size_t count) override;
  absl::Status Broadcast(void* data, size_t bytes, int root) override;
  absl::Status Barrier() override;
  // The staging memory is this rank's slot of the segment and the result its result area: a
  // staged sum skips Sum's copy in and copy out (2 x 8 bytes per value, which is what made
  // deterministic mode's int64 gradient cost twice the float one).
  // Why reuse is safe without more synchronization: a sum's reduce starts only when every
  // rank has arrived, and a rank leaves it only when every rank has reduced. So (1) a rank that
  // rewrites its slot for the next step has seen every peer finish reading it (its own last
  // sum of this step returned), and (2) a peer overwrites the result of this step only in the
  // next sum, which no rank enters before it has finished reading the result (it arrives
  // there after its update). Pieces of one step use disjoint ranges.
  int64_t* StagingInt64(size_t count) override;
  absl::Status SumStagedInt64(size_t offset, size_t count) override;
  const int64_t* StagedResultInt64() const override;
  // Wakes any rank waiting in a shared-memory collective; they return ABORTED.
  void Abort() override;

 private:
  struct Header;
  ShmCommunicator(std::unique_ptr<Communicator> base, void* mapping, size_t mapping_bytes,
                  size_t max_bytes, std::chrono::milliseconds timeout,
                  std::shared_ptr<AbortSignal> abort);
  template <typename T>
  absl::Status Sum(T* data, size_t count);
  // Sums elements [offset, offset + count) of every slot into result_, each rank its share.
  template <typename T>
  absl::Status ReduceSlots(size_t offset, size_t count);
  // Waits until `counter` reaches `target`; ABORTED or DEADLINE_EXCEEDED otherwise.
  absl::Status WaitFor(std::atomic<uint32_t>& counter, uint32_t target, const char* phase);

  std::unique_ptr<Communicator> base_;
  void* mapping_;
  size_t mapping_bytes_;
  Header* header_;
  char* slots_;   // size() slots of max_bytes_ each
  char* result_;  // max_bytes_
  const size_t max_bytes_;
  const std::chrono::milliseconds timeout_;
  uint32_t ops_ = 0;  // collectives issued so far (identical on every rank)
  std::atomic<bool> aborted_{false};
  std::shared_ptr<AbortSignal> abort_;  // outlives on_abort_
  AbortSignal::Subscription on_abort_;
};

}  // namespace lockstep::worker
