// lockstepctl's command logic against a fake JobService stub: formatting, watch resume and
// backoff, exit codes, spec parsing, list against a server that pages in circles, the TLS hints
// and the plaintext-token warning; export of crafted, randomly mutated and valid checkpoints,
// and its refusal to replace files.
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <sstream>

#include "cli/commands.h"
#include "cli/format.h"
#include "cli/invocation.h"
#include "cli/watch_printer.h"
#include "common/hash.h"
#include "common/auth.h"
#include "common/safetensors.h"
#include "common/utf8.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "kernels/cpu_kernels.h"
#include "common/checkpoint.h"

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
    if (list_override) {
      ++list_calls;
      return list_override(request, r);
    }
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
  // When set, answers ListJobs instead of `jobs` (list_calls still counts).
  std::function<grpc::Status(const v1::ListJobsRequest&, v1::ListJobsResponse*)> list_override;
  grpc::Status CancelJob(grpc::ClientContext*, const v1::CancelJobRequest&, v1::Job*) override {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "job job-1 has already ended");
  }
  grpc::Status SuspendJob(grpc::ClientContext*, const v1::SuspendJobRequest& r,
                          v1::Job* j) override {
    j->set_job_id(r.job_id());
    j->set_state(v1::JOB_STATE_SUSPENDED);
    j->set_reason("suspended by a user; its state of step 40 is kept by w0, w1");
    return grpc::Status::OK;
  }
  grpc::Status ResumeJob(grpc::ClientContext*, const v1::ResumeJobRequest& r, v1::Job*) override {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        "job " + r.job_id() + " is not suspended (JOB_STATE_RUNNING)");
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
  // Serves `log_lines` from `first_kept` on, two at a time (so that paging is exercised), and
  // calls `after_logs` after each answer (a follow test appends lines and ends the job there).
  std::vector<v1::LogLine> log_lines;
  int64_t first_kept = 0;
  std::vector<int64_t> log_requests;
  std::function<void()> after_logs;
  grpc::Status GetJobLogs(grpc::ClientContext*, const v1::GetJobLogsRequest& r,
                          v1::JobLogs* out) override {
    log_requests.push_back(r.from_sequence());
    out->set_first_sequence(first_kept);
    int64_t next = std::max(r.from_sequence(), first_kept);
    for (const v1::LogLine& line : log_lines) {
      if (line.sequence() < next) continue;
      if (out->lines_size() == 2) break;
      next = line.sequence() + 1;
      if (r.has_rank() && line.rank() != r.rank()) continue;
      *out->add_lines() = line;
    }
    out->set_next_sequence(next);
    if (after_logs) after_logs();
    return grpc::Status::OK;
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
  NOASYNC(v1::Job, v1::SuspendJobRequest, SuspendJob)
  NOASYNC(v1::Job, v1::ResumeJobRequest, ResumeJob)
  NOASYNC(v1::ListWorkersResponse, v1::ListWorkersRequest, ListWorkers)
  NOASYNC(v1::TrainingCurve, v1::GetTrainingCurveRequest, GetTrainingCurve)
  NOASYNC(v1::JobLogs, v1::GetJobLogsRequest, GetJobLogs)
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
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanBytes(100), "100 B");
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
  // What rank 0 wrote keeps its lines but not its control bytes; a missing sample says why.
  job.set_state(v1::JOB_STATE_SUCCEEDED);
  job.mutable_sample()->set_text("first line\n\x1b[2Jsecond");
  job.set_sample_error("");
  std::string detail = FormatJobDetail(job, absl::UnixEpoch(), absl::UTCTimeZone());
  EXPECT_EQ(detail.find('\x1b'), std::string::npos) << detail;
  EXPECT_NE(detail.find("  | first line\n  | \\x1b[2Jsecond"), std::string::npos) << detail;
  std::string summary = FormatFinalSummary(job, absl::UnixEpoch());
  EXPECT_EQ(summary.find('\x1b'), std::string::npos) << summary;
  job.clear_sample();
  job.set_sample_error("not written: rank 0, w0 (w-1), was lost before writing it");
  detail = FormatJobDetail(job, absl::UnixEpoch(), absl::UTCTimeZone());
  EXPECT_NE(detail.find("No sample"), std::string::npos) << detail;
  EXPECT_NE(detail.find("rank 0, w0 (w-1), was lost"), std::string::npos) << detail;
  summary = FormatFinalSummary(job, absl::UnixEpoch());
  EXPECT_NE(summary.find("no sample: not written: rank 0"), std::string::npos) << summary;
}

