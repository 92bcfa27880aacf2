#include "worker/cuda/nccl_communicator.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kernels/gpu_check.h"

namespace lockstep::worker {
namespace {

// How often the watchdog looks: short against any timeout, long enough not to burn a core.
constexpr auto kPoll = std::chrono::microseconds(100);

}  // namespace

absl::StatusOr<ncclUniqueId> ExchangeNcclId(StoreClient& store, int rank, absl::Duration timeout) {
  ncclUniqueId id;
  if (rank == 0) {
    LOCKSTEP_GPU_RETURN_IF_ERROR(ncclGetUniqueId(&id));
    LOCKSTEP_RETURN_IF_ERROR(
        store.Set(kNcclIdKey, std::string(id.internal, id.internal + sizeof(id.internal))));
    return id;
  }
  absl::StatusOr<std::string> bytes = store.Get(kNcclIdKey, timeout);
  if (!bytes.ok()) {
    return absl::Status(bytes.status().code(),
                        absl::StrCat("waiting for rank 0's NCCL id: ", bytes.status().message()));
  }
  if (bytes->size() != sizeof(id.internal)) {
    return absl::InternalError(absl::StrCat("store key ", kNcclIdKey, " holds ", bytes->size(),
                                            " bytes, not an NCCL id (", sizeof(id.internal), ")"));
  }
  std::memcpy(id.internal, bytes->data(), bytes->size());
  return id;
}

int NcclRuntimeVersion() {
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess) return 0;
  return version;
}

std::string NcclVersionName(int code) {
  // NCCL_VERSION: X * 1000 + Y * 100 + Z up to 2.8, X * 10000 + Y * 100 + Z after.
  if (code < 10000) return absl::StrCat(code / 1000, ".", code % 1000 / 100, ".", code % 100);
  return absl::StrCat(code / 10000, ".", code % 10000 / 100, ".", code % 100);
}

bool NcclSharedGpuVariableSet() {
  // NCCL reads it as an integer: any value but 0 enables.
  const char* value = std::getenv(kNcclSharedGpuVariable);
  int enabled = 0;
  return value != nullptr && absl::SimpleAtoi(value, &enabled) && enabled != 0;
}

bool NcclSharedGpuAllowed() {
  return NcclRuntimeVersion() >= kNcclSharedGpuVersion && NcclSharedGpuVariableSet();
}

std::string SharedGpuAdvice(absl::string_view nccl_error, int version, bool variable_set) {
  // NCCL's words: "Duplicate GPU detected" before the option existed; "Multiple Ranks are using
  // the same GPU/Partition. Set NCCL_MULTI_RANK_GPU_ENABLE=1 ..." since.
  if (!absl::StrContains(nccl_error, "Duplicate GPU") &&
      !absl::StrContains(nccl_error, "Multiple Ranks are using the same GPU")) {
    return "";
  }
  if (version < kNcclSharedGpuVersion) {
    return absl::StrCat("several ranks of this group are on one GPU, which NCCL ",
                        NcclVersionName(version), " refuses: it needs NCCL ",
                        NcclVersionName(kNcclSharedGpuVersion), " or later with ",
                        kNcclSharedGpuVariable, "=1 (or give each worker its own GPU)");
  }
  if (!variable_set) {
    return absl::StrCat("several ranks of this group are on one GPU: set ",
                        kNcclSharedGpuVariable, "=1 in the workers' environment (NCCL ",
                        NcclVersionName(version), " allows it then), or give each worker its own GPU");
  }
  return "";
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(StoreClient& store,
                                                                         int rank, int size,
                                                                         Options options) {
  absl::StatusOr<ncclUniqueId> id = ExchangeNcclId(store, rank, options.init_timeout);
  if (!id.ok()) return id.status();
  std::unique_ptr<NcclCommunicator> comm(new NcclCommunicator());
  comm->rank_ = rank;
  comm->size_ = size;
  comm->options_ = options;
  if (options.abort != nullptr) {
    NcclCommunicator* raw = comm.get();
    comm->on_abort_ = options.abort->OnRaise([raw] { raw->Abort(); });
  }
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&comm->stream_, cudaStreamNonBlocking));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // init and collectives return at once; we poll (and can abort)
  // A communicator NCCL made and then failed is aborted (Fail), never finalized.
  if (const ncclResult_t r = ncclCommInitRankConfig(&comm->comm_, size, *id, rank, &config);
      r != ncclSuccess && r != ncclInProgress) {
    return comm->Fail(kernels::GpuStatus(r, "ncclCommInitRankConfig", __FILE__, __LINE__));
  }
  const absl::Time deadline = absl::Now() + options.init_timeout;
  while (true) {
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t r = ncclCommGetAsyncError(comm->comm_, &state); r != ncclSuccess) {
      return comm->Fail(kernels::GpuStatus(r, "ncclCommGetAsyncError", __FILE__, __LINE__));
    }
    if (state == ncclSuccess) break;
    if (state != ncclInProgress) {
      absl::Status failed = kernels::GpuStatus(state, "ncclCommInitRankConfig", __FILE__, __LINE__);
      // The refusal of several ranks on one GPU is an invalid usage; NCCL's last error (one
      // text for the process, which its init thread wrote) says which.
      if (state == ncclInvalidUsage) {
        const char* last = ncclGetLastError(comm->comm_);
        const std::string advice = SharedGpuAdvice(last != nullptr ? last : "",
                                                   NcclRuntimeVersion(), NcclSharedGpuVariableSet());
        if (!advice.empty()) {
          failed = absl::FailedPreconditionError(absl::StrCat(advice, " [", failed.message(), "]"));
        }
      }
      return comm->Fail(failed);
    }
    if (comm->abort_requested_) {
      return comm->Fail(absl::AbortedError("aborted during NCCL init"));
    }
    if (absl::Now() > deadline) {
      return comm->Fail(absl::DeadlineExceededError(absl::StrCat(
          "NCCL init of rank ", rank, "/", size, " did not finish within ",
          absl::FormatDuration(options.init_timeout), " (a rank missing or unreachable?)")));
    }
    std::this_thread::sleep_for(kPoll);
  }
  return comm;
}

