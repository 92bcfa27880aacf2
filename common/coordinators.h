// Finding the leading coordinator. With --state_backend=etcd several coordinators run and one
// leads; the others answer every call UNAVAILABLE and name the leader in the trailing metadata
// kLeaderMetadataKey. Workers, lockstepctl and the Python client take a comma-separated
// --coordinator list and follow that name, or try the next address.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/client_context.h"

namespace lockstep {

inline constexpr char kLeaderMetadataKey[] = "x-lockstep-leader";
// The leading coordinator's term (etcd's create revision of its leader key; docs/deploy.md), in
// the initial metadata of every call it admits. A client that has seen a larger term takes an
// answer with a smaller one for a deposed leader's (stale), as workers do with Registered.term.
inline constexpr char kTermMetadataKey[] = "x-lockstep-term";

// "a:1,b:2" → {"a:1", "b:2"}; spaces around entries are dropped. An empty list or entry is
// INVALID_ARGUMENT naming the flag's value.
absl::StatusOr<std::vector<std::string>> SplitCoordinators(const std::string& flag);

// The leader a standby named in the answer of a finished call, or empty.
std::string LeaderNamedBy(const grpc::ClientContext& context);

}  // namespace lockstep
