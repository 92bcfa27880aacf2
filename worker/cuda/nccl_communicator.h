// GPU collectives over NCCL for one generation of one job. Rank 0 of the generation creates the
// NCCL id and publishes it through the coordinator's store, which scopes keys by (job,
// generation): a rank of an older generation can neither read the new id nor join the new
// group. Initialization is nonblocking and polled against a deadline; collectives run on the
// communicator's own stream; Wait() is the watchdog: it polls the stream and NCCL's async error
// against the collective timeout and, on an error, a timeout or Abort(), aborts the NCCL
// communicator so that no rank stays stuck in a dead collective. The worker then reports the
// failure and rejoins the next generation, as a CPU worker does.
//
// Thread safety: one thread issues collectives and Wait(); Abort() may be called from any
// thread (the agent's, on a coordinator abort).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "worker/comm/abort_signal.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store_client.h"

namespace lockstep::worker {

// The NCCL loaded at run time (ncclGetVersion): its version code, NCCL_VERSION's encoding
// (2.30.3 -> 23003), and its name ("2.30.3").
int NcclRuntimeVersion();
std::string NcclVersionName(int code);
// The first NCCL that lets several ranks of one communicator share a GPU, when
// NCCL_MULTI_RANK_GPU_ENABLE=1 is set (older ones refuse: "Duplicate GPU detected"). Tests and
// the GPU check run 2-4 workers on one GPU with it.
inline constexpr int kNcclSharedGpuVersion = 23003;
inline constexpr char kNcclSharedGpuVariable[] = "NCCL_MULTI_RANK_GPU_ENABLE";
// Whether the variable is set (to a nonzero integer, as NCCL reads it), and whether this
// process may put several ranks on one GPU: NCCL new enough and the variable set.
bool NcclSharedGpuVariableSet();
bool NcclSharedGpuAllowed();
// What to tell the user when NCCL's init failed with `nccl_error` (its last error text): for
// a refusal of several ranks on one GPU, which of the two is missing; "" otherwise.
std::string SharedGpuAdvice(absl::string_view nccl_error, int version, bool variable_set);

// The store key under which rank 0 publishes the generation's NCCL id.
inline constexpr char kNcclIdKey[] = "nccl-id";

// Rank 0: creates an id (ncclGetUniqueId needs no GPU; it starts NCCL's bootstrap listener in
// this process, which must live until every rank has joined) and stores it. Other ranks: wait
// up to `timeout` for it. The store's status comes back with its code: DEADLINE_EXCEEDED names
// the key when rank 0 never published it, ABORTED when the generation ended or the store
// client's abort signal was raised, UNAVAILABLE when the coordinator is unreachable.
absl::StatusOr<ncclUniqueId> ExchangeNcclId(StoreClient& store, int rank, absl::Duration timeout);

class NcclCommunicator final : public DeviceGroup {
 public:
  struct Options {
    absl::Duration init_timeout = absl::Seconds(60);
    absl::Duration collective_timeout = absl::Seconds(30);
    // Raised by the agent when the coordinator aborts the generation: ends a pending init
    // early and makes Wait() abort the communicator.
    std::shared_ptr<AbortSignal> abort;
  };
  // Exchanges the id, then initializes rank `rank` of `size` on the current device (the worker
  // selected it at start) with a nonblocking communicator, polled until ready or the deadline.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(StoreClient& store, int rank,
                                                                  int size, Options options);
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  cudaStream_t stream() const { return stream_; }

  // Enqueue in-place sums and a broadcast on stream(); they return once enqueued. Work the
  // caller did on another stream must be made visible first (an event the stream waits on).
  absl::Status AllreduceSum(float* device_data, size_t count);
  absl::Status AllreduceSum(int64_t* device_data, size_t count);
  absl::Status AllreduceSum(double* device_data, size_t count);
  absl::Status Broadcast(void* device_data, size_t bytes, int root);

  // Waits until everything enqueued has finished. ABORTED after Abort(), DEADLINE_EXCEEDED
  // after the collective timeout (a peer hung), UNAVAILABLE on an NCCL error (a peer died):
  // in all three cases the NCCL communicator has been aborted and this object is finished.
  absl::Status Wait();
  // Any thread: makes Wait() (and the init poll) abort the communicator and return ABORTED.
  void Abort() { abort_requested_ = true; }

 private:
  NcclCommunicator() = default;
  // Aborts the NCCL communicator once; returns `why`.
  absl::Status Fail(absl::Status why);
  // After a collective was called: waits (bounded, abortable) until a nonblocking communicator
  // has finished enqueuing it; fails the communicator on an error.
  absl::Status Settle(ncclResult_t enqueued, const char* call);

  int rank_ = 0;
  int size_ = 0;
  Options options_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::atomic<bool> abort_requested_{false};
  bool failed_ = false;
  AbortSignal::Subscription on_abort_;
};

}  // namespace lockstep::worker