TEST(Format, QueueListsPositionPriorityWorkersWaitAndWhy) {
  v1::ListJobsResponse q;
  EXPECT_EQ(FormatQueue(q, absl::UnixEpoch()), "No queued jobs.\n");
  for (int i = 0; i < 2; ++i) {
    v1::Job* j = q.add_jobs();
    j->set_job_id(absl::StrCat("job-", 7 + i));
    j->set_state(v1::JOB_STATE_PENDING);
    j->set_submit_time_unix_ms(1'700'000'000'000);
    j->mutable_spec()->set_priority(i == 0 ? 10 : 0);
    j->mutable_spec()->set_min_workers(2);
    j->mutable_spec()->set_max_workers(4);
  }
  q.mutable_jobs(0)->set_reason("waiting for 2 idle cpu workers (1 idle)");
  q.mutable_jobs(1)->set_reason("queued behind job-7 (priority 10), which is waiting");
  q.mutable_jobs(0)->set_would_preempt("suspend job-3 (priority 0)");
  const std::string s = FormatQueue(q, absl::FromUnixMillis(1'700'000'090'000));
  std::cout << s;
  EXPECT_THAT(s, HasSubstr("#  JOB    NAME  STATE    PRIORITY  WORKERS  WAITING  WOULD PREEMPT               WHY"));
  EXPECT_THAT(s, HasSubstr("1  job-7  -     PENDING  10        2-4      1m30s    suspend job-3 (priority 0)  waiting for 2 idle"));
  EXPECT_THAT(s, HasSubstr("2  job-8  -     PENDING  0         2-4      1m30s    -                           queued behind job-7"));
}

TEST(Format, Tables) {
  v1::ListJobsResponse r;
  *r.add_jobs() = Ev(0, v1::JobEvent::PROGRESS, v1::JOB_STATE_RUNNING, 120).job();
  *r.add_jobs() = Ev(0, v1::JobEvent::STATE, v1::JOB_STATE_SUCCEEDED, 468).job();
  r.mutable_jobs(1)->set_job_id("job-2");
  r.mutable_jobs(1)->mutable_spec()->set_name("fmnist");
  std::string s = FormatJobList(r, absl::FromUnixMillis(1'700'000'200'000));
  std::cout << s;
  EXPECT_THAT(s, HasSubstr("job-1  -       RUNNING    0         120/468  0.5123  0        3m20s"));
  EXPECT_THAT(s, HasSubstr("job-2  fmnist  SUCCEEDED  0         468/468  0.5123  0        1m02s"));
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

TEST(Commands, SuspendSaysWhereTheStateIsAndResumeErrorsExitThree) {
  FakeStub stub;
  FakeClock clock;
  std::vector<absl::Duration> sleeps;
  std::ostringstream out, err;
  Invocation inv;
  inv.command = Command::kSuspend;
  inv.job_id = "job-3";
  EXPECT_EQ(RunCommand(inv, stub, TestOptions(&clock, &sleeps), out, err), 0);
  EXPECT_EQ(out.str(),
            "suspended job-3: suspended by a user; its state of step 40 is kept by w0, w1\n");
  inv.command = Command::kResume;
  EXPECT_EQ(RunCommand(inv, stub, TestOptions(&clock, &sleeps), out, err), 3);
  EXPECT_EQ(err.str(),
            "lockstepctl: FAILED_PRECONDITION: job job-3 is not suspended (JOB_STATE_RUNNING)\n");
  // `status` of a suspended job says by whom, since when, and who keeps its state.
  v1::Job job;
  job.set_job_id("job-3");
  job.set_state(v1::JOB_STATE_SUSPENDED);
  job.mutable_suspension()->set_by_job("job-7");
  job.mutable_suspension()->set_step(40);
  job.mutable_suspension()->set_since_unix_ms(60'000);
  job.mutable_suspension()->add_holders("w0");
  job.mutable_suspension()->add_holders("w1");
  const std::string detail =
      FormatJobDetail(job, absl::FromUnixSeconds(150), absl::UTCTimeZone());
  EXPECT_NE(detail.find("Suspended:"), std::string::npos) << detail;
  EXPECT_NE(detail.find("for job-7, 1m30s ago, at step 40; state kept by w0, w1"),
            std::string::npos)
      << detail;
  // Both take exactly one JOB.
  FlagValues f;
  std::istringstream in;
  for (const char* command : {"suspend", "resume"}) {
    EXPECT_FALSE(ParseInvocation({command}, f, nullptr, in).ok()) << command;
    auto parsed = ParseInvocation({command, "job-9"}, f, nullptr, in);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(parsed->job_id, "job-9");
  }
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

TEST(Invocation, ForceOnlyAppliesToExport) {
  std::istringstream in;
  FlagValues f;
  f.force = true;
  auto exported = ParseInvocation({"export", "a.ckpt"}, f, nullptr, in);
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_TRUE(exported->force);
  auto listed = ParseInvocation({"list"}, f, nullptr, in);
  EXPECT_EQ(listed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(listed.status().message()), HasSubstr("--force"));
  auto queue = ParseInvocation({"queue"}, FlagValues(), nullptr, in);
  ASSERT_TRUE(queue.ok()) << queue.status();
  EXPECT_EQ(queue->command, Command::kQueue);
  EXPECT_EQ(ParseInvocation({"queue", "extra"}, FlagValues(), nullptr, in).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A coordinator (or something posing as one) that repeats a page token, a job, or sends empty
// pages with a token would keep `list` paging forever; it stops with INTERNAL saying why. The
// fake refuses after 50 calls, so a client that pages forever fails here instead of hanging.
TEST(Commands, ListStopsWhenTheCoordinatorPagesInCircles) {
  using Pages = std::function<void(int call, v1::ListJobsResponse*)>;
  auto job = [](v1::ListJobsResponse* r, const std::string& id) { r->add_jobs()->set_job_id(id); };
  struct Case {
    std::string what;
    Pages pages;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"the same token again",
       [&](int n, v1::ListJobsResponse* r) {
         job(r, absl::StrCat("job-", n));
         r->set_next_page_token("same");
       },
       "repeated the page token \"same\""},
      {"tokens in a cycle",
       [&](int n, v1::ListJobsResponse* r) {
         job(r, absl::StrCat("job-", n));
         r->set_next_page_token(n % 2 == 0 ? "a" : "b");
       },
       "repeated the page token"},
      {"empty pages",
       [&](int n, v1::ListJobsResponse* r) { r->set_next_page_token(absl::StrCat(n)); },
       "without jobs"},
      {"the same job under new tokens",
       [&](int n, v1::ListJobsResponse* r) {
         job(r, "job-1");
         r->set_next_page_token(absl::StrCat(n));
       },
       "listed job job-1 twice"},
  };
  for (const Case& c : cases) {
    FakeStub stub;
    stub.list_override = [&](const v1::ListJobsRequest&, v1::ListJobsResponse* r) {
      if (stub.list_calls > 50) {
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "the client paged forever");
      }
      c.pages(stub.list_calls, r);
      return grpc::Status::OK;
    };
    FakeClock clock;
    std::vector<absl::Duration> sleeps;
    std::ostringstream out, err;
    Invocation inv;
    inv.command = Command::kList;
    EXPECT_EQ(RunCommand(inv, stub, TestOptions(&clock, &sleeps), out, err), kExitRpcError)
        << c.what;
    EXPECT_THAT(err.str(), HasSubstr("INTERNAL")) << c.what;
    EXPECT_THAT(err.str(), HasSubstr(c.expected)) << c.what;
    EXPECT_LE(stub.list_calls, 3) << c.what;
    EXPECT_EQ(out.str(), "") << c.what;
  }
}

// New tokens and new jobs forever: bounded by kMaxListPages.
TEST(Commands, ListFollowsAtMostMaxListPages) {
  FakeStub stub;
  stub.list_override = [&](const v1::ListJobsRequest&, v1::ListJobsResponse* r) {
    if (stub.list_calls > kMaxListPages + 10) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "the client paged forever");
    }
    r->add_jobs()->set_job_id(absl::StrCat("job-", stub.list_calls));
    r->set_next_page_token(absl::StrCat(stub.list_calls));
    return grpc::Status::OK;
  };
  FakeClock clock;
  std::vector<absl::Duration> sleeps;
  std::ostringstream out, err;
  absl::Status status = ListJobs(stub, TestOptions(&clock, &sleeps), out);
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(absl::StrCat("more than ", kMaxListPages)));
  EXPECT_EQ(stub.list_calls, kMaxListPages);
}

