// Prometheus metrics as an operator uses them: the coordinator and every worker serve
// /metrics while a job trains, a real Prometheus server (Debian's `prometheus`, when
// installed) scrapes them all, and the recovery counter rises after a worker is killed.
#include <signal.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "tests/testing/cluster.h"
#include "tests/testing/http.h"

namespace lockstep {
namespace {

using testing::Cluster;
using testing::Process;
using testing::HttpGet;
using testing::SampleValue;

std::string TempDir() {
  std::string dir = std::filesystem::temp_directory_path() / "lockstep-metrics-XXXXXX";
  return mkdtemp(dir.data()) != nullptr ? dir : "";
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

int ReadPort(const std::string& path) {
  std::ifstream in(path);
  int port = 0;
  in >> port;
  return port;
}

// Polls http://127.0.0.1:PORT/metrics until pred(text) holds; the last text otherwise.
std::string ScrapeUntil(int port, const std::function<bool(const std::string&)>& pred,
                        absl::Duration timeout = absl::Seconds(30)) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string text;
  while (absl::Now() < deadline) {
    absl::StatusOr<std::string> got = HttpGet("127.0.0.1", port, "/metrics");
    if (got.ok()) {
      text = *std::move(got);
      if (pred(text)) return text;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  return text;
}

// A port nobody listens on now (for the Prometheus server, which takes no port 0).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

class MetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempDir();
    ASSERT_FALSE(dir_.empty());
    auto cluster = Cluster::Start(
        {"--metrics_listen=127.0.0.1:0", "--metrics_port_file=" + dir_ + "/coordinator.port"});
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    coordinator_port_ = ReadPort(dir_ + "/coordinator.port");
    ASSERT_GT(coordinator_port_, 0);
  }
  void TearDown() override {
    cluster_.reset();
    std::filesystem::remove_all(dir_);
  }

  int StartWorker(const std::string& name) {
    const std::string port_file = dir_ + "/" + name + ".port";
    absl::Status s = cluster_->StartWorker(
        name, {"--metrics_listen=127.0.0.1:0", "--metrics_port_file=" + port_file});
    EXPECT_TRUE(s.ok()) << s;
    return ReadPort(port_file);
  }

  std::string dir_;
  std::unique_ptr<Cluster> cluster_;
  int coordinator_port_ = 0;
};

TEST_F(MetricsTest, CoordinatorAndWorkersServeTheirMetricsAndCountARecovery) {
  std::map<std::string, int> ports;
  for (const std::string name : {"w0", "w1", "w2"}) ports[name] = StartWorker(name);
  for (const auto& [name, port] : ports) ASSERT_GT(port, 0) << name;

  std::unique_ptr<Process> prometheus;
  const int prometheus_port = FreePort();
  const bool have_prometheus = std::filesystem::exists("/usr/bin/prometheus");
  if (have_prometheus) {
    std::ofstream config(dir_ + "/prometheus.yml");
    config << "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\nscrape_configs:\n"
           << "  - job_name: coordinator\n    static_configs:\n      - targets: ['127.0.0.1:"
           << coordinator_port_ << "']\n"
           << "  - job_name: workers\n    static_configs:\n      - targets: [";
    bool first = true;
    for (const auto& [name, port] : ports) {
      config << (first ? "" : ", ") << "'127.0.0.1:" << port << "'";
      first = false;
    }
    config << "]\n";
    config.close();
    auto started = Process::Spawn(
        {"/usr/bin/prometheus", "--config.file=" + dir_ + "/prometheus.yml",
         "--storage.tsdb.path=" + dir_ + "/tsdb",
         absl::StrCat("--web.listen-address=127.0.0.1:", prometheus_port)},
        dir_ + "/prometheus.log");
    ASSERT_TRUE(started.ok()) << started.status();
    prometheus = *std::move(started);
  }

  // Long enough to outlast every check; cancelled at the end.
  v1::JobSpec spec = testing::SyntheticJob(2, 3, 1000000);
  spec.set_heartbeat_timeout_ms(5000);  // no false losses on a loaded machine
  spec.set_collective_timeout_ms(5000);
  absl::StatusOr<v1::Job> job = cluster_->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const std::string id = job->job_id();
  // Enough steps for every check below (each worker's counters pass 10); a loaded machine
  // trains slowly, so the wait is long.
  ASSERT_TRUE(cluster_->WaitFor(id, [](const v1::Job& j) { return j.step() >= 50; },
                                absl::Seconds(180))
                  .ok());

  // Every worker: serving the job at its rank, steps timed, bytes summed, memory.
  for (const auto& [name, port] : ports) {
    const std::string text = ScrapeUntil(port, [](const std::string& t) {
      return SampleValue(t, "lockstep_worker_steps_total").value_or(0) >= 10;
    });
    EXPECT_GE(SampleValue(text, "lockstep_worker_steps_total").value_or(0), 10) << name << text;
    std::optional<double> rank =
        SampleValue(text, "lockstep_worker_serving", {{"job", id}, {"world_size", "3"}});
    ASSERT_TRUE(rank.has_value()) << name << "\n" << text;
    EXPECT_GE(*rank, 0);
    EXPECT_LT(*rank, 3);
    EXPECT_GE(SampleValue(text, "lockstep_worker_step_seconds_count").value_or(0), 10);
    EXPECT_GT(SampleValue(text, "lockstep_worker_step_phase_seconds_total", {{"phase", "compute"}})
                  .value_or(0),
              0);
    // MLP 32-64-64-4: 6596 gradient values and the loss, as floats.
    EXPECT_EQ(SampleValue(text, "lockstep_worker_reduced_bytes_per_step").value_or(0),
              (32 * 64 + 64 + 64 * 64 + 64 + 64 * 4 + 4 + 1) * 4.0);
    EXPECT_GT(SampleValue(text, "lockstep_worker_memory_bytes", {{"kind", "peak"}}).value_or(0),
              1e6);
    EXPECT_GT(SampleValue(text, "lockstep_worker_training_loss").value_or(0), 0);
    EXPECT_EQ(SampleValue(text, "lockstep_worker_info", {{"name", name}, {"device", "cpu"}}), 1.0);
  }
  std::string text = ScrapeUntil(coordinator_port_, [](const std::string&) { return true; });
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_jobs", {{"state", "running"}}), 1.0) << text;
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_workers", {{"state", "busy"}, {"device", "cpu"}}),
            3.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_queue_wait_seconds_count"), 1.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_recoveries_total", {{"kind", "failure"}}), 0.0);
  EXPECT_GE(SampleValue(text, "lockstep_coordinator_rpcs_total",
                        {{"method", "/lockstep.v1.JobService/GetJob"}, {"code", "OK"}})
                .value_or(0),
            1);

