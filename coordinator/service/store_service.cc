// StoreService: the bootstrap key-value store used to form communicator groups.
#include "absl/strings/str_cat.h"
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

grpc::Status StoreServiceImpl::Get(grpc::ServerContext* context, const v1::StoreGetRequest* request,
                                   v1::StoreGetResponse* response) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kWorker); !s.ok()) return s;
  if (auto s = CheckScope(request->job_id(), request->generation()); !s.ok()) return s;
  if (request->key().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "key: required");
  }
  absl::StatusOr<std::string> value =
      coordinator_->StoreWait(SessionKey(*context), request->job_id(), request->generation(),
                              {request->key()}, WaitTimeout(request->timeout_ms()), context);
  if (!value.ok()) return ToGrpcStatus(value.status());
  response->set_value(*std::move(value));
  return grpc::Status::OK;
}

grpc::Status StoreServiceImpl::Wait(grpc::ServerContext* context,
                                    const v1::StoreWaitRequest* request, v1::StoreWaitResponse*) {
  if (grpc::Status s = coordinator_->gate().Admit(*context, Role::kWorker); !s.ok()) return s;
  if (auto s = CheckScope(request->job_id(), request->generation()); !s.ok()) return s;
  std::vector<std::string> keys(request->keys().begin(), request->keys().end());
  for (const std::string& k : keys) {
    if (k.empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "keys: empty key");
  }
  absl::StatusOr<std::string> value =
      coordinator_->StoreWait(SessionKey(*context), request->job_id(), request->generation(), keys,
                              WaitTimeout(request->timeout_ms()), context);
  return ToGrpcStatus(value.status());
}

}  // namespace lockstep::coordinator