// gRPC 1.51's texts for refused TLS handshakes, as lockstepctl receives them (the first ones
// observed against a coordinator with --tls_ca, i.e. requiring client certificates): the hint
// names the flag that is wrong, not every TLS flag.
TEST(Commands, UnavailableHintNamesTheFlagThatIsWrong) {
  const std::string failed = "failed to connect to all addresses; last error: ";
  const std::string closed = failed + "UNAVAILABLE: ipv4:127.0.0.1:4242: Socket closed";
  const std::string handshake =
      failed + "UNKNOWN: ipv4:127.0.0.1:4242: Ssl handshake failed: SSL_ERROR_SSL: ";
  struct Case {
    std::string what;
    bool tls;
    bool client_cert;
    std::string message;
    std::string names;      // the hint says this
    std::string not_named;  // and not this
  };
  const std::vector<Case> cases = {
      {"no client certificate (TLS 1.3)", true, false, closed, "pass --tls_cert and --tls_key",
       "--tls_ca"},
      {"a client certificate of another CA, or expired (TLS 1.3)", true, true, closed,
       "refused this client's certificate: --tls_cert/--tls_key", "--tls_ca"},
      {"a refused client certificate (TLS 1.2)", true, true,
       handshake + "error:0A000412:SSL routines::sslv3 alert bad certificate", "--tls_cert",
       "--tls_ca"},
      {"no client certificate (TLS 1.3 alert)", true, false,
       handshake + "error:0A00045C:SSL routines::tlsv13 alert certificate required", "--tls_cert",
       "--tls_ca"},
      {"BoringSSL's spelling", true, true, handshake + "SSLV3_ALERT_CERTIFICATE_EXPIRED",
       "--tls_cert", "--tls_ca"},
      {"a coordinator certificate from an untrusted CA", true, true,
       handshake + "error:0A000086:SSL routines::certificate verify failed", "--tls_ca",
       "--tls_cert"},
      {"a name the coordinator's certificate lacks", true, false,
       failed + "UNKNOWN: ipv4:127.0.0.1:4242: Peer name foo is not in peer certificate",
       "--tls_server_name", "--tls_cert"},
      {"TLS to a plaintext coordinator", true, false,
       handshake + "error:0A00010B:SSL routines::wrong version number", "serves no TLS",
       "--tls_cert/--tls_key signed"},
      {"plaintext to a TLS coordinator", false, false, closed, "pass --tls_ca", ""},
      {"nothing listens", true, false,
       failed + "UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused",
       "is the coordinator running", "TLS"},
  };
  for (const Case& c : cases) {
    const std::string hint =
        UnavailableHint(absl::UnavailableError(c.message), c.tls, c.client_cert);
    EXPECT_THAT(hint, HasSubstr(c.names)) << c.what;
    if (!c.not_named.empty()) {
      EXPECT_THAT(hint, ::testing::Not(HasSubstr(c.not_named))) << c.what;
    }
  }
  // An unknown text keeps the hint that names everything.
  EXPECT_THAT(UnavailableHint(absl::UnavailableError("something new"), true, true),
              HasSubstr("--tls_ca must be the CA"));
  EXPECT_THAT(UnavailableHint(absl::UnavailableError("something new"), false, false),
              HasSubstr("if the coordinator serves TLS, pass --tls_ca"));
}

