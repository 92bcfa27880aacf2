// The control plane under many workers: a load generator that plays N workers on the real API
// (bench/sim_workers.h) against a coordinator it starts on loopback, submits one job for all of
// them, and drops one stream.
//
// Measured per N: the submit RPC, submit to every worker assigned, the drop to every survivor
// aborted and to every survivor assigned the next generation, and the coordinator's CPU
// seconds, resident memory and thread count (from /proc). Prints a table, writes JSON.
// --backends runs each N with the coordinator's state in memory (no --state_dir), in files
// (--state_dir) or in etcd (a one-member etcd on loopback that the benchmark starts); with
// etcd it also counts, from etcd's own counters, the transactions, keys written and bytes the
// coordinator sent for the submit (to every worker assigned, and 1 s more) and for the drop (to
// every survivor re-assigned, and 1 s more); the leader's lease renewals are in the bytes.
//
//   control_plane_bench --coordinator=build/coordinator/lockstep-coordinator
//       --workers=1024,4096,10000 --backends=memory,file,etcd
//       --out=bench/results/control_plane.json
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/coordinator_process.h"
#include "bench/etcd_process.h"
#include "bench/sim_workers.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/client_callback.h"
#include "lockstep/v1/job.grpc.pb.h"

ABSL_FLAG(bool, keep_logs, false, "Keep each run's coordinator log (and say where).");
ABSL_FLAG(std::string, coordinator, "build/coordinator/lockstep-coordinator",
          "The lockstep-coordinator binary to start (on 127.0.0.1, a free port).");
ABSL_FLAG(std::string, workers, "1024,4096,10000", "Comma-separated worker counts.");
ABSL_FLAG(int, workers_per_host, 8, "Simulated workers per host name.");
ABSL_FLAG(int, streams_per_channel, 64, "Session streams per connection.");
ABSL_FLAG(double, phase_timeout_s, 120, "Give up on a phase after this long.");
ABSL_FLAG(std::string, out, "", "Write the results as JSON here.");
ABSL_FLAG(std::string, backends, "memory",
          "Comma-separated: where the coordinator keeps its state, each run in turn: memory, "
          "file (--state_dir) or etcd (a one-member etcd the benchmark starts).");
ABSL_FLAG(std::string, etcd, "/usr/bin/etcd", "The etcd binary (Debian's etcd-server).");

