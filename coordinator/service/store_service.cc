// StoreService: the bootstrap key-value store used to form communicator groups. Get and Wait
// hold no thread while they wait: the store finishes the call when the key arrives.
#include <atomic>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/auth.h"
#include "common/grpc_status.h"
#include "coordinator/service/services.h"

namespace lockstep::coordinator {
namespace {

// Longest a single Get/Wait may block; clients loop for longer waits.
constexpr absl::Duration kMaxWait = absl::Seconds(300);
constexpr size_t kMaxValueBytes = 1 << 20;

grpc::Status CheckScope(const std::string& job_id, int64_t generation) {
  if (job_id.empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id: required");
  if (generation <= 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("generation: must be > 0, got ", generation));
  }
  return grpc::Status::OK;
}

absl::Duration WaitTimeout(int64_t timeout_ms) {
  if (timeout_ms <= 0) return absl::Seconds(30);
  return std::min(absl::Milliseconds(timeout_ms), kMaxWait);
}

// A Get or Wait in flight. The store's callback fills the response and finishes the call
// (exactly once); a cancelled call cancels its wait. The reactor goes once both Start has
// returned and gRPC is done with it: the wait may end on another thread while Start still runs.
class StoreWaitReactor final : public grpc::ServerUnaryReactor {
 public:
  // The call's reactor: refused with `status` when that is not OK, else waiting.
  static grpc::ServerUnaryReactor* Begin(Coordinator* coordinator, const grpc::Status& status,
                                         const std::string& session_key, const std::string& job_id,
                                         int64_t generation, std::vector<std::string> keys,
                                         absl::Duration timeout,
                                         std::function<void(std::string)> on_value) {
    auto* reactor = new StoreWaitReactor(coordinator);
    if (!status.ok()) {
      reactor->Finish(status);
      reactor->Release();
    } else {
      reactor->Start(session_key, job_id, generation, std::move(keys), timeout,
                     std::move(on_value));
    }
    return reactor;
  }

  void OnCancel() override {
    BootstrapStore::WaitId id = 0;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      if (!started_) return;  // Start cancels it
      id = id_;
    }
    coordinator_->CancelStoreWait(id);  // a wait that ended already is left alone
  }

  void OnDone() override { Release(); }

 private:
  explicit StoreWaitReactor(Coordinator* coordinator) : coordinator_(coordinator) {}

  void Start(const std::string& session_key, const std::string& job_id, int64_t generation,
             std::vector<std::string> keys, absl::Duration timeout,
             std::function<void(std::string)> on_value) {
    const BootstrapStore::WaitId id = coordinator_->StoreWaitAsync(
        session_key, job_id, generation, std::move(keys), timeout,
        [this, on_value = std::move(on_value)](absl::StatusOr<std::string> value) {
          if (value.ok() && on_value) on_value(*std::move(value));
          Finish(ToGrpcStatus(value.status()));
        });
    bool cancel = false;
    {
      absl::MutexLock lock(&mu_);
      id_ = id;
      started_ = true;
      cancel = cancelled_;
    }
    if (cancel) coordinator_->CancelStoreWait(id);
    Release();
  }

  void Release() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  Coordinator* const coordinator_;
  std::atomic<int> refs_{2};  // Start (or Refuse), and OnDone
  absl::Mutex mu_;
  BootstrapStore::WaitId id_ ABSL_GUARDED_BY(mu_) = 0;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

grpc::Status StoreServiceImpl::Set(grpc::ServerContext* context, const v1::StoreSetRequest* request,
                                   v1::StoreSetResponse*) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kWorker); !s.ok()) return s;
  if (auto s = CheckScope(request->job_id(), request->generation()); !s.ok()) return s;
  if (request->key().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "key: required");
  }
  if (request->value().size() > kMaxValueBytes) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("value: ", request->value().size(), " bytes exceeds the ",
                                     kMaxValueBytes, "-byte limit"));
  }
  return ToGrpcStatus(coordinator_->StoreSet(SessionKey(*context), request->job_id(),
                                             request->generation(), request->key(),
                                             request->value()));
}

grpc::Status StoreServiceImpl::Add(grpc::ServerContext* context, const v1::StoreAddRequest* request,
                                   v1::StoreAddResponse* response) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kWorker); !s.ok()) return s;
  if (auto s = CheckScope(request->job_id(), request->generation()); !s.ok()) return s;
  if (request->key().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "key: required");
  }
  absl::StatusOr<int64_t> sum =
      coordinator_->StoreAdd(SessionKey(*context), request->job_id(), request->generation(),
                             request->key(), request->amount());
  if (!sum.ok()) return ToGrpcStatus(sum.status());
  response->set_value(*sum);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* StoreServiceImpl::Get(grpc::CallbackServerContext* context,
                                                const v1::StoreGetRequest* request,
                                                v1::StoreGetResponse* response) {
  grpc::Status s = coordinator_->gate().Admit(*context, Role::kWorker);
  if (s.ok()) s = CheckScope(request->job_id(), request->generation());
  if (s.ok() && request->key().empty()) {
    s = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "key: required");
  }
  return StoreWaitReactor::Begin(
      coordinator_, s, SessionKey(*context), request->job_id(), request->generation(),
      {request->key()}, WaitTimeout(request->timeout_ms()),
      [response](std::string value) { response->set_value(std::move(value)); });
}

grpc::ServerUnaryReactor* StoreServiceImpl::Wait(grpc::CallbackServerContext* context,
                                                 const v1::StoreWaitRequest* request,
                                                 v1::StoreWaitResponse*) {
  grpc::Status s = coordinator_->gate().Admit(*context, Role::kWorker);
  if (s.ok()) s = CheckScope(request->job_id(), request->generation());
  std::vector<std::string> keys(request->keys().begin(), request->keys().end());
  for (const std::string& k : keys) {
    if (s.ok() && k.empty()) {
      s = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "keys: empty key");
    }
  }
  return StoreWaitReactor::Begin(coordinator_, s, SessionKey(*context), request->job_id(),
                                 request->generation(), std::move(keys),
                                 WaitTimeout(request->timeout_ms()), nullptr);
}

}  // namespace lockstep::coordinator