TEST(Commands, ARefusedClientCertificateIsBlamedOnTheCertificate) {
  FakeStub stub;
  stub.list_override = [](const v1::ListJobsRequest&, v1::ListJobsResponse*) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "failed to connect to all addresses; last error: UNAVAILABLE: "
                        "ipv4:127.0.0.1:4242: Socket closed");
  };
  FakeClock clock;
  std::vector<absl::Duration> sleeps;
  std::ostringstream out, err;
  Invocation inv;
  inv.command = Command::kList;
  CommandOptions options = TestOptions(&clock, &sleeps);
  options.tls = true;
  options.tls_client_cert = true;
  EXPECT_EQ(RunCommand(inv, stub, options, out, err), kExitRpcError);
  EXPECT_THAT(err.str(), HasSubstr("lockstepctl: UNAVAILABLE: failed to connect"));
  EXPECT_THAT(err.str(), HasSubstr("--tls_cert/--tls_key must be signed by the CA"));
  EXPECT_THAT(err.str(), ::testing::Not(HasSubstr("--tls_ca"))) << err.str();
}

// The rule the coordinator applies to its own listening address: a token in plaintext beyond
// loopback is warned about, once, without showing the token.
TEST(Commands, APlaintextTokenBeyondLoopbackIsWarnedAbout) {
  struct Case {
    std::string coordinator;
    std::string token;
    bool tls;
    Command command;
    bool warned;
  };
  const std::vector<Case> cases = {
      {"coordinator.example:7070", "s3cret", false, Command::kList, true},
      {"10.0.0.5:7070", "s3cret", false, Command::kWorkers, true},
      {"coordinator.example:7070", "s3cret", true, Command::kList, false},
      {"coordinator.example:7070", "", false, Command::kList, false},
      {"127.0.0.1:7070", "s3cret", false, Command::kList, false},
      {"localhost:7070", "s3cret", false, Command::kList, false},
      {"[::1]:7070", "s3cret", false, Command::kList, false},
      {"coordinator.example:7070", "s3cret", false, Command::kHelp, false},  // sends nothing
  };
  for (const Case& c : cases) {
    FakeStub stub;  // nothing is dialled: the fake answers
    FakeClock clock;
    std::vector<absl::Duration> sleeps;
    std::ostringstream out, err;
    Invocation inv;
    inv.command = c.command;
    inv.coordinator = c.coordinator;
    inv.token = c.token;
    CommandOptions options = TestOptions(&clock, &sleeps);
    options.tls = c.tls;
    EXPECT_EQ(RunCommand(inv, stub, options, out, err), kExitOk) << c.coordinator << err.str();
    const std::string expected =
        absl::StrCat("lockstepctl: warning: sending the token to ", c.coordinator, " without TLS");
    if (c.warned) {
      EXPECT_THAT(err.str(), HasSubstr(expected));
      EXPECT_EQ(err.str().find("warning"), err.str().rfind("warning")) << "once";
      EXPECT_THAT(err.str(), ::testing::Not(HasSubstr(c.token)));
    } else {
      EXPECT_EQ(err.str(), "") << c.coordinator << " tls=" << c.tls;
    }
  }
}

// ---- export

// The version-3 checkpoint layout (common/checkpoint.cc; checkpoint_test checks the same
// offsets against WriteCheckpoint): num_params at 96, the checksum at 112, the manifest's length
// at 120, the manifest from 128. The checksum covers the file with its own field zeroed.
constexpr size_t kNumParamsAt = 96;
constexpr size_t kChecksumAt = 112;
constexpr size_t kManifestAt = 128;