namespace lockstep {
namespace {

using Clock = std::chrono::steady_clock;
using bench::ProcessStats;
using bench::Stats;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Result {
  int workers = 0;
  std::string backend;
  std::string error;  // empty when every phase completed
  double registered_s = 0, submit_rpc_s = 0, assigned_s = 0, aborted_s = 0, reassigned_s = 0;
  ProcessStats idle, after_assign, end;
  // etcd only: what the coordinator wrote from the submit to every worker assigned, and from
  // the drop to every survivor re-assigned.
  bench::EtcdCounters submit_writes, drop_writes;
};

// Waits until the coordinator at `address` serves (on etcd it leads first).
bool WaitServing(const std::string& address, absl::Duration timeout) {
  auto health = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    grpc::health::v1::HealthCheckResponse response;
    if (health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response).ok() &&
        response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

Result RunOne(int n, const std::string& backend) {
  Result r;
  r.workers = n;
  r.backend = backend;
  std::unique_ptr<bench::EtcdProcess> etcd;
  std::vector<std::string> flags;
  const std::string tag = "control-plane-" + backend;
  if (backend == "file") {
    flags.push_back("--state_dir=" + bench::TempDir(tag, n) + "/state");
  } else if (backend == "etcd") {
    absl::StatusOr<std::unique_ptr<bench::EtcdProcess>> started =
        bench::EtcdProcess::Start(absl::GetFlag(FLAGS_etcd), bench::TempDir(tag + "-etcd", n));
    if (!started.ok()) {
      r.error = std::string(started.status().message());
      return r;
    }
    etcd = *std::move(started);
    flags = {"--state_backend=etcd", "--etcd_endpoints=" + etcd->endpoint()};
  }
  absl::StatusOr<std::unique_ptr<bench::CoordinatorProcess>> coordinator =
      bench::CoordinatorProcess::StartInTemp(absl::GetFlag(FLAGS_coordinator), tag, n,
                                             absl::GetFlag(FLAGS_keep_logs), flags);
  if (!coordinator.ok()) {
    r.error = std::string(coordinator.status().message());
    return r;
  }
  // etcd's counters now, or the error that ends the run.
  auto counters = [&]() -> bench::EtcdCounters {
    if (etcd == nullptr) return {};
    absl::StatusOr<bench::EtcdCounters> c = etcd->Counters();
    if (!c.ok()) r.error = std::string(c.status().message());
    return c.value_or(bench::EtcdCounters{});
  };
  const pid_t pid = (*coordinator)->pid();
  const std::string address = (*coordinator)->address();
  auto stop = [&] {
    if (!r.error.empty()) {
      std::cerr << "N = " << n << ": " << r.error << "\n";
      (*coordinator)->KeepLog();
    }
    coordinator->reset();
  };
  const absl::Duration timeout = absl::Seconds(absl::GetFlag(FLAGS_phase_timeout_s));
  if (!WaitServing(address, absl::Seconds(20))) {
    r.error = "the coordinator did not serve within 20 s";
    stop();
    return r;
  }

  const auto t_register = Clock::now();
  auto workers = std::make_unique<bench::SimWorkers>(
      address, bench::SimWorkersOptions{n, absl::GetFlag(FLAGS_workers_per_host),
                                        absl::GetFlag(FLAGS_streams_per_channel)});
  auto finish = [&] {
    workers.reset();  // every stream ended
    r.end = Stats(pid);
    stop();
  };
  if (!workers->WaitRegistered(timeout)) {
    r.error = absl::StrCat("only ", workers->registered(), " of ", n, " workers registered (",
                           workers->ended(), " streams ended)");
    finish();
    return r;
  }
  r.registered_s = Since(t_register);
  r.idle = Stats(pid);

  auto jobs =
      v1::JobService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  const bench::EtcdCounters before_submit = counters();
  const auto t_submit = Clock::now();
  {
    grpc::ClientContext context;
    v1::SubmitJobRequest request;
    // The survivors of one drop re-form without a spare.
    *request.mutable_spec() = bench::SimulatedJob(n - 1, n);
    v1::Job job;
    grpc::Status s = jobs->SubmitJob(&context, request, &job);
    r.submit_rpc_s = Since(t_submit);
    if (!s.ok()) {
      r.error = "submit: " + s.error_message();
      finish();
      return r;
    }
  }
  if (!workers->WaitAssigned(1, n, timeout)) {
    r.error = "not every worker was assigned";
    finish();
    return r;
  }
  r.assigned_s = Since(t_submit);
  absl::SleepFor(absl::Seconds(1));  // settled, and every write of the submit done
  r.after_assign = Stats(pid);
  r.submit_writes = counters() - before_submit;

  const bench::EtcdCounters before_drop = counters();
  const auto t_drop = Clock::now();
  workers->Drop(n / 2);
  if (!workers->WaitAborted(1, n - 1, timeout)) {
    r.error = "not every survivor was aborted after the drop";
    finish();
    return r;
  }
  r.aborted_s = Since(t_drop);
  if (!workers->WaitAssigned(2, n - 1, timeout)) {
    r.error = "the survivors were not all assigned the next generation";
    finish();
    return r;
  }
  r.reassigned_s = Since(t_drop);
  absl::SleepFor(absl::Seconds(1));  // every write of the re-formation done
  r.drop_writes = counters() - before_drop;
  finish();
  return r;
}

std::string Mb(int64_t bytes) { return absl::StrFormat("%.0f MB", bytes / 1e6); }

}  // namespace
}  // namespace lockstep

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using lockstep::Result;
  // As in the coordinator: Debian's abseil records every lock order in one global graph, and
  // the generator holds a mutex per simulated worker; it must not be what limits N.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Every stream is a file descriptor or two on each side.
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  files.rlim_cur = files.rlim_max;
  setrlimit(RLIMIT_NOFILE, &files);
  std::vector<Result> results;
  const absl::StatusOr<std::vector<int>> counts =
      lockstep::bench::ParseCounts("workers", absl::GetFlag(FLAGS_workers), 2, "worker");
  if (!counts.ok()) {
    std::cerr << counts.status().message() << "\n";
    return 2;
  }
  const std::vector<std::string> backends =
      absl::StrSplit(absl::GetFlag(FLAGS_backends), ',', absl::SkipEmpty());
  for (const std::string& backend : backends) {
    if (backend != "memory" && backend != "file" && backend != "etcd") {
      std::cerr << "--backends: \"" << backend << "\" is not memory, file or etcd\n";
      return 2;
    }
  }
  for (const int n : *counts) {
    for (const std::string& backend : backends) {
      std::cerr << "N = " << n << ", " << backend << " ..." << std::endl;
      results.push_back(lockstep::RunOne(n, backend));
    }
  }
  std::printf(
      "| N | state | registered | submit RPC | all assigned | drop: all aborted | drop: all "
      "re-assigned | "
      "coordinator CPU | RSS idle / assigned / end | threads idle / assigned |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Result& r : results) {
    std::printf(
        "| %d | %s | %.2f s | %.2f s | %.2f s | %.2f s | %.2f s | %.1f s | %s / %s / %s | %lld / "
        "%lld |%s\n",
        r.workers, r.backend.c_str(), r.registered_s, r.submit_rpc_s, r.assigned_s, r.aborted_s,
        r.reassigned_s, r.end.cpu_s, lockstep::Mb(r.idle.rss_bytes).c_str(),
        lockstep::Mb(r.after_assign.rss_bytes).c_str(), lockstep::Mb(r.end.rss_bytes).c_str(),
        static_cast<long long>(r.idle.threads), static_cast<long long>(r.after_assign.threads),
        r.error.empty() ? "" : (" failed: " + r.error).c_str());
  }
  bool any_etcd = false;
  for (const Result& r : results) any_etcd |= r.backend == "etcd";
  if (any_etcd) {
    std::printf(
        "\nWhat the coordinator wrote to etcd (its Txn calls, keys written, bytes it sent):\n\n");
    std::printf(
        "| N | submit → all assigned, + 1 s: txns / keys / KB | drop → all re-assigned, + 1 s: "
        "txns / keys / KB |\n");
    std::printf("|---|---|---|\n");
    for (const Result& r : results) {
      if (r.backend != "etcd") continue;
      std::printf("| %d | %lld / %lld / %.1f | %lld / %lld / %.1f |\n", r.workers,
                  static_cast<long long>(r.submit_writes.txns),
                  static_cast<long long>(r.submit_writes.puts),
                  r.submit_writes.received_bytes / 1e3, static_cast<long long>(r.drop_writes.txns),
                  static_cast<long long>(r.drop_writes.puts), r.drop_writes.received_bytes / 1e3);
    }
  }
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    std::ofstream json(out);
    json << "[\n";
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      json << absl::StrFormat(
          "  {\"workers\": %d, \"backend\": \"%s\", \"error\": \"%s\", \"registered_s\": %.3f, "
          "\"submit_rpc_s\": %.3f, "
          "\"assigned_s\": %.3f, \"aborted_s\": %.3f, \"reassigned_s\": %.3f, "
          "\"coordinator_cpu_s\": %.2f, \"rss_idle_bytes\": %d, \"rss_assigned_bytes\": %d, "
          "\"rss_end_bytes\": %d, \"threads_idle\": %d, \"threads_assigned\": %d, "
          "\"etcd_submit_txns\": %d, \"etcd_submit_keys\": %d, \"etcd_submit_bytes\": %d, "
          "\"etcd_drop_txns\": %d, \"etcd_drop_keys\": %d, \"etcd_drop_bytes\": %d}%s\n",
          r.workers, r.backend, r.error, r.registered_s, r.submit_rpc_s, r.assigned_s, r.aborted_s,
          r.reassigned_s, r.end.cpu_s, r.idle.rss_bytes, r.after_assign.rss_bytes, r.end.rss_bytes,
          r.idle.threads, r.after_assign.threads, r.submit_writes.txns, r.submit_writes.puts,
          r.submit_writes.received_bytes, r.drop_writes.txns, r.drop_writes.puts,
          r.drop_writes.received_bytes, i + 1 < results.size() ? "," : "");
    }
    json << "]\n";
  }
  for (const Result& r : results) {
    if (!r.error.empty()) return 1;
  }
  return 0;
}
