// What a hostile or careless client can hold on a coordinator, from raw gRPC and HTTP clients on
// loopback: slow and idle HTTP connections, and requests whose bodies the server cannot bound by
// their Content-Length, do not starve the dashboard or the metrics port, grow its memory, or keep
// their descriptors; made-up gRPC method names do not grow /metrics; watchers of a job
// hold no thread each; a worker session that never registers is closed; gRPC reflection is off
// unless asked for, and behind the token when on; idle client channels survive a minute.
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/grpc_options.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "lockstep/v1/worker.grpc.pb.h"
#include "tests/testing/cluster.h"
#include "tests/testing/http.h"

namespace lockstep {
namespace {

using testing::Cluster;

constexpr char kToken[] = "bounds-token";

std::chrono::system_clock::time_point In(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}

// The open descriptors of a process.
int OpenFds(pid_t pid) {
  int n = 0;
  for ([[maybe_unused]] const auto& entry :
       std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"))) {
    ++n;
  }
  return n;
}

// A number from /proc/PID/status ("Threads:", "VmRSS:" in kB); -1 when absent.
int64_t StatusValue(pid_t pid, absl::string_view key) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, key)) {
      absl::string_view value = absl::StripAsciiWhitespace(line.substr(key.size()));
      absl::ConsumeSuffix(&value, " kB");
      int64_t n = 0;
      if (absl::SimpleAtoi(value, &n)) return n;
    }
  }
  return -1;
}

int Threads(pid_t pid) { return static_cast<int>(StatusValue(pid, "Threads:")); }

// Polls until OpenFds(pid) <= limit; the last count.
int WaitForFds(pid_t pid, int limit, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  int fds = OpenFds(pid);
  while (fds > limit && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
    fds = OpenFds(pid);
  }
  return fds;
}

// Thousands of client sockets in this process: the soft limit is raised to the hard one.
void RaiseFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = std::min<rlim_t>(limit.rlim_max, 1 << 20);
    setrlimit(RLIMIT_NOFILE, &limit);
  }
}

rlim_t FileLimit() {
  rlimit limit{};
  getrlimit(RLIMIT_NOFILE, &limit);
  return limit.rlim_cur;
}

int ReadPort(const std::string& path) {
  std::ifstream in(path);
  int port = 0;
  in >> port;
  return port;
}

// A TCP connection to 127.0.0.1:port; -1 when it fails.
int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Sends all of `bytes`; false when the connection fails first.
bool SendAll(int fd, absl::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n <= 0) return false;
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return true;
}

// Slowloris: `n` clients, each sending `start` (by default a request line and the first bytes of
// a header) and then `unit` every 100 ms, connecting again whenever the server closes on them,
// until Stop.
class Trickle {
 public:
  Trickle(int port, int n,
          std::string start = "GET /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ",
          std::string unit = "a") {
    for (int i = 0; i < n; ++i) {
      threads_.emplace_back([this, port, start, unit] {
        while (!stop_) {
          const int fd = Connect(port);
          if (fd < 0) {
            absl::SleepFor(absl::Milliseconds(50));
            continue;
          }
          bool open = SendAll(fd, start);
          while (open && !stop_) {
            absl::SleepFor(absl::Milliseconds(100));
            open = SendAll(fd, unit);
          }
          close(fd);
          if (!stop_) reconnects_.fetch_add(1);
        }
      });
    }
  }
  ~Trickle() { Stop(); }
  void Stop() {
    stop_ = true;
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }
  int reconnects() const { return reconnects_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> reconnects_{0};
  std::vector<std::thread> threads_;
};

// Idle connections: opened and never written to.
std::vector<int> OpenIdle(int port, int n) {
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    const int fd = Connect(port);
    if (fd >= 0) fds.push_back(fd);
  }
  return fds;
}

// A GET through cpp-httplib's client, with the token or without, that must be answered 200
// within 5 s: how long it took.
absl::Duration TimedGet(int port, const std::string& path, bool with_token) {
  const std::map<std::string, std::string> auth = {
      {"Authorization", absl::StrCat("Bearer ", kToken)}};
  const absl::Time start = absl::Now();
  absl::StatusOr<testing::HttpResponse> response = testing::HttpRequest(
      "GET", "127.0.0.1", port, path, with_token ? auth : std::map<std::string, std::string>{}, "",
      {}, absl::Seconds(5));
  const absl::Duration took = absl::Now() - start;
  EXPECT_TRUE(response.ok()) << path << ": " << response.status();
  if (response.ok()) {
    EXPECT_EQ(response->status, 200) << path << ": " << response->body;
  }
  return took;
}

