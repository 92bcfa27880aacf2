#include "worker/program_service.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "common/grpc_status.h"
#include "glog/logging.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "lockstep/v1/program.grpc.pb.h"

namespace lockstep::worker {
namespace {

constexpr char kSecretHeader[] = "x-lockstep-program";
constexpr absl::Duration kMaxWait = absl::Seconds(300);

absl::Duration WaitTimeout(int64_t timeout_ms) {
  if (timeout_ms <= 0) return kMaxWait;
  return std::min(absl::Milliseconds(timeout_ms), kMaxWait);
}

}  // namespace

class ProgramServer::Service final : public v1::ProgramService::Service {
 public:
  explicit Service(ProgramServer* server) : server_(server) {}

  grpc::Status StoreSet(grpc::ServerContext* context, const v1::ProgramStoreRequest* request,
                        v1::ProgramStoreResponse*) override {
    std::shared_ptr<Held> held;
    if (grpc::Status s = Authorize(*context, &held); !s.ok()) return s;
    if (request->key().empty()) return Invalid("key: required");
    return ToGrpcStatus(held->endpoint.store->Set(request->key(), request->value()));
  }
  grpc::Status StoreGet(grpc::ServerContext* context, const v1::ProgramStoreRequest* request,
                        v1::ProgramStoreResponse* response) override {
    std::shared_ptr<Held> held;
    if (grpc::Status s = Authorize(*context, &held); !s.ok()) return s;
    if (request->key().empty()) return Invalid("key: required");
    absl::StatusOr<std::string> value =
        held->endpoint.store->Get(request->key(), WaitTimeout(request->timeout_ms()));
    if (!value.ok()) return ToGrpcStatus(value.status());
    response->set_value(*std::move(value));
    return grpc::Status::OK;
  }
  grpc::Status StoreAdd(grpc::ServerContext* context, const v1::ProgramStoreRequest* request,
                        v1::ProgramStoreResponse* response) override {
    std::shared_ptr<Held> held;
    if (grpc::Status s = Authorize(*context, &held); !s.ok()) return s;
    if (request->key().empty()) return Invalid("key: required");
    absl::StatusOr<int64_t> sum = held->endpoint.store->Add(request->key(), request->amount());
    if (!sum.ok()) return ToGrpcStatus(sum.status());
    response->set_sum(*sum);
    return grpc::Status::OK;
  }
  grpc::Status StoreWait(grpc::ServerContext* context, const v1::ProgramStoreRequest* request,
                         v1::ProgramStoreResponse*) override {
    std::shared_ptr<Held> held;
    if (grpc::Status s = Authorize(*context, &held); !s.ok()) return s;
    if (request->keys().empty()) return Invalid("keys: required");
    const std::vector<std::string> keys(request->keys().begin(), request->keys().end());
    return ToGrpcStatus(held->endpoint.store->Wait(keys, WaitTimeout(request->timeout_ms())));
  }
  grpc::Status Report(grpc::ServerContext* context, const v1::ProgramReportRequest* request,
                      v1::ProgramReportResponse*) override {
    std::shared_ptr<Held> held;
    if (grpc::Status s = Authorize(*context, &held); !s.ok()) return s;
    if (request->step() <= 0) {
      return Invalid(absl::StrCat("step: must be > 0, got ", request->step()));
    }
    if (request->samples() < 0) {
      return Invalid(absl::StrCat("samples: must be >= 0, got ", request->samples()));
    }
    absl::MutexLock lock(&held->mu);
    if (held->closed) return Gone();
    return ToGrpcStatus(held->endpoint.report(*request));
  }
  grpc::Status CheckpointSlots(grpc::ServerContext* context,
                               const v1::CheckpointSlotsRequest* request,
                               v1::CheckpointSlotsResponse* response) override {
    std::shared_ptr<Held> held;
    if (grpc::Status s = Authorize(*context, &held); !s.ok()) return s;
    if (request->bytes() <= 0) {
      return Invalid(absl::StrCat("bytes: must be > 0, got ", request->bytes()));
    }
    absl::MutexLock lock(&held->mu);
    if (held->closed) return Gone();
    if (!held->endpoint.checkpoint_slots) return NoCheckpoints();
    absl::StatusOr<v1::CheckpointSlotsResponse> slots =
        held->endpoint.checkpoint_slots(request->bytes());
    if (!slots.ok()) return ToGrpcStatus(slots.status());
    *response = *std::move(slots);
    return grpc::Status::OK;
  }
  grpc::Status CheckpointRestore(grpc::ServerContext* context,
                                 const v1::CheckpointRestoreRequest* request,
                                 v1::CheckpointRestoreResponse* response) override {
    std::shared_ptr<Held> held;
    if (grpc::Status s = Authorize(*context, &held); !s.ok()) return s;
    if (request->loaded_ms() < 0) {
      return Invalid(absl::StrCat("loaded_ms: must be >= 0, got ", request->loaded_ms()));
    }
    absl::MutexLock lock(&held->mu);
    if (held->closed) return Gone();
    if (!held->endpoint.checkpoint_restore) return NoCheckpoints();
    absl::StatusOr<v1::CheckpointRestoreResponse> restore =
        held->endpoint.checkpoint_restore(*request);
    if (!restore.ok()) return ToGrpcStatus(restore.status());
    *response = *std::move(restore);
    return grpc::Status::OK;
  }

