// lockstepctl's command logic against a fake JobService stub: formatting, watch resume and
// backoff, exit codes, spec parsing.
#include <cstdlib>
#include <deque>
#include <fstream>
#include <sstream>

#include "cli/commands.h"
#include "cli/format.h"
#include "common/utf8.h"
#include "cli/invocation.h"
#include "cli/watch_printer.h"
#include "common/auth.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lockstep::cli {
namespace {
using ::testing::HasSubstr;

class FakeReader : public grpc::ClientReaderInterface<v1::JobEvent> {
 public:
  FakeReader(std::vector<v1::JobEvent> events, grpc::Status end)
      : events_(events.begin(), events.end()), end_(end) {}
  bool Read(v1::JobEvent* e) override {
    if (events_.empty()) return false;
    *e = events_.front();
    events_.pop_front();
    return true;
  }
  grpc::Status Finish() override { return end_; }
  bool NextMessageSize(uint32_t* sz) override {
    *sz = 1 << 20;
    return !events_.empty();
  }
  void WaitForInitialMetadata() override {}

 private:
  std::deque<v1::JobEvent> events_;
  grpc::Status end_;
};

struct Stream {
  std::vector<v1::JobEvent> events;
  grpc::Status end;
};

class FakeStub : public v1::JobService::StubInterface {
 public:
  std::deque<Stream> streams;
  std::vector<int64_t> from_sequences;
  v1::Job get_job;
  grpc::Status get_status;
  v1::ListJobsResponse jobs;
  v1::ListWorkersResponse workers;
  bool saw_deadline = false;

  grpc::Status SubmitJob(grpc::ClientContext* c, const v1::SubmitJobRequest& r,
                         v1::Job* j) override {
    saw_deadline = c->deadline() < std::chrono::system_clock::now() + std::chrono::hours(1);
    j->set_job_id("job-7");
    *j->mutable_spec() = r.spec();
    return grpc::Status::OK;
  }
  grpc::Status GetJob(grpc::ClientContext*, const v1::GetJobRequest&, v1::Job* j) override {
    *j = get_job;
    return get_status;
  }
  // Serves `jobs` (newest first) in pages of `jobs_per_page`, like the coordinator.
  grpc::Status ListJobs(grpc::ClientContext*, const v1::ListJobsRequest& request,
                        v1::ListJobsResponse* r) override {
    int from = 0;
    if (!request.page_token().empty()) from = std::stoi(request.page_token());
    for (int i = from; i < jobs.jobs_size() && i < from + jobs_per_page; ++i) {
      *r->add_jobs() = jobs.jobs(i);
    }
    if (from + jobs_per_page < jobs.jobs_size()) {
      r->set_next_page_token(std::to_string(from + jobs_per_page));
    }
    r->set_total_jobs(jobs.jobs_size());
    ++list_calls;
    return grpc::Status::OK;
  }
  int jobs_per_page = 1000;
  int list_calls = 0;
  grpc::Status CancelJob(grpc::ClientContext*, const v1::CancelJobRequest&, v1::Job*) override {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "job job-1 has already ended");
  }
  grpc::Status ListWorkers(grpc::ClientContext*, const v1::ListWorkersRequest&,
                           v1::ListWorkersResponse* r) override {
    *r = workers;
    return grpc::Status::OK;
  }
  grpc::Status GetTrainingCurve(grpc::ClientContext*, const v1::GetTrainingCurveRequest&,
                                v1::TrainingCurve*) override {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "not used by lockstepctl");
  }

 private:
  grpc::ClientReaderInterface<v1::JobEvent>* WatchJobRaw(grpc::ClientContext*,
                                                         const v1::WatchJobRequest& r) override {
    from_sequences.push_back(r.from_sequence());
    if (streams.empty())
      return new FakeReader({}, grpc::Status(grpc::StatusCode::UNAVAILABLE, "down"));
    Stream s = streams.front();
    streams.pop_front();
    std::vector<v1::JobEvent> evs;
    for (auto& e : s.events)
      if (e.sequence() >= r.from_sequence()) evs.push_back(e);
    return new FakeReader(evs, s.end);
  }
