#include "common/http_framing.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace lockstep {

Framing FrameHead(absl::string_view head, size_t max_body_bytes) {
  Framing f;
  auto refuse = [&f](int status, std::string why) {
    f.refuse = status;
    f.why = std::move(why);
    return f;
  };
  for (size_t i = head.find('\n'); i != absl::string_view::npos; i = head.find('\n', i + 1)) {
    if (i == 0 || head[i - 1] != '\r') return refuse(400, "a line of the head ends in a bare LF");
  }
  bool has_length = false;
  size_t pos = head.find("\r\n") + 2;  // past the request line: cpp-httplib checks that
  while (pos < head.size()) {
    const size_t begin = pos;
    const size_t eol = head.find("\r\n", pos);
    const absl::string_view line = head.substr(pos, eol - pos);
    pos = eol + 2;
    if (line.empty()) break;  // the blank line
    const size_t colon = line.find(':');
    const absl::string_view name = line.substr(0, colon);
    if (colon == absl::string_view::npos || name.empty() ||
        name.find_first_of(" \t") != absl::string_view::npos) {
      return refuse(400, "a header line is not NAME: VALUE");
    }
    const absl::string_view value = absl::StripAsciiWhitespace(line.substr(colon + 1));
    if (absl::EqualsIgnoreCase(name, "Transfer-Encoding")) {
      return refuse(411, "send the request body with a Content-Length, not a Transfer-Encoding");
    }
    if (absl::EqualsIgnoreCase(name, "Content-Length")) {
      if (has_length) return refuse(400, "more than one Content-Length");
      has_length = true;
      if (value.empty() || value.find_first_not_of("0123456789") != absl::string_view::npos) {
        return refuse(400, "Content-Length is not a number");
      }
      // 18 digits or fewer: SimpleAtoi cannot overflow, and more is over any limit anyway.
      if (value.size() > 18 || !absl::SimpleAtoi(value, &f.body) || f.body > max_body_bytes) {
        return refuse(413, absl::StrCat("a request body is at most ", max_body_bytes, " bytes"));
      }
    }
    if (absl::EqualsIgnoreCase(name, "Expect")) {
      if (!absl::EqualsIgnoreCase(value, "100-continue")) {
        return refuse(417, "the only expectation met is 100-continue");
      }
      f.expect_lines.emplace_back(begin, pos);
    }
  }
  return f;
}

std::string Refusal(int status, absl::string_view why) {
  static constexpr std::pair<int, const char*> kReasons[] = {
      {411, "Length Required"},
      {413, "Payload Too Large"},
      {414, "URI Too Long"},
      {417, "Expectation Failed"},
      {431, "Request Header Fields Too Large"}};
  const char* reason = "Bad Request";
  for (const auto& [code, text] : kReasons) {
    if (code == status) reason = text;
  }
  return absl::StrCat("HTTP/1.1 ", status, " ", reason,
                      "\r\nContent-Type: text/plain\r\nConnection: close\r\nContent-Length: ",
                      why.size() + 1, "\r\n\r\n", why, "\n");
}

}  // namespace lockstep