  // Prometheus itself scrapes every target (up == 1) and has the workers' step counters.
  auto query = [&](const std::string& promql) -> std::string {
    std::string encoded;
    for (char c : promql) {
      encoded += std::isalnum(static_cast<unsigned char>(c)) || c == '_'
                     ? std::string(1, c)
                     : absl::StrFormat("%%%02X", static_cast<unsigned char>(c));
    }
    absl::StatusOr<std::string> got =
        HttpGet("127.0.0.1", prometheus_port, "/api/v1/query?query=" + encoded);
    return got.ok() ? *got : "";
  };
  auto wait_for_query = [&](const std::string& promql, const std::string& needle) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    std::string answer;
    while (absl::Now() < deadline) {
      answer = query(promql);
      if (answer.find(needle) != std::string::npos) return answer;
      absl::SleepFor(absl::Milliseconds(250));
    }
    return answer;
  };
  if (have_prometheus) {
    std::string up = wait_for_query("count(up == 1)", "\"4\"]");
    EXPECT_NE(up.find("\"4\"]"), std::string::npos)
        << "Prometheus does not see 4 targets up: " << up << "\n"
        << Slurp(dir_ + "/prometheus.log");
    std::string steps = wait_for_query("count(lockstep_worker_steps_total > 0)", "\"3\"]");
    EXPECT_NE(steps.find("\"3\"]"), std::string::npos) << steps;
  }

  // Kill a member: the coordinator counts one recovery and times it once the group trains again.
  cluster_->worker("w1")->Signal(SIGKILL);
  text = ScrapeUntil(coordinator_port_, [](const std::string& t) {
    return SampleValue(t, "lockstep_coordinator_recovery_seconds_count").value_or(0) >= 1;
  });
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_recoveries_total", {{"kind", "failure"}}), 1.0)
      << text;
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_recovery_seconds_count"), 1.0) << text;
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_generation_formation_seconds_count"), 1.0);
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_steps_redone_total"), 0.0);
  EXPECT_GE(SampleValue(text, "lockstep_coordinator_workers", {{"state", "lost"}, {"device", "cpu"}})
                .value_or(0),
            1);
  // The survivors' runs were aborted, and they serve the job again in a world of 2.
  for (const std::string name : {"w0", "w2"}) {
    std::string w = ScrapeUntil(ports[name], [&](const std::string& t) {
      return SampleValue(t, "lockstep_worker_serving", {{"job", id}, {"world_size", "2"}})
          .has_value();
    });
    EXPECT_GE(SampleValue(w, "lockstep_worker_aborts_total").value_or(0), 1) << name << w;
    EXPECT_EQ(SampleValue(w, "lockstep_worker_runs_total"), 2.0) << name;
    EXPECT_FALSE(SampleValue(w, "lockstep_worker_serving", {{"world_size", "3"}}).has_value());
  }
  if (have_prometheus) {
    std::string recoveries = wait_for_query(
        "lockstep_coordinator_recoveries_total{kind=\"failure\"}", "\"1\"]");
    EXPECT_NE(recoveries.find("\"1\"]"), std::string::npos) << recoveries;
  }

  grpc::ClientContext context;
  v1::CancelJobRequest cancel;
  cancel.set_job_id(id);
  v1::Job cancelled;
  ASSERT_TRUE(cluster_->jobs().CancelJob(&context, cancel, &cancelled).ok());
  text = ScrapeUntil(coordinator_port_, [](const std::string& t) {
    return SampleValue(t, "lockstep_coordinator_jobs", {{"state", "cancelled"}}) == 1.0;
  });
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_jobs", {{"state", "cancelled"}}), 1.0) << text;
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_jobs", {{"state", "running"}}), 0.0);
  std::string w0 = ScrapeUntil(ports["w0"], [&](const std::string& t) {
    return !SampleValue(t, "lockstep_worker_serving").has_value();
  });
  EXPECT_FALSE(SampleValue(w0, "lockstep_worker_serving").has_value()) << "idle worker: " << w0;
  if (prometheus != nullptr) {
    prometheus->Signal(SIGTERM);
    (void)prometheus->Wait(absl::Seconds(10));
  }
}