void Put64(std::string& bytes, size_t at, uint64_t value) {
  std::memcpy(bytes.data() + at, &value, sizeof(value));
}
void Seal(std::string& bytes) {
  if (bytes.size() < kChecksumAt + 8) return;
  Put64(bytes, kChecksumAt, 0);
  Put64(bytes, kChecksumAt, Fnv1a64(bytes.data(), bytes.size()));
}
std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// "w" [2, 3] then "b" [3]: 9 parameters, and a configuration.
v1::ModelManifest SmallManifest() {
  v1::ModelManifest m;
  m.set_architecture("mlp/test");
  m.set_config_json("{\"model_type\": \"test\", \"n\": 3}");
  v1::TensorInfo* w = m.add_tensors();
  w->set_name("w");
  w->add_shape(2);
  w->add_shape(3);
  w->set_offset(0);
  v1::TensorInfo* b = m.add_tensors();
  b->set_name("b");
  b->add_shape(3);
  b->set_offset(6);
  return m;
}

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/export-", getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  // A checkpoint (a new file each call) of `num_params` parameters with `manifest` as bytes.
  std::string Checkpoint(const std::string& manifest, size_t num_params = 9,
                         const std::string& job = "job-1-abc") {
    CheckpointData d;
    d.step = ++step_;
    d.job_id = job;
    d.manifest = manifest;
    for (size_t i = 0; i < num_params; ++i) d.params.push_back(0.5f * i - 1);
    d.optimizer_state = {1, 2};
    absl::StatusOr<std::string> path = WriteCheckpoint(dir_ + "/ckpt", d, 1000);
    EXPECT_TRUE(path.ok()) << path.status();
    return path.value_or("");
  }
  std::string Checkpoint(const v1::ModelManifest& manifest, size_t num_params = 9,
                         const std::string& job = "job-1-abc") {
    return Checkpoint(manifest.SerializeAsString(), num_params, job);
  }
  int Export(const std::string& checkpoint, const std::string& output, bool force,
             std::string* err_text = nullptr) {
    FakeStub stub;
    FakeClock clock;
    std::vector<absl::Duration> sleeps;
    std::ostringstream out, err;
    Invocation inv;
    inv.command = Command::kExport;
    inv.checkpoint = checkpoint;
    inv.export_output = output;
    inv.force = force;
    const int rc = RunCommand(inv, stub, TestOptions(&clock, &sleeps), out, err);
    if (err_text != nullptr) *err_text = err.str();
    return rc;
  }
  std::string dir_;
  int64_t step_ = 0;
};

// The safetensors file at `path` for `num_params` parameters: its size agrees with its header,
// and the header is a JSON object with exactly one key per tensor plus "__metadata__", each
// tensor's byte range inside the data.
void ExpectWellFormedSafetensors(const std::string& path, size_t num_params,
                                 const std::string& context) {
  const std::string bytes = ReadBytes(path);
  ASSERT_GE(bytes.size(), 8u) << context;
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes.data(), 8);
  ASSERT_EQ(bytes.size(), 8 + header_bytes + num_params * sizeof(float)) << context;
  google::protobuf::Struct header;
  ASSERT_TRUE(
      google::protobuf::util::JsonStringToMessage(bytes.substr(8, header_bytes), &header).ok())
      << context << ": " << bytes.substr(8, header_bytes);
  ASSERT_TRUE(header.fields().contains("__metadata__")) << context;
  const std::string json = bytes.substr(8, header_bytes);
  size_t keys = 0;  // "dtype" appears once per tensor
  for (size_t at = json.find("\"dtype\""); at != std::string::npos;
       at = json.find("\"dtype\"", at + 1)) {
    ++keys;
  }
  EXPECT_EQ(static_cast<size_t>(header.fields_size()), keys + 1)
      << context << ": a repeated key: " << json;
  for (const auto& [name, value] : header.fields()) {
    if (name == "__metadata__") continue;
    const auto& offsets = value.struct_value().fields().at("data_offsets").list_value();
    ASSERT_EQ(offsets.values_size(), 2) << context;
    EXPECT_LE(offsets.values(0).number_value(), offsets.values(1).number_value()) << context;
    EXPECT_LE(offsets.values(1).number_value(), num_params * sizeof(float)) << context;
  }
}

TEST_F(ExportTest, WritesTheModelAndConfigAndReplacesThemOnlyWithForce) {
  const std::string checkpoint = Checkpoint(SmallManifest());
  const std::string model = dir_ + "/out/model.safetensors";
  const std::string config = dir_ + "/out/config.json";
  std::string err;
  ASSERT_EQ(Export(checkpoint, model, false, &err), kExitOk) << err;
  ExpectWellFormedSafetensors(model, 9, "export");
  EXPECT_EQ(ReadBytes(config), SmallManifest().config_json() + "\n");

  // A second export would replace both: refused, naming the file and --force, nothing touched.
  std::ofstream(model, std::ios::trunc) << "precious model";
  ASSERT_EQ(Export(checkpoint, model, false, &err), kExitFileError);
  EXPECT_THAT(err, HasSubstr("ALREADY_EXISTS: " + model + " already exists"));
  EXPECT_THAT(err, HasSubstr("pass --force"));
  EXPECT_EQ(ReadBytes(model), "precious model");
  // A config.json beside a new model is not silently replaced either, and no model appears.
  std::filesystem::remove(model);
  std::ofstream(config, std::ios::trunc) << "precious config";
  ASSERT_EQ(Export(checkpoint, model, false, &err), kExitFileError);
  EXPECT_THAT(err, HasSubstr(config + " already exists"));
  EXPECT_FALSE(std::filesystem::exists(model));
  EXPECT_EQ(ReadBytes(config), "precious config");
  // A dangling link counts as a file: writing through it would create its target.
  std::filesystem::remove(config);
  std::filesystem::create_symlink(dir_ + "/nowhere", model);
  EXPECT_EQ(Export(checkpoint, model, false, &err), kExitFileError);
  EXPECT_THAT(err, HasSubstr(model + " already exists"));
  EXPECT_FALSE(std::filesystem::exists(config));

  // --force replaces both.
  std::ofstream(config, std::ios::trunc) << "precious config";
  ASSERT_EQ(Export(checkpoint, model, true, &err), kExitOk) << err;
  ExpectWellFormedSafetensors(model, 9, "forced export");
  EXPECT_EQ(ReadBytes(config), SmallManifest().config_json() + "\n");
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/nowhere")) << "the link is replaced, not followed";

  // Never a directory, and never config.json itself, even with --force.
  std::filesystem::create_directories(dir_ + "/a-directory");
  EXPECT_EQ(Export(checkpoint, dir_ + "/a-directory", true, &err), kExitFileError);
  EXPECT_THAT(err, HasSubstr("is a directory"));
  EXPECT_EQ(Export(checkpoint, dir_ + "/other/config.json", true, &err), kExitFileError);
  EXPECT_THAT(err, HasSubstr("INVALID_ARGUMENT"));
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/other/config.json"));
}

