// Local cluster harness for integration tests.
#include "tests/testing/cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/coordinators.h"
#include "common/grpc_options.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"

extern char** environ;

namespace lockstep::testing {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::chrono::system_clock::time_point Deadline(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d);
}

}  // namespace

v1::JobSpec SyntheticJob(int min_workers, int max_workers, int64_t steps) {
  v1::JobSpec spec;
  spec.set_name("synthetic");
  spec.mutable_model()->set_type("mlp");
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(64);
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(64);
  spec.mutable_dataset()->set_type("synthetic");
  auto* s = spec.mutable_dataset()->mutable_synthetic();
  s->set_train_samples(8192);
  s->set_test_samples(2048);
  s->set_input_dim(32);
  s->set_num_classes(4);
  s->set_seed(5);
  spec.mutable_optimizer()->set_type("sgd");
  spec.mutable_optimizer()->set_learning_rate(0.05);
  spec.mutable_optimizer()->set_momentum(0.9);
  spec.set_global_batch_size(120);  // divisible into 1, 2, 3 and 4 workers' shards alike
  spec.set_micro_shards(12);
  spec.set_max_steps(steps);
  spec.set_seed(17);
  spec.set_min_workers(min_workers);
  spec.set_max_workers(max_workers);
  return spec;
}

v1::JobSpec DeterministicJob(int min_workers, int max_workers, int64_t steps,
                             int64_t heartbeat_timeout_ms, int64_t collective_timeout_ms) {
  v1::JobSpec spec = SyntheticJob(min_workers, max_workers, steps);
  spec.set_deterministic(true);
  if (heartbeat_timeout_ms > 0) spec.set_heartbeat_timeout_ms(heartbeat_timeout_ms);
  if (collective_timeout_ms > 0) spec.set_collective_timeout_ms(collective_timeout_ms);
  return spec;
}

absl::StatusOr<std::unique_ptr<Process>> Process::Spawn(const std::vector<std::string>& argv,
                                                        const std::string& log_path) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": ", strerror(rc)));
  }
  return std::unique_ptr<Process>(new Process(pid));
}

Process::~Process() {
  if (!reaped_) {
    kill(pid_, SIGKILL);
    kill(pid_, SIGCONT);
    waitpid(pid_, &status_, 0);
  }
}

void Process::Signal(int sig) {
  if (!reaped_) kill(pid_, sig);
}

bool Process::running() {
  if (reaped_) return false;
  if (waitpid(pid_, &status_, WNOHANG) == pid_) reaped_ = true;
  return !reaped_;
}

absl::StatusOr<int> Process::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (running()) {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("pid ", pid_, " still running"));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (WIFEXITED(status_)) return WEXITSTATUS(status_);
  return 128 + WTERMSIG(status_);
}

absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv,
                                         absl::Duration timeout, const std::string& stdin_data) {
  static int counter = 0;
  const std::string base = absl::StrCat(::testing::TempDir(), "/cmd-", getpid(), "-", counter++);
  const std::vector<std::string>& args = argv;
  std::string in_path = "/dev/null";
  if (!stdin_data.empty()) {
    in_path = base + ".in";
    std::ofstream(in_path) << stdin_data;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, in_path.c_str(), O_RDONLY, 0);
  const std::string out_path = base + ".out";
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::vector<char*> cargs;
  for (const std::string& a : args) cargs.push_back(const_cast<char*>(a.c_str()));
  cargs.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, cargs[0], &actions, nullptr, cargs.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return absl::InternalError(absl::StrCat("posix_spawn: ", strerror(rc)));
  absl::StatusOr<int> code = [&]() -> absl::StatusOr<int> {
    const absl::Time deadline = absl::Now() + timeout;
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (absl::Now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        return absl::DeadlineExceededError(absl::StrCat(argv[0], " did not finish within ",
                                                        absl::FormatDuration(timeout), ": ",
                                                        ReadFile(out_path)));
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }();
  CommandResult result;
  if (code.ok()) result.output = ReadFile(out_path);
  std::error_code ignored;  // what the command read and wrote is in the result
  std::filesystem::remove(out_path, ignored);
  if (!stdin_data.empty()) std::filesystem::remove(in_path, ignored);
  if (!code.ok()) return code.status();
  result.exit_code = *code;
  return result;
}

std::vector<std::string> Cluster::TestRootFlags() {
  std::string tmp = ::testing::TempDir();
  while (tmp.size() > 1 && tmp.back() == '/') tmp.pop_back();
  return {absl::StrCat("--data_root=", tmp, ",/usr/share/datasets,/usr/share/games/fortunes"),
          "--checkpoint_root=" + tmp};
}

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Start(
    const std::vector<std::string>& coordinator_flags, const std::string& token,
    const TlsFiles& client_tls, bool test_roots) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      MakeChannelCredentials(client_tls);
  if (!credentials.ok()) return credentials.status();
  std::unique_ptr<Cluster> cluster(new Cluster());
  cluster->test_roots_ = test_roots;
  static int counter = 0;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  cluster->dir_ = absl::StrCat(::testing::TempDir(), "/lockstep-", getpid(), "-",
                               info ? info->name() : "cluster", "-", counter++);
  std::filesystem::remove_all(cluster->dir_);
  std::filesystem::create_directories(cluster->dir_);
  cluster->coordinator_flags_ = coordinator_flags;
  if (!token.empty()) {
    cluster->token_file_ = cluster->dir_ + "/token";
    std::ofstream(cluster->token_file_) << token << "\n";
    cluster->coordinator_flags_.push_back("--token_file=" + cluster->token_file_);
  }
  LOCKSTEP_RETURN_IF_ERROR(cluster->StartCoordinator("127.0.0.1:0"));
  cluster->client_auth_ = {token, "integration test", *credentials, client_tls.server_name};
  cluster->jobs_ = v1::JobService::NewStub(MakeChannel(cluster->address_, cluster->client_auth_));
  return cluster;
}

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::StartOnEtcd(
    const std::string& etcd_endpoints, int coordinators,
    const std::vector<std::string>& coordinator_flags) {
  std::vector<std::string> flags = {"--state_backend=etcd", "--etcd_endpoints=" + etcd_endpoints};
  flags.insert(flags.end(), coordinator_flags.begin(), coordinator_flags.end());
  absl::StatusOr<std::unique_ptr<Cluster>> cluster = Start(flags);
  if (!cluster.ok()) return cluster.status();
  Cluster& c = **cluster;
  c.addresses_.push_back(c.address_);
  for (int i = 1; i < coordinators; ++i) LOCKSTEP_RETURN_IF_ERROR(c.StartStandby(i));
  return cluster;
}

