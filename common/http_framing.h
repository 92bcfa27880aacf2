// How the HTTP server's acceptor frames a request before any handler sees it (pure: the head's
// bytes in, the body's length or a refusal out). common/http_server.cc uses it; the cases are
// in tests/unit/http_framing_test.cc.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace lockstep {

// What the acceptor makes of a request's head: the length of the body that follows it, or the
// status to refuse the request with and why.
struct Framing {
  int refuse = 0;  // an HTTP status, or 0
  std::string why;
  size_t body = 0;
  // "Expect: 100-continue": the client may wait for a 100 before it sends the body. Its lines,
  // [begin, end) in the head, are erased before the parser sees them: the acceptor answers it,
  // and cpp-httplib would send a second 100 (it does for any Expect).
  std::vector<std::pair<size_t, size_t>> expect_lines;
};

// `head`: a request line and headers through the blank line that ends them. Anything cpp-httplib
// could take for a body the acceptor has not framed is refused (RFC 9112 section 6): a
// Transfer-Encoding (411: the dashboard and the metrics take no chunked bodies), two
// Content-Lengths or one that is not a number, a header name with whitespace before its colon,
// or a line ending in a bare LF (400: cpp-httplib would read them differently), a body over
// `max_body_bytes` (413), an expectation other than 100-continue (417). A POST without a length
// has no body.
Framing FrameHead(absl::string_view head, size_t max_body_bytes);

// An answer the acceptor writes itself, before it closes the connection: the status line, a
// plain-text body saying `why`, and "Connection: close".
std::string Refusal(int status, absl::string_view why);

}  // namespace lockstep