TEST_F(MetricsTest, RejectedCallsAndRpcCodesAreCounted) {
  // A second coordinator that requires a token, and a client without it.
  const std::string port_file = dir_ + "/secure.port";
  auto secure = Cluster::Start({"--metrics_listen=127.0.0.1:0", "--metrics_port_file=" + port_file},
                               "right-token");
  ASSERT_TRUE(secure.ok()) << secure.status();
  const int port = ReadPort(port_file);
  absl::StatusOr<testing::CommandResult> refused = testing::RunCommand(
      {LOCKSTEP_CTL_BIN, "--coordinator=" + (*secure)->address(), "list"}, absl::Seconds(20));
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_NE(refused->exit_code, 0);
  std::string text = ScrapeUntil(port, [](const std::string& t) {
    return SampleValue(t, "lockstep_coordinator_rejected_calls_total").value_or(0) >= 1;
  });
  EXPECT_GE(SampleValue(text, "lockstep_coordinator_rejected_calls_total").value_or(0), 1) << text;
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_rejected_clients"), 1.0);
  EXPECT_GE(SampleValue(text, "lockstep_coordinator_rpcs_total",
                        {{"method", "/lockstep.v1.JobService/ListJobs"}, {"code", "UNAUTHENTICATED"}})
                .value_or(0),
            1)
      << text;
  // A job spec the coordinator refuses is counted under its code.
  v1::JobSpec bad = testing::SyntheticJob(1, 1, 10);
  bad.set_global_batch_size(-1);
  EXPECT_FALSE(cluster_->Submit(bad).ok());
  text = ScrapeUntil(coordinator_port_, [](const std::string& t) {
    return SampleValue(t, "lockstep_coordinator_rpcs_total",
                       {{"method", "/lockstep.v1.JobService/SubmitJob"}, {"code", "INVALID_ARGUMENT"}})
        .has_value();
  });
  EXPECT_EQ(SampleValue(text, "lockstep_coordinator_rpcs_total",
                        {{"method", "/lockstep.v1.JobService/SubmitJob"}, {"code", "INVALID_ARGUMENT"}}),
            1.0)
      << text;
}

