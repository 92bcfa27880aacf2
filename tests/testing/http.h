// Test clients for the daemons' HTTP endpoints: requests through cpp-httplib (HTTP or HTTPS),
// raw bytes over a socket (malformed requests), and lookups in the Prometheus text exposition
// format.
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

struct HttpResponse {
  int status = 0;
  std::string body;
  std::multimap<std::string, std::string> headers;
  std::string Header(const std::string& key) const;  // "" when absent
};

// HTTPS for HttpRequest: the CA the server's certificate is checked against, and a client
// certificate with its key (mutual TLS) when set.
struct HttpsFiles {
  std::string ca;
  std::string cert;
  std::string key;
};

// Any method; HTTPS when `https.ca` is set. UNAVAILABLE naming the URL when no answer came.
absl::StatusOr<HttpResponse> HttpRequest(const std::string& method, const std::string& host,
                                         int port, const std::string& path,
                                         const std::map<std::string, std::string>& headers = {},
                                         const std::string& body = "",
                                         const HttpsFiles& https = {},
                                         absl::Duration timeout = absl::Seconds(10));

// Sends `bytes` as they are and returns what the server wrote back: one whole response, or what
// came until it closed the connection or `timeout` passed.
absl::StatusOr<std::string> RawHttp(const std::string& host, int port, const std::string& bytes,
                                    absl::Duration timeout = absl::Seconds(10));

// The value of the sample `name{labels}` in an exposition text: the labels given must all
// match, others may be present. nullopt when there is none.
std::optional<double> SampleValue(const std::string& text, const std::string& name,
                                  const std::map<std::string, std::string>& labels = {});

}  // namespace lockstep::testing