#define NOASYNC(Resp, Req, Name)                                           \
  grpc::ClientAsyncResponseReaderInterface<Resp>* Async##Name##Raw(        \
      grpc::ClientContext*, const Req&, grpc::CompletionQueue*) override { \
    return nullptr;                                                        \
  }                                                                        \
  grpc::ClientAsyncResponseReaderInterface<Resp>* PrepareAsync##Name##Raw( \
      grpc::ClientContext*, const Req&, grpc::CompletionQueue*) override { \
    return nullptr;                                                        \
  }
  NOASYNC(v1::Job, v1::SubmitJobRequest, SubmitJob)
  NOASYNC(v1::Job, v1::GetJobRequest, GetJob)
  NOASYNC(v1::ListJobsResponse, v1::ListJobsRequest, ListJobs)
  NOASYNC(v1::Job, v1::CancelJobRequest, CancelJob)
  NOASYNC(v1::ListWorkersResponse, v1::ListWorkersRequest, ListWorkers)
  NOASYNC(v1::TrainingCurve, v1::GetTrainingCurveRequest, GetTrainingCurve)
  grpc::ClientAsyncReaderInterface<v1::JobEvent>* AsyncWatchJobRaw(grpc::ClientContext*,
                                                                   const v1::WatchJobRequest&,
                                                                   grpc::CompletionQueue*,
                                                                   void*) override {
    return nullptr;
  }
  grpc::ClientAsyncReaderInterface<v1::JobEvent>* PrepareAsyncWatchJobRaw(
      grpc::ClientContext*, const v1::WatchJobRequest&, grpc::CompletionQueue*) override {
    return nullptr;
  }
};

v1::JobEvent Ev(int64_t seq, v1::JobEvent::Kind kind, v1::JobState state, int64_t step,
                const std::string& msg = "") {
  v1::JobEvent e;
  e.set_sequence(seq);
  e.set_kind(kind);
  e.set_message(msg);
  e.set_time_unix_ms(1'700'000'000'000 + seq * 1000);
  v1::Job* j = e.mutable_job();
  j->set_job_id("job-1");
  j->set_state(state);
  j->set_step(step);
  j->set_total_steps(468);
  j->set_loss(0.5123);
  j->set_samples_per_second(29345.4);
  j->set_eta_ms(12'300);
  j->set_submit_time_unix_ms(1'700'000'000'000);
  j->set_start_time_unix_ms(1'700'000'001'000);
  if (IsTerminal(state)) j->set_end_time_unix_ms(1'700'000'063'500);
  return e;
}

TEST(Format, Basics) {
  EXPECT_EQ(ShortDuration(absl::Milliseconds(850)), "850ms");
  EXPECT_EQ(ShortDuration(absl::Milliseconds(1250)), "1.2s");
  EXPECT_EQ(ShortDuration(absl::Seconds(12)), "12s");
  EXPECT_EQ(ShortDuration(absl::Seconds(62)), "1m02s");
  EXPECT_EQ(ShortDuration(absl::Seconds(7500)), "2h05m");
  EXPECT_EQ(ShortDuration(absl::Hours(76)), "3d04h");
  EXPECT_EQ(ShortDuration(-absl::Seconds(3)), "0ms");
  EXPECT_EQ(FormatThousands(29345), "29,345");
  EXPECT_EQ(FormatThousands(-1234567), "-1,234,567");
  EXPECT_EQ(FormatThousands(999), "999");
  EXPECT_EQ(FormatThousands(0), "0");
  EXPECT_EQ(FormatThousands(INT64_MIN), "-9,223,372,036,854,775,808");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(100), "100 B");
  EXPECT_EQ(JobStateName(v1::JOB_STATE_RUNNING), "RUNNING");
  EXPECT_EQ(JobStateName(static_cast<v1::JobState>(42)), "STATE_42");
  v1::Job j = Ev(0, v1::JobEvent::PROGRESS, v1::JOB_STATE_RUNNING, 120).job();
  EXPECT_EQ(FormatProgress(j), "step 120/468 (25.6%)  loss 0.5123  29,345 samples/s  ETA 12s");
  v1::JobEvent e =
      Ev(3, v1::JobEvent::MEMBERSHIP, v1::JOB_STATE_RUNNING, 0, "generation 1 formed: w0, w1");
  EXPECT_EQ(FormatEventLine(e, absl::UTCTimeZone()),
            "[22:13:23] job-1 RUNNING: generation 1 formed: w0, w1");
}