// Checkpoints whose manifest cannot describe their parameters, made by hand: each refused with
// DATA_LOSS naming the file and the problem, before any output exists.
TEST_F(ExportTest, CraftedManifestsAreRefusedBeforeAnythingIsWritten) {
  struct Case {
    std::string what;
    std::string checkpoint;
    std::string problem;
  };
  std::vector<Case> cases;
  auto with = [&](const std::string& what, const std::function<void(v1::ModelManifest&)>& edit,
                  const std::string& problem) {
    v1::ModelManifest m = SmallManifest();
    edit(m);
    cases.push_back({what, Checkpoint(m), problem});
  };
  auto shape = [](v1::TensorInfo* t, std::vector<int64_t> dims) {
    t->clear_shape();
    for (int64_t d : dims) t->add_shape(d);
  };
  // 2^32 x 2^32 elements wraps to 0 in 64 bits: "w" would cover nothing and "b" all 9.
  with(
      "a shape whose element count overflows",
      [&](v1::ModelManifest& m) {
        shape(m.mutable_tensors(0), {int64_t{1} << 32, int64_t{1} << 32});
        m.mutable_tensors(1)->set_offset(0);
        shape(m.mutable_tensors(1), {9});
      },
      "more elements than");
  with(
      "a dimension of 2^63 - 1",
      [&](v1::ModelManifest& m) {
        shape(m.mutable_tensors(0), {std::numeric_limits<int64_t>::max()});
      },
      "more elements than");
  with(
      "a negative dimension",
      [&](v1::ModelManifest& m) {
        shape(m.mutable_tensors(0), {-2, -3});
      },
      "dimension 0 is -2");
  with(
      "a zero dimension",
      [&](v1::ModelManifest& m) {
        shape(m.mutable_tensors(0), {2, 0});
      },
      "dimension 1 is 0");
  with(
      "bytes beyond the parameters",
      [&](v1::ModelManifest& m) { shape(m.mutable_tensors(1), {30}); }, "more elements than");
  with(
      "a scalar after the last parameter",
      [&](v1::ModelManifest& m) {
        v1::TensorInfo* s = m.add_tensors();
        s->set_name("s");
        s->set_offset(9);
      },
      "lies beyond");
  with(
      "an offset at 2^63",
      [&](v1::ModelManifest& m) { m.mutable_tensors(1)->set_offset(uint64_t{1} << 63); },
      "starts at 9223372036854775808");
  with(
      "a gap", [&](v1::ModelManifest& m) { m.mutable_tensors(1)->set_offset(7); }, "starts at 7");
  with(
      "an overlap", [&](v1::ModelManifest& m) { m.mutable_tensors(1)->set_offset(5); },
      "starts at 5");
  with(
      "too few tensors", [&](v1::ModelManifest& m) { m.mutable_tensors()->RemoveLast(); },
      "cover 6 of 9");
  with(
      "a repeated name", [&](v1::ModelManifest& m) { m.mutable_tensors(1)->set_name("w"); },
      "\"w\" appears twice");
  with(
      "a tensor named __metadata__",
      [&](v1::ModelManifest& m) { m.mutable_tensors(1)->set_name("__metadata__"); },
      "reserved key");
  with(
      "a tensor without a name", [&](v1::ModelManifest& m) { m.mutable_tensors(1)->set_name(""); },
      "has no name");
  with(
      "a configuration that is not JSON",
      [&](v1::ModelManifest& m) { m.set_config_json("{\"model_type\": "); },
      "configuration is not a JSON object");
  cases.push_back({"manifest bytes that do not parse", Checkpoint(std::string("\xff\xff\xff\x0f")),
                   "does not parse"});
  cases.push_back(
      {"a job id that is not UTF-8", Checkpoint(SmallManifest(), 9, "job-\xff\xfe"), "not UTF-8"});
  // The 200-byte file that used to abort the export: it announces 2^34 parameters.
  std::string huge = ReadBytes(Checkpoint(SmallManifest())).substr(0, 200);
  Put64(huge, kNumParamsAt, uint64_t{1} << 34);
  Seal(huge);
  const std::string huge_path = dir_ + "/huge.ckpt";
  std::ofstream(huge_path, std::ios::binary) << huge;
  cases.push_back({"a 200-byte file announcing 64 GiB", huge_path, "truncated"});

  for (const Case& c : cases) {
    const std::string model = dir_ + "/out/model.safetensors";
    std::ostringstream out;
    absl::Status status = ExportCheckpoint(c.checkpoint, model, out);
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << c.what << ": " << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.checkpoint)) << c.what;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.problem)) << c.what;
    EXPECT_FALSE(std::filesystem::exists(model)) << c.what;
    EXPECT_FALSE(std::filesystem::exists(dir_ + "/out/config.json")) << c.what;
    EXPECT_EQ(out.str(), "") << c.what;
  }
  // A checkpoint of the earlier format, without a manifest: what to do instead.
  std::ostringstream out;
  EXPECT_EQ(ExportCheckpoint(Checkpoint(std::string()), dir_ + "/x.safetensors", out).code(),
            absl::StatusCode::kFailedPrecondition);
}

