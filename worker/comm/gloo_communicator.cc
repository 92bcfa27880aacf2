// Gloo communicator: every Gloo call on the communicator's own thread, abandoned on abort.
// Gloo reports failures by exception; they stop here and become statuses. A timeout is told
// from other failures by the time the call took (Gloo 0.5 throws the same exception type for
// both, and its text is not a contract).
#include "worker/comm/gloo_communicator.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/context.h"
#include "gloo/transport/tcp/device.h"
#include "glog/logging.h"
#include "worker/comm/gloo_store.h"

namespace lockstep::worker {

// The thread that makes the Gloo calls, and the one call it runs at a time. Shared by the
// communicator and the thread, so an abandoned call keeps what it needs.
struct GlooCommunicator::Thread {
  absl::Mutex mu;
  std::function<void()> task ABSL_GUARDED_BY(mu);
  bool running ABSL_GUARDED_BY(mu) = false;
  uint64_t submitted ABSL_GUARDED_BY(mu) = 0;
  uint64_t finished ABSL_GUARDED_BY(mu) = 0;
  bool stop ABSL_GUARDED_BY(mu) = false;
  bool aborted ABSL_GUARDED_BY(mu) = false;
  bool exited ABSL_GUARDED_BY(mu) = false;
  std::thread thread;

  void Loop() {
    while (true) {
      std::function<void()> next;
      {
        absl::MutexLock lock(&mu);
        mu.Await(absl::Condition(
            +[](Thread* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu) { return t->task || t->stop; },
            this));
        if (!task) {
          exited = true;
          return;
        }
        next = std::move(task);
        task = nullptr;
        running = true;
      }
      next();
      absl::MutexLock lock(&mu);
      running = false;
      ++finished;
    }
  }
};

namespace {

absl::Mutex g_graveyard_mu(absl::kConstInit);

// Threads of abandoned calls: joined once their call has returned; whatever is still running
// at exit is left to the process's end.
struct Abandoned {
  std::shared_ptr<void> owner;  // keeps the Thread alive
  std::thread* thread;
  std::function<bool()> exited;
};

std::vector<Abandoned>& AbandonedList() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_graveyard_mu) {
  static std::vector<Abandoned>* list = new std::vector<Abandoned>;
  return *list;
}

// Joins the abandoned threads whose call has returned.
void ReapAbandoned() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_graveyard_mu) {
  std::vector<Abandoned>& list = AbandonedList();
  for (auto it = list.begin(); it != list.end();) {
    if (it->exited()) {
      it->thread->join();
      it = list.erase(it);
    } else {
      ++it;
    }
  }
}

absl::Status FromException(const char* what, const std::exception& e, absl::Duration took,
                           std::chrono::milliseconds timeout) {
  if (took >= absl::FromChrono(timeout)) {
    return absl::DeadlineExceededError(absl::StrCat(what, " did not complete within ",
                                                    timeout.count(), " ms: ", e.what()));
  }
  return absl::UnavailableError(absl::StrCat(what, ": ", e.what()));
}

}  // namespace

int GlooCommunicator::AbandonedThreads() {
  absl::MutexLock lock(&g_graveyard_mu);
  ReapAbandoned();
  return static_cast<int>(AbandonedList().size());
}

GlooCommunicator::GlooCommunicator(int rank, int size, std::chrono::milliseconds timeout,
                                   std::shared_ptr<AbortSignal> abort)
    : rank_(rank), size_(size), timeout_(timeout), thread_(std::make_shared<Thread>()),
      abort_(std::move(abort)) {
  Thread* t = thread_.get();
  t->thread = std::thread([t] { t->Loop(); });
  if (abort_ != nullptr) on_abort_ = abort_->OnRaise([this] { Abort(); });
}

GlooCommunicator::~GlooCommunicator() {
  on_abort_.Reset();
  bool running = false;
  {
    absl::MutexLock lock(&thread_->mu);
    thread_->stop = true;
    thread_->task = nullptr;
    running = thread_->running;
  }
  context_.reset();  // the abandoned call, if any, holds its own reference
  if (!running) {
    thread_->thread.join();
    return;
  }
  LOG(INFO) << "rank " << rank_ << ": a Gloo call blocked on a peer is abandoned; its thread "
            << "ends at the collective timeout (" << timeout_.count() << " ms)";
  std::shared_ptr<Thread> t = thread_;
  absl::MutexLock lock(&g_graveyard_mu);
  ReapAbandoned();
  AbandonedList().push_back({t, &t->thread, [t] {
                               absl::MutexLock l(&t->mu);
                               return t->exited;
                             }});
}

void GlooCommunicator::Abort() {
  absl::MutexLock lock(&thread_->mu);
  thread_->aborted = true;
}

