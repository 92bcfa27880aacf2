// Test clients for the daemons' HTTP endpoints: GET through cpp-httplib, and lookups in the
// Prometheus text exposition format.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace lockstep::testing {

// The body of a 200 answer; UNAVAILABLE naming the URL for anything else.
absl::StatusOr<std::string> HttpGet(const std::string& host, int port, const std::string& path,
                                    absl::Duration timeout = absl::Seconds(10));

// The value of the sample `name{labels}` in an exposition text: the labels given must all
// match, others may be present. nullopt when there is none.
std::optional<double> SampleValue(const std::string& text, const std::string& name,
                                  const std::map<std::string, std::string>& labels = {});

}  // namespace lockstep::testing