 private:
  static grpc::Status Invalid(const std::string& what) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, what);
  }
  static grpc::Status Gone() {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "no running program holds this secret (its generation ended)");
  }
  static grpc::Status NoCheckpoints() {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "this worker keeps no checkpoint memory for programs");
  }
  grpc::Status Authorize(const grpc::ServerContext& context, std::shared_ptr<Held>* held) {
    const auto& metadata = context.client_metadata();
    const auto it = metadata.find(kSecretHeader);
    if (it == metadata.end()) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          absl::StrCat("missing ", kSecretHeader, " (LOCKSTEP_AGENT_TOKEN)"));
    }
    *held = server_->Find(std::string(it->second.data(), it->second.size()));
    return *held == nullptr ? Gone() : grpc::Status::OK;
  }

  ProgramServer* const server_;
};

absl::StatusOr<std::unique_ptr<ProgramServer>> ProgramServer::Start() {
  const char* tmp = getenv("TMPDIR");
  std::string pattern = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp",
                                     "/lockstep-programs-XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) {
    return absl::ErrnoToStatus(errno, absl::StrCat("creating ", pattern));
  }
  auto server = std::unique_ptr<ProgramServer>(new ProgramServer());
  server->dir_ = pattern;
  // Reachable by the programs' user; the secret, not the path, is what admits a call.
  chmod(pattern.c_str(), 0755);
  const std::string socket = absl::StrCat(pattern, "/agent.sock");
  server->address_ = absl::StrCat("unix:", socket);
  server->service_ = std::make_unique<Service>(server.get());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(server->address_, grpc::InsecureServerCredentials());
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot serve programs on ", server->address_));
  }
  chmod(socket.c_str(), 0666);
  return server;
}

ProgramServer::~ProgramServer() {
  if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
  unlink(absl::StrCat(dir_, "/agent.sock").c_str());
  rmdir(dir_.c_str());
}

std::unique_ptr<ProgramServer::Registration> ProgramServer::Register(Endpoint endpoint) {
  auto held = std::make_shared<Held>();
  held->endpoint = std::move(endpoint);
  std::string token = RandomSecret();
  {
    absl::MutexLock lock(&mu_);
    endpoints_[token] = std::move(held);
  }
  return std::unique_ptr<Registration>(new Registration(this, std::move(token)));
}

std::shared_ptr<ProgramServer::Held> ProgramServer::Find(const std::string& token) {
  absl::MutexLock lock(&mu_);
  const auto it = endpoints_.find(token);
  return it == endpoints_.end() ? nullptr : it->second;
}

void ProgramServer::Unregister(const std::string& token) {
  std::shared_ptr<Held> held;
  {
    absl::MutexLock lock(&mu_);
    const auto it = endpoints_.find(token);
    if (it == endpoints_.end()) return;
    held = std::move(it->second);
    endpoints_.erase(it);
  }
  absl::MutexLock lock(&held->mu);  // waits for a report in progress
  held->closed = true;
}

ProgramServer::Registration::~Registration() { server_->Unregister(token_); }

}  // namespace lockstep::worker
