// Starting a one-member etcd for a benchmark, and reading its counters.
#include "bench/etcd_process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "bench/coordinator_process.h"
#include "common/loopback_ports.h"
#include "httplib.h"

namespace lockstep::bench {
namespace {

// The sum of the samples of `metric` whose labels contain `label` (empty: every sample).
int64_t Sum(const std::string& text, const std::string& metric, const std::string& label) {
  double sum = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, metric)) continue;
    if (line.empty() || (line[0] != ' ' && line[0] != '{')) continue;  // a longer name
    if (!label.empty() && line.find(label) == absl::string_view::npos) continue;
    double value = 0;
    if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &value)) sum += value;
  }
  return static_cast<int64_t>(sum);
}

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdProcess>> EtcdProcess::Start(const std::string& binary,
                                                                const std::string& dir) {
  std::unique_ptr<EtcdProcess> p(new EtcdProcess());
  p->dir_ = dir;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::vector<int> ports = FreeLoopbackPorts(2);
  p->port_ = ports[0];
  p->endpoint_ = absl::StrCat("http://127.0.0.1:", ports[0]);
  const std::string peer = absl::StrCat("http://127.0.0.1:", ports[1]);
  absl::StatusOr<pid_t> pid =
      Spawn({binary, "--name=bench", "--data-dir=" + dir + "/data",
             "--listen-client-urls=" + p->endpoint_, "--advertise-client-urls=" + p->endpoint_,
             "--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer,
             "--initial-cluster=bench=" + peer},
            dir + "/etcd.log");
  if (!pid.ok()) return pid.status();
  p->pid_ = *pid;
  httplib::Client client("127.0.0.1", p->port_);
  for (int i = 0; i < 200; ++i) {
    if (auto health = client.Get("/health");
        health && health->status == 200 && health->body.find("true") != std::string::npos) {
      return p;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::UnavailableError(
      absl::StrCat("etcd did not serve within 10 s; its log: ", dir, "/etcd.log"));
}

EtcdProcess::~EtcdProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  std::filesystem::remove_all(dir_);
}

absl::StatusOr<EtcdCounters> EtcdProcess::Counters() const {
  httplib::Client client("127.0.0.1", port_);
  auto metrics = client.Get("/metrics");
  if (!metrics || metrics->status != 200) {
    return absl::UnavailableError(
        absl::StrCat("etcd's /metrics on ", endpoint_, " did not answer"));
  }
  EtcdCounters c;
  c.txns = Sum(metrics->body, "grpc_server_handled_total", "grpc_method=\"Txn\"");
  c.puts = Sum(metrics->body, "etcd_mvcc_put_total", "");
  c.received_bytes = Sum(metrics->body, "etcd_network_client_grpc_received_bytes_total", "");
  return c;
}

}  // namespace lockstep::bench