// Text from workers and specs cannot forge output lines or drive the terminal.
TEST(Format, UntrustedTextIsEscaped) {
  EXPECT_EQ(EscapeForTerminal("ok"), "ok");
  EXPECT_EQ(EscapeForTerminal("a\nb\x1b[2Jc"), "a\\x0ab\\x1b[2Jc");
  EXPECT_EQ(EscapeForTerminal("caf\xc3\xa9 \xff"), "caf\xc3\xa9 \xef\xbf\xbd");
  v1::JobEvent e;
  e.set_time_unix_ms(0);
  e.mutable_job()->set_job_id("job-1");
  e.mutable_job()->set_state(v1::JOB_STATE_FAILED);
  e.set_message("worker w0 reported: \x1b[31mfake\rjob-9 SUCCEEDED");
  const std::string line = FormatEventLine(e, absl::UTCTimeZone());
  EXPECT_EQ(line.find('\x1b'), std::string::npos) << line;
  EXPECT_EQ(line.find('\r'), std::string::npos) << line;
  EXPECT_NE(line.find("\\x1b[31mfake\\x0djob-9"), std::string::npos) << line;
  v1::Job job;
  job.set_job_id("job-1");
  job.set_state(v1::JOB_STATE_FAILED);
  job.set_reason("bad\nline");
  EXPECT_NE(FormatJobDetail(job, absl::UnixEpoch(), absl::UTCTimeZone()).find("bad\\x0aline"),
            std::string::npos);
}

TEST(Format, Tables) {
  v1::ListJobsResponse r;
  *r.add_jobs() = Ev(0, v1::JobEvent::PROGRESS, v1::JOB_STATE_RUNNING, 120).job();
  *r.add_jobs() = Ev(0, v1::JobEvent::STATE, v1::JOB_STATE_SUCCEEDED, 468).job();
  r.mutable_jobs(1)->set_job_id("job-2");
  r.mutable_jobs(1)->mutable_spec()->set_name("fmnist");
  std::string s = FormatJobList(r, absl::FromUnixMillis(1'700'000'200'000));
  std::cout << s;
  EXPECT_THAT(s, HasSubstr("job-1  -       RUNNING    120/468  0.5123  0        3m20s"));
  EXPECT_THAT(s, HasSubstr("job-2  fmnist  SUCCEEDED  468/468  0.5123  0        1m02s"));
  v1::Job j = r.jobs(1);
  auto* m = j.add_members();
  m->set_rank(0);
  m->set_worker_id("w-1");
  m->set_worker_name("w0");
  m->set_host("h");
  m->set_step(468);
  m->set_parameter_checksum("abcdef0123456789");
  m->set_peak_memory_bytes(300 << 20);
  j.mutable_eval()->set_test_accuracy(0.8731);
  j.mutable_eval()->set_test_samples(10000);
  j.mutable_eval()->set_test_loss(0.3512);
  std::cout << FormatJobDetail(j, absl::FromUnixMillis(1'700'000'200'000), absl::UTCTimeZone());
  std::cout << FormatFinalSummary(j, absl::Now());
  v1::ListWorkersResponse w;
  auto* wi = w.add_workers();
  wi->set_worker_id("w-1");
  wi->set_name("w0");
  wi->set_host("h");
  wi->set_device("cpu");
  wi->set_state("busy");
  wi->set_job_id("job-1");
  wi->set_last_heartbeat_unix_ms(1'700'000'199'500);
  auto* wi2 = w.add_workers();
  wi2->set_worker_id("w-2");
  wi2->set_state("lost");
  std::cout << FormatWorkerList(w, absl::FromUnixMillis(1'700'000'200'000));
}

