// Protobuf's JSON mapping, the one JSON schema of Lockstep's messages (lockstepctl --json, the
// dashboard's API): lowerCamelCase names, enums by name, 64-bit integers as strings, and every
// primitive field printed, so readers see zeros and empty strings instead of missing keys.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "google/protobuf/message.h"

namespace lockstep {

// `multiline` pretty-prints; otherwise the document is one line (for JSON Lines streams). The
// text ends in a newline. INTERNAL if serialization fails.
absl::StatusOr<std::string> ToJson(const google::protobuf::Message& message, bool multiline);

}  // namespace lockstep
