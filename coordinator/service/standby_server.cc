// A standby coordinator's answer to every call: UNAVAILABLE, naming the leader.
#include "coordinator/service/standby_server.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/grpc_options.h"
#include "grpcpp/server_builder.h"

namespace lockstep::coordinator {

absl::StatusOr<std::unique_ptr<StandbyServer>> StandbyServer::Start(
    const std::string& listen, const std::shared_ptr<grpc::ServerCredentials>& credentials,
    int* port) {
  std::unique_ptr<StandbyServer> standby(new StandbyServer());
  grpc::ServerBuilder builder;
  ConfigureServer(builder);
  builder.AddListeningPort(listen, credentials, port);
  builder.RegisterCallbackGenericService(standby.get());
  standby->server_ = builder.BuildAndStart();
  if (standby->server_ == nullptr || *port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", listen, " (address in use or invalid?)"));
  }
  return standby;
}

StandbyServer::~StandbyServer() { Stop(); }

void StandbyServer::SetLeader(const std::string& leader, const std::string& why) {
  absl::MutexLock lock(&mu_);
  leader_ = leader;
  why_ = why;
}

void StandbyServer::Stop() {
  if (server_ == nullptr) return;
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  server_->Wait();
  server_.reset();
}

grpc::ServerGenericBidiReactor* StandbyServer::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  std::string leader, why;
  {
    absl::MutexLock lock(&mu_);
    leader = leader_;
    why = why_;
  }
  std::string message;
  if (!leader.empty()) {
    context->AddTrailingMetadata(lockstep::kLeaderMetadataKey, leader);
    message = absl::StrCat("this coordinator is a standby: the leader is at ", leader,
                           " (--coordinator=", leader, ")");
  } else {
    message = absl::StrCat("this coordinator is a standby and no leader is known: ", why);
  }
  class Reactor final : public grpc::ServerGenericBidiReactor {
   public:
    explicit Reactor(std::string message) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, std::move(message)));
    }
    void OnDone() override { delete this; }
  };
  return new Reactor(std::move(message));
}

}  // namespace lockstep::coordinator
