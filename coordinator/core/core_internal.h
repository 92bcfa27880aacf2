// Small helpers shared by the core's files (core.cc, registry.cc, jobs.cc, placement.cc,
// reports.cc, recovery.cc); not part of the core's interface.
#pragma once

#include <string>

#include "absl/strings/str_format.h"
#include "absl/time/time.h"

namespace lockstep::coordinator::internal {

// "cuda:3" -> "cuda"; "cpu" -> "cpu".
inline std::string DeviceKind(const std::string& device) {
  return device.substr(0, device.find(':'));
}

// "2.5s".
inline std::string Seconds1(absl::Duration d) {
  return absl::StrFormat("%.1fs", absl::ToDoubleSeconds(d));
}

}  // namespace lockstep::coordinator::internal
