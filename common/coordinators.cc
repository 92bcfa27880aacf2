// Coordinator lists and the leader a standby names.
#include "common/coordinators.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace lockstep {

absl::StatusOr<std::vector<std::string>> SplitCoordinators(const std::string& flag) {
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(flag, ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (part.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--coordinator '", flag, "': an empty address (HOST:PORT[,HOST:PORT...])"));
    }
    out.emplace_back(part);
  }
  return out;
}

std::string LeaderNamedBy(const grpc::ClientContext& context) {
  const auto& trailers = context.GetServerTrailingMetadata();
  auto it = trailers.find(kLeaderMetadataKey);
  if (it == trailers.end()) return "";
  return std::string(it->second.data(), it->second.size());
}

}  // namespace lockstep
