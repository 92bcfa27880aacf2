// The control plane under many workers: a load generator that plays N workers on the real API
// (a Session stream each, exactly the messages lockstep-worker sends: register, then heartbeats
// every 500 ms) against a coordinator it starts on loopback, submits one job for all of them,
// and drops one stream. gRPC's callback API drives every stream from a few threads, so the
// generator is not what limits N.
//
// Measured per N: the submit RPC, submit to every worker assigned, the drop to every survivor
// aborted and to every survivor assigned the next generation, and the coordinator's CPU
// seconds, resident memory and thread count (from /proc). Prints a table, writes JSON.
//
//   control_plane_bench --coordinator=build/coordinator/lockstep-coordinator
//       --workers=1024,4096,10000 --out=bench/results/control_plane.json
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
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
#include "grpcpp/create_channel.h"
#include "grpcpp/support/client_callback.h"
#include "lockstep/v1/job.grpc.pb.h"
#include "lockstep/v1/worker.grpc.pb.h"

ABSL_FLAG(std::string, coordinator, "build/coordinator/lockstep-coordinator",
          "The lockstep-coordinator binary to start (on 127.0.0.1, a free port).");
ABSL_FLAG(std::string, workers, "1024,4096,10000", "Comma-separated worker counts.");
ABSL_FLAG(int, workers_per_host, 8, "Simulated workers per host name.");
ABSL_FLAG(int, streams_per_channel, 64, "Session streams per connection.");
ABSL_FLAG(double, phase_timeout_s, 120, "Give up on a phase after this long.");
ABSL_FLAG(std::string, out, "", "Write the results as JSON here.");

namespace lockstep {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Counts what the simulated workers heard, and lets the driver wait for a count.
struct Tally {
  absl::Mutex mu;
  int registered ABSL_GUARDED_BY(mu) = 0;
  int ended ABSL_GUARDED_BY(mu) = 0;  // streams that closed
  std::map<int64_t, int> assigned ABSL_GUARDED_BY(mu);  // generation -> workers assigned
  std::map<int64_t, int> aborted ABSL_GUARDED_BY(mu);   // generation -> workers aborted

  // Waits until pred() holds; false after `timeout`.
  template <typename Pred>
  bool WaitFor(Pred pred, absl::Duration timeout) {
    absl::MutexLock lock(&mu);
    return mu.AwaitWithTimeout(absl::Condition(&pred), timeout);
  }
};

// One simulated worker: a Session stream with one write in flight at a time.
class SimWorker : public grpc::ClientBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage> {
 public:
  SimWorker(v1::WorkerService::Stub* stub, std::string name, std::string host, Tally* tally)
      : tally_(tally) {
    v1::WorkerMessage hello;
    v1::RegisterRequest* r = hello.mutable_register_();
    r->set_name(std::move(name));
    r->set_host(std::move(host));
    r->set_device("cpu");
    r->set_device_name("cpu");
    r->set_comm_address("127.0.0.1");
    r->add_capabilities("gloo");
    stub->async()->Session(&context_, this);
    // Heartbeats are written from another thread: the hold keeps the stream until its read
    // side has ended (ReleaseHold), so no write can come after OnDone.
    AddHold();
    Send(hello);
    StartRead(&in_);
    StartCall();
  }

  void Heartbeat() {
    v1::WorkerMessage m;
    m.mutable_heartbeat();
    Send(m);
  }
  // Ends the stream as a dying worker's would.
  void Drop() { context_.TryCancel(); }
  bool done() const { return done_.load(); }

  void OnReadDone(bool ok) override {
    if (!ok) return ReleaseHold();
    {
      absl::MutexLock lock(&tally_->mu);
      if (in_.has_registered()) ++tally_->registered;
      if (in_.has_assignment()) ++tally_->assigned[in_.assignment().generation()];
      if (in_.has_abort()) ++tally_->aborted[in_.abort().generation()];
    }
    StartRead(&in_);
  }
  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    queue_.pop_front();
    if (!ok) {
      queue_.clear();
      broken_ = true;
      return;
    }
    if (!queue_.empty()) StartWrite(&queue_.front());
  }
  void OnDone(const grpc::Status&) override {
    done_.store(true);
    absl::MutexLock lock(&tally_->mu);
    ++tally_->ended;
  }

 private:
  void ReleaseHold() {
    absl::MutexLock lock(&mu_);
    if (released_) return;
    released_ = true;
    RemoveHold();
  }
  void Send(const v1::WorkerMessage& m) {
    absl::MutexLock lock(&mu_);
    if (released_ || broken_ || queue_.size() > 4) return;  // a slow stream skips a beat
    queue_.push_back(m);
    if (queue_.size() == 1) StartWrite(&queue_.front());
  }

  grpc::ClientContext context_;
  Tally* const tally_;
  v1::CoordinatorMessage in_;
  absl::Mutex mu_;
  std::deque<v1::WorkerMessage> queue_ ABSL_GUARDED_BY(mu_);
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> done_{false};
};

