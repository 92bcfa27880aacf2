// Store client over gRPC. Waits are long polls on the coordinator; an abort cancels the call.
#include "worker/comm/store_client.h"

#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpcpp/client_context.h"
#include "common/test_hooks.h"

namespace lockstep::worker {
namespace {

// Extra time on the RPC deadline over the server-side wait, so the server's answer (with its
// reason) arrives before the client gives up.
constexpr absl::Duration kDeadlineSlack = absl::Seconds(5);

}  // namespace

CoordinatorStoreClient::CoordinatorStoreClient(
    std::shared_ptr<v1::StoreService::StubInterface> stub, std::string session_key,
    std::string job_id, int64_t generation, std::shared_ptr<AbortSignal> abort)
    : stub_(std::move(stub)),
      session_key_(std::move(session_key)),
      job_id_(std::move(job_id)),
      generation_(generation),
      abort_(std::move(abort)) {}

template <typename Call>
absl::Status CoordinatorStoreClient::Run(const char* op, const std::string& key,
                                         absl::Duration timeout, Call&& call) {
  const std::string what = absl::StrCat("store ", op, " \"", key, "\" (", job_id_, " generation ",
                                        generation_, ")");
  if (abort_ != nullptr && abort_->raised()) {
    return absl::AbortedError(absl::StrCat(what, ": the generation was aborted"));
  }
  grpc::ClientContext context;
  context.AddMetadata(kSessionKeyMetadata, session_key_);
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoMilliseconds(timeout + kDeadlineSlack));
  AbortSignal::Subscription cancel;
  if (abort_ != nullptr) cancel = abort_->OnRaise([&context] { context.TryCancel(); });
  const grpc::Status status = call(&context);
  cancel.Reset();
  if (status.ok()) return absl::OkStatus();
  if (abort_ != nullptr && abort_->raised()) {
    return absl::AbortedError(absl::StrCat(what, ": the generation was aborted"));
  }
  const absl::Status s = ToAbslStatus(status);
  // The store's refusals as this generation's end, never the job's (worker/generation.h's
  // IsFatal): a session or a membership that is no longer live (PERMISSION_DENIED, NOT_FOUND:
  // an abort is on its way) is ABORTED; a scope that is full (RESOURCE_EXHAUSTED: a member
  // flooded it) is UNAVAILABLE, and the next generation gets a fresh scope.
  absl::StatusCode code = s.code();
  if (code == absl::StatusCode::kPermissionDenied || code == absl::StatusCode::kNotFound) {
    code = absl::StatusCode::kAborted;
  } else if (code == absl::StatusCode::kResourceExhausted) {
    code = absl::StatusCode::kUnavailable;
  }
  return absl::Status(code, absl::StrCat(what, ": ", s.message()));
}

absl::Status CoordinatorStoreClient::Set(const std::string& key, const std::string& value) {
  v1::StoreSetRequest request;
  request.set_job_id(job_id_);
  request.set_generation(generation_);
  request.set_key(key);
  request.set_value(value);
  absl::Status status = Run("set", key, absl::ZeroDuration(), [&](grpc::ClientContext* context) {
    v1::StoreSetResponse response;
    return stub_->Set(context, request, &response);
  });
  if (status.ok()) {
    test_hooks::Reach(("store_set_" + key).c_str(), generation_,
                      abort_ != nullptr ? &abort_->flag() : nullptr);
  }
  return status;
}

absl::StatusOr<std::string> CoordinatorStoreClient::Get(const std::string& key,
                                                        absl::Duration timeout) {
  v1::StoreGetRequest request;
  request.set_job_id(job_id_);
  request.set_generation(generation_);
  request.set_key(key);
  request.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  v1::StoreGetResponse response;
  absl::Status status = Run("get", key, timeout, [&](grpc::ClientContext* context) {
    return stub_->Get(context, request, &response);
  });
  if (!status.ok()) return status;
  return std::move(*response.mutable_value());
}

absl::Status CoordinatorStoreClient::Wait(const std::vector<std::string>& keys,
                                          absl::Duration timeout) {
  if (keys.empty()) return absl::OkStatus();
  v1::StoreWaitRequest request;
  request.set_job_id(job_id_);
  request.set_generation(generation_);
  for (const std::string& k : keys) request.add_keys(k);
  request.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  return Run("wait", keys.front(), timeout, [&](grpc::ClientContext* context) {
    v1::StoreWaitResponse response;
    return stub_->Wait(context, request, &response);
  });
}

absl::StatusOr<int64_t> CoordinatorStoreClient::Add(const std::string& key, int64_t amount) {
  v1::StoreAddRequest request;
  request.set_job_id(job_id_);
  request.set_generation(generation_);
  request.set_key(key);
  request.set_amount(amount);
  v1::StoreAddResponse response;
  LOCKSTEP_RETURN_IF_ERROR(Run("add", key, absl::ZeroDuration(), [&](grpc::ClientContext* context) {
    return stub_->Add(context, request, &response);
  }));
  return response.value();
}

}  // namespace lockstep::worker