// What the server writes back on `fd` while the client sends `unit` every 100 ms, as an attacker
// goes on sending: until a response head (a 100 Continue counts) has come, the server closes,
// or `timeout` passes.
std::string AnswerWhileTrickling(int fd, absl::string_view unit, absl::Duration timeout) {
  std::string answer;
  const absl::Time deadline = absl::Now() + timeout;
  absl::Time next_send = absl::Now() + absl::Milliseconds(100);
  while (absl::Now() < deadline && answer.find("\r\n\r\n") == std::string::npos) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 20) > 0) {
      char buffer[4096];
      const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
      if (n <= 0) break;
      answer.append(buffer, static_cast<size_t>(n));
      continue;
    }
    if (absl::Now() >= next_send) {
      (void)SendAll(fd, unit);
      next_send += absl::Milliseconds(100);
    }
  }
  return answer;
}

// What the server writes on `fd` until it closes, a read fails (*error: its errno, else 0), or
// `timeout` passes without a byte.
std::string ReadUntilClosed(int fd, absl::Duration timeout, int* error = nullptr) {
  std::string answer;
  char buffer[4096];
  pollfd p{fd, POLLIN, 0};
  if (error != nullptr) *error = 0;
  while (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) > 0) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n < 0 && error != nullptr) *error = errno;
    if (n <= 0) break;
    answer.append(buffer, static_cast<size_t>(n));
  }
  return answer;
}

class BoundsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    RaiseFileLimit();
    dir_ = std::filesystem::temp_directory_path() / "lockstep-bounds-XXXXXX";
    ASSERT_NE(mkdtemp(dir_.data()), nullptr);
  }
  void TearDown() override {
    cluster_.reset();
    std::filesystem::remove_all(dir_);
  }

  // A coordinator with the token, its dashboard and its metrics port.
  void StartCluster(std::vector<std::string> flags = {}) {
    flags.push_back("--http_listen=127.0.0.1:0");
    flags.push_back("--http_port_file=" + dir_ + "/http.port");
    flags.push_back("--metrics_listen=127.0.0.1:0");
    flags.push_back("--metrics_port_file=" + dir_ + "/metrics.port");
    auto started = Cluster::Start(flags, kToken);
    ASSERT_TRUE(started.ok()) << started.status();
    cluster_ = *std::move(started);
    http_port_ = ReadPort(dir_ + "/http.port");
    metrics_port_ = ReadPort(dir_ + "/metrics.port");
    ASSERT_GT(http_port_, 0);
    ASSERT_GT(metrics_port_, 0);
  }
  pid_t pid() { return cluster_->coordinator()->pid(); }

  std::shared_ptr<grpc::Channel> Channel(const std::string& token = kToken) {
    return MakeChannel(cluster_->address(), {token, "bounds test"});
  }

  std::string dir_;
  std::unique_ptr<Cluster> cluster_;
  int http_port_ = 0;
  int metrics_port_ = 0;
};