// Status shows the job's checkpoints (the last good one, the failed writes with the system's
// reason) and marks recoveries the coordinator caused and redone counts that are lower bounds.
TEST(Format, JobDetailShowsCheckpointsAndRecoveryKinds) {
  v1::Job j;
  j.set_job_id("job-3-a1b2c3");
  j.set_state(v1::JOB_STATE_RUNNING);
  j.mutable_spec()->set_checkpoint_every_steps(100);
  v1::CheckpointStatus* c = j.mutable_checkpoints();
  c->set_last_good_step(400);
  c->set_last_good_path("/ckpt/job-3-a1b2c3.step-000000000400.ckpt");
  c->set_last_good_unix_ms(1'700'000'190'000);
  c->set_failed_writes(2);
  c->set_last_failed_step(600);
  c->set_last_error("writing /ckpt/x.tmp: No space left on device");
  v1::Recovery* r = j.add_recovery_history();
  r->set_from_generation(1);
  r->set_to_generation(2);
  r->set_coordinator_caused(true);
  r->set_first_step_unix_ms(1'700'000'100'000);
  r->set_steps_redone(12);
  r->set_steps_redone_lower_bound(true);
  const std::string out =
      FormatJobDetail(j, absl::FromUnixMillis(1'700'000'200'000), absl::UTCTimeZone());
  EXPECT_THAT(out, HasSubstr("last good at step 400 (/ckpt/job-3-a1b2c3.step-000000000400.ckpt"));
  EXPECT_THAT(out, HasSubstr("2 writes failed, the last at step 600: writing /ckpt/x.tmp: No "
                             "space left on device"));
  EXPECT_THAT(out, HasSubstr("coordinator"));
  EXPECT_THAT(out, HasSubstr(">=12"));
}

TEST(Format, WorkerListShowsTheDeviceAndItsMemory) {
  v1::ListWorkersResponse w;
  auto* wi = w.add_workers();
  wi->set_worker_id("w-1");
  wi->set_device("cuda:1");
  wi->set_device_name("NVIDIA H200");
  wi->set_device_uuid("GPU-8a5d3e1f-0001-abcd-ef10-2030405060ff");
  wi->set_free_memory_bytes(int64_t{139} << 30);
  wi->set_total_memory_bytes(int64_t{140} << 30);
  wi->set_state("idle");
  const std::string out = FormatWorkerList(w, absl::FromUnixMillis(1'700'000'200'000));
  EXPECT_THAT(out, HasSubstr("MEMORY FREE"));
  EXPECT_THAT(out, HasSubstr("cuda:1 NVIDIA H200 GPU-8a5d3e1f "));
  EXPECT_THAT(out, HasSubstr("139.0 GiB / 140.0 GiB"));
}

TEST(Format, WorkerListShowsRejectedClients) {
  v1::ListWorkersResponse w;
  auto* r = w.add_rejected_clients();
  r->set_peer("172.18.0.4");
  r->set_client("lockstep-worker w-3");
  r->set_reason("wrong token: it does not match the coordinator's token");
  r->set_count(7);
  r->set_last_unix_ms(1'700'000'198'000);
  const std::string out = FormatWorkerList(w, absl::FromUnixMillis(1'700'000'200'000));
  EXPECT_THAT(out, HasSubstr("No workers."));
  EXPECT_THAT(out, HasSubstr("Rejected clients:"));
  EXPECT_THAT(out, HasSubstr("172.18.0.4"));
  EXPECT_THAT(out, HasSubstr("lockstep-worker w-3"));
  EXPECT_THAT(out, HasSubstr("2.0s ago"));
  EXPECT_THAT(out, HasSubstr("wrong token"));
}

