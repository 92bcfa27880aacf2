// The one place where absl::Status and grpc::Status are converted into each other.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace lockstep {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status ToAbslStatus(const grpc::Status& status);

// "CODE_NAME: message", e.g. "NOT_FOUND: job j-7 does not exist".
std::string StatusLine(const absl::Status& status);

}  // namespace lockstep
