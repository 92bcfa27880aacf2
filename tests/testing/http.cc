#include "tests/testing/http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "httplib.h"

namespace lockstep::testing {
namespace {

// `a="x",b="y"` -> {a: x, b: y}; label values in these tests hold no quotes or commas.
std::map<std::string, std::string> ParseLabels(absl::string_view text) {
  std::map<std::string, std::string> labels;
  for (absl::string_view pair : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const size_t eq = pair.find('=');
    if (eq == absl::string_view::npos) continue;
    absl::string_view value = pair.substr(eq + 1);
    absl::ConsumePrefix(&value, "\"");
    absl::ConsumeSuffix(&value, "\"");
    labels[std::string(pair.substr(0, eq))] = std::string(value);
  }
  return labels;
}

}  // namespace

absl::StatusOr<std::string> HttpGet(const std::string& host, int port, const std::string& path,
                                    absl::Duration timeout) {
  httplib::Client client(host, port);
  const auto seconds = absl::ToInt64Seconds(timeout);
  client.set_connection_timeout(seconds, 0);
  client.set_read_timeout(seconds, 0);
  httplib::Result result = client.Get(path);
  const std::string url = absl::StrCat("http://", host, ":", port, path);
  if (!result) {
    return absl::UnavailableError(
        absl::StrCat("GET ", url, ": ", httplib::to_string(result.error())));
  }
  if (result->status != 200) {
    return absl::UnavailableError(
        absl::StrCat("GET ", url, ": HTTP ", result->status, ": ", result->body));
  }
  return result->body;
}

std::string HttpResponse::Header(const std::string& key) const {
  auto it = headers.find(key);
  return it == headers.end() ? "" : it->second;
}

absl::StatusOr<HttpResponse> HttpRequest(const std::string& method, const std::string& host,
                                         int port, const std::string& path,
                                         const std::map<std::string, std::string>& headers,
                                         const std::string& body, const HttpsFiles& https,
                                         absl::Duration timeout) {
  // A server that refuses the TLS handshake closes the socket under OpenSSL's writes: the
  // test process must see an error, not SIGPIPE.
  static const bool sigpipe_ignored = [] { return signal(SIGPIPE, SIG_IGN) != SIG_ERR; }();
  (void)sigpipe_ignored;
  std::unique_ptr<httplib::ClientImpl> client;
  if (https.ca.empty()) {
    client = std::make_unique<httplib::ClientImpl>(host, port);
  } else {
    auto tls = https.cert.empty()
                   ? std::make_unique<httplib::SSLClient>(host, port)
                   : std::make_unique<httplib::SSLClient>(host, port, https.cert, https.key);
    tls->set_ca_cert_path(https.ca.c_str());
    tls->enable_server_certificate_verification(true);
    client = std::move(tls);
  }
  const auto seconds = absl::ToInt64Seconds(timeout);
  client->set_connection_timeout(seconds, 0);
  client->set_read_timeout(seconds, 0);
  httplib::Headers request_headers(headers.begin(), headers.end());
  httplib::Request request;
  request.method = method;
  request.path = path;
  request.headers = request_headers;
  request.body = body;
  if (!body.empty()) request.set_header("Content-Type", "application/octet-stream");
  httplib::Result result = client->send(request);
  const std::string url =
      absl::StrCat(https.ca.empty() ? "http://" : "https://", host, ":", port, path);
  if (!result) {
    return absl::UnavailableError(
        absl::StrCat(method, " ", url, ": ", httplib::to_string(result.error())));
  }
  HttpResponse response;
  response.status = result->status;
  response.body = result->body;
  for (const auto& [key, value] : result->headers) response.headers.emplace(key, value);
  return response;
}

absl::StatusOr<std::string> RawHttp(const std::string& host, int port, const std::string& bytes,
                                    absl::Duration timeout) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket failed");
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &address.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat(host, " is not an IPv4 address"));
  }
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    return absl::UnavailableError(absl::StrCat("connect ", host, ":", port, " failed"));
  }
  // The server may answer (and close) before it has read everything: a failed send is fine.
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string answer;
  const absl::Time deadline = absl::Now() + timeout;
  char buffer[4096];
  while (absl::Now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    const int ready = poll(&p, 1, 100);
    if (ready <= 0) continue;
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    answer.append(buffer, static_cast<size_t>(n));
    // One whole response (headers, and the body its Content-Length announces) is enough.
    const size_t end = answer.find("\r\n\r\n");
    if (end == std::string::npos) continue;
    size_t length = 0;
    const size_t at = absl::AsciiStrToLower(answer.substr(0, end)).find("content-length:");
    if (at != std::string::npos) {
      const size_t eol = answer.find("\r\n", at);
      absl::SimpleAtoi(absl::StripAsciiWhitespace(answer.substr(at + 15, eol - at - 15)), &length);
    }
    if (answer.size() >= end + 4 + length) break;
  }
  return answer;
}

std::optional<double> SampleValue(const std::string& text, const std::string& name,
                                  const std::map<std::string, std::string>& labels) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    absl::string_view rest(line);
    if (!absl::ConsumePrefix(&rest, name)) continue;
    std::map<std::string, std::string> found;
    if (absl::ConsumePrefix(&rest, "{")) {
      const size_t close = rest.find('}');
      if (close == absl::string_view::npos) continue;
      found = ParseLabels(rest.substr(0, close));
      rest.remove_prefix(close + 1);
    }
    if (rest.empty() || rest[0] != ' ') continue;  // a longer name with this prefix
    bool match = true;
    for (const auto& [key, value] : labels) {
      auto it = found.find(key);
      match = match && it != found.end() && it->second == value;
    }
    if (!match) continue;
    double value = 0;
    std::vector<absl::string_view> fields = absl::StrSplit(absl::StripAsciiWhitespace(rest), ' ');
    if (!fields.empty() && absl::SimpleAtod(fields[0], &value)) return value;
  }
  return std::nullopt;
}

}  // namespace lockstep::testing
