#include "coordinator/core/agreement.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lockstep::coordinator {

std::string Disagreement(const std::vector<FinishedResult>& results) {
  if (results.empty()) return "";
  const FinishedResult& first = results.front();
  bool agree = true;
  for (const FinishedResult& r : results) {
    agree = agree && r.step == first.step && r.checksum == first.checksum && r.eval == first.eval;
  }
  if (agree) return "";
  std::vector<std::string> parts;
  for (const FinishedResult& r : results) {
    parts.push_back(absl::StrCat(r.name, ": step ", r.step, ", parameters ", r.checksum,
                                 r.eval == first.eval ? "" : ", a different evaluation"));
  }
  return absl::StrCat("the members disagree on the result (", absl::StrJoin(parts, "; "), ")");
}

}  // namespace lockstep::coordinator