TEST(Token, FilesAreTrimmedAndBadOnesNamed) {
  const std::string dir = ::testing::TempDir();
  std::ofstream(dir + "/good") << "  s3cret-token\n";
  std::ofstream(dir + "/empty") << "\n";
  std::ofstream(dir + "/spaced") << "two words\n";
  absl::StatusOr<std::string> good = ReadTokenFile(dir + "/good");
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(*good, "s3cret-token");
  EXPECT_THAT(std::string(ReadTokenFile(dir + "/empty").status().message()), HasSubstr("empty"));
  EXPECT_THAT(std::string(ReadTokenFile(dir + "/spaced").status().message()),
              HasSubstr("printable ASCII"));
  absl::Status missing = ReadTokenFile(dir + "/nope").status();
  EXPECT_THAT(std::string(missing.message()), HasSubstr(dir + "/nope"));
  // The flag wins over the environment.
  setenv("LOCKSTEP_TOKEN", "from-env", 1);
  EXPECT_EQ(ResolveToken(dir + "/good").value_or(""), "s3cret-token");
  EXPECT_EQ(ResolveToken("").value_or(""), "from-env");
  unsetenv("LOCKSTEP_TOKEN");
  EXPECT_EQ(ResolveToken("").value_or("?"), "");
}

CommandOptions TestOptions(FakeClock* clock, std::vector<absl::Duration>* sleeps) {
  CommandOptions o;
  o.clock = clock;
  o.sleep = [sleeps](absl::Duration d) { sleeps->push_back(d); };
  o.time_zone = absl::UTCTimeZone();
  return o;
}

// What `lockstepctl watch job-1` did against a fake stub, with a fake clock and recorded
// sleeps instead of real waits.
struct WatchRun {
  int rc = -1;
  std::string out, err;
  std::vector<absl::Duration> sleeps;
};
WatchRun RunWatch(FakeStub& stub) {
  FakeClock clock;
  WatchRun run;
  std::ostringstream out, err;
  Invocation inv;
  inv.command = Command::kWatch;
  inv.job_id = "job-1";
  run.rc = RunCommand(inv, stub, TestOptions(&clock, &run.sleeps), out, err);
  run.out = out.str();
  run.err = err.str();
  return run;
}

TEST(Watch, ResumesAfterUnavailableAndSucceeds) {
  FakeStub stub;
  std::vector<v1::JobEvent> all = {
      Ev(0, v1::JobEvent::STATE, v1::JOB_STATE_PENDING, 0, "submitted"),
      Ev(1, v1::JobEvent::STATE, v1::JOB_STATE_RUNNING, 0, "running"),
      Ev(2, v1::JobEvent::PROGRESS, v1::JOB_STATE_RUNNING, 100),
      Ev(3, v1::JobEvent::PROGRESS, v1::JOB_STATE_RUNNING, 200),
      Ev(4, v1::JobEvent::PROGRESS, v1::JOB_STATE_RUNNING, 468),
      Ev(5, v1::JobEvent::STATE, v1::JOB_STATE_SUCCEEDED, 468, "trained 468 steps")};
  all[5].mutable_job()->mutable_eval()->set_test_accuracy(0.8731);
  all[5].mutable_job()->mutable_eval()->set_test_samples(10000);
  all[5].mutable_job()->mutable_eval()->set_test_loss(0.3512);
  stub.streams.push_back(
      {{all[0], all[1], all[2]}, grpc::Status(grpc::StatusCode::UNAVAILABLE, "x")});
  stub.streams.push_back({{}, grpc::Status(grpc::StatusCode::UNAVAILABLE, "x")});
  stub.streams.push_back({all, grpc::Status::OK});
  WatchRun run = RunWatch(stub);
  std::cout << run.out << "--err--\n" << run.err;
  EXPECT_EQ(run.rc, 0);
  EXPECT_THAT(stub.from_sequences, ::testing::ElementsAre(0, 3, 3));
  EXPECT_THAT(run.sleeps, ::testing::ElementsAre(absl::Milliseconds(500), absl::Seconds(1)));
  EXPECT_THAT(run.out, HasSubstr("test accuracy 0.8731 (10000 samples), test loss 0.3512"));
  EXPECT_THAT(run.out, HasSubstr("step 468/468 (100.0%)"));
  EXPECT_THAT(run.out, HasSubstr("job-1 SUCCEEDED in 1m02s"));
}