// A deterministic loop over a few thousand checkpoints: random manifests (shapes, offsets and
// names drawn from values that broke readers before) and random byte mutations of a valid
// manifest, each sealed with a valid checksum so that it reaches export's own checks. Export
// never crashes; it succeeds with a well-formed file, or refuses with DATA_LOSS.
TEST_F(ExportTest, FuzzedCheckpointsNeverCrashExport) {
  // A template file: every fuzzed checkpoint is its header with new counts, a new manifest and
  // new values, resealed (written without fsync: thousands of them).
  const std::string base = ReadBytes(Checkpoint(SmallManifest()));
  ASSERT_GT(base.size(), kManifestAt);
  const std::string serialized = SmallManifest().SerializeAsString();
  std::mt19937_64 rng(1234567);
  const int64_t dims[] = {-1,
                          0,
                          1,
                          2,
                          3,
                          9,
                          int64_t{1} << 31,
                          int64_t{1} << 32,
                          int64_t{1} << 62,
                          std::numeric_limits<int64_t>::max(),
                          std::numeric_limits<int64_t>::min()};
  const std::string names[] = {"w", "b", "c", "__metadata__", "", "w\"\\", "\xc3\xa9"};
  const std::string path = dir_ + "/fuzz.ckpt";
  const std::string model = dir_ + "/fuzz-out/model.safetensors";
  int written = 0, refused = 0;
  for (int i = 0; i < 2000; ++i) {
    std::string manifest;
    size_t num_params = rng() % 13;
    if (i % 2 == 0) {
      v1::ModelManifest m;
      m.set_config_json(rng() % 4 == 0 ? "[1" : "{}");
      uint64_t next = 0;
      const int tensors = static_cast<int>(rng() % 5);
      for (int t = 0; t < tensors; ++t) {
        v1::TensorInfo* info = m.add_tensors();
        info->set_name(rng() % 3 == 0 ? names[rng() % std::size(names)] : absl::StrCat("t", t));
        uint64_t count = 1;
        const int rank = static_cast<int>(rng() % 3);
        for (int d = 0; d < rank; ++d) {
          // Mostly small and valid, so that many manifests are well-formed.
          const int64_t dim =
              rng() % 3 == 0 ? dims[rng() % std::size(dims)] : static_cast<int64_t>(1 + rng() % 3);
          info->add_shape(dim);
          count *= static_cast<uint64_t>(dim);  // may wrap: it is only a guess for the offsets
        }
        info->set_offset(rng() % 4 == 0 ? rng() % 16 : next);
        next += count;
      }
      if (rng() % 2 == 0 && next <= 12) num_params = next;  // often exactly right
      manifest = m.SerializeAsString();
    } else {
      manifest = serialized;
      num_params = rng() % 4 == 0 ? rng() % 13 : 9;
      const int mutations = 1 + static_cast<int>(rng() % 3);
      for (int k = 0; k < mutations && !manifest.empty(); ++k) {
        const size_t at = rng() % manifest.size();
        switch (rng() % 3) {
          case 0:
            manifest[at] = static_cast<char>(rng());
            break;
          case 1:
            manifest.resize(at);
            break;
          case 2:
            manifest.insert(at, 1, static_cast<char>(rng()));
            break;
        }
      }
    }
    std::string bytes = base.substr(0, kManifestAt - 8);
    Put64(bytes, kNumParamsAt, num_params);
    Put64(bytes, kNumParamsAt + 8, 0);  // no optimizer state
    bytes.append(8, '\0');
    Put64(bytes, kManifestAt - 8, manifest.size());
    bytes += manifest;
    for (size_t p = 0; p < num_params; ++p) {
      const float value = 0.25f * static_cast<float>(p);
      bytes.append(reinterpret_cast<const char*>(&value), sizeof(value));
    }
    Seal(bytes);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    std::ostringstream out;
    const absl::Status status = ExportCheckpoint(path, model, out, /*force=*/true);
    const std::string context = absl::StrCat("case ", i, ": ", status.ToString());
    if (status.ok()) {
      ++written;
      ExpectWellFormedSafetensors(model, num_params, context);
    } else {
      ++refused;
      EXPECT_TRUE(absl::IsDataLoss(status) || absl::IsFailedPrecondition(status)) << context;
      EXPECT_THAT(std::string(status.message()), HasSubstr(path)) << context;
    }
  }
  // Both outcomes happen, or the loop tested less than it seems to.
  EXPECT_GT(written, 100);
  EXPECT_GT(refused, 500);
}

