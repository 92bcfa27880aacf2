// Coordinator-backed rendezvous store.
#include "worker/comm/coordinator_store.h"

#include "absl/strings/str_cat.h"
#include "gloo/common/error.h"

namespace lockstep::worker {
namespace {

// Extra time on the RPC deadline over the server-side wait, so the server's answer (with its
// reason) arrives before the client gives up.
constexpr auto kDeadlineSlack = std::chrono::seconds(5);

[[noreturn]] void Throw(const char* op, const std::string& key, const grpc::Status& status) {
  throw gloo::IoException(absl::StrCat("store ", op, " \"", key, "\": ",
                                       static_cast<int>(status.error_code()), " ",
                                       status.error_message()));
}

}  // namespace

CoordinatorStore::CoordinatorStore(std::shared_ptr<v1::StoreService::StubInterface> stub,
                                   std::string job_id, int64_t generation,
                                   std::chrono::milliseconds timeout)
    : stub_(std::move(stub)),
      job_id_(std::move(job_id)),
      generation_(generation),
      timeout_(timeout) {}

void CoordinatorStore::set(const std::string& key, const std::vector<char>& data) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kDeadlineSlack);
  v1::StoreSetRequest request;
  request.set_job_id(job_id_);
  request.set_generation(generation_);
  request.set_key(key);
  request.set_value(std::string(data.begin(), data.end()));
  v1::StoreSetResponse response;
  grpc::Status status = stub_->Set(&context, request, &response);
  if (!status.ok()) Throw("set", key, status);
}

std::vector<char> CoordinatorStore::get(const std::string& key) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout_ + kDeadlineSlack);
  v1::StoreGetRequest request;
  request.set_job_id(job_id_);
  request.set_generation(generation_);
  request.set_key(key);
  request.set_timeout_ms(timeout_.count());
  v1::StoreGetResponse response;
  grpc::Status status = stub_->Get(&context, request, &response);
  if (!status.ok()) Throw("get", key, status);
  return std::vector<char>(response.value().begin(), response.value().end());
}

void CoordinatorStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void CoordinatorStore::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  if (keys.empty()) return;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout + kDeadlineSlack);
  v1::StoreWaitRequest request;
  request.set_job_id(job_id_);
  request.set_generation(generation_);
  for (const std::string& k : keys) request.add_keys(k);
  request.set_timeout_ms(timeout.count());
  v1::StoreWaitResponse response;
  grpc::Status status = stub_->Wait(&context, request, &response);
  if (!status.ok()) Throw("wait", keys.front(), status);
}

}  // namespace lockstep::worker
