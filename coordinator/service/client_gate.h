// The coordinator's front door: every RPC handler asks Admit() first. Calls without the shared
// token are answered UNAUTHENTICATED and remembered by (address, client name) so that
// `lockstepctl workers` can show who is being turned away and why; a misconfigured worker
// shows up there instead of only in its own logs.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/auth.h"
#include "common/clock.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"
#include "lockstep/v1/job.pb.h"

namespace lockstep::coordinator {

class ClientGate {
 public:
  // Distinct (address, client) pairs remembered; the least recently rejected one goes first.
  static constexpr size_t kMaxRemembered = 64;

  ClientGate(std::string token, Clock* clock) : checker_(std::move(token)), clock_(clock) {}

  // OK, or UNAUTHENTICATED naming the problem (the rejection is recorded and logged).
  grpc::Status Admit(const grpc::ServerContext& context);
  // The same for an HTTP request (the dashboard): its peer address, what it calls itself and
  // its "authorization" header.
  absl::Status AdmitHttp(const std::string& peer_host, const std::string& client,
                         absl::string_view authorization);
  // Whether callers must present the token.
  bool token_required() const { return checker_.enabled(); }
  // Most recently rejected first.
  std::vector<v1::RejectedClient> Rejected() const;
  // Calls refused since start, and the distinct clients remembered now (for metrics).
  std::pair<int64_t, int64_t> RejectedCounts() const;

 private:
  // Records and logs a rejection; returns `status`.
  absl::Status Reject(absl::Status status, const std::string& peer_host, const std::string& client);

  const TokenChecker checker_;
  Clock* const clock_;
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, v1::RejectedClient> rejected_ ABSL_GUARDED_BY(mu_);
  int64_t rejected_calls_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace lockstep::coordinator
