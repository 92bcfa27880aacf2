// The coordinator's core alone (no gRPC, no threads): how long its decisions take with N
// registered workers, the time the shell holds its lock for them before any message is written.
//
// Measured per N: registering N workers, the decision that assigns one job of N (submit and
// the tick that starts it), one member's loss (its abort and the re-formation of N-1), a tick
// that hands N heartbeats over, and the snapshot the shell copies to save the job.
//
//   build/bench/core_decision_bench --workers=1024,4096,10000 --out=core.json
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/coordinator_process.h"
#include "bench/sim_workers.h"
#include "coordinator/core/core.h"

ABSL_FLAG(std::string, workers, "1024,4096,10000", "Comma-separated worker counts.");
ABSL_FLAG(int, repeat, 3, "Runs per N; the table shows the fastest.");
ABSL_FLAG(std::string, out, "", "Write the results as JSON here.");

namespace lockstep {
namespace {

using coordinator::Core;
using coordinator::CoreOptions;
using coordinator::Decisions;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Result {
  int n = 0;
  double register_s = 0;
  double assign_s = 0;
  size_t assign_messages = 0;
  double reform_s = 0;
  size_t reform_messages = 0;
  size_t reform_wire_messages = 0;  // after FoldAbortsIntoAssignments, as the shell sends them
  size_t reform_bytes = 0;
  double tick_s = 0;
  double snapshot_s = 0;
  std::string error;
};

Result RunOnce(int n) {
  Result r;
  r.n = n;
  CoreOptions options;
  options.heartbeat_timeout = absl::Seconds(3600);
  Core core(options);
  absl::Time now = absl::FromUnixSeconds(1'800'000'000);
  std::vector<std::string> ids;
  auto t = Clock::now();
  for (int i = 0; i < n; ++i) {
    v1::RegisterRequest request;
    request.set_name(absl::StrFormat("sim-%05d", i));
    request.set_host(absl::StrFormat("host-%04d", i / 8));
    request.set_device("cpu");
    request.set_device_name("cpu");
    request.set_comm_address("127.0.0.1");
    request.add_capabilities("gloo");
    Decisions d;
    absl::StatusOr<std::string> id = core.RegisterWorker(request, now, &d);
    if (!id.ok()) {
      r.error = id.status().ToString();
      return r;
    }
    ids.push_back(*id);
  }
  r.register_s = Since(t);

  Decisions assigned;
  t = Clock::now();
  absl::StatusOr<v1::Job> job = core.SubmitJob(bench::SimulatedJob(n - 1, n), now, &assigned);
  if (!job.ok()) {
    r.error = job.status().ToString();
    return r;
  }
  core.Tick(now, &assigned);
  r.assign_s = Since(t);
  r.assign_messages = assigned.messages.size();
  if (r.assign_messages != static_cast<size_t>(n)) {
    r.error = absl::StrFormat("%d workers, %d assignments", n, r.assign_messages);
    return r;
  }

  now += absl::Seconds(1);
  Decisions reformed;
  t = Clock::now();
  core.WorkerDisconnected(ids[n / 2], "connection lost", now, &reformed);
  r.reform_s = Since(t);
  r.reform_messages = reformed.messages.size();
  coordinator::FoldAbortsIntoAssignments(reformed.messages);
  r.reform_wire_messages = reformed.messages.size();
  for (const Decisions::Outgoing& m : reformed.messages) r.reform_bytes += m.message.ByteSizeLong();
  const absl::StatusOr<v1::Job> after = core.GetJob(job->job_id());
  if (!after.ok() || after->generation() != 2 || after->members_size() != n - 1) {
    r.error = "the job did not re-form with N-1 members";
    return r;
  }

  now += absl::Milliseconds(100);
  Decisions ticked;
  t = Clock::now();
  for (const std::string& id : ids) core.NoteHeartbeat(id, now);
  core.Tick(now, &ticked);
  r.tick_s = Since(t);

  t = Clock::now();
  const absl::StatusOr<v1::Job> snapshot = core.GetJob(job->job_id());
  r.snapshot_s = Since(t);
  return r;
}

std::string Ms(double s) { return absl::StrFormat("%.1f ms", s * 1e3); }

}  // namespace
}  // namespace lockstep

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using lockstep::Result;
  std::vector<Result> results;
  const absl::StatusOr<std::vector<int>> counts =
      lockstep::bench::ParseCounts("workers", absl::GetFlag(FLAGS_workers), 2, "worker");
  if (!counts.ok()) {
    std::fprintf(stderr, "%s\n", std::string(counts.status().message()).c_str());
    return 2;
  }
  for (const int n : *counts) {
    Result best;
    for (int i = 0; i < std::max(1, absl::GetFlag(FLAGS_repeat)); ++i) {
      Result r = lockstep::RunOnce(n);
      if (!r.error.empty()) {
        std::fprintf(stderr, "N = %d: %s\n", n, r.error.c_str());
        return 1;
      }
      if (i == 0 || r.reform_s + r.assign_s < best.reform_s + best.assign_s) best = r;
    }
    results.push_back(best);
  }
  using lockstep::Ms;
  std::printf(
      "| N | register all | assign decision (messages) | loss + re-form decision (messages; "
      "on the wire, bytes) | tick with N heartbeats | job snapshot |\n"
      "|---|---|---|---|---|---|\n");
  for (const Result& r : results) {
    std::printf("| %d | %s | %s (%zu) | %s (%zu; %zu, %.1f MB) | %s | %s |\n", r.n,
                Ms(r.register_s).c_str(), Ms(r.assign_s).c_str(), r.assign_messages,
                Ms(r.reform_s).c_str(), r.reform_messages, r.reform_wire_messages,
                r.reform_bytes / 1e6, Ms(r.tick_s).c_str(), Ms(r.snapshot_s).c_str());
  }
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    std::ofstream f(out);
    f << "[\n";
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      f << absl::StrFormat(
          "  {\"workers\": %d, \"register_s\": %.6f, \"assign_s\": %.6f, \"assign_messages\": %zu, "
          "\"reform_s\": %.6f, \"reform_messages\": %zu, \"reform_wire_messages\": %zu, "
          "\"reform_bytes\": %zu, \"tick_s\": %.6f, \"snapshot_s\": %.6f}%s\n",
          r.n, r.register_s, r.assign_s, r.assign_messages, r.reform_s, r.reform_messages,
          r.reform_wire_messages, r.reform_bytes, r.tick_s, r.snapshot_s,
          i + 1 < results.size() ? "," : "");
    }
    f << "]\n";
    if (!f) {
      std::fprintf(stderr, "could not write %s\n", out.c_str());
      return 1;
    }
  }
  return 0;
}