NcclCommunicator::~NcclCommunicator() {
  on_abort_.Reset();
  if (comm_ != nullptr) {
    // A healthy communicator is finalized (flushes NCCL's pending work); a failed one was
    // aborted already and only needs destroying.
    if (!failed_ && !abort_requested_) {
      ncclCommFinalize(comm_);
      ncclResult_t state = ncclInProgress;
      const absl::Time deadline = absl::Now() + absl::Seconds(5);
      while (state == ncclInProgress && absl::Now() < deadline) {
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
        std::this_thread::sleep_for(kPoll);
      }
      if (state != ncclSuccess) {
        ncclCommAbort(comm_);
      } else {
        ncclCommDestroy(comm_);
      }
    } else {
      ncclCommAbort(comm_);  // after an abort request, or a failure that left it allocated
    }
  }
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status NcclCommunicator::Fail(absl::Status why) {
  if (!failed_ && comm_ != nullptr) {
    ncclCommAbort(comm_);
    comm_ = nullptr;  // abort frees it
  }
  failed_ = true;
  return why;
}

absl::Status NcclCommunicator::AllreduceSum(float* device_data, size_t count) {
  if (failed_) return absl::AbortedError("NCCL communicator already failed");
  return Settle(
      ncclAllReduce(device_data, device_data, count, ncclFloat32, ncclSum, comm_, stream_),
      "ncclAllReduce");
}

absl::Status NcclCommunicator::AllreduceSum(int64_t* device_data, size_t count) {
  if (failed_) return absl::AbortedError("NCCL communicator already failed");
  return Settle(ncclAllReduce(device_data, device_data, count, ncclInt64, ncclSum, comm_, stream_),
                "ncclAllReduce");
}

absl::Status NcclCommunicator::AllreduceSum(double* device_data, size_t count) {
  if (failed_) return absl::AbortedError("NCCL communicator already failed");
  return Settle(
      ncclAllReduce(device_data, device_data, count, ncclFloat64, ncclSum, comm_, stream_),
      "ncclAllReduce");
}

absl::Status NcclCommunicator::Broadcast(void* device_data, size_t bytes, int root) {
  if (failed_) return absl::AbortedError("NCCL communicator already failed");
  return Settle(ncclBroadcast(device_data, device_data, bytes, ncclUint8, root, comm_, stream_),
                "ncclBroadcast");
}

absl::Status NcclCommunicator::Settle(ncclResult_t enqueued, const char* call) {
  if (enqueued != ncclSuccess && enqueued != ncclInProgress) {
    return Fail(kernels::GpuStatus(enqueued, call, __FILE__, __LINE__));
  }
  // A nonblocking communicator may return before the call is fully enqueued; the next NCCL
  // call may only follow once the communicator's state is no longer ncclInProgress.
  const absl::Time deadline = absl::Now() + options_.collective_timeout;
  ncclResult_t state = enqueued;
  while (state == ncclInProgress) {
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
    if (state == ncclSuccess) break;
    if (state != ncclInProgress) {
      return Fail(kernels::GpuStatus(state, call, __FILE__, __LINE__));
    }
    if (abort_requested_) return Fail(absl::AbortedError("collective aborted by the coordinator"));
    if (absl::Now() > deadline) {
      return Fail(absl::DeadlineExceededError(absl::StrCat(
          call, " was not enqueued within ", absl::FormatDuration(options_.collective_timeout))));
    }
    std::this_thread::sleep_for(kPoll);
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Wait() {
  if (failed_) return absl::AbortedError("NCCL communicator already failed");
  const absl::Time deadline = absl::Now() + options_.collective_timeout;
  while (true) {
    // An abort wins even over work that happens to be finished: the generation is over.
    if (abort_requested_) return Fail(absl::AbortedError("collective aborted by the coordinator"));
    const cudaError_t done = cudaStreamQuery(stream_);
    if (done == cudaSuccess) return absl::OkStatus();
    // "Not ready" may be left as the thread's last error; the next launch check must not see it.
    if (done == cudaErrorNotReady) cudaGetLastError();
    if (done != cudaErrorNotReady) {
      return Fail(kernels::GpuStatus(done, "cudaStreamQuery(nccl stream)", __FILE__, __LINE__));
    }
    ncclResult_t state = ncclSuccess;
    if (const ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) {
      state = r;  // the query itself failed: its error is the one to tell
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      return Fail(absl::UnavailableError(absl::StrCat(
          "NCCL reported an error (a peer died or the network failed): ", ncclGetErrorString(state),
          " ", ncclGetLastError(comm_))));
    }
    if (absl::Now() > deadline) {
      return Fail(absl::DeadlineExceededError(
          absl::StrCat("NCCL collective did not finish within ",
                       absl::FormatDuration(options_.collective_timeout), " (a peer hung?)")));
    }
    std::this_thread::sleep_for(kPoll);
  }
}

}  // namespace lockstep::worker
