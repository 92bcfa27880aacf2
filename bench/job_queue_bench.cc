// The job queue under thousands of jobs: a coordinator on loopback with no workers, so that every
// submitted job stays queued; then N submits, 5 s of idle ticks, and N cancels (a cancel storm),
// over the real API. Measured per N: the coordinator's CPU seconds for each phase (from /proc),
// per operation and in all, and each phase's wall time. A cost that grows with N is a scan of
// every job where only the changed one should be touched.
//
//   job_queue_bench --coordinator=build/coordinator/lockstep-coordinator
//       --jobs=1000,8000,12000 --out=bench/results/job_queue.json
#include <unistd.h>

#include <chrono>
#include <functional>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/coordinator_process.h"
#include "grpcpp/create_channel.h"
#include "lockstep/v1/job.grpc.pb.h"

ABSL_FLAG(std::string, coordinator, "build/coordinator/lockstep-coordinator",
          "The lockstep-coordinator binary to start (on 127.0.0.1, a free port).");
ABSL_FLAG(std::string, jobs, "1000,8000,12000", "Comma-separated queue lengths.");
ABSL_FLAG(bool, keep_logs, false, "Keep each run's coordinator log (and say where).");
ABSL_FLAG(std::string, out, "", "Write the results as JSON here.");

namespace lockstep {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Phase {
  double cpu_s = 0;   // the coordinator's
  double wall_s = 0;
};

struct Result {
  int jobs = 0;
  std::string error;
  Phase submit, idle, cancel;
};

// A small job nothing can run: no worker ever registers.
v1::JobSpec QueuedJob() {
  v1::JobSpec spec;
  spec.set_name("queued");
  spec.mutable_model()->set_type("mlp");
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(16);
  spec.mutable_dataset()->set_type("synthetic");
  auto* s = spec.mutable_dataset()->mutable_synthetic();
  s->set_train_samples(256);
  s->set_test_samples(64);
  s->set_input_dim(8);
  s->set_num_classes(2);
  spec.mutable_optimizer()->set_learning_rate(0.1);
  spec.set_global_batch_size(32);
  spec.set_max_steps(10);
  return spec;
}

Result RunOne(int n) {
  Result r;
  r.jobs = n;
  absl::StatusOr<std::unique_ptr<bench::CoordinatorProcess>> coordinator =
      bench::CoordinatorProcess::StartInTemp(absl::GetFlag(FLAGS_coordinator), "job-queue", n,
                                             absl::GetFlag(FLAGS_keep_logs));
  if (!coordinator.ok()) {
    r.error = std::string(coordinator.status().message());
    return r;
  }
  const pid_t pid = (*coordinator)->pid();
  auto jobs = v1::JobService::NewStub(
      grpc::CreateChannel((*coordinator)->address(), grpc::InsecureChannelCredentials()));
  auto measure = [&](Phase* phase, const std::function<bool()>& run) {
    const double cpu = bench::Stats(pid).cpu_s;
    const auto start = Clock::now();
    const bool ok = run();
    phase->wall_s = Since(start);
    phase->cpu_s = bench::Stats(pid).cpu_s - cpu;
    return ok;
  };
  std::vector<std::string> ids;
  const v1::JobSpec spec = QueuedJob();
  const bool submitted = measure(&r.submit, [&] {
    for (int i = 0; i < n; ++i) {
      grpc::ClientContext context;
      v1::SubmitJobRequest request;
      *request.mutable_spec() = spec;
      v1::Job job;
      if (grpc::Status s = jobs->SubmitJob(&context, request, &job); !s.ok()) {
        r.error = "submit: " + s.error_message();
        return false;
      }
      ids.push_back(job.job_id());
    }
    return true;
  });
  if (submitted) {
    measure(&r.idle, [] {
      absl::SleepFor(absl::Seconds(5));
      return true;
    });
    measure(&r.cancel, [&] {
      for (const std::string& id : ids) {
        grpc::ClientContext context;
        v1::CancelJobRequest request;
        request.set_job_id(id);
        v1::Job job;
        if (grpc::Status s = jobs->CancelJob(&context, request, &job); !s.ok()) {
          r.error = "cancel: " + s.error_message();
          return false;
        }
      }
      return true;
    });
  }
  if (!r.error.empty()) (*coordinator)->KeepLog();
  return r;
}

}  // namespace
}  // namespace lockstep

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using lockstep::Result;
  std::vector<Result> results;
  const absl::StatusOr<std::vector<int>> counts =
      lockstep::bench::ParseCounts("jobs", absl::GetFlag(FLAGS_jobs), 1, "job");
  if (!counts.ok()) {
    std::cerr << counts.status().message() << "\n";
    return 2;
  }
  for (const int n : *counts) {
    std::cerr << "N = " << n << " ..." << std::endl;
    results.push_back(lockstep::RunOne(n));
  }
  std::printf("| queued jobs N | submit N: CPU (per submit) | 5 s idle: CPU | cancel N: CPU (per "
              "cancel) | cancel N: wall |\n|---|---|---|---|---|\n");
  for (const Result& r : results) {
    std::printf("| %d | %.2f s (%.3f ms) | %.2f s | %.2f s (%.3f ms) | %.1f s |%s\n", r.jobs,
                r.submit.cpu_s, 1e3 * r.submit.cpu_s / r.jobs, r.idle.cpu_s, r.cancel.cpu_s,
                1e3 * r.cancel.cpu_s / r.jobs, r.cancel.wall_s,
                r.error.empty() ? "" : (" failed: " + r.error).c_str());
  }
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    std::ofstream json(out);
    json << "[\n";
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      json << absl::StrFormat(
          "  {\"jobs\": %d, \"error\": \"%s\", \"submit_cpu_s\": %.3f, \"submit_wall_s\": %.3f, "
          "\"idle_5s_cpu_s\": %.3f, \"cancel_cpu_s\": %.3f, \"cancel_wall_s\": %.3f}%s\n",
          r.jobs, r.error, r.submit.cpu_s, r.submit.wall_s, r.idle.cpu_s, r.cancel.cpu_s,
          r.cancel.wall_s, i + 1 < results.size() ? "," : "");
    }
    json << "]\n";
  }
  for (const Result& r : results) {
    if (!r.error.empty()) return 1;
  }
  return 0;
}