struct ProcessStats {
  double cpu_s = 0;
  int64_t rss_bytes = 0;
  int64_t threads = 0;
};

ProcessStats Stats(pid_t pid) {
  ProcessStats s;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(status, line);) {
    std::vector<std::string> f = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (f.size() >= 2 && f[0] == "VmRSS:") s.rss_bytes = std::stoll(f[1]) * 1024;
    if (f.size() >= 2 && f[0] == "Threads:") s.threads = std::stoll(f[1]);
  }
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string all((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
  std::vector<std::string> f = absl::StrSplit(all.substr(all.rfind(')') + 2), ' ');
  if (f.size() > 12) {
    s.cpu_s = (std::stod(f[11]) + std::stod(f[12])) / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  return s;
}

struct Result {
  int workers = 0;
  std::string error;  // empty when every phase completed
  double registered_s = 0, submit_rpc_s = 0, assigned_s = 0, aborted_s = 0, reassigned_s = 0;
  ProcessStats idle, after_assign, end;
};

v1::JobSpec JobFor(int n) {
  v1::JobSpec spec;
  spec.set_name("control-plane-bench");
  spec.mutable_model()->set_type("mlp");
  spec.mutable_model()->add_hidden_widths(16);
  spec.mutable_dataset()->set_type("synthetic");
  auto* s = spec.mutable_dataset()->mutable_synthetic();
  s->set_train_samples(1 << 20);
  s->set_test_samples(1024);
  s->set_input_dim(8);
  s->set_num_classes(2);
  spec.mutable_optimizer()->set_learning_rate(0.1);
  spec.set_global_batch_size(n);
  spec.set_micro_shards(n);
  spec.set_max_steps(1000);
  spec.set_min_workers(n - 1);  // the survivors of one drop re-form without a spare
  spec.set_max_workers(n);
  spec.set_step_timeout_ms(3'600'000);  // simulated workers never step
  return spec;
}

Result RunOne(int n) {
  Result r;
  r.workers = n;
  const std::string dir = absl::StrCat(std::filesystem::temp_directory_path().string(),
                                       "/lockstep-control-plane-", getpid(), "-", n);
  std::filesystem::create_directories(dir);
  const std::string port_file = dir + "/port";
  const std::string log = dir + "/coordinator.log";
  std::vector<std::string> args = {absl::GetFlag(FLAGS_coordinator), "--listen=127.0.0.1:0",
                                   "--port_file=" + port_file};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, 2, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const int spawned = posix_spawn(&pid, argv[0], &files, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  if (spawned != 0) {
    r.error = "cannot start " + args[0];
    return r;
  }
  auto stop = [&] {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    if (r.error.empty()) {
      std::filesystem::remove_all(dir);
    } else {
      std::cerr << "N = " << n << ": " << r.error << "; the coordinator's log: " << log << "\n";
    }
  };
  std::string port;
  for (int i = 0; i < 200 && port.empty(); ++i) {
    std::ifstream(port_file) >> port;
    int parsed = 0;
    if (!absl::SimpleAtoi(port, &parsed) || parsed <= 0) port.clear();
    if (port.empty()) absl::SleepFor(absl::Milliseconds(50));
  }
  if (port.empty()) {
    r.error = "the coordinator wrote no port file";
    stop();
    return r;
  }
  const std::string address = "127.0.0.1:" + port;
  const absl::Duration timeout = absl::Seconds(absl::GetFlag(FLAGS_phase_timeout_s));

  // Connections: a few streams each, as workers on many hosts would have.
  const int per_channel = std::max(1, absl::GetFlag(FLAGS_streams_per_channel));
  std::vector<std::unique_ptr<v1::WorkerService::Stub>> stubs;
  for (int i = 0; i < (n + per_channel - 1) / per_channel; ++i) {
    grpc::ChannelArguments channel_args;
    channel_args.SetInt("lockstep.bench.channel", i);  // a distinct connection each
    channel_args.SetMaxReceiveMessageSize(64 << 20);
    stubs.push_back(v1::WorkerService::NewStub(grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(), channel_args)));
  }
  Tally tally;
  std::vector<std::unique_ptr<SimWorker>> workers;
  const auto t_register = Clock::now();
  for (int i = 0; i < n; ++i) {
    workers.push_back(std::make_unique<SimWorker>(
        stubs[i / per_channel].get(), absl::StrFormat("sim-%05d", i),
        absl::StrFormat("host-%04d", i / std::max(1, absl::GetFlag(FLAGS_workers_per_host))),
        &tally));
  }
  std::atomic<bool> beating{true};
  std::thread heart([&] {
    while (beating.load()) {
      for (auto& w : workers) w->Heartbeat();
      absl::SleepFor(absl::Milliseconds(500));
    }
  });
  auto finish = [&] {
    beating.store(false);
    heart.join();
    for (auto& w : workers) w->Drop();
    tally.WaitFor([&]() ABSL_SHARED_LOCKS_REQUIRED(tally.mu) { return tally.ended == n; },
                  absl::Seconds(30));
    r.end = Stats(pid);
    stop();
  };
  if (!tally.WaitFor([&]() ABSL_SHARED_LOCKS_REQUIRED(tally.mu) { return tally.registered == n; },
                     timeout)) {
    {
      absl::MutexLock lock(&tally.mu);
      r.error = absl::StrCat("only ", tally.registered, " of ", n, " workers registered (",
                             tally.ended, " streams ended)");
    }
    finish();
    return r;
  }
  r.registered_s = Since(t_register);
  r.idle = Stats(pid);

  auto jobs = v1::JobService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  const auto t_submit = Clock::now();
  {
    grpc::ClientContext context;
    v1::SubmitJobRequest request;
    *request.mutable_spec() = JobFor(n);
    v1::Job job;
    grpc::Status s = jobs->SubmitJob(&context, request, &job);
    r.submit_rpc_s = Since(t_submit);
    if (!s.ok()) {
      r.error = "submit: " + s.error_message();
      finish();
      return r;
    }
  }
  if (!tally.WaitFor([&]() ABSL_SHARED_LOCKS_REQUIRED(tally.mu) { return tally.assigned[1] == n; },
                     timeout)) {
    r.error = "not every worker was assigned";
    finish();
    return r;
  }
  r.assigned_s = Since(t_submit);
  absl::SleepFor(absl::Seconds(1));  // settled
  r.after_assign = Stats(pid);

  const auto t_drop = Clock::now();
  workers[n / 2]->Drop();
  if (!tally.WaitFor(
          [&]() ABSL_SHARED_LOCKS_REQUIRED(tally.mu) { return tally.aborted[1] >= n - 1; },
          timeout)) {
    r.error = "not every survivor was aborted after the drop";
    finish();
    return r;
  }
  r.aborted_s = Since(t_drop);
  if (!tally.WaitFor(
          [&]() ABSL_SHARED_LOCKS_REQUIRED(tally.mu) { return tally.assigned[2] >= n - 1; },
          timeout)) {
    r.error = "the survivors were not all assigned the next generation";
    finish();
    return r;
  }
  r.reassigned_s = Since(t_drop);
  finish();
  return r;
}

std::string Mb(int64_t bytes) { return absl::StrFormat("%.0f MB", bytes / 1e6); }

}  // namespace
}  // namespace lockstep

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  using lockstep::Result;
  // Every stream is a file descriptor or two on each side.
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  files.rlim_cur = files.rlim_max;
  setrlimit(RLIMIT_NOFILE, &files);
  std::vector<Result> results;
  for (absl::string_view w : absl::StrSplit(absl::GetFlag(FLAGS_workers), ',', absl::SkipEmpty())) {
    int n = 0;
    if (!absl::SimpleAtoi(w, &n) || n < 2) {
      std::cerr << "--workers: \"" << w << "\" is not a worker count of 2 or more\n";
      return 2;
    }
    std::cerr << "N = " << n << " ..." << std::endl;
    results.push_back(lockstep::RunOne(n));
  }
  std::printf("| N | registered | submit RPC | all assigned | drop: all aborted | drop: all re-assigned | "
              "coordinator CPU | RSS idle / assigned / end | threads idle / assigned |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const Result& r : results) {
    std::printf("| %d | %.2f s | %.2f s | %.2f s | %.2f s | %.2f s | %.1f s | %s / %s / %s | %lld / %lld |%s\n",
                r.workers, r.registered_s, r.submit_rpc_s, r.assigned_s, r.aborted_s,
                r.reassigned_s, r.end.cpu_s, lockstep::Mb(r.idle.rss_bytes).c_str(),
                lockstep::Mb(r.after_assign.rss_bytes).c_str(), lockstep::Mb(r.end.rss_bytes).c_str(),
                static_cast<long long>(r.idle.threads),
                static_cast<long long>(r.after_assign.threads),
                r.error.empty() ? "" : (" failed: " + r.error).c_str());
  }
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    std::ofstream json(out);
    json << "[\n";
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      json << absl::StrFormat(
          "  {\"workers\": %d, \"error\": \"%s\", \"registered_s\": %.3f, \"submit_rpc_s\": %.3f, "
          "\"assigned_s\": %.3f, \"aborted_s\": %.3f, \"reassigned_s\": %.3f, "
          "\"coordinator_cpu_s\": %.2f, \"rss_idle_bytes\": %d, \"rss_assigned_bytes\": %d, "
          "\"rss_end_bytes\": %d, \"threads_idle\": %d, \"threads_assigned\": %d}%s\n",
          r.workers, r.error, r.registered_s, r.submit_rpc_s, r.assigned_s, r.aborted_s,
          r.reassigned_s, r.end.cpu_s, r.idle.rss_bytes, r.after_assign.rss_bytes,
          r.end.rss_bytes, r.idle.threads, r.after_assign.threads,
          i + 1 < results.size() ? "," : "");
    }
    json << "]\n";
  }
  for (const Result& r : results) {
    if (!r.error.empty()) return 1;
  }
  return 0;
}
