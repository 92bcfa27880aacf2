// The worker's ProgramService (proto/lockstep/v1/program.proto): what the program it runs
// reaches through lockstep.torch. One gRPC server per worker on a Unix socket in a directory
// of its own; each running program is an endpoint under a random secret that its environment
// carries (LOCKSTEP_AGENT_TOKEN), so a program reaches its own generation's store scope and
// reports its own progress, and nothing else.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server.h"
#include "lockstep/v1/program.pb.h"
#include "worker/comm/store_client.h"

namespace lockstep::worker {

class ProgramServer {
 public:
  // What one running program's calls reach. Its functions run on gRPC threads, one at a time,
  // until the endpoint's Registration goes.
  struct Endpoint {
    std::shared_ptr<StoreClient> store;
    std::function<absl::Status(const v1::ProgramReportRequest&)> report;
    // lockstep.torch.Checkpointer (null: unavailable): its slots in the worker's memory, and
    // the state to restore. Short calls, run like `report`.
    std::function<absl::StatusOr<v1::CheckpointSlotsResponse>(int64_t bytes)> checkpoint_slots;
    std::function<absl::StatusOr<v1::CheckpointRestoreResponse>(
        const v1::CheckpointRestoreRequest&)>
        checkpoint_restore;
  };
  // While it lives, the endpoint serves calls carrying `token()`; its destruction waits for a
  // report in progress and refuses later calls (UNAUTHENTICATED).
  class Registration {
   public:
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;
    ~Registration();
    const std::string& token() const { return token_; }

   private:
    friend class ProgramServer;
    Registration(ProgramServer* server, std::string token) : server_(server), token_(std::move(token)) {}
    ProgramServer* const server_;
    const std::string token_;
  };

  // Listens on DIR/agent.sock, DIR a new directory under $TMPDIR (or /tmp).
  static absl::StatusOr<std::unique_ptr<ProgramServer>> Start();
  ~ProgramServer();

  // "unix:/tmp/lockstep-programs-XXXXXX/agent.sock" (LOCKSTEP_AGENT_ADDRESS).
  const std::string& address() const { return address_; }
  std::unique_ptr<Registration> Register(Endpoint endpoint);

  // The endpoint behind a call's secret, or null (the service's use).
  struct Held;
  std::shared_ptr<Held> Find(const std::string& token) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Service;
  ProgramServer() = default;
  void Unregister(const std::string& token) ABSL_LOCKS_EXCLUDED(mu_);

  std::string dir_;
  std::string address_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Held>> endpoints_ ABSL_GUARDED_BY(mu_);
};

// An endpoint as calls hold it: `mu` serializes reports with the registration's end.
struct ProgramServer::Held {
  absl::Mutex mu;
  bool closed ABSL_GUARDED_BY(mu) = false;
  Endpoint endpoint;
};

}  // namespace lockstep::worker