// 40 slowloris clients and 3,000 idle connections on the dashboard (and 10 and up to 1,000 on
// the metrics port): a plain client still gets the JSON in under a second, and once the attackers
// go the coordinator's descriptors are back where they were.
TEST_F(BoundsTest, SlowAndIdleHttpClientsStarveNoRequestAndGiveTheirDescriptorsBack) {
  // This process holds every attacking socket: 3,000 for the dashboard and what is left, up to
  // 1,000, for the metrics port.
  const int metrics_idle = std::min<int>(1000, static_cast<int>(FileLimit()) - 3300);
  if (metrics_idle < 100) {
    GTEST_SKIP() << "needs 3,400 descriptors (ulimit -n), has " << FileLimit();
  }
  StartCluster();
  TimedGet(http_port_, "/api/v1/jobs", true);
  TimedGet(metrics_port_, "/metrics", false);
  absl::SleepFor(absl::Milliseconds(500));
  const int fds_before = OpenFds(pid());

  Trickle dashboard_trickle(http_port_, 40);
  Trickle metrics_trickle(metrics_port_, 10);
  std::vector<int> idle = OpenIdle(http_port_, 3000);
  std::vector<int> idle_metrics = OpenIdle(metrics_port_, metrics_idle);
  EXPECT_EQ(idle.size(), 3000u);
  EXPECT_EQ(static_cast<int>(idle_metrics.size()), metrics_idle);
  int fds_during = 0;
  absl::Duration slowest = absl::ZeroDuration();
  absl::Duration slowest_metrics = absl::ZeroDuration();
  // Longer than the server's request deadline (5 s): the trickling clients are cut off and
  // come back meanwhile.
  const absl::Time until = absl::Now() + absl::Seconds(8);
  int requests = 0;
  while (absl::Now() < until) {
    slowest = std::max(slowest, TimedGet(http_port_, "/api/v1/jobs", true));
    slowest_metrics = std::max(slowest_metrics, TimedGet(metrics_port_, "/metrics", false));
    fds_during = std::max(fds_during, OpenFds(pid()));
    ++requests;
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_LT(slowest, absl::Seconds(1)) << "the dashboard was starved";
  EXPECT_LT(slowest_metrics, absl::Seconds(1)) << "the metrics port was starved";
  // What the server keeps: 256 dashboard and 64 metrics connections, and the rest of its own.
  EXPECT_LE(fds_during, fds_before + 256 + 64 + 20);
  EXPECT_GT(dashboard_trickle.reconnects(), 0) << "the trickling clients were never cut off";

  dashboard_trickle.Stop();
  metrics_trickle.Stop();
  for (int fd : idle) close(fd);
  for (int fd : idle_metrics) close(fd);
  const int fds_after = WaitForFds(pid(), fds_before + 5, absl::Seconds(20));
  EXPECT_LE(fds_after, fds_before + 5);
  EXPECT_LT(TimedGet(http_port_, "/api/v1/jobs", true), absl::Seconds(1));
  std::cout << "[ numbers  ] dashboard under 40 slowloris + 3,000 idle: " << requests
            << " requests, slowest " << absl::FormatDuration(slowest) << " (metrics port, 10 + "
            << metrics_idle << ": slowest " << absl::FormatDuration(slowest_metrics)
            << "); coordinator fds " << fds_before << " before, " << fds_during
            << " at most during, " << fds_after << " after; " << dashboard_trickle.reconnects()
            << " slowloris reconnects" << std::endl;
  EXPECT_TRUE(cluster_->coordinator()->running());
}

// A request that a parser reading on until the request's end would wait on for as long as the
// client keeps sending (or read without end): a whole head, then a unit every 100 ms.
struct HttpAttack {
  std::string name;
  std::string head;    // sent at once
  std::string unit;    // then sent every 100 ms, for ever
  std::string answer;  // how the server's answer begins
};

void PrintTo(const HttpAttack& attack, std::ostream* out) { *out << attack.name; }

std::string CancelHead() {
  return "POST /api/v1/jobs/job-1/cancel HTTP/1.1\r\nHost: 127.0.0.1\r\n";
}

std::vector<HttpAttack> HttpAttacks() {
  const std::string post = CancelHead();
  return {
      // A chunked body: its end is a chunk the client may never send.
      {"ChunkedBody", post + "Transfer-Encoding: chunked\r\n\r\n", "1\r\na\r\n", "HTTP/1.1 411"},
      // A POST without a length has no body: it is answered, and what follows is the next
      // request (not a body read until the client closes).
      {"PostWithoutLength",
       absl::StrCat(post, "Authorization: Bearer ", kToken, "\r\nX-Lockstep-Dashboard: 1\r\n\r\n"),
       "a", "HTTP/1.1 404"},
      {"RequestLineWithoutEnd", "GET /" + std::string(17 << 10, 'a'), "a", "HTTP/1.1 414"},
      {"HeadWithoutEnd",
       "GET /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Long: " + std::string(17 << 10, 'b'), "b",
       "HTTP/1.1 431"},
      {"LengthOverTheLimit", post + "Content-Length: 100000000\r\n\r\n", "a", "HTTP/1.1 413"},
      // cpp-httplib reads the first Content-Length; a server that frames by the last would hand
      // it a request with 16,000 bytes still to come.
      {"TwoLengths", post + "Content-Length: 16000\r\nContent-Length: 0\r\n\r\n", "a",
       "HTTP/1.1 400"},
      // The client is told to go on, and its body must then arrive in time like any other.
      {"ExpectContinue", post + "Content-Length: 16000\r\nExpect: 100-continue\r\n\r\n", "a",
       "HTTP/1.1 100 Continue\r\n"},
      {"ExpectSomethingElse", post + "Content-Length: 16000\r\nExpect: 200-ok\r\n\r\n", "a",
       "HTTP/1.1 417"},
  };
}

class HttpAttackTest : public BoundsTest, public ::testing::WithParamInterface<HttpAttack> {};

// One such client gets its answer at once, however long it goes on sending; and while a handler
// thread's worth more of them than each port has threads (16 + 1 on the dashboard, 1 + 1 on the
// metrics port) keep at it, reconnecting whenever they are closed, real requests are answered.
TEST_P(HttpAttackTest, IsAnsweredAtOnceAndStarvesNoRequest) {
  const HttpAttack& attack = GetParam();
  StartCluster();
  const int fd = Connect(http_port_);
  ASSERT_GE(fd, 0);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(SendAll(fd, attack.head));
  const std::string answer = AnswerWhileTrickling(fd, attack.unit, absl::Seconds(8));
  const absl::Duration answered_in = absl::Now() - start;
  close(fd);
  EXPECT_TRUE(absl::StartsWith(answer, attack.answer)) << "answered: " << answer.substr(0, 300);
  EXPECT_LT(answered_in, absl::Seconds(2));

  Trickle dashboard(http_port_, 16 + 1, attack.head, attack.unit);
  Trickle metrics(metrics_port_, 1 + 1, attack.head, attack.unit);
  absl::SleepFor(absl::Milliseconds(500));  // every one has sent its head
  absl::Duration slowest = absl::ZeroDuration();
  absl::Duration slowest_metrics = absl::ZeroDuration();
  int probes = 0;
  const absl::Time until = absl::Now() + absl::Seconds(3);
  do {
    slowest = std::max(slowest, TimedGet(http_port_, "/api/v1/jobs", true));
    slowest_metrics = std::max(slowest_metrics, TimedGet(metrics_port_, "/metrics", false));
    ++probes;
    absl::SleepFor(absl::Milliseconds(100));
  } while (absl::Now() < until);
  dashboard.Stop();
  metrics.Stop();
  // Generous, but well under the 5 s request deadline: a port whose handler threads such clients
  // held would answer only when the deadline let one of them go.
  EXPECT_LT(slowest, absl::Milliseconds(2500));
  EXPECT_LT(slowest_metrics, absl::Milliseconds(2500));
  std::cout << "[ numbers  ] " << attack.name << ": answered in "
            << absl::FormatDuration(answered_in) << "; with 17 + 2 of them, " << probes
            << " GETs of each port, slowest " << absl::FormatDuration(slowest) << " (dashboard), "
            << absl::FormatDuration(slowest_metrics) << " (metrics)" << std::endl;
  EXPECT_TRUE(cluster_->coordinator()->running());
}

INSTANTIATE_TEST_SUITE_P(Requests, HttpAttackTest, ::testing::ValuesIn(HttpAttacks()),
                         [](const ::testing::TestParamInfo<HttpAttack>& info) {
                           return info.param.name;
                         });

// 200 MB bodies sent as fast as loopback goes, in the framings a Content-Length limit does not
// bound (chunked, no length) and one over the limit: each is answered, and the coordinator's
// resident memory stays within a few MB of where it was.
TEST_F(BoundsTest, StreamedBodiesDoNotGrowTheCoordinatorsMemory) {
  StartCluster();
  EXPECT_LT(TimedGet(http_port_, "/api/v1/jobs", true), absl::Seconds(5));
  struct Flood {
    std::string name;
    std::string head;
    bool chunked;
    std::string answer;
  };
  const std::string post = CancelHead();
  const std::vector<Flood> floods = {
      {"chunked", post + "Transfer-Encoding: chunked\r\n\r\n", true, "HTTP/1.1 411"},
      {"no length",
       absl::StrCat(post, "Authorization: Bearer ", kToken, "\r\nX-Lockstep-Dashboard: 1\r\n\r\n"),
       false, "HTTP/1.1 404"},
      {"over the limit", post + "Content-Length: 209715200\r\n\r\n", false, "HTTP/1.1 413"},
  };
  constexpr int64_t kBodyBytes = 200 << 20;
  constexpr int64_t kBlock = 1 << 20;
  for (const Flood& flood : floods) {
    const int64_t rss_before = StatusValue(pid(), "VmRSS:");
    const int fd = Connect(http_port_);
    ASSERT_GE(fd, 0);
    // A server that neither reads nor closes fails the send instead of blocking the test.
    const timeval send_timeout{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof(send_timeout));
    const absl::Time start = absl::Now();
    ASSERT_TRUE(SendAll(fd, flood.head));
    std::atomic<bool> done{false};
    std::atomic<int64_t> sent{0};
    std::thread sender([&] {
      const std::string block = flood.chunked
                                    ? absl::StrCat("100000\r\n", std::string(kBlock, 'x'), "\r\n")
                                    : std::string(kBlock, 'x');
      const absl::Time deadline = absl::Now() + absl::Seconds(30);
      while (sent.load() < kBodyBytes && absl::Now() < deadline && SendAll(fd, block)) {
        sent.fetch_add(kBlock);
      }
      done = true;
    });
    int64_t rss_peak = rss_before;
    std::string answer;
    absl::Duration answered_in = absl::InfiniteDuration();
    while (!done.load()) {
      rss_peak = std::max(rss_peak, StatusValue(pid(), "VmRSS:"));
      char buffer[4096];
      const ssize_t n = recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
      if (n > 0) {
        answer.append(buffer, static_cast<size_t>(n));
        if (answered_in == absl::InfiniteDuration()) answered_in = absl::Now() - start;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    sender.join();
    rss_peak = std::max(rss_peak, StatusValue(pid(), "VmRSS:"));
    close(fd);
    EXPECT_TRUE(absl::StartsWith(answer, flood.answer))
        << flood.name << ": " << answer.substr(0, 300);
    EXPECT_LT(answered_in, absl::Seconds(2)) << flood.name;
    EXPECT_LT(rss_peak - rss_before, 8 << 10)
        << flood.name << ": VmRSS grew from " << rss_before << " kB to " << rss_peak << " kB";
    std::cout << "[ numbers  ] a 200 MB " << flood.name << " body: " << (sent.load() >> 20)
              << " MB sent, answered in " << absl::FormatDuration(answered_in)
              << ", coordinator VmRSS " << rss_before << " kB before, " << rss_peak << " kB at most"
              << std::endl;
  }
  EXPECT_LT(TimedGet(http_port_, "/api/v1/jobs", true), absl::Seconds(5));
  EXPECT_TRUE(cluster_->coordinator()->running());
}

// "Expect: 100-continue" is answered once, and the request then served when its body comes
// (the parser never sees the Expect, so it sends no second 100).
TEST_F(BoundsTest, ExpectContinueIsAnsweredOnceAndTheRequestServed) {
  StartCluster();
  const int fd = Connect(http_port_);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SendAll(fd, absl::StrCat(CancelHead(), "Authorization: Bearer ", kToken,
                                       "\r\nX-Lockstep-Dashboard: 1\r\nContent-Length: 2\r\n"
                                       "Expect: 100-continue\r\nConnection: close\r\n\r\n")));
  std::string answer = AnswerWhileTrickling(fd, "", absl::Seconds(5));
  EXPECT_EQ(answer, "HTTP/1.1 100 Continue\r\n\r\n");
  ASSERT_TRUE(SendAll(fd, "{}"));
  const std::string rest = ReadUntilClosed(fd, absl::Seconds(5));
  close(fd);
  EXPECT_TRUE(absl::StartsWith(rest, "HTTP/1.1 404")) << rest;
  EXPECT_NE(rest.find("job-1"), std::string::npos) << rest;
}

// A response that closes the connection (Connection: close) while the client has pipelined more
// requests the server never read: the response arrives whole. A close with unread bytes would
// reset the connection and drop what the kernel had not yet sent; the client's small receive
// buffer keeps most of the response there until it reads.
TEST_F(BoundsTest, AClosingResponseSurvivesUnreadPipelinedRequests) {
  StartCluster();
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  const int small = 4096;
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(http_port_));
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  std::string requests =
      "GET /assets/app.js HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  while (requests.size() < (64 << 10)) {
    requests += "GET /api/v1/auth HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  }
  ASSERT_TRUE(SendAll(fd, requests));
  absl::SleepFor(absl::Milliseconds(500));  // the server has answered what fits, and moved on
  int error = 0;
  const std::string answer = ReadUntilClosed(fd, absl::Seconds(5), &error);
  close(fd);
  const size_t end = answer.find("\r\n\r\n");
  ASSERT_NE(end, std::string::npos) << answer.substr(0, 300);
  EXPECT_TRUE(absl::StartsWith(answer, "HTTP/1.1 200")) << answer.substr(0, 300);
  const size_t at = absl::AsciiStrToLower(answer.substr(0, end)).find("content-length:");
  ASSERT_NE(at, std::string::npos) << answer.substr(0, end);
  size_t length = 0;
  ASSERT_TRUE(absl::SimpleAtoi(
      absl::StripAsciiWhitespace(answer.substr(at + 15, answer.find("\r\n", at) - at - 15)),
      &length));
  EXPECT_GT(length, 16u << 10);  // more than the kernel's buffers hold for an unread client
  EXPECT_EQ(answer.size() - (end + 4), length)
      << "the response was cut short" << (error != 0 ? absl::StrCat(": ", strerror(error)) : "");
  EXPECT_EQ(error, 0) << strerror(error);
}

// A raw client calls 5,000 made-up methods, some under the prefixes of the real ones: each is
// counted as "other", and /metrics stays small.
TEST_F(BoundsTest, MadeUpMethodNamesDoNotGrowTheMetrics) {
  StartCluster();
  for (const bool with_token : {false, true}) {
    grpc::GenericStub stub(Channel(with_token ? kToken : ""));
    grpc::CompletionQueue cq;
    constexpr int kCalls = 2500;
    constexpr int kInFlight = 100;
    struct Call {
      grpc::ClientContext context;
      grpc::ByteBuffer response;
      grpc::Status status;
      std::unique_ptr<grpc::GenericClientAsyncResponseReader> reader;
    };
    std::vector<std::unique_ptr<Call>> calls(kCalls);
    const char* const kPrefixes[] = {"/lockstep.v1.JobService/", "/lockstep.v1.Made", "/grpc.",
                                     "/grpc.health.v1.Health/", "/x.y/"};
    grpc::Slice empty("");
    const grpc::ByteBuffer request(&empty, 1);
    int started = 0;
    int done = 0;
    int unimplemented = 0;
    while (done < kCalls) {
      while (started < kCalls && started - done < kInFlight) {
        auto call = std::make_unique<Call>();
        call->context.set_deadline(In(absl::Seconds(30)));
        const std::string method =
            absl::StrCat(kPrefixes[started % 5], "Nope", with_token ? "T" : "U", started);
        call->reader = stub.PrepareUnaryCall(&call->context, method, request, &cq);
        call->reader->StartCall();
        call->reader->Finish(&call->response, &call->status, reinterpret_cast<void*>(started));
        calls[started] = std::move(call);
        ++started;
      }
      void* tag = nullptr;
      bool ok = false;
      ASSERT_TRUE(cq.Next(&tag, &ok));
      const auto i = reinterpret_cast<intptr_t>(tag);
      unimplemented += calls[i]->status.error_code() == grpc::StatusCode::UNIMPLEMENTED;
      calls[i].reset();
      ++done;
    }
    EXPECT_EQ(unimplemented, kCalls);
  }
  absl::StatusOr<std::string> text;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  do {
    text = testing::HttpGet("127.0.0.1", metrics_port_, "/metrics");
    ASSERT_TRUE(text.ok()) << text.status();
  } while (testing::SampleValue(*text, "lockstep_coordinator_rpcs_total",
                                {{"method", "other"}, {"code", "UNIMPLEMENTED"}})
                   .value_or(0) < 5000 &&
           absl::Now() < deadline);
  EXPECT_EQ(testing::SampleValue(*text, "lockstep_coordinator_rpcs_total",
                                 {{"method", "other"}, {"code", "UNIMPLEMENTED"}}),
            5000.0);
  EXPECT_EQ(text->find("Nope"), std::string::npos);
  EXPECT_LT(text->size(), 20000u);
  // The real methods are still counted by name.
  EXPECT_TRUE(cluster_->Workers().ok());
  text = testing::HttpGet("127.0.0.1", metrics_port_, "/metrics");
  ASSERT_TRUE(text.ok());
  EXPECT_GE(
      testing::SampleValue(*text, "lockstep_coordinator_rpcs_total",
                           {{"method", "/lockstep.v1.JobService/ListWorkers"}, {"code", "OK"}})
          .value_or(0),
      1)
      << *text;
  std::cout << "[ numbers  ] /metrics after 5,000 made-up methods: " << text->size() << " bytes"
            << std::endl;
}

// 200 clients watch a running job: the coordinator's threads stay flat, each watcher gets every
// event through the job's end, and the ones that go early end CANCELLED.
TEST_F(BoundsTest, TwoHundredWatchersHoldNoThreads) {
  StartCluster();
  ASSERT_TRUE(cluster_->StartWorkers(1).ok());
  absl::StatusOr<v1::Job> job = cluster_->Submit(testing::SyntheticJob(1, 1, 1'000'000));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(
      cluster_
          ->WaitFor(
              job->job_id(), [](const v1::Job& j) { return j.step() > 0; }, absl::Seconds(60))
          .ok());
  // One watcher first, so that what gRPC starts once for streams is in the baseline.
  ASSERT_TRUE([&] {
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(10)));
    v1::WatchJobRequest request;
    request.set_job_id(job->job_id());
    auto reader = cluster_->jobs().WatchJob(&context, request);
    v1::JobEvent event;
    const bool read = reader->Read(&event);
    context.TryCancel();
    reader->Finish();
    return read;
  }());
  absl::SleepFor(absl::Milliseconds(500));
  const int threads_before = Threads(pid());
  const int fds_before = OpenFds(pid());

  constexpr int kWatchers = 200;
  constexpr int kLeaving = 40;  // these cancel their stream after the first events
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < 8; ++i) channels.push_back(Channel());
  struct Watcher {
    std::vector<v1::JobEvent> events;
    grpc::Status status;
    grpc::ClientContext context;
  };
  std::vector<Watcher> watchers(kWatchers);
  std::atomic<int> started{0};
  absl::Mutex mu;
  bool release = false;  // the leaving ones go
  std::vector<std::thread> threads;
  for (int i = 0; i < kWatchers; ++i) {
    threads.emplace_back([&, i] {
      Watcher& w = watchers[i];
      auto stub = v1::JobService::NewStub(channels[i % channels.size()]);
      w.context.set_deadline(In(absl::Seconds(240)));
      v1::WatchJobRequest request;
      request.set_job_id(job->job_id());
      auto reader = stub->WatchJob(&w.context, request);
      v1::JobEvent event;
      while (reader->Read(&event)) {
        w.events.push_back(event);
        if (w.events.size() == 1) started.fetch_add(1);
        if (i < kLeaving) {
          absl::MutexLock lock(&mu);
          mu.Await(absl::Condition(&release));
          w.context.TryCancel();
        }
      }
      w.status = reader->Finish();
    });
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (started.load() < kWatchers && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(started.load(), kWatchers) << cluster_->Logs();
  // The job trains on meanwhile, so events flow to every watcher while the threads are counted.
  int threads_during = 0;
  for (int i = 0; i < 30; ++i) {
    threads_during = std::max(threads_during, Threads(pid()));
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_LE(threads_during, threads_before + 10);
  {
    absl::MutexLock lock(&mu);
    release = true;
  }
  grpc::ClientContext context;
  v1::CancelJobRequest cancel;
  cancel.set_job_id(job->job_id());
  v1::Job cancelled;
  ASSERT_TRUE(cluster_->jobs().CancelJob(&context, cancel, &cancelled).ok());
  for (std::thread& t : threads) t.join();
  absl::StatusOr<std::vector<v1::JobEvent>> history = cluster_->History(job->job_id());
  ASSERT_TRUE(history.ok()) << history.status();
  ASSERT_FALSE(history->empty());
  EXPECT_EQ(history->back().job().state(), v1::JOB_STATE_CANCELLED);
  int complete = 0;
  for (int i = 0; i < kWatchers; ++i) {
    const Watcher& w = watchers[i];
    if (i < kLeaving) {
      EXPECT_EQ(w.status.error_code(), grpc::StatusCode::CANCELLED) << i;
      continue;
    }
    EXPECT_TRUE(w.status.ok()) << i << ": " << w.status.error_message();
    ASSERT_EQ(w.events.size(), history->size()) << "watcher " << i;
    for (size_t e = 0; e < w.events.size(); ++e) {
      ASSERT_EQ(w.events[e].sequence(), (*history)[e].sequence()) << "watcher " << i;
      ASSERT_EQ(w.events[e].message(), (*history)[e].message()) << "watcher " << i;
    }
    ++complete;
  }
  EXPECT_EQ(complete, kWatchers - kLeaving);
  channels.clear();
  const int fds_after = WaitForFds(pid(), fds_before + 5, absl::Seconds(10));
  EXPECT_LE(fds_after, fds_before + 5);
  const int threads_after = Threads(pid());
  EXPECT_LE(threads_after, threads_before + 10);
  std::cout << "[ numbers  ] coordinator threads: " << threads_before << " before, "
            << threads_during << " at most with " << kWatchers << " watchers, " << threads_after
            << " after; " << history->size() << " events each" << std::endl;
}

// A worker session that never registers is closed after WorkerServiceImpl::kRegisterTimeout
// (10 s) with a status that says why; one that begins with a heartbeat is refused at once.
TEST_F(BoundsTest, SessionsThatNeverRegisterAreClosed) {
  StartCluster();
  const int fds_before = OpenFds(pid());
  constexpr absl::Duration kRegisterTimeout = absl::Seconds(10);
  auto stub = v1::WorkerService::NewStub(Channel());

  grpc::ClientContext heartbeat_context;
  heartbeat_context.set_deadline(In(absl::Seconds(30)));
  auto heartbeat_first = stub->Session(&heartbeat_context);
  v1::WorkerMessage beat;
  beat.mutable_heartbeat();
  heartbeat_first->Write(beat);
  v1::CoordinatorMessage reply;
  EXPECT_FALSE(heartbeat_first->Read(&reply));
  const grpc::Status refused = heartbeat_first->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("must be register"), std::string::npos)
      << refused.error_message();

  constexpr int kSilent = 20;
  const absl::Time opened = absl::Now();
  std::vector<std::thread> threads;
  std::vector<grpc::Status> statuses(kSilent);
  std::vector<absl::Duration> lasted(kSilent);
  for (int i = 0; i < kSilent; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext context;
      context.set_deadline(In(absl::Seconds(60)));
      auto session = stub->Session(&context);
      v1::CoordinatorMessage message;
      while (session->Read(&message)) {
      }
      statuses[i] = session->Finish();
      lasted[i] = absl::Now() - opened;
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kSilent; ++i) {
    EXPECT_EQ(statuses[i].error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << i;
    EXPECT_NE(statuses[i].error_message().find("no register message within 10s"), std::string::npos)
        << statuses[i].error_message();
    EXPECT_GE(lasted[i], kRegisterTimeout - absl::Seconds(1));
    EXPECT_LE(lasted[i], kRegisterTimeout + absl::Seconds(8));
  }
  // A worker that registers is unaffected, and the coordinator holds nothing of the others.
  ASSERT_TRUE(cluster_->StartWorker("w0").ok());
  absl::SleepFor(kRegisterTimeout + absl::Seconds(1));
  ASSERT_TRUE(cluster_->WaitForWorker("w0", "idle", absl::Seconds(5)).ok());
  stub.reset();
  EXPECT_LE(WaitForFds(pid(), fds_before + 8, absl::Seconds(10)), fds_before + 8);
  std::cout << "[ numbers  ] silent sessions closed after "
            << absl::FormatDuration(*std::max_element(lasted.begin(), lasted.end())) << " at most"
            << std::endl;
}

// One reflection exchange (list the services) over a raw generic stream: the answer's bytes, or
// the status that ended the call.
absl::StatusOr<std::string> ListServicesByReflection(
    const std::shared_ptr<grpc::Channel>& channel) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(10)));
  auto call = stub.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag = nullptr;
  bool ok = false;
  auto step = [&](int expected) {
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(tag), expected);
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  step(1);
  // ServerReflectionRequest{list_services: ""}: field 7, length-delimited, empty.
  grpc::Slice request_bytes(std::string("\x3a\x00", 2));
  grpc::ByteBuffer request(&request_bytes, 1);
  call->Write(request, reinterpret_cast<void*>(2));
  step(2);
  call->WritesDone(reinterpret_cast<void*>(3));
  step(3);
  grpc::ByteBuffer response;
  call->Read(&response, reinterpret_cast<void*>(4));
  const bool answered = step(4);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  if (!answered) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  std::vector<grpc::Slice> slices;
  (void)response.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes;
}