TEST_F(MetricsTest, BadMetricsAddressesStopTheDaemonWithAClearMessage) {
  const std::vector<std::vector<std::string>> daemons = {
      {LOCKSTEP_COORDINATOR_BIN, "--listen=127.0.0.1:0"},
      {LOCKSTEP_WORKER_BIN, "--coordinator=" + cluster_->address(), "--name=bad-metrics"}};
  for (const std::vector<std::string>& daemon : daemons) {
    std::vector<std::string> argv = daemon;
    argv.push_back("--metrics_listen=nonsense");
    absl::StatusOr<testing::CommandResult> bad = testing::RunCommand(argv, absl::Seconds(20));
    ASSERT_TRUE(bad.ok()) << bad.status();
    EXPECT_NE(bad->exit_code, 0) << daemon[0];
    EXPECT_NE(bad->output.find("--metrics_listen: metrics address \"nonsense\" is not HOST:PORT"),
              std::string::npos)
        << bad->output;
    // The coordinator's metrics port is taken.
    argv = daemon;
    argv.push_back(absl::StrCat("--metrics_listen=127.0.0.1:", coordinator_port_));
    bad = testing::RunCommand(argv, absl::Seconds(20));
    ASSERT_TRUE(bad.ok()) << bad.status();
    EXPECT_NE(bad->exit_code, 0) << daemon[0];
    EXPECT_NE(bad->output.find(absl::StrCat("cannot serve metrics on 127.0.0.1:", coordinator_port_)),
              std::string::npos)
        << bad->output;
  }
}

// Scrapers that hold the metrics ports (a request trickled in a byte at a time, so the one
// HTTP thread of each endpoint waits on them) do not hold up training: the job steps on
// meanwhile, and the endpoints answer again once the scrapers go.
TEST_F(MetricsTest, ASlowScraperDoesNotStallTraining) {
  const int worker_port = StartWorker("w0");
  ASSERT_GT(worker_port, 0);
  absl::StatusOr<v1::Job> job = cluster_->Submit(testing::SyntheticJob(1, 1, 1'000'000));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(cluster_
                  ->WaitFor(job->job_id(), [](const v1::Job& j) { return j.step() > 0; },
                            absl::Seconds(60))
                  .ok());
  std::vector<int> sockets;
  for (int port : {worker_port, coordinator_port_}) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    const std::string start = "GET /metrics HTTP/1.1\r\n";
    ASSERT_GT(send(fd, start.data(), start.size(), MSG_NOSIGNAL), 0);
    sockets.push_back(fd);
  }
  auto step = [&] {
    absl::StatusOr<v1::Job> now = cluster_->Get(job->job_id());
    return now.ok() ? now->step() : -1;
  };
  const int64_t held_at = step();
  // Keep the requests unfinished, a header byte every half second, for three seconds.
  for (int i = 0; i < 6; ++i) {
    for (int fd : sockets) send(fd, "X", 1, MSG_NOSIGNAL);
    absl::SleepFor(absl::Milliseconds(500));
  }
  const int64_t released_at = step();
  for (int fd : sockets) close(fd);
  EXPECT_GT(released_at, held_at) << "training went on while the scrapers held the endpoints";
  // Both endpoints serve again.
  EXPECT_TRUE(testing::HttpGet("127.0.0.1", worker_port, "/metrics", absl::Seconds(20)).ok());
  EXPECT_TRUE(testing::HttpGet("127.0.0.1", coordinator_port_, "/metrics", absl::Seconds(20)).ok());
  auto status = cluster_->Get(job->job_id());
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->state(), v1::JOB_STATE_RUNNING) << status->reason();
}

}  // namespace
}  // namespace lockstep
