// Gloo communicator. Gloo reports failures by exception; they stop here and become statuses.
#include "worker/comm/gloo_communicator.h"

#include "absl/strings/str_cat.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"

namespace lockstep::worker {
namespace {

absl::Status FromException(const char* op, const std::exception& e) {
  const std::string what = e.what();
  if (what.find("Timed out") != std::string::npos || what.find("timed out") != std::string::npos) {
    return absl::DeadlineExceededError(absl::StrCat(op, ": ", what));
  }
  return absl::UnavailableError(absl::StrCat(op, ": ", what));
}

}  // namespace

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    int rank, int size, gloo::rendezvous::Store& store, const std::string& hostname,
    std::chrono::milliseconds timeout) {
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(timeout);
    context->connectFullMesh(store, device);
    return std::unique_ptr<GlooCommunicator>(
        new GlooCommunicator(rank, size, std::move(context), timeout));
  } catch (const std::exception& e) {
    return FromException("forming the Gloo group", e);
  }
}

GlooCommunicator::GlooCommunicator(int rank, int size, std::shared_ptr<gloo::Context> context,
                                   std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), context_(std::move(context)), timeout_(timeout) {}

GlooCommunicator::~GlooCommunicator() = default;

template <typename T>
absl::Status GlooCommunicator::Allreduce(T* data, size_t count) {
  if (size_ == 1 || count == 0) return absl::OkStatus();
  try {
    gloo::AllreduceOptions opts(context_);
    opts.setOutput(data, count);
    opts.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<T>));
    // Ring is the fastest on loopback and TCP here (FACTS.md); never BCUBE (wrong sums at 3).
    opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
    opts.setTimeout(timeout_);
    gloo::allreduce(opts);
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return FromException("allreduce", e);
  }
}

absl::Status GlooCommunicator::AllreduceSum(float* data, size_t count) {
  return Allreduce(data, count);
}
absl::Status GlooCommunicator::AllreduceSum(double* data, size_t count) {
  return Allreduce(data, count);
}
absl::Status GlooCommunicator::AllreduceSum(int64_t* data, size_t count) {
  return Allreduce(data, count);
}

absl::Status GlooCommunicator::Broadcast(void* data, size_t bytes, int root) {
  if (size_ == 1 || bytes == 0) return absl::OkStatus();
  try {
    gloo::BroadcastOptions opts(context_);
    opts.setOutput(static_cast<uint8_t*>(data), bytes);
    opts.setRoot(root);
    opts.setTimeout(timeout_);
    gloo::broadcast(opts);
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return FromException("broadcast", e);
  }
}

absl::Status GlooCommunicator::Barrier() {
  if (size_ == 1) return absl::OkStatus();
  try {
    gloo::BarrierOptions opts(context_);
    opts.setTimeout(timeout_);
    gloo::barrier(opts);
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return FromException("barrier", e);
  }
}

}  // namespace lockstep::worker
