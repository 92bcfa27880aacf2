// The coordinator's front door: every RPC handler asks Admit() first. Calls without the shared
// token are answered UNAUTHENTICATED and remembered by (address, client name) so that
// `lockstepctl workers` can show who is being turned away and why; a misconfigured worker
// shows up there instead of only in its own logs.
//
// Roles: with a worker token as well (--worker_token_file), the operator token opens the
// JobService and the dashboard only, and the worker token the WorkerService and the store only:
// a worker cannot submit or cancel jobs, and an operator cannot join as a worker
// (PERMISSION_DENIED naming the role). Without one, the one token opens everything.
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

enum class Role { kOperator, kWorker };

class ClientGate {
 public:
  // Distinct (address, client) pairs remembered; the least often rejected (the oldest of those)
  // goes first.
  static constexpr size_t kMaxRemembered = 64;
  // Of those, per address: one address that keeps inventing client names replaces its own
  // entries, never the other addresses'.
  static constexpr size_t kMaxRememberedPerAddress = 8;

  ClientGate(std::string token, Clock* clock, std::string worker_token = "")
      : checker_(std::move(token)), worker_checker_(std::move(worker_token)), clock_(clock) {}

  // OK, or UNAUTHENTICATED naming the problem, or PERMISSION_DENIED for the other role's
  // token (the rejection is recorded and logged). With a term set, the call's initial metadata
  // carries it (kTermMetadataKey).
  grpc::Status Admit(grpc::ServerContextBase& context, Role role);
  // Coordinators on etcd: the term this one leads. Call before serving.
  void set_term(int64_t term) { term_ = term; }
  // The same for an HTTP request (the dashboard, an operator's): its peer address, what it
  // calls itself and its "authorization" header.
  absl::Status AdmitHttp(const std::string& peer_host, const std::string& client,
                         absl::string_view authorization);
  // Whether callers must present the token.
  bool token_required() const { return checker_.enabled(); }
  // Whether workers have a token of their own.
  bool roles() const { return worker_checker_.enabled(); }
  // Most recently rejected first.
  std::vector<v1::RejectedClient> Rejected() const;
  // Calls refused since start, and the distinct clients remembered now (for metrics).
  std::pair<int64_t, int64_t> RejectedCounts() const;

 private:
  // Records and logs a rejection; returns `status`.
  absl::Status Reject(absl::Status status, const std::string& peer_host, const std::string& client);
  // The check of one call's "authorization" header for `role`.
  absl::Status Check(absl::string_view authorization, Role role) const;

  const TokenChecker checker_;         // the operators' (or everyone's) token
  const TokenChecker worker_checker_;  // the workers' token; disabled: no roles
  Clock* const clock_;
  int64_t term_ = 0;  // set before serving, then only read
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, v1::RejectedClient> rejected_ ABSL_GUARDED_BY(mu_);
  int64_t rejected_calls_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace lockstep::coordinator