TEST(Watch, GivesUpAfterRetries) {
  FakeStub stub;
  WatchRun run = RunWatch(stub);
  EXPECT_EQ(run.rc, 3);
  EXPECT_EQ(run.sleeps.size(), 5u);
  EXPECT_EQ(run.sleeps.back(), absl::Seconds(8));
  EXPECT_THAT(run.err, HasSubstr("lockstepctl: UNAVAILABLE: down\n"));
}

TEST(Watch, NotFoundIsNotRetried) {
  FakeStub stub;
  stub.streams.push_back(
      {{}, grpc::Status(grpc::StatusCode::NOT_FOUND, "job job-1 does not exist")});
  WatchRun run = RunWatch(stub);
  EXPECT_EQ(run.rc, 3);
  EXPECT_TRUE(run.sleeps.empty());
  EXPECT_EQ(run.err, "lockstepctl: NOT_FOUND: job job-1 does not exist\n");
}

TEST(Watch, FailedExitsOneWithReason) {
  FakeStub stub;
  v1::JobEvent e = Ev(0, v1::JobEvent::STATE, v1::JOB_STATE_FAILED, 10, "worker w1 lost");
  e.mutable_job()->set_reason("worker w1 lost");
  stub.streams.push_back({{e}, grpc::Status::OK});
  WatchRun run = RunWatch(stub);
  EXPECT_EQ(run.rc, 1);
  EXPECT_THAT(run.out, HasSubstr("job-1 FAILED after 1m02s: worker w1 lost"));
}

TEST(Watch, StreamEndsEarlyFallsBackToGetJob) {
  FakeStub stub;
  stub.streams.push_back(
      {{Ev(0, v1::JobEvent::STATE, v1::JOB_STATE_RUNNING, 0, "running")}, grpc::Status::OK});
  stub.get_job = Ev(9, v1::JobEvent::STATE, v1::JOB_STATE_CANCELLED, 5).job();
  WatchRun run = RunWatch(stub);
  EXPECT_EQ(run.rc, 1);
  EXPECT_THAT(run.out, HasSubstr("job-1 CANCELLED after"));
}

TEST(Watch, ReplacedJobIsNotFollowed) {
  FakeStub stub;
  stub.streams.push_back({{Ev(0, v1::JobEvent::STATE, v1::JOB_STATE_RUNNING, 0, "running")},
                          grpc::Status(grpc::StatusCode::UNAVAILABLE, "x")});
  v1::JobEvent other = Ev(1, v1::JobEvent::STATE, v1::JOB_STATE_SUCCEEDED, 5, "done");
  other.mutable_job()->set_submit_time_unix_ms(1'800'000'000'000);
  stub.streams.push_back({{other}, grpc::Status::OK});
  WatchRun run = RunWatch(stub);
  EXPECT_EQ(run.rc, 3);
  EXPECT_THAT(run.err, HasSubstr("NOT_FOUND: job job-1 no longer exists"));
  EXPECT_THAT(run.out, ::testing::Not(HasSubstr("SUCCEEDED")));
}

TEST(WatchPrinter, ThrottlesProgressAndAlwaysPrintsLast) {
  FakeClock clock;
  std::ostringstream out;
  WatchPrinter p(OutputFormat::kTable, false, &clock, absl::UTCTimeZone(), out);
  for (int s = 1; s <= 10; ++s) {
    p.OnEvent(Ev(s, v1::JobEvent::PROGRESS, v1::JOB_STATE_RUNNING, s));
    clock.Advance(absl::Milliseconds(300));
  }
  p.Finish(Ev(11, v1::JobEvent::STATE, v1::JOB_STATE_SUCCEEDED, 10).job());
  std::cout << out.str();
  std::string o = out.str();
  EXPECT_THAT(o, HasSubstr("step 1/468"));
  EXPECT_THAT(o, HasSubstr("step 5/468"));
  EXPECT_THAT(o, HasSubstr("step 9/468"));
  EXPECT_THAT(o, HasSubstr("step 10/468"));
  EXPECT_THAT(o, ::testing::Not(HasSubstr("step 2/468")));
}