absl::Status Cluster::StartStandby(int i) {
  const std::string port_file = absl::StrCat(dir_, "/port", i);
  std::vector<std::string> argv = {
      LOCKSTEP_COORDINATOR_BIN, "--listen=127.0.0.1:0", "--port_file=" + port_file,
      absl::StrCat("--test_hooks_dir=", dir_, "/hooks/coordinator", i)};
  if (test_roots_) {
    for (const std::string& flag : TestRootFlags()) argv.push_back(flag);
  }
  argv.insert(argv.end(), coordinator_flags_.begin(), coordinator_flags_.end());
  auto process = Process::Spawn(argv, absl::StrCat(dir_, "/coordinator", i, ".log"));
  if (!process.ok()) return process.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!std::filesystem::exists(port_file)) {
    if (!(*process)->running() || absl::Now() > deadline) {
      return absl::UnavailableError(absl::StrCat("coordinator ", i, " did not start:\n", Logs()));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  addresses_.push_back(absl::StrCat("127.0.0.1:", std::stoi(ReadFile(port_file))));
  standbys_.push_back(*std::move(process));
  return absl::OkStatus();
}

absl::StatusOr<int> Cluster::FollowLeader(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  do {
    for (size_t i = 0; i < addresses_.size(); ++i) {
      std::shared_ptr<grpc::Channel> channel = MakeChannel(addresses_[i], client_auth_);
      auto health = grpc::health::v1::Health::NewStub(channel);
      grpc::ClientContext context;
      context.set_deadline(Deadline(absl::Milliseconds(300)));
      grpc::health::v1::HealthCheckResponse response;
      if (health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response).ok() &&
          response.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
        jobs_ = v1::JobService::NewStub(channel);
        address_ = addresses_[i];
        return static_cast<int>(i);
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  } while (absl::Now() < deadline);
  return absl::UnavailableError(
      absl::StrCat("no coordinator serves within ", absl::FormatDuration(timeout), ":\n", Logs()));
}

std::string Cluster::WorkerCoordinatorFlag() const {
  return addresses_.empty() ? address_ : absl::StrJoin(addresses_, ",");
}

absl::Status Cluster::StartCoordinator(const std::string& listen) {
  const std::string port_file = dir_ + "/port";
  std::filesystem::remove(port_file);
  // Its test hooks' files, from a clean slate for every coordinator process.
  const std::string hooks = dir_ + "/hooks/coordinator";
  std::filesystem::remove_all(hooks);
  std::vector<std::string> argv = {LOCKSTEP_COORDINATOR_BIN, "--listen=" + listen,
                                   "--port_file=" + port_file, "--test_hooks_dir=" + hooks};
  // On etcd the state is there (the coordinator refuses a --state_dir beside it).
  if (std::find(coordinator_flags_.begin(), coordinator_flags_.end(), "--state_backend=etcd") ==
      coordinator_flags_.end()) {
    argv.push_back("--state_dir=" + dir_ + "/state");
  }
  if (test_roots_) {
    for (const std::string& flag : TestRootFlags()) argv.push_back(flag);
  }
  argv.insert(argv.end(), coordinator_flags_.begin(), coordinator_flags_.end());
  auto process = Process::Spawn(argv, dir_ + "/coordinator.log");
  if (!process.ok()) return process.status();
  coordinator_ = *std::move(process);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!std::filesystem::exists(port_file)) {
    if (!coordinator_->running() || absl::Now() > deadline) {
      return absl::UnavailableError(absl::StrCat("coordinator did not start:\n", Logs()));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  address_ = absl::StrCat("127.0.0.1:", std::stoi(ReadFile(port_file)));
  return absl::OkStatus();
}

absl::Status Cluster::RestartCoordinator(bool keep_state) {
  coordinator_->Signal(SIGKILL);
  if (absl::StatusOr<int> code = coordinator_->Wait(absl::Seconds(10)); !code.ok()) {
    return code.status();
  }
  if (!keep_state) std::filesystem::remove_all(dir_ + "/state");
  // The same port, so the workers (which know only this address) find the new coordinator.
  return StartCoordinator(address_);
}

absl::Status Cluster::WaitForWorker(const std::string& name, const std::string& state,
                                    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    auto workers = Workers();
    if (workers.ok()) {
      for (const v1::WorkerInfo& w : *workers) {
        if (w.name() == name && w.state() == state) return absl::OkStatus();
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("worker ", name, " not ", state, " within ",
                                                  absl::FormatDuration(timeout), ":\n", Logs()));
}

Cluster::~Cluster() {
  workers_.clear();
  for (auto& standby : standbys_) {
    if (standby->running()) standby->Signal(SIGTERM);
  }
  for (auto& standby : standbys_) (void)standby->Wait(absl::Seconds(5));
  if (coordinator_ != nullptr) {
    coordinator_->Signal(SIGTERM);
    (void)coordinator_->Wait(absl::Seconds(5));
  }
  standbys_.clear();  // killed, if still running: nothing writes in the directory after this
  coordinator_.reset();
  // A passing test's directory goes with it (tens of MB of logs, state and checkpoint memory
  // per test); a failing test's stays for its logs, and every one with LOCKSTEP_TEST_KEEP_DIRS
  // set.
  if (!::testing::Test::HasFailure() && std::getenv("LOCKSTEP_TEST_KEEP_DIRS") == nullptr) {
    std::error_code ignored;  // a program's process the test left running may still write
    std::filesystem::remove_all(dir_, ignored);
  }
}

absl::Status Cluster::StartWorker(const std::string& name, const std::vector<std::string>& flags,
                                  const std::vector<std::string>& launcher) {
  const std::string hooks = absl::StrCat(dir_, "/hooks/", name);
  std::filesystem::remove_all(hooks);
  // A program worker's checkpoint memory in the cluster's directory, not /dev/shm: a worker the
  // test kills leaves it behind (`flags` may name another).
  const std::string memory = absl::StrCat(dir_, "/shm");
  std::filesystem::create_directories(memory);
  std::vector<std::string> argv = launcher;
  for (const std::string& arg :
       {std::string(LOCKSTEP_WORKER_BIN), "--coordinator=" + WorkerCoordinatorFlag(),
        std::string("--device=cpu"), "--name=" + name, "--test_hooks_dir=" + hooks,
        "--data_cache_dir=" + dir_ + "/cache", "--checkpoint_memory_dir=" + memory}) {
    argv.push_back(arg);
  }
  if (!token_file_.empty()) argv.push_back("--token_file=" + token_file_);
  if (test_roots_) {
    for (const std::string& flag : TestRootFlags()) argv.push_back(flag);
  }
  argv.insert(argv.end(), flags.begin(), flags.end());
  auto process = Process::Spawn(argv, absl::StrCat(dir_, "/", name, ".log"));
  if (!process.ok()) return process.status();
  workers_[name] = *std::move(process);
  // Registered: idle, or already busy when a running job took it as a spare at once.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    auto workers = Workers();
    if (workers.ok()) {
      for (const v1::WorkerInfo& w : *workers) {
        if (w.name() == name && w.state() != "lost") return absl::OkStatus();
      }
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::DeadlineExceededError(absl::StrCat("worker ", name, " did not register:\n", Logs()));
}

absl::Status Cluster::WaitForHook(const std::string& worker, const std::string& hook,
                                  absl::Duration timeout) {
  const std::string path = absl::StrCat(dir_, "/hooks/", worker, "/", hook, ".reached");
  const absl::Time deadline = absl::Now() + timeout;
  while (!std::filesystem::exists(path)) {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(worker, " did not reach test hook ", hook,
                                                      " within ", absl::FormatDuration(timeout),
                                                      ":\n", Logs()));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return absl::OkStatus();
}

void Cluster::ReleaseHook(const std::string& worker, const std::string& hook) {
  std::ofstream(absl::StrCat(dir_, "/hooks/", worker, "/", hook, ".release")) << "go\n";
}

absl::Status Cluster::StartWorkers(int n) {
  for (int i = 0; i < n; ++i) {
    LOCKSTEP_RETURN_IF_ERROR(StartWorker(absl::StrCat("w", i)));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::Job> Cluster::Submit(const v1::JobSpec& spec) {
  grpc::ClientContext context;
  context.set_deadline(Deadline(absl::Seconds(10)));
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  v1::Job job;
  grpc::Status status = jobs_->SubmitJob(&context, request, &job);
  if (!status.ok()) return ToAbslStatus(status);
  return job;
}

absl::StatusOr<v1::Job> Cluster::SubmitTo(int i, const v1::JobSpec& spec, absl::Duration timeout) {
  auto stub = v1::JobService::NewStub(MakeChannel(addresses_.at(i), client_auth_));
  grpc::ClientContext context;
  context.set_deadline(Deadline(timeout));
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  v1::Job job;
  grpc::Status status = stub->SubmitJob(&context, request, &job);
  if (!status.ok()) return ToAbslStatus(status);
  return job;
}

absl::StatusOr<int64_t> Cluster::TermOf(int i) {
  auto stub = v1::JobService::NewStub(MakeChannel(addresses_.at(i), client_auth_));
  grpc::ClientContext context;
  context.set_deadline(Deadline(absl::Seconds(10)));
  v1::ListJobsResponse response;
  grpc::Status status = stub->ListJobs(&context, v1::ListJobsRequest(), &response);
  if (!status.ok()) return ToAbslStatus(status);
  const auto& metadata = context.GetServerInitialMetadata();
  auto it = metadata.find(kTermMetadataKey);
  int64_t term = 0;
  if (it != metadata.end() &&
      !absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &term)) {
    return absl::InternalError("the term in the metadata is not a number");
  }
  return term;
}

absl::StatusOr<std::vector<v1::Job>> Cluster::List() {
  grpc::ClientContext context;
  context.set_deadline(Deadline(absl::Seconds(10)));
  v1::ListJobsRequest request;
  request.set_page_size(1000);
  v1::ListJobsResponse response;
  grpc::Status status = jobs_->ListJobs(&context, request, &response);
  if (!status.ok()) return ToAbslStatus(status);
  return std::vector<v1::Job>(response.jobs().begin(), response.jobs().end());
}

absl::StatusOr<v1::Job> Cluster::Get(const std::string& job_id) {
  grpc::ClientContext context;
  context.set_deadline(Deadline(absl::Seconds(10)));
  v1::GetJobRequest request;
  request.set_job_id(job_id);
  v1::Job job;
  grpc::Status status = jobs_->GetJob(&context, request, &job);
  if (!status.ok()) return ToAbslStatus(status);
  return job;
}

absl::StatusOr<v1::Job> Cluster::WaitFor(const std::string& job_id,
                                         const std::function<bool(const v1::Job&)>& pred,
                                         absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  v1::Job last;
  while (absl::Now() < deadline) {
    absl::StatusOr<v1::Job> job = Get(job_id);
    // A coordinator that is restarting (or was just frozen) is asked again; on etcd, the one
    // that leads now.
    if (absl::IsUnavailable(job.status()) || absl::IsDeadlineExceeded(job.status())) {
      if (addresses_.size() > 1) (void)FollowLeader(absl::ZeroDuration());
      absl::SleepFor(absl::Milliseconds(50));
      continue;
    }
    if (!job.ok()) return job.status();
    if (pred(*job)) return job;
    last = *job;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("job ", job_id, " still ",
                                                  v1::JobState_Name(last.state()), " at step ",
                                                  last.step(), ": ", last.reason(), "\n", Logs()));
}

absl::StatusOr<v1::Job> Cluster::WaitForEnd(const std::string& job_id, absl::Duration timeout) {
  return WaitFor(
      job_id,
      [](const v1::Job& j) {
        return j.state() == v1::JOB_STATE_SUCCEEDED || j.state() == v1::JOB_STATE_FAILED ||
               j.state() == v1::JOB_STATE_CANCELLED;
      },
      timeout);
}

absl::StatusOr<std::vector<v1::JobEvent>> Cluster::History(const std::string& job_id) {
  grpc::ClientContext context;
  context.set_deadline(Deadline(absl::Seconds(10)));
  v1::WatchJobRequest request;
  request.set_job_id(job_id);
  auto reader = jobs_->WatchJob(&context, request);
  std::vector<v1::JobEvent> events;
  v1::JobEvent event;
  while (reader->Read(&event)) events.push_back(event);
  grpc::Status status = reader->Finish();
  if (!status.ok()) return ToAbslStatus(status);
  return events;
}

absl::StatusOr<std::vector<v1::WorkerInfo>> Cluster::Workers() {
  grpc::ClientContext context;
  context.set_deadline(Deadline(absl::Seconds(5)));
  v1::ListWorkersResponse response;
  grpc::Status status = jobs_->ListWorkers(&context, v1::ListWorkersRequest(), &response);
  if (!status.ok()) return ToAbslStatus(status);
  return std::vector<v1::WorkerInfo>(response.workers().begin(), response.workers().end());
}

std::string Cluster::Logs() const {
  std::string out;
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    if (entry.path().extension() != ".log") continue;
    std::string text = ReadFile(entry.path());
    if (text.size() > 3000) text = "..." + text.substr(text.size() - 3000);
    absl::StrAppend(&out, "==== ", entry.path().filename().string(), " ====\n", text, "\n");
  }
  return out;
}

}  // namespace lockstep::testing