v1::LogLine Line(int64_t sequence, int64_t generation, int32_t rank, const std::string& text) {
  v1::LogLine line;
  line.set_sequence(sequence);
  line.set_generation(generation);
  line.set_rank(rank);
  line.set_text(text);
  return line;
}

TEST(Logs, PrintsEachLineWithItsRankAndTheGenerationsBetween) {
  FakeStub stub;
  stub.first_kept = 1;
  stub.log_lines = {Line(1, 1, 0, "epoch 0"), Line(2, 1, 1, "red \x1b[31mtext"),
                    Line(3, 1, 1, "Traceback"), Line(4, 2, 0, "resumed at step 40"),
                    Line(5, 2, 1, "done")};
  FakeClock clock;
  std::vector<absl::Duration> sleeps;
  std::ostringstream out;
  ASSERT_TRUE(ShowLogs(stub, "job-1", -1, 0, false, TestOptions(&clock, &sleeps), out).ok());
  EXPECT_EQ(out.str(),
            "(1 older lines are no longer kept)\n"
            "--- generation 1 ---\n"
            "[default0]:epoch 0\n"
            "[default1]:red \\x1b[31mtext\n"
            "[default1]:Traceback\n"
            "--- generation 2 ---\n"
            "[default0]:resumed at step 40\n"
            "[default1]:done\n");
  EXPECT_THAT(stub.log_requests, ::testing::ElementsAre(0, 3, 5, 6));
  std::ostringstream ones;
  ASSERT_TRUE(ShowLogs(stub, "job-1", 1, 0, false, TestOptions(&clock, &sleeps), ones).ok());
  EXPECT_THAT(ones.str(), HasSubstr("[default1]:Traceback\n--- generation 2 ---\n[default1]:done"));
  EXPECT_THAT(ones.str(), ::testing::Not(HasSubstr("[default0]")));
}

TEST(Logs, FollowPrintsNewLinesUntilTheJobHasEnded) {
  FakeStub stub;
  stub.get_job.set_state(v1::JOB_STATE_RUNNING);
  stub.log_lines = {Line(0, 1, 0, "step 1")};
  int answers = 0;
  stub.after_logs = [&] {
    // The second poll finds a new line; after it the job ends.
    if (++answers == 2) {
      stub.log_lines.push_back(Line(1, 1, 0, "step 2"));
      stub.get_job.set_state(v1::JOB_STATE_SUCCEEDED);
    }
  };
  FakeClock clock;
  std::vector<absl::Duration> sleeps;
  std::ostringstream out;
  ASSERT_TRUE(ShowLogs(stub, "job-1", -1, 0, true, TestOptions(&clock, &sleeps), out).ok());
  EXPECT_EQ(out.str(), "--- generation 1 ---\n[default0]:step 1\n[default0]:step 2\n");
  EXPECT_FALSE(sleeps.empty());
  v1::LogLine json_line = Line(7, 3, 2, "x");
  stub.log_lines = {json_line};
  stub.after_logs = nullptr;
  CommandOptions json = TestOptions(&clock, &sleeps);
  json.output = OutputFormat::kJson;
  std::ostringstream json_out;
  ASSERT_TRUE(ShowLogs(stub, "job-1", -1, 0, false, json, json_out).ok());
  EXPECT_EQ(json_out.str(),
            "{\"sequence\":\"7\",\"generation\":\"3\",\"rank\":2,\"worker\":\"\",\"stderr\":false,"
            "\"text\":\"x\",\"unixMs\":\"0\"}\n");
}

TEST(Logs, FlagsApplyOnlyToLogs) {
  FlagValues flags;
  flags.follow = true;
  std::istringstream in;
  auto status = ParseInvocation({"status", "job-1"}, flags, nullptr, in);
  EXPECT_THAT(std::string(status.status().message()), HasSubstr("only apply to logs"));
  flags.rank = 3;
  flags.generation = 2;
  auto logs = ParseInvocation({"logs", "job-1"}, flags, nullptr, in);
  ASSERT_TRUE(logs.ok()) << logs.status();
  EXPECT_EQ(logs->command, Command::kLogs);
  EXPECT_EQ(logs->rank, 3);
  EXPECT_EQ(logs->generation, 2);
  EXPECT_TRUE(logs->follow);
  flags.rank = -7;
  EXPECT_THAT(std::string(ParseInvocation({"logs", "job-1"}, flags, nullptr, in).status().message()),
              HasSubstr("--rank: must be a rank"));
}

}  // namespace
}  // namespace lockstep::cli