absl::Status GlooCommunicator::Run(const char* what, std::function<absl::Status()> op) {
  auto result = std::make_shared<absl::Status>();
  Thread* t = thread_.get();
  absl::MutexLock lock(&t->mu);
  if (t->aborted) return absl::AbortedError(absl::StrCat(what, ": the generation was aborted"));
  if (t->running || t->task) {
    return absl::AbortedError(absl::StrCat(what, ": an earlier call was abandoned"));
  }
  const uint64_t seq = ++t->submitted;
  t->task = [op = std::move(op), result] { *result = op(); };
  struct Args {
    Thread* t;
    uint64_t seq;
  } args{t, seq};
  t->mu.Await(absl::Condition(
      +[](Args* a) ABSL_EXCLUSIVE_LOCKS_REQUIRED(a->t->mu) {
        return a->t->finished >= a->seq || a->t->aborted;
      },
      &args));
  if (t->finished >= seq) return *result;
  return absl::AbortedError(absl::StrCat(what, ": the generation was aborted"));
}

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    int rank, int size, std::shared_ptr<StoreClient> store, const std::string& hostname,
    std::chrono::milliseconds timeout, std::shared_ptr<AbortSignal> abort) {
  std::unique_ptr<GlooCommunicator> comm(new GlooCommunicator(rank, size, timeout, abort));
  auto gloo_store = std::make_shared<GlooStore>(std::move(store), absl::FromChrono(timeout));
  auto formed = std::make_shared<std::shared_ptr<gloo::Context>>();
  absl::Status s = comm->Run("forming the Gloo group", [=]() -> absl::Status {
    const absl::Time start = absl::Now();
    try {
      gloo::transport::tcp::attr attr;
      attr.hostname = hostname;
      std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
      context->setTimeout(timeout);
      context->connectFullMesh(*gloo_store, device);
      *formed = std::move(context);
      return absl::OkStatus();
    } catch (const std::exception& e) {
      // A store failure keeps its own code (ABORTED: the generation ended, ...).
      if (absl::Status f = gloo_store->failure(); !f.ok()) {
        return absl::Status(f.code(), absl::StrCat("forming the Gloo group: ", f.message()));
      }
      return FromException("forming the Gloo group", e, absl::Now() - start, timeout);
    }
  });
  if (!s.ok()) return s;
  comm->context_ = *formed;
  return comm;
}

std::shared_ptr<std::vector<uint8_t>> GlooCommunicator::Buffer(size_t bytes) {
  // One buffer serves every call (they run one at a time); it grows to the largest call and
  // stays, so a step's buckets cost a copy each way and no allocation. An abandoned call keeps
  // it, and its communicator takes no further call.
  if (buffer_ == nullptr) buffer_ = std::make_shared<std::vector<uint8_t>>();
  if (buffer_->size() < bytes) buffer_->resize(bytes);
  return buffer_;
}

template <typename T>
absl::Status GlooCommunicator::Allreduce(T* data, size_t count) {
  if (size_ == 1 || count == 0) return absl::OkStatus();
  std::shared_ptr<std::vector<uint8_t>> buffer = Buffer(count * sizeof(T));
  T* const staged = reinterpret_cast<T*>(buffer->data());
  std::memcpy(staged, data, count * sizeof(T));
  std::shared_ptr<gloo::Context> context = context_;
  const auto timeout = timeout_;
  absl::Status s = Run("allreduce", [buffer, staged, count, context, timeout]() -> absl::Status {
    const absl::Time start = absl::Now();
    try {
      gloo::AllreduceOptions opts(context);
      opts.setOutput(staged, count);
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<T>));
      // Ring is the fastest on loopback and TCP here; never BCUBE (wrong sums with 3 ranks).
      opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      opts.setTimeout(timeout);
      gloo::allreduce(opts);
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return FromException("allreduce", e, absl::Now() - start, timeout);
    }
  });
  if (s.ok()) std::memcpy(data, staged, count * sizeof(T));
  return s;
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
  std::shared_ptr<std::vector<uint8_t>> buffer = Buffer(bytes);
  if (rank_ == root) std::memcpy(buffer->data(), data, bytes);
  std::shared_ptr<gloo::Context> context = context_;
  const auto timeout = timeout_;
  absl::Status s = Run("broadcast", [buffer, bytes, context, timeout, root]() -> absl::Status {
    const absl::Time start = absl::Now();
    try {
      gloo::BroadcastOptions opts(context);
      opts.setOutput(buffer->data(), bytes);
      opts.setRoot(root);
      opts.setTimeout(timeout);
      gloo::broadcast(opts);
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return FromException("broadcast", e, absl::Now() - start, timeout);
    }
  });
  if (s.ok() && rank_ != root) std::memcpy(data, buffer->data(), bytes);
  return s;
}

absl::Status GlooCommunicator::Barrier() {
  if (size_ == 1) return absl::OkStatus();
  std::shared_ptr<gloo::Context> context = context_;
  const auto timeout = timeout_;
  return Run("barrier", [context, timeout]() -> absl::Status {
    const absl::Time start = absl::Now();
    try {
      gloo::BarrierOptions opts(context);
      opts.setTimeout(timeout);
      gloo::barrier(opts);
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return FromException("barrier", e, absl::Now() - start, timeout);
    }
  });
}

}  // namespace lockstep::worker
