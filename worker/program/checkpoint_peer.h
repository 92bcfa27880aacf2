// Copies of program jobs' lockstep.torch checkpoints between workers (CheckpointPeerService,
// proto/lockstep/v1/program.proto; docs/programs.md). A worker serves, on its comm address, the
// generations it takes part in: each member's saves arrive there from the member whose
// checkpoint peer it is, and a member of a later generation that lacks the agreed step fetches
// it from there. Calls carry the generation's secret (Assignment.checkpoint_secret); the
// payload is checked against the save's XXH3-64 on both ends, and only a matching copy is
// committed (SlotWriter).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/server.h"
#include "worker/program/checkpoint_memory.h"

namespace lockstep::worker {

// Payload bytes per message, and the most a message may take (both ends raise gRPC's 4 MiB
// default to it).
inline constexpr size_t kCheckpointChunkBytes = 4 << 20;
inline constexpr int kCheckpointMessageLimit = 8 << 20;
inline constexpr char kCheckpointSecretMetadata[] = "x-lockstep-checkpoint";

class CheckpointPeerServer {
 public:
  // Listens on HOST:0 (the worker's comm address); copies go into `memory` (not owned).
  static absl::StatusOr<std::unique_ptr<CheckpointPeerServer>> Start(const std::string& host,
                                                                     CheckpointMemory* memory);
  ~CheckpointPeerServer();
  // HOST:PORT, for RegisterRequest.peer_address.
  const std::string& address() const { return address_; }

  // While it lives, calls for `job_id` carrying `secret` are served (a later generation's
  // registration replaces it; this one's end then leaves that one in place).
  class Registration {
   public:
    ~Registration();
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;

   private:
    friend class CheckpointPeerServer;
    Registration(CheckpointPeerServer* server, std::string job_id, std::string secret)
        : server_(server), job_id_(std::move(job_id)), secret_(std::move(secret)) {}
    CheckpointPeerServer* const server_;
    const std::string job_id_, secret_;
  };
  std::unique_ptr<Registration> Serve(const std::string& job_id, const std::string& secret)
      ABSL_LOCKS_EXCLUDED(mu_);

  // OK when `secret` is the one served for `job_id` (the service's check).
  absl::Status Admit(const std::string& job_id, const std::string& secret) const
      ABSL_LOCKS_EXCLUDED(mu_);
  CheckpointMemory* memory() const { return memory_; }

 private:
  class Service;
  CheckpointPeerServer() = default;

  CheckpointMemory* memory_ = nullptr;
  std::string address_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::string> secrets_ ABSL_GUARDED_BY(mu_);  // job id -> secret
};

// Streams a member's newest committed save to its checkpoint peer, in the background (a
// SaveFollower: after saves, coalesced, at most one copy per `interval` and a quarter of the
// time, never blocking the program).
class CheckpointReplicator {
 public:
  static constexpr double kDuty = 0.25;
  CheckpointReplicator(CheckpointMemory* memory, std::string job_id, std::string worker,
                       std::string peer_worker, std::string peer_address, std::string secret,
                       absl::Duration interval);
  ~CheckpointReplicator();  // cancels a copy in progress
  void Wake() { follower_->Wake(); }
  SaveFollower::Stats stats() const { return follower_->stats(); }
  bool WaitCopied(int64_t step, absl::Duration timeout) const {
    return follower_->WaitDone(step, timeout);
  }

 private:
  absl::Status Copy(const HeldCheckpoint& save) ABSL_LOCKS_EXCLUDED(mu_);

  const std::string job_id_, worker_, peer_address_, secret_;
  std::shared_ptr<grpc::Channel> channel_;
  absl::Mutex mu_;
  grpc::ClientContext* in_flight_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> stopping_{false};  // the same, for the test hook inside a copy
  std::unique_ptr<SaveFollower> follower_;  // last: its thread uses the rest
};

// Fetches `source_worker`'s save of `step` from the worker at `address` into this worker's own
// slots for the job (the program restores it from there). DATA_LOSS when the copy does not
// match its checksum; the holder's errors otherwise, each naming the holder. `source_worker`
// empty: the holder's own save (CheckpointFetchPlan.holders_own). Once `abort` (if
// given) is set, CANCELLED at the next chunk. Nothing is committed unless all of it arrived.
absl::StatusOr<HeldCheckpoint> FetchCheckpoint(CheckpointMemory* memory, const std::string& address,
                                               const std::string& holder, const std::string& secret,
                                               const std::string& job_id,
                                               const std::string& source_worker, int64_t step,
                                               const std::atomic<bool>* abort = nullptr);

}  // namespace lockstep::worker
