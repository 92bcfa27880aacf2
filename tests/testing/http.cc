#include "tests/testing/http.h"

#include <sstream>

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
