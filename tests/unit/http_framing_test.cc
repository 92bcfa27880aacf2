// The acceptor's framing of a request head (common/http_framing.h), case by case.
#include "common/http_framing.h"

#include <string>

#include "gtest/gtest.h"

namespace lockstep {
namespace {

struct Case {
  const char* what;
  std::string head;
  int refuse;  // 0: framed
  size_t body;
  size_t expect_lines;
};

TEST(HttpFramingTest, TheHeadDecidesTheBodyOrTheRefusal) {
  const std::string get = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  const Case cases[] = {
      {"a GET without a body", get, 0, 0, 0},
      {"a POST with a length", "POST /a HTTP/1.1\r\nContent-Length: 12\r\n\r\n", 0, 12, 0},
      {"a length at the limit", "POST /a HTTP/1.1\r\ncontent-length: 100\r\n\r\n", 0, 100, 0},
      {"a length over the limit", "POST /a HTTP/1.1\r\nContent-Length: 101\r\n\r\n", 413, 0, 0},
      {"a length of 19 digits", "POST /a HTTP/1.1\r\nContent-Length: 1000000000000000000\r\n\r\n",
       413, 0, 0},
      {"two lengths", "POST /a HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n", 400,
       0, 0},
      {"a length that is no number", "POST /a HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400, 0, 0},
      {"an empty length", "POST /a HTTP/1.1\r\nContent-Length:\r\n\r\n", 400, 0, 0},
      {"chunked", "POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 411, 0, 0},
      {"a bare LF", "GET / HTTP/1.1\r\nHost: x\n\r\n", 400, 0, 0},
      {"whitespace before the colon", "GET / HTTP/1.1\r\nHost : x\r\n\r\n", 400, 0, 0},
      {"a line without a colon", "GET / HTTP/1.1\r\nHost\r\n\r\n", 400, 0, 0},
      {"100-continue", "POST /a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n", 0,
       3, 1},
      {"another expectation", "POST /a HTTP/1.1\r\nExpect: 200-ok\r\n\r\n", 417, 0, 0},
  };
  for (const Case& c : cases) {
    const Framing f = FrameHead(c.head, 100);
    EXPECT_EQ(f.refuse, c.refuse) << c.what << ": " << f.why;
    if (c.refuse == 0) {
      EXPECT_EQ(f.body, c.body) << c.what;
      EXPECT_EQ(f.expect_lines.size(), c.expect_lines) << c.what;
    } else {
      EXPECT_FALSE(f.why.empty()) << c.what;
    }
  }
}

TEST(HttpFramingTest, TheExpectLineIsTheOneToErase) {
  const std::string head =
      "POST /a HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n";
  const Framing f = FrameHead(head, 100);
  ASSERT_EQ(f.expect_lines.size(), 1u);
  const auto [begin, end] = f.expect_lines[0];
  EXPECT_EQ(head.substr(begin, end - begin), "Expect: 100-continue\r\n");
}

TEST(HttpFramingTest, ARefusalIsACompleteResponseThatCloses) {
  EXPECT_EQ(Refusal(413, "too big"),
            "HTTP/1.1 413 Payload Too Large\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            "Content-Length: 8\r\n\r\ntoo big\n");
  EXPECT_EQ(Refusal(400, "no").substr(0, 26), "HTTP/1.1 400 Bad Request\r\n");
}

}  // namespace
}  // namespace lockstep