TEST_F(BoundsTest, ReflectionIsOffByDefaultAndBehindTheTokenWhenOn) {
  for (const std::vector<std::string>& flags :
       std::vector<std::vector<std::string>>{{}, {"--grpc_reflection=false"}}) {
    StartCluster(flags);
    for (const std::string token : {"", kToken}) {
      absl::StatusOr<std::string> services = ListServicesByReflection(Channel(token));
      EXPECT_TRUE(absl::IsUnimplemented(services.status()))
          << (flags.empty() ? "default flags" : flags[0]) << ", token \"" << token
          << "\": " << services.status() << " " << services.value_or("");
    }
    cluster_.reset();
  }
  StartCluster({"--grpc_reflection"});
  for (const std::string token : {"", "not-the-token"}) {
    absl::StatusOr<std::string> services = ListServicesByReflection(Channel(token));
    EXPECT_TRUE(absl::IsUnauthenticated(services.status()))
        << "token \"" << token << "\": " << services.status() << " " << services.value_or("");
  }
  absl::StatusOr<std::string> services = ListServicesByReflection(Channel());
  ASSERT_TRUE(services.ok()) << services.status();
  EXPECT_NE(services->find("lockstep.v1.JobService"), std::string::npos) << *services;
  // The refused calls are counted where the others are.
  auto workers = cluster_->Workers();
  ASSERT_TRUE(workers.ok());
  absl::StatusOr<std::string> text = testing::HttpGet("127.0.0.1", metrics_port_, "/metrics");
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(testing::SampleValue(
                *text, "lockstep_coordinator_rpcs_total",
                {{"method", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"},
                 {"code", "UNAUTHENTICATED"}}),
            2.0)
      << *text;
}

// A channel made as lockstepctl makes it, and a plain one, each idle for a minute between two
// calls: the second call succeeds (the server's keepalive did not drop the connection).
TEST_F(BoundsTest, IdleChannelsSurviveAMinute) {
  StartCluster();
  auto list = [&](v1::JobService::Stub& stub, bool add_token) {
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(10)));
    if (add_token) context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    v1::ListJobsResponse response;
    return stub.ListJobs(&context, v1::ListJobsRequest(), &response);
  };
  auto ours = v1::JobService::NewStub(Channel());
  auto plain = v1::JobService::NewStub(
      grpc::CreateChannel(cluster_->address(), grpc::InsecureChannelCredentials()));
  ASSERT_TRUE(list(*ours, false).ok());
  ASSERT_TRUE(list(*plain, true).ok());
  absl::SleepFor(absl::Seconds(60));
  const grpc::Status ours_after = list(*ours, false);
  const grpc::Status plain_after = list(*plain, true);
  EXPECT_TRUE(ours_after.ok()) << ours_after.error_code() << ": " << ours_after.error_message();
  EXPECT_TRUE(plain_after.ok()) << plain_after.error_code() << ": " << plain_after.error_message();
}

}  // namespace
}  // namespace lockstep
