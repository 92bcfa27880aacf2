// Trust boundaries, tried the way someone holding the cluster's token would: a raw gRPC client
// that registers as a worker and forges reports, oversized and malformed input, and a job too
// big for its worker. The victim job always ends with its true result (deterministic mode: the
// same parameter checksum as an undisturbed run), or fails with a reason; no daemon dies.
#include <filesystem>
#include <fstream>
#include <atomic>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "lockstep/v1/store.grpc.pb.h"
#include "lockstep/v1/worker.grpc.pb.h"
#include "tests/testing/cluster.h"
#include "tests/testing/gpt_job.h"

namespace lockstep {
namespace {

using testing::Cluster;

v1::JobSpec Deterministic(int min_workers, int max_workers, int64_t steps) {
  return testing::DeterministicJob(min_workers, max_workers, steps);
}

// A client that speaks the worker protocol itself.
class FakeWorker {
 public:
  // `device` "cuda:0" keeps it out of CPU jobs.
  FakeWorker(const std::string& address, const std::string& name,
             const std::string& device = "cpu", const std::string& token = "")
      : stub_(v1::WorkerService::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {
    if (!token.empty()) context_.AddMetadata("authorization", "Bearer " + token);
    stream_ = stub_->Session(&context_);
    v1::WorkerMessage hello;
    v1::RegisterRequest* r = hello.mutable_register_();
    r->set_name(name);
    r->set_host("fake-host");
    r->set_device(device);
    r->set_comm_address("127.0.0.1");
    stream_->Write(hello);
  }
  ~FakeWorker() { Close(); }
  // The next message from the coordinator (false when the stream ended).
  bool Read(v1::CoordinatorMessage* message) { return stream_->Read(message); }
  bool Send(const v1::WorkerMessage& message) { return stream_->Write(message); }
  void Close() {
    if (closed_) return;
    closed_ = true;
    context_.TryCancel();
    stream_->Finish().IgnoreError();
  }
  // After the coordinator ended the stream (Read returned false): its status.
  grpc::Status Finish() {
    closed_ = true;
    return stream_->Finish();
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<v1::WorkerService::Stub> stub_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream_;
  bool closed_ = false;
};

v1::WorkerMessage ForgedFinished(const std::string& job_id, int64_t generation, int64_t step) {
  v1::WorkerMessage m;
  v1::FinishedReport* f = m.mutable_finished();
  f->set_job_id(job_id);
  f->set_generation(generation);
  f->set_step(step);
  f->set_parameter_checksum("deadbeefdeadbeef");
  f->mutable_eval()->set_test_accuracy(0.9999);
  return m;
}

TEST(TrustTest, ForgedFinishedAndFatalReportsDoNotDecideTheJob) {
  auto started = Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = *std::move(started);
  ASSERT_TRUE(cluster->StartWorkers(2).ok());
  constexpr int64_t kSteps = 60;
  // The undisturbed run.
  auto reference = cluster->Submit(Deterministic(2, 2, kSteps));
  ASSERT_TRUE(reference.ok()) << reference.status();
  auto undisturbed = cluster->WaitForEnd(reference->job_id(), absl::Seconds(120));
  ASSERT_TRUE(undisturbed.ok()) << cluster->Logs();
  ASSERT_EQ(undisturbed->state(), v1::JOB_STATE_SUCCEEDED) << undisturbed->reason();

  // A fake worker joins the next job's first generation, reports it finished with a made-up
  // checksum and accuracy, and disconnects. A second one, never a member, forges the same.
  FakeWorker fake(cluster->address(), "fake");
  v1::CoordinatorMessage message;
  ASSERT_TRUE(fake.Read(&message));
  ASSERT_TRUE(message.has_registered());
  auto victim = cluster->Submit(Deterministic(2, 3, kSteps));
  ASSERT_TRUE(victim.ok()) << victim.status();
  ASSERT_TRUE(fake.Read(&message));
  ASSERT_TRUE(message.has_assignment()) << message.DebugString();
  ASSERT_EQ(message.assignment().job_id(), victim->job_id());
  ASSERT_TRUE(fake.Send(ForgedFinished(victim->job_id(), message.assignment().generation(), kSteps)));
  absl::SleepFor(absl::Milliseconds(200));
  fake.Close();
  {
    // Never a member: a GPU worker that the CPU job cannot take.
    FakeWorker outsider(cluster->address(), "outsider", "cuda:0");
    ASSERT_TRUE(outsider.Read(&message));
    ASSERT_TRUE(message.has_registered());
    // The victim's store keys are its members' only: with this session's key, or none.
    auto store = v1::StoreService::NewStub(
        grpc::CreateChannel(cluster->address(), grpc::InsecureChannelCredentials()));
    auto current = cluster->WaitFor(
        victim->job_id(), [](const v1::Job& j) { return j.state() == v1::JOB_STATE_RUNNING; },
        absl::Seconds(30));
    ASSERT_TRUE(current.ok());
    for (const std::string& key : {message.registered().session_key(), std::string()}) {
      grpc::ClientContext context;
      if (!key.empty()) context.AddMetadata("x-lockstep-session", key);
      v1::StoreGetRequest get;
      get.set_job_id(victim->job_id());
      get.set_generation(current->generation());
      get.set_key("rank_0");
      get.set_timeout_ms(100);
      v1::StoreGetResponse value;
      grpc::Status status = store->Get(&context, get, &value);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED)
          << status.error_message();
    }
    outsider.Send(ForgedFinished(victim->job_id(), 1, kSteps));
    v1::WorkerMessage failure;
    failure.mutable_failure()->set_job_id(victim->job_id());
    failure.mutable_failure()->set_generation(1);
    failure.mutable_failure()->set_fatal(true);
    failure.mutable_failure()->set_message("dataset does not load (forged)");
    outsider.Send(failure);
    absl::SleepFor(absl::Milliseconds(200));
  }

  auto ended = cluster->WaitForEnd(victim->job_id(), absl::Seconds(120));
  ASSERT_TRUE(ended.ok()) << cluster->Logs();
  EXPECT_EQ(ended->state(), v1::JOB_STATE_SUCCEEDED) << ended->reason();
  EXPECT_EQ(ended->step(), kSteps);
  ASSERT_EQ(ended->members_size(), 2);
  for (const v1::Member& m : ended->members()) {
    EXPECT_EQ(m.parameter_checksum(), undisturbed->members(0).parameter_checksum())
        << m.worker_name();
  }
  EXPECT_NE(ended->eval().test_accuracy(), 0.9999) << "not the forged evaluation";
  EXPECT_EQ(ended->eval().test_accuracy(), undisturbed->eval().test_accuracy());
  EXPECT_GE(ended->generations_size(), 2);

  // A member's forged fatal failure: the forger leaves the job (and is not taken back as a
  // spare); the others train on to the true result, and the job says who reported what.
  FakeWorker forger(cluster->address(), "forger");
  ASSERT_TRUE(forger.Read(&message));
  ASSERT_TRUE(message.has_registered());
  auto second = cluster->Submit(Deterministic(2, 3, kSteps));
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE(forger.Read(&message));
  ASSERT_TRUE(message.has_assignment()) << message.DebugString();
  v1::WorkerMessage fatal;
  fatal.mutable_failure()->set_job_id(second->job_id());
  fatal.mutable_failure()->set_generation(message.assignment().generation());
  fatal.mutable_failure()->set_fatal(true);
  fatal.mutable_failure()->set_message("dataset does not load (forged)");
  ASSERT_TRUE(forger.Send(fatal));
  ended = cluster->WaitForEnd(second->job_id(), absl::Seconds(120));
  ASSERT_TRUE(ended.ok()) << cluster->Logs();
  EXPECT_EQ(ended->state(), v1::JOB_STATE_SUCCEEDED) << ended->reason();
  EXPECT_EQ(ended->step(), kSteps);
  ASSERT_EQ(ended->members_size(), 2);
  for (const v1::Member& m : ended->members()) {
    EXPECT_NE(m.worker_name(), "forger");
    EXPECT_EQ(m.parameter_checksum(), undisturbed->members(0).parameter_checksum())
        << m.worker_name();
  }
  ASSERT_GE(ended->recovery_history_size(), 1);
  EXPECT_NE(ended->recovery_history(0).reason().find("worker forger"), std::string::npos)
      << ended->recovery_history(0).reason();
  EXPECT_NE(ended->recovery_history(0).reason().find("(forged)"), std::string::npos);
  EXPECT_TRUE(cluster->coordinator()->running());
}

// No forged value sticks to a job: a member that reports Finished with an evaluation the job
// never ran, a sample and an export path, then disconnects, leaves nothing of them (the job
// has no evaluation, and rank 0's own sample); and fatal reports from a worker token holder
// that rejoins again and again under new names never use up the job's max_restarts.
TEST(TrustTest, ForgedValuesNeverStickAndFatalReportsCannotFailAJob) {
  auto started = Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = *std::move(started);
  ASSERT_TRUE(cluster->StartWorkers(2).ok());
  FakeWorker fake(cluster->address(), "fake");
  v1::CoordinatorMessage message;
  ASSERT_TRUE(fake.Read(&message));
  ASSERT_TRUE(message.has_registered());
  v1::JobSpec gpt = testing::SmallGptSpec();
  gpt.set_min_workers(2);
  gpt.set_max_workers(3);
  gpt.set_skip_evaluation(true);
  gpt.mutable_sample()->set_max_tokens(16);
  auto victim = cluster->Submit(gpt);
  ASSERT_TRUE(victim.ok()) << victim.status();
  ASSERT_TRUE(fake.Read(&message));
  ASSERT_TRUE(message.has_assignment()) << message.DebugString();
  v1::WorkerMessage forged = ForgedFinished(victim->job_id(), message.assignment().generation(),
                                            gpt.max_steps());
  forged.mutable_finished()->mutable_sample()->set_text("forged sample");
  forged.mutable_finished()->set_export_path("/etc/passwd");
  forged.mutable_finished()->set_train_samples_per_second(1e12);
  ASSERT_TRUE(fake.Send(forged));
  absl::SleepFor(absl::Milliseconds(200));
  fake.Close();
  auto ended = cluster->WaitForEnd(victim->job_id(), absl::Seconds(120));
  ASSERT_TRUE(ended.ok()) << cluster->Logs();
  ASSERT_EQ(ended->state(), v1::JOB_STATE_SUCCEEDED) << ended->reason();
  EXPECT_FALSE(ended->has_eval()) << "a job without evaluation shows none";
  EXPECT_EQ(ended->reason().find("accuracy"), std::string::npos) << ended->reason();
  EXPECT_FALSE(ended->sample().text().empty()) << ended->sample_error();
  EXPECT_NE(ended->sample().text(), "forged sample");
  EXPECT_EQ(ended->export_path(), "");
  EXPECT_LT(ended->train_samples_per_second(), 1e12);
  for (const v1::Member& m : ended->members()) EXPECT_NE(m.worker_name(), "fake");

  // Fatal reports, one per new identity: each reporter leaves the job, which is not charged.
  v1::JobSpec long_job = Deterministic(2, 3, 1'000'000);
  long_job.set_max_restarts(1);
  auto job = cluster->Submit(long_job);
  ASSERT_TRUE(job.ok()) << job.status();
  for (int i = 0; i < 5; ++i) {
    // It joins as a spare once the current generation has stepped.
    FakeWorker rejoining(cluster->address(), absl::StrCat("rejoining-", i));
    ASSERT_TRUE(rejoining.Read(&message));
    ASSERT_TRUE(message.has_registered());
    ASSERT_TRUE(rejoining.Read(&message));
    ASSERT_TRUE(message.has_assignment()) << i << ": " << message.DebugString();
    v1::WorkerMessage fatal;
    fatal.mutable_failure()->set_job_id(job->job_id());
    fatal.mutable_failure()->set_generation(message.assignment().generation());
    fatal.mutable_failure()->set_fatal(true);
    fatal.mutable_failure()->set_message(absl::StrCat("forged fatal error ", i));
    ASSERT_TRUE(rejoining.Send(fatal));
    // The job re-forms without it after the fatal report's grace (2 s).
    auto reformed = cluster->WaitFor(
        job->job_id(),
        [&](const v1::Job& j) {
          return j.generation() > message.assignment().generation() &&
                 j.state() == v1::JOB_STATE_RUNNING;
        },
        absl::Seconds(60));
    ASSERT_TRUE(reformed.ok()) << reformed.status();
    EXPECT_EQ(reformed->recoveries(), 0) << reformed->reason();
  }
  auto running = cluster->Get(job->job_id());
  ASSERT_TRUE(running.ok());
  EXPECT_EQ(running->state(), v1::JOB_STATE_RUNNING) << running->reason();
  EXPECT_EQ(running->recoveries(), 0);
  grpc::ClientContext context;
  v1::CancelJobRequest cancel;
  cancel.set_job_id(job->job_id());
  v1::Job cancelled;
  EXPECT_TRUE(cluster->jobs().CancelJob(&context, cancel, &cancelled).ok());
}

// A worker token holder that joins a job and stays connected and silent (heartbeats, but never
// takes part in the group) is left out of the next generation each time, without charge, and
// after kMaxChargesPerWorker times no longer taken: a job with max_restarts 0 trains on.
TEST(TrustTest, ASilentMemberCannotUseUpTheJobsRestarts) {
  auto started = Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = *std::move(started);
  ASSERT_TRUE(cluster->StartWorker("w0").ok());
  v1::JobSpec spec = Deterministic(1, 2, 1'000'000);
  spec.set_max_restarts(0);
  spec.set_collective_timeout_ms(2000);  // how long the group waits for the silent one
  auto job = cluster->Submit(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(cluster->WaitFor(job->job_id(), [](const v1::Job& j) { return j.step() > 0; },
                               absl::Seconds(60))
                  .ok());
  FakeWorker silent(cluster->address(), "silent");
  std::atomic<bool> done{false};
  std::thread beats([&] {
    v1::WorkerMessage beat;
    beat.mutable_heartbeat();
    while (!done) {
      silent.Send(beat);
      absl::SleepFor(absl::Milliseconds(300));
    }
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(90);
  // Taken as a spare, left out, taken again... until it is no longer taken.
  while (absl::Now() < deadline) {
    auto j = cluster->Get(job->job_id());
    ASSERT_TRUE(j.ok()) << j.status();
    ASSERT_TRUE(j->state() == v1::JOB_STATE_RUNNING ||
                j->state() == v1::JOB_STATE_RECONFIGURING)
        << j->reason() << cluster->Logs();
    EXPECT_EQ(j->recoveries(), 0) << j->reason();
    bool member = false;
    for (const v1::Member& m : j->members()) member = member || m.worker_name() == "silent";
    int left_out = 0;
    for (const v1::Recovery& r : j->recovery_history()) {
      left_out += r.reason().find("took no part") != std::string::npos;
    }
    if (left_out >= 3 && !member) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  done = true;
  beats.join();
  auto j = cluster->WaitFor(
      job->job_id(), [](const v1::Job& j) { return j.state() == v1::JOB_STATE_RUNNING; },
      absl::Seconds(30));
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->recoveries(), 0);
  int left_out = 0;
  for (const v1::Recovery& r : j->recovery_history()) {
    left_out += r.reason().find("took no part") != std::string::npos;
  }
  EXPECT_EQ(left_out, 3) << "left out three times, then no longer taken";
  // Still not taken a while later.
  absl::SleepFor(absl::Seconds(1));
  j = cluster->Get(job->job_id());
  ASSERT_TRUE(j.ok());
  for (const v1::Member& m : j->members()) EXPECT_NE(m.worker_name(), "silent");
  grpc::ClientContext context;
  v1::CancelJobRequest cancel;
  cancel.set_job_id(job->job_id());
  v1::Job cancelled;
  EXPECT_TRUE(cluster->jobs().CancelJob(&context, cancel, &cancelled).ok());
}

// The coordinator's resident memory in bytes (VmRSS), or -1.
int64_t ResidentBytes(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// A member that floods its generation's bootstrap store (1 MiB values under new keys) is
// refused once the generation's limit is reached, with RESOURCE_EXHAUSTED naming it; when the
// generation closes the coordinator's memory is back within 10% of what it was.
TEST(TrustTest, AStoreFloodIsRefusedAtTheLimitAndItsMemoryReturns) {
  auto started = Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = *std::move(started);
  ASSERT_TRUE(cluster->StartWorker("w0").ok());
  auto job = cluster->Submit(Deterministic(1, 2, 1'000'000));
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(cluster->WaitFor(job->job_id(), [](const v1::Job& j) { return j.step() > 0; },
                               absl::Seconds(60))
                  .ok());
  FakeWorker flooder(cluster->address(), "flooder");
  v1::CoordinatorMessage message;
  ASSERT_TRUE(flooder.Read(&message));
  ASSERT_TRUE(message.has_registered());
  const std::string session = message.registered().session_key();
  ASSERT_TRUE(flooder.Read(&message));  // taken as a spare
  ASSERT_TRUE(message.has_assignment()) << message.DebugString();
  const int64_t generation = message.assignment().generation();
  const pid_t coordinator = cluster->coordinator()->pid();
  const int64_t before = ResidentBytes(coordinator);
  ASSERT_GT(before, 0);
  auto store = v1::StoreService::NewStub(
      grpc::CreateChannel(cluster->address(), grpc::InsecureChannelCredentials()));
  int accepted = 0;
  grpc::Status refused;
  for (int i = 0; i < 1500; ++i) {
    grpc::ClientContext context;
    context.AddMetadata("x-lockstep-session", session);
    v1::StoreSetRequest set;
    set.set_job_id(job->job_id());
    set.set_generation(generation);
    set.set_key(absl::StrCat("flood-", i));
    set.set_value(std::string(1'000'000, static_cast<char>('a' + i % 26)));
    v1::StoreSetResponse response;
    grpc::Status status = store->Set(&context, set, &response);
    if (!status.ok()) {
      refused = status;
      break;
    }
    ++accepted;
  }
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.error_message();
  EXPECT_NE(refused.error_message().find("may hold at most"), std::string::npos)
      << refused.error_message();
  EXPECT_LE(accepted, 40) << "a generation of 2 holds tens of MiB at most";
  const int64_t peak = ResidentBytes(coordinator);
  // The flooder goes; its generation closes and the job trains on without it.
  flooder.Close();
  ASSERT_TRUE(cluster
                  ->WaitFor(job->job_id(),
                            [&](const v1::Job& j) {
                              return j.generation() > generation &&
                                     j.state() == v1::JOB_STATE_RUNNING;
                            },
                            absl::Seconds(60))
                  .ok());
  absl::SleepFor(absl::Milliseconds(500));
  const int64_t after = ResidentBytes(coordinator);
  EXPECT_LE(after, before + before / 10)
      << "resident " << before << " bytes before the flood, " << peak << " at its peak, "
      << after << " after its generation closed";
  grpc::ClientContext context;
  v1::CancelJobRequest cancel;
  cancel.set_job_id(job->job_id());
  v1::Job cancelled;
  EXPECT_TRUE(cluster->jobs().CancelJob(&context, cancel, &cancelled).ok());
}

TEST(TrustTest, OversizedAndMalformedInputIsRefusedNamingTheField) {
  auto started = Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = *std::move(started);
  // Names that would bloat every listing or forge log lines.
  for (const auto& [name, field] :
       {std::pair<std::string, std::string>{std::string(15 << 20, 'n'), "spec"},
        {std::string(300, 'n'), "name"},
        {"job\n[12:00:00] job-9 SUCCEEDED", "name"}}) {
    v1::JobSpec spec = testing::SyntheticJob(1, 1, 10);
    spec.set_name(name);
    auto refused = cluster->Submit(spec);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find(field), std::string::npos) << refused.status();
  }
  // Bytes that are not UTF-8 in a string field: the request does not parse, and the answer
  // says so (gRPC alone would answer INTERNAL with no message).
  {
    v1::JobSpec spec = testing::SyntheticJob(1, 1, 10);
    spec.set_name("caf\xe9");
    auto refused = cluster->Submit(spec);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    EXPECT_NE(refused.status().message().find("not UTF-8"), std::string::npos) << refused.status();
    EXPECT_NE(refused.status().message().find("SubmitJob"), std::string::npos) << refused.status();
  }
  // A worker name with a newline or too long: the session is refused with the reason.
  for (const std::string& name : {std::string("w0\nforged"), std::string(100, 'w')}) {
    FakeWorker bad(cluster->address(), name);
    v1::CoordinatorMessage message;
    EXPECT_FALSE(bad.Read(&message)) << "registered as " << name;
  }
  grpc::ClientContext context;
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(cluster->jobs().ListJobs(&context, v1::ListJobsRequest(), &jobs).ok());
  EXPECT_EQ(jobs.jobs_size(), 0);
  EXPECT_TRUE(cluster->coordinator()->running());
}

// A job whose memory the preflight admits but the worker cannot get (its address space is
// capped here) fails with the reason; the worker lives on and trains the next job.
TEST(TrustTest, AJobTooBigForItsWorkerFailsAndTheWorkerLivesOn) {
  auto started = Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = *std::move(started);
  constexpr int64_t kLimit = int64_t{4} << 30;
  ASSERT_TRUE(cluster
                  ->StartWorker("w0", {},
                                {"/usr/bin/prlimit", absl::StrCat("--as=", kLimit)})
                  .ok());
  auto workers = cluster->Workers();
  ASSERT_TRUE(workers.ok());
  // 1.5 billion floats (6 GB) of synthetic data.
  v1::JobSpec big = testing::SyntheticJob(1, 1, 10);
  big.mutable_dataset()->mutable_synthetic()->set_train_samples(12'000'000);
  big.mutable_dataset()->mutable_synthetic()->set_test_samples(1000);
  big.mutable_dataset()->mutable_synthetic()->set_input_dim(128);
  if (workers->at(0).free_memory_bytes() < (int64_t{7} << 30)) {
    GTEST_SKIP() << "the worker reports under 7 GiB free; the job would be refused at submit";
  }
  auto job = cluster->Submit(big);
  ASSERT_TRUE(job.ok()) << job.status();
  auto ended = cluster->WaitForEnd(job->job_id(), absl::Seconds(120));
  ASSERT_TRUE(ended.ok()) << cluster->Logs();
  EXPECT_EQ(ended->state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(ended->reason().find("out of memory"), std::string::npos) << ended->reason();
  EXPECT_NE(ended->reason().find("worker w0"), std::string::npos) << ended->reason();
  EXPECT_TRUE(cluster->worker("w0")->running()) << cluster->Logs();
  // The same worker trains the next job.
  auto next = cluster->Submit(testing::SyntheticJob(1, 1, 20));
  ASSERT_TRUE(next.ok());
  auto done = cluster->WaitForEnd(next->job_id(), absl::Seconds(120));
  ASSERT_TRUE(done.ok()) << cluster->Logs();
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason();
}

// A second worker under a live worker's name stops with exit code 5 (a supervisor does not
// restart it) once the name has been refused for --name_conflict_timeout; the first one is
// untouched.
TEST(TrustTest, ANameHeldByALiveWorkerStopsTheSecondWithCodeFive) {
  auto started = Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = *std::move(started);
  ASSERT_TRUE(cluster->StartWorker("w0").ok());
  const std::string log = cluster->dir() + "/squatter.log";
  auto squatter = testing::Process::Spawn(
      {LOCKSTEP_WORKER_BIN, "--coordinator=" + cluster->address(), "--device=cpu", "--name=w0",
       "--name_conflict_timeout=1s"},
      log);
  ASSERT_TRUE(squatter.ok()) << squatter.status();
  absl::StatusOr<int> code = (*squatter)->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 5);
  std::ifstream in(log);
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(text.find("another live worker holds the name w0"), std::string::npos) << text;
  EXPECT_TRUE(cluster->worker("w0")->running());
  EXPECT_TRUE(cluster->WaitForWorker("w0", "idle", absl::Seconds(5)).ok());
}

// A session that floods the coordinator with messages is ended, saying why; the cluster's jobs
// are untouched.
TEST(TrustTest, AFloodOfReportsEndsTheSession) {
  auto started = Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = *std::move(started);
  ASSERT_TRUE(cluster->StartWorker("w0").ok());
  FakeWorker flooder(cluster->address(), "flooder", "cuda:0");
  v1::CoordinatorMessage message;
  ASSERT_TRUE(flooder.Read(&message));
  v1::WorkerMessage stale;
  stale.mutable_progress()->set_job_id("job-1");
  stale.mutable_progress()->set_generation(1);
  stale.mutable_progress()->set_step(1);
  int sent = 0;
  while (sent < 100000 && flooder.Send(stale)) ++sent;
  while (flooder.Read(&message)) {
  }
  grpc::Status status = flooder.Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_NE(status.error_message().find("messages a second"), std::string::npos);
  auto job = cluster->Submit(testing::SyntheticJob(1, 1, 20));
  ASSERT_TRUE(job.ok());
  auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(60));
  ASSERT_TRUE(done.ok()) << cluster->Logs();
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED);
}

// With a workers' token, each token opens only its side.
TEST(TrustTest, WorkerAndOperatorTokensOpenOnlyTheirSide) {
  std::string dir = std::filesystem::temp_directory_path() / "lockstep-roles-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const std::string worker_token = dir + "/worker-token";
  std::ofstream(worker_token) << "the-workers-token\n";
  auto started = Cluster::Start({"--worker_token_file=" + worker_token}, "the-operators-token");
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = *std::move(started);
  for (const char* name : {"w0", "w1"}) {
    ASSERT_TRUE(cluster->StartWorker(name, {"--token_file=" + worker_token}).ok())
        << cluster->Logs();
  }
  // Operators submit (the cluster's stub has their token), workers train.
  auto job = cluster->Submit(testing::SyntheticJob(2, 2, 50));
  ASSERT_TRUE(job.ok()) << job.status();
  auto ended = cluster->WaitForEnd(job->job_id(), absl::Seconds(120));
  ASSERT_TRUE(ended.ok()) << cluster->Logs();
  EXPECT_EQ(ended->state(), v1::JOB_STATE_SUCCEEDED) << ended->reason();

  // The workers' token on the job API.
  auto jobs = v1::JobService::NewStub(
      grpc::CreateChannel(cluster->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer the-workers-token");
  v1::Job submitted;
  v1::SubmitJobRequest submit;
  *submit.mutable_spec() = testing::SyntheticJob(1, 1, 10);
  grpc::Status status = jobs->SubmitJob(&context, submit, &submitted);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_NE(status.error_message().find("worker's token"), std::string::npos)
      << status.error_message();
  // The operators' token as a worker: refused, and a worker process given it stops (code 3).
  {
    FakeWorker fake(cluster->address(), "fake", "cpu", "the-operators-token");
    v1::CoordinatorMessage message;
    EXPECT_FALSE(fake.Read(&message));
  }
  auto operator_worker = testing::RunCommand(
      {LOCKSTEP_WORKER_BIN, "--coordinator=" + cluster->address(), "--name=w9",
       "--token_file=" + cluster->token_file()},
      absl::Seconds(30));
  ASSERT_TRUE(operator_worker.ok());
  EXPECT_EQ(operator_worker->exit_code, 3) << operator_worker->output;
  EXPECT_NE(operator_worker->output.find("operator's token"), std::string::npos)
      << operator_worker->output;
  cluster.reset();
  std::filesystem::remove_all(dir);
}

// A job reads and writes only inside the directories the coordinator and the workers allow:
// by name at submit, and through symbolic links on the worker, before anything is written.
TEST(TrustTest, JobPathsStayInsideTheAllowedDirectories) {
  std::string dir = std::filesystem::temp_directory_path() / "lockstep-paths-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  std::filesystem::create_directories(dir + "/data");
  std::filesystem::create_directories(dir + "/ckpt");
  std::filesystem::create_directories(dir + "/outside");
  std::filesystem::create_symlink(dir + "/outside", dir + "/ckpt/link");
  const std::vector<std::string> roots = {"--data_root=" + dir + "/data",
                                          "--checkpoint_root=" + dir + "/ckpt"};
  auto started = Cluster::Start(roots);
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = *std::move(started);
  ASSERT_TRUE(cluster->StartWorker("w0", roots).ok());

  v1::JobSpec outside = testing::SyntheticJob(1, 1, 20);
  outside.set_checkpoint_every_steps(5);
  outside.set_checkpoint_dir("/etc/lockstep-was-here");
  auto refused = cluster->Submit(outside);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("checkpoint_dir"), std::string::npos)
      << refused.status();
  outside.set_checkpoint_dir(dir + "/ckpt/../outside");
  EXPECT_EQ(cluster->Submit(outside).status().code(), absl::StatusCode::kInvalidArgument);

  // Inside by name, outside through the link: the worker refuses it, and writes nothing.
  v1::JobSpec linked = outside;
  linked.set_checkpoint_dir(dir + "/ckpt/link/run");
  auto job = cluster->Submit(linked);
  ASSERT_TRUE(job.ok()) << job.status();
  auto ended = cluster->WaitForEnd(job->job_id(), absl::Seconds(60));
  ASSERT_TRUE(ended.ok()) << cluster->Logs();
  EXPECT_EQ(ended->state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(ended->reason().find("checkpoint_dir"), std::string::npos) << ended->reason();
  EXPECT_NE(ended->reason().find("outside the allowed directories"), std::string::npos)
      << ended->reason();
  EXPECT_TRUE(std::filesystem::is_empty(dir + "/outside"));

  // Inside: trains and writes its checkpoints there.
  v1::JobSpec inside = outside;
  inside.set_checkpoint_dir(dir + "/ckpt/run");
  auto good = cluster->Submit(inside);
  ASSERT_TRUE(good.ok()) << good.status();
  auto done = cluster->WaitForEnd(good->job_id(), absl::Seconds(60));
  ASSERT_TRUE(done.ok()) << cluster->Logs();
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason();
  EXPECT_FALSE(std::filesystem::is_empty(dir + "/ckpt/run"));
  EXPECT_TRUE(cluster->worker("w0")->running());
  cluster.reset();
  std::filesystem::remove_all(dir);
}

// Secure by default: with the daemons' own flags, a job cannot read a file outside the data
// roots (/etc/shadow, read as root, once printed in a GPT's sample) nor write checkpoints or
// exports outside the checkpoint roots; the refusal names the field and the roots, and says
// nothing of the file itself.
TEST(TrustTest, OutOfTheBoxJobsReadAndWriteOnlyInsideTheDefaultRoots) {
  auto started = Cluster::Start({}, "", {}, /*test_roots=*/false);
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = *std::move(started);
  ASSERT_TRUE(cluster->StartWorker("w0").ok());
  v1::JobSpec gpt = testing::SmallGptSpec();
  gpt.mutable_dataset()->set_path("/usr/share/games/fortunes");
  gpt.set_max_steps(300);
  gpt.mutable_model()->mutable_gpt()->set_context_length(8);
  gpt.mutable_sample()->set_max_tokens(64);
  struct Case {
    std::string field;
    std::function<void(v1::JobSpec*)> set;
  } cases[] = {
      {"dataset.path", [](v1::JobSpec* s) { s->mutable_dataset()->set_path("/etc/shadow"); }},
      {"dataset.path",
       [](v1::JobSpec* s) {
         s->mutable_dataset()->set_type("tokens");
         s->mutable_dataset()->set_path("/etc/passwd");
         s->mutable_dataset()->set_validation_path("/etc/passwd");
       }},
      {"dataset.path",
       [](v1::JobSpec* s) {
         s->mutable_dataset()->set_path("/usr/share/datasets/../../../etc/shadow");
       }},
      {"checkpoint_dir",
       [](v1::JobSpec* s) {
         s->set_checkpoint_every_steps(10);
         s->set_checkpoint_dir("/root/lockstep-was-here");
       }},
      {"output_dir", [](v1::JobSpec* s) { s->set_output_dir("/etc/lockstep-was-here"); }},
  };
  for (const Case& c : cases) {
    v1::JobSpec spec = gpt;
    c.set(&spec);
    auto refused = cluster->Submit(spec);
    ASSERT_FALSE(refused.ok()) << c.field << ": the job was accepted";
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
    const std::string message(refused.status().message());
    EXPECT_NE(message.find(c.field), std::string::npos) << message;
    EXPECT_NE(message.find(c.field == "dataset.path" ? "/usr/share/datasets"
                                                     : "/var/lib/lockstep/checkpoints"),
              std::string::npos)
        << "the refusal names the allowed directories: " << message;
    EXPECT_EQ(message.find("root:"), std::string::npos) << message;
    EXPECT_EQ(message.find("bytes"), std::string::npos) << message;
  }
  // The examples' own data is inside the defaults.
  v1::JobSpec fortunes = gpt;
  fortunes.set_max_steps(5);
  if (std::filesystem::exists("/usr/share/games/fortunes")) {
    auto job = cluster->Submit(fortunes);
    ASSERT_TRUE(job.ok()) << job.status();
    auto done = cluster->WaitForEnd(job->job_id(), absl::Seconds(120));
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << cluster->Logs();
  }
}

// A cancelled job stops its worker's data loading at once: the worker is held just before the
// load (test hook), the job is cancelled there, and the load gives up at its first check
// instead of building the whole data set; the next job gets the worker.
TEST(TrustTest, CancelStopsDataLoading) {
  auto started = Cluster::Start();
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<Cluster> cluster = *std::move(started);
  ASSERT_TRUE(cluster->StartWorker("w0", {"--test_hooks=before_loading"}).ok());
  v1::JobSpec big = testing::SyntheticJob(1, 1, 10);
  big.mutable_dataset()->mutable_synthetic()->set_train_samples(500'000);
  big.mutable_dataset()->mutable_synthetic()->set_input_dim(256);
  auto job = cluster->Submit(big);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(cluster->WaitForHook("w0", "before_loading", absl::Seconds(60)).ok());
  {
    grpc::ClientContext context;
    v1::CancelJobRequest cancel;
    cancel.set_job_id(job->job_id());
    v1::Job cancelled;
    ASSERT_TRUE(cluster->jobs().CancelJob(&context, cancel, &cancelled).ok());
  }
  auto next = cluster->Submit(testing::SyntheticJob(1, 1, 10));
  ASSERT_TRUE(next.ok()) << next.status();
  auto done = cluster->WaitForEnd(next->job_id(), absl::Seconds(120));
  ASSERT_TRUE(done.ok()) << cluster->Logs();
  EXPECT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason();
  EXPECT_NE(cluster->Logs().find("the job ended while its data set was loading"), std::string::npos)
      << cluster->Logs();
}

}  // namespace
}  // namespace lockstep