TEST(WatchPrinter, Live) {
  FakeClock clock;
  std::ostringstream out;
  WatchPrinter p(OutputFormat::kTable, true, &clock, absl::UTCTimeZone(), out);
  p.OnEvent(Ev(1, v1::JobEvent::PROGRESS, v1::JOB_STATE_RUNNING, 1));
  p.OnEvent(Ev(2, v1::JobEvent::MEMBERSHIP, v1::JOB_STATE_RUNNING, 1, "gen 2"));
  p.OnEvent(Ev(3, v1::JobEvent::PROGRESS, v1::JOB_STATE_RUNNING, 2));
  p.OnEvent(Ev(4, v1::JobEvent::STATE, v1::JOB_STATE_SUCCEEDED, 2, "done"));
  p.Finish(Ev(4, v1::JobEvent::STATE, v1::JOB_STATE_SUCCEEDED, 2, "done").job());
  std::string o = out.str();
  for (char& c : o)
    if (c == '\x1b') c = 'E';
  std::cout << o;
}

TEST(Invocation, Parse) {
  std::istringstream in("{\"name\":\"a\",\"globalBatchSize\":\"256\"}");
  FlagValues f;
  auto inv = ParseInvocation({"submit", "-"}, f, nullptr, in);
  ASSERT_TRUE(inv.ok()) << inv.status();
  EXPECT_EQ(inv->spec.global_batch_size(), 256);
  EXPECT_EQ(inv->coordinator, "127.0.0.1:7070");
  EXPECT_EQ(ResolveCoordinator("", "h:1"), "h:1");
  EXPECT_EQ(ResolveCoordinator("x:2", "h:1"), "x:2");
  std::istringstream in2("{\"global_batch_size\": 256, \"min_workers\": 1}");
  auto inv2 = ParseInvocation({"submit", "-"}, f, nullptr, in2);
  ASSERT_TRUE(inv2.ok()) << inv2.status();
  EXPECT_EQ(inv2->spec.min_workers(), 1);
}

TEST(Commands, SubmitSetsDeadlineAndCancelError) {
  FakeStub stub;
  FakeClock clock;
  std::vector<absl::Duration> sleeps;
  std::ostringstream out, err;
  Invocation inv;
  inv.command = Command::kSubmit;
  EXPECT_EQ(RunCommand(inv, stub, TestOptions(&clock, &sleeps), out, err), 0);
  EXPECT_EQ(out.str(), "job-7\n");
  EXPECT_TRUE(stub.saw_deadline);
  inv.command = Command::kCancel;
  inv.job_id = "job-1";
  EXPECT_EQ(RunCommand(inv, stub, TestOptions(&clock, &sleeps), out, err), 3);
  EXPECT_EQ(err.str(), "lockstepctl: FAILED_PRECONDITION: job job-1 has already ended\n");
}

// `list` follows the pages to the last one and shows every job, oldest first.
TEST(Commands, ListFollowsEveryPage) {
  FakeStub stub;
  stub.jobs_per_page = 2;
  for (int i = 5; i >= 1; --i) {
    v1::Job* job = stub.jobs.add_jobs();
    job->set_job_id("job-" + std::to_string(i));
    job->set_state(v1::JOB_STATE_SUCCEEDED);
  }
  FakeClock clock;
  std::vector<absl::Duration> sleeps;
  std::ostringstream out, err;
  Invocation inv;
  inv.command = Command::kList;
  ASSERT_EQ(RunCommand(inv, stub, TestOptions(&clock, &sleeps), out, err), 0) << err.str();
  EXPECT_EQ(stub.list_calls, 3);
  size_t at = 0;
  for (int i = 1; i <= 5; ++i) {
    const size_t next = out.str().find("job-" + std::to_string(i) + " ");
    ASSERT_NE(next, std::string::npos) << out.str();
    EXPECT_GT(next, at) << out.str();
    at = next;
  }
}

}  // namespace
}  // namespace lockstep::cli
