// The coordinator core, driven by events with an explicit clock: registration, gang
// scheduling, rank assignment, generations, stale-generation fencing and timeouts.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/gpu_limits.h"
#include "common/job_memory.h"
#include "coordinator/core/core.h"
#include "coordinator/core/job_spec.h"
#include "coordinator/core/ranks.h"
#include "coordinator/store/job_store.h"
#include "gtest/gtest.h"

namespace lockstep::coordinator {
namespace {

using v1::JobState;

v1::JobSpec Spec(int min_workers, int max_workers) {
  v1::JobSpec spec;
  spec.mutable_model()->set_type("mlp");
  spec.mutable_dataset()->set_type("synthetic");
  auto* s = spec.mutable_dataset()->mutable_synthetic();
  s->set_train_samples(1024);
  s->set_test_samples(128);
  s->set_input_dim(4);
  s->set_num_classes(2);
  spec.mutable_optimizer()->set_learning_rate(0.1);
  spec.set_global_batch_size(64);
  spec.set_max_steps(100);
  spec.set_min_workers(min_workers);
  spec.set_max_workers(max_workers);
  return spec;
}

class CoreTest : public ::testing::Test {
 protected:
  explicit CoreTest(CoreOptions options = Options()) : core_(options) {}
  static CoreOptions Options() {
    CoreOptions o;
    o.heartbeat_timeout = absl::Seconds(5);
    return o;
  }

  std::string Register(const std::string& name, const std::string& host = "h1",
                       const std::string& device = "cpu", int64_t free_memory_bytes = 0) {
    v1::RegisterRequest r;
    r.set_name(name);
    r.set_host(host);
    r.set_device(device);
    r.set_free_memory_bytes(free_memory_bytes);
    Decisions d;
    absl::StatusOr<std::string> id = core_.RegisterWorker(r, now_, &d);
    EXPECT_TRUE(id.ok()) << id.status();
    Collect(d);
    return id.value_or("");
  }
  std::string Submit(v1::JobSpec spec) {
    Decisions d;
    absl::StatusOr<v1::Job> job = core_.SubmitJob(spec, now_, &d);
    EXPECT_TRUE(job.ok()) << job.status();
    Collect(d);
    return job.ok() ? job->job_id() : "";
  }
  void Collect(const Decisions& d) {
    for (const auto& m : d.messages) sent_.push_back(m);
    for (const auto& c : d.close_sessions) closed_.push_back(c);
    for (const auto& e : d.ends_to_record) ends_.push_back(e);
  }
  // What the shell does once it has saved the jobs that succeeded: their members may go.
  void RecordEnds() {
    Decisions d;
    for (const std::string& id : ends_) core_.JobEndRecorded(id, now_, &d);
    ends_.clear();
    Collect(d);
  }
  v1::Job Job(const std::string& id) { return core_.GetJob(id).value(); }
  // The id of the live worker named `name`.
  std::string FindId(const std::string& name) {
    for (const v1::WorkerInfo& w : core_.ListWorkers()) {
      if (w.name() == name && w.state() != "lost") return w.worker_id();
    }
    return "";
  }
  // Assignments sent since the last call, by worker id.
  std::map<std::string, v1::Assignment> TakeAssignments() {
    std::map<std::string, v1::Assignment> out;
    for (const auto& m : sent_) {
      if (m.message.has_assignment()) out[m.worker_id] = m.message.assignment();
    }
    sent_.clear();
    return out;
  }
  std::vector<std::string> TakeAborts() {
    std::vector<std::string> out;
    for (const auto& m : sent_) {
      if (m.message.has_abort()) out.push_back(m.worker_id);
    }
    sent_.clear();
    return out;
  }
  absl::Status Progress(const std::string& worker, const std::string& job, int64_t gen,
                        int64_t step) {
    v1::ProgressReport p;
    p.set_job_id(job);
    p.set_generation(gen);
    p.set_step(step);
    p.set_loss(1.0 / step);
    p.set_samples_per_second(1000);
    p.set_total_steps(100);
    Decisions d;
    absl::Status s = core_.ReportProgress(worker, p, now_, &d);
    Collect(d);
    return s;
  }
  absl::Status Finished(const std::string& worker, const std::string& job, int64_t gen,
                        const std::string& checksum) {
    v1::FinishedReport f;
    f.set_job_id(job);
    f.set_generation(gen);
    f.set_step(100);
    f.set_parameter_checksum(checksum);
    f.mutable_eval()->set_test_accuracy(0.9);
    Decisions d;
    absl::Status s = core_.ReportFinished(worker, f, now_, &d);
    Collect(d);
    return s;
  }
  void Heartbeats(const std::vector<std::string>& workers) {
    for (const auto& w : workers) ASSERT_TRUE(core_.Heartbeat(w, now_).ok());
  }
  void Tick() {
    Decisions d;
    core_.Tick(now_, &d);
    Collect(d);
  }

  absl::Time now_ = absl::FromUnixSeconds(1'700'000'000);
  Core core_;
  std::vector<Decisions::Outgoing> sent_;
  std::vector<std::string> closed_;
  std::vector<std::string> ends_;  // Decisions::ends_to_record not yet recorded
};

TEST_F(CoreTest, RegistrationAssignsIdsAndRefusesDuplicateLiveNames) {
  const std::string a = Register("w0");
  const std::string b = Register("w1");
  EXPECT_NE(a, b);
  v1::RegisterRequest dup;
  dup.set_name("w0");
  dup.set_device("cpu");
  Decisions d;
  EXPECT_EQ(core_.RegisterWorker(dup, now_, &d).status().code(), absl::StatusCode::kAlreadyExists);
  v1::RegisterRequest unnamed;
  unnamed.set_device("cpu");
  EXPECT_EQ(core_.RegisterWorker(unnamed, now_, &d).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Once the first w0 is gone its name can be reused (a restarted worker).
  core_.WorkerDisconnected(a, "stream closed", now_, &d);
  EXPECT_TRUE(core_.RegisterWorker(dup, now_, &d).ok());
  EXPECT_EQ(core_.ListWorkers().size(), 3u);
  // ... and then it is held again, by the new one.
  EXPECT_EQ(core_.RegisterWorker(dup, now_, &d).status().code(), absl::StatusCode::kAlreadyExists);
  // A worker lost to heartbeat silence frees its name too.
  now_ += absl::Seconds(60);
  Tick();
  EXPECT_TRUE(core_.RegisterWorker(dup, now_, &d).ok());
}

TEST(RegistrationTest, NamesAndFieldsAreBoundedAndPrintable) {
  v1::RegisterRequest good;
  good.set_name("gpu-host-3:0");
  good.set_host("gpu-host-3.example");
  good.set_device("cuda:0");
  EXPECT_TRUE(ValidateRegistration(good).ok());
  struct Case {
    std::string what;
    std::function<void(v1::RegisterRequest*)> mutate;
    std::string field;
  };
  const std::vector<Case> cases = {
      {"no name", [](v1::RegisterRequest* r) { r->clear_name(); }, "register.name"},
      {"long name", [](v1::RegisterRequest* r) { r->set_name(std::string(65, 'w')); },
       "register.name"},
      {"newline", [](v1::RegisterRequest* r) { r->set_name("w0\nFAKE LOG"); }, "register.name"},
      {"space", [](v1::RegisterRequest* r) { r->set_name("w 0"); }, "register.name"},
      {"escape in host", [](v1::RegisterRequest* r) { r->set_host("h\x1b[31m"); }, "register.host"},
      {"huge address", [](v1::RegisterRequest* r) { r->set_comm_address(std::string(300, 'a')); },
       "register.comm_address"},
      {"no device", [](v1::RegisterRequest* r) { r->clear_device(); }, "register.device"},
  };
  for (const Case& c : cases) {
    v1::RegisterRequest r = good;
    c.mutate(&r);
    absl::Status s = ValidateRegistration(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(s.message().find(c.field), std::string::npos) << c.what << ": " << s;
  }
}

TEST_F(CoreTest, JobWaitsForMinWorkersThenGangStartsUpToMax) {
  const std::string w0 = Register("w0");
  const std::string job = Submit(Spec(2, 3));
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_PENDING);
  EXPECT_NE(Job(job).reason().find("waiting for 2 idle cpu workers"), std::string::npos)
      << Job(job).reason();
  EXPECT_TRUE(TakeAssignments().empty());
  const std::string w1 = Register("w1");
  v1::Job j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(j.generation(), 1);
  auto assignments = TakeAssignments();
  ASSERT_EQ(assignments.size(), 2u);
  EXPECT_EQ(assignments[w0].rank(), 0);
  EXPECT_EQ(assignments[w1].rank(), 1);
  EXPECT_EQ(assignments[w0].world_size(), 2);
  EXPECT_EQ(assignments[w0].generation(), 1);
  EXPECT_EQ(assignments[w0].start_step(), 1);
  // A third worker arriving later does not disturb the running generation (no elastic growth
  // in this release) and stays idle.
  Register("w2");
  EXPECT_TRUE(TakeAssignments().empty());
}

TEST_F(CoreTest, TakesAtMostMaxWorkers) {
  for (int i = 0; i < 4; ++i) Register("w" + std::to_string(i));
  const std::string job = Submit(Spec(1, 2));
  EXPECT_EQ(TakeAssignments().size(), 2u);
  EXPECT_EQ(Job(job).members_size(), 2);
}

TEST_F(CoreTest, FifoHeadBlocksLaterJobs) {
  Register("w0");
  const std::string big = Submit(Spec(2, 2));
  const std::string small = Submit(Spec(1, 1));
  EXPECT_EQ(Job(big).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Job(small).state(), v1::JOB_STATE_PENDING) << "gang FIFO: the head job goes first";
  Register("w1");
  EXPECT_EQ(Job(big).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(small).state(), v1::JOB_STATE_PENDING);
}

TEST_F(CoreTest, FinishedByAllMembersSucceedsAndFreesWorkers) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string job = Submit(Spec(2, 2));
  TakeAssignments();
  ASSERT_TRUE(Progress(w0, job, 1, 1).ok());
  EXPECT_EQ(Job(job).step(), 1);
  EXPECT_EQ(Job(job).total_steps(), 100);
  ASSERT_TRUE(Finished(w0, job, 1, "abc").ok());
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING) << "one member is still training";
  TakeAborts();
  ASSERT_TRUE(Finished(w1, job, 1, "abc").ok());
  v1::Job j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(j.step(), 100);
  EXPECT_DOUBLE_EQ(j.eval().test_accuracy(), 0.9);
  EXPECT_EQ(j.members(0).parameter_checksum(), "abc");
  EXPECT_EQ(j.members(1).parameter_checksum(), "abc");
  // Two-phase finish: until the shell has saved the end, the members keep the trained state
  // and stay the job's (a coordinator lost now finishes the job from them).
  EXPECT_EQ(ends_, std::vector<std::string>{job});
  EXPECT_TRUE(TakeAborts().empty()) << "nobody is told to drop the state before the record";
  const std::string next = Submit(Spec(2, 2));
  EXPECT_EQ(Job(next).state(), v1::JOB_STATE_PENDING);
  for (const v1::WorkerInfo& w : core_.ListWorkers()) EXPECT_EQ(w.state(), "busy") << w.name();
  // Recorded: both are told the job ended (they drop its state) and the next job starts.
  sent_.clear();
  RecordEnds();
  int told = 0;
  for (const auto& m : sent_) {
    told += m.message.has_abort() && m.message.abort().job_ended() &&
            m.message.abort().job_id() == job && (m.worker_id == w0 || m.worker_id == w1);
  }
  EXPECT_EQ(told, 2);
  EXPECT_EQ(Job(next).state(), v1::JOB_STATE_RUNNING);
}

TEST_F(CoreTest, StaleGenerationIsRejectedWithAborted) {
  const std::string w0 = Register("w0");
  const std::string job = Submit(Spec(1, 1));
  TakeAssignments();
  EXPECT_EQ(Progress(w0, job, 2, 1).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(Progress(w0, job, 0, 1).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(Job(job).step(), 0) << "a rejected report changes nothing";
  EXPECT_TRUE(core_.Fence(job, 1).ok());
  EXPECT_EQ(core_.Fence(job, 2).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(core_.Fence("job-404", 1).code(), absl::StatusCode::kNotFound);
  Decisions d;
  ASSERT_TRUE(core_.CancelJob(job, now_, &d).ok());
  EXPECT_EQ(Progress(w0, job, 1, 2).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(core_.Fence(job, 1).code(), absl::StatusCode::kAborted);
  ASSERT_EQ(d.ended_generations.size(), 1u);
  EXPECT_EQ(d.ended_generations[0], std::make_pair(job, int64_t{1}));
}

TEST_F(CoreTest, NonMemberCannotReport) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string job = Submit(Spec(1, 1));
  TakeAssignments();
  // Not the job's at all: refused, and nothing is fenced (ABORTED is for a member's stale
  // generation).
  EXPECT_EQ(Progress(w1, job, 1, 1).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(Progress(w0, job, 1, 1).ok());
}

TEST_F(CoreTest, WithRecoveryDisabledStreamClosedFailsTheJobAndAbortsSurvivors) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  v1::JobSpec spec = Spec(2, 2);
  spec.set_max_restarts(0);
  const std::string job = Submit(spec);
  TakeAssignments();
  Decisions d;
  core_.WorkerDisconnected(w1, "stream closed", now_, &d);
  Collect(d);
  v1::Job j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(j.reason().find("w1"), std::string::npos) << j.reason();
  EXPECT_NE(j.reason().find("stream closed"), std::string::npos) << j.reason();
  EXPECT_NE(j.reason().find("recovery disabled"), std::string::npos) << j.reason();
  EXPECT_EQ(TakeAborts(), std::vector<std::string>{w0});
  // The survivor is idle and can take the next job; the lost worker cannot.
  const std::string next = Submit(Spec(1, 2));
  auto a = TakeAssignments();
  ASSERT_EQ(a.size(), 1u);
  EXPECT_EQ(a.begin()->first, w0);
  EXPECT_EQ(Job(next).state(), v1::JOB_STATE_RUNNING);
}

TEST_F(CoreTest, FatalFailureReportFailsJobWithTheWorkersMessage) {
  const std::string w0 = Register("w0");
  const std::string job = Submit(Spec(1, 1));
  TakeAssignments();
  v1::FailureReport f;
  f.set_job_id(job);
  f.set_generation(1);
  f.set_message("loading data set at /nope: dataset directory /nope does not exist");
  f.set_fatal(true);
  Decisions d;
  ASSERT_TRUE(core_.ReportFailure(w0, f, now_, &d).ok());
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(Job(job).reason().find("/nope"), std::string::npos);
}

// A fatal report is its reporter's own error (its data, its device): the reporter leaves the
// job, and the others train on; a lone report, true or forged, never fails a job for the others.
TEST_F(CoreTest, ALoneFatalReportRemovesItsReporterAndTheJobTrainsOn) {
  const std::string w0 = Register("w0"), w1 = Register("w1"), w2 = Register("w2");
  const std::string job = Submit(Spec(2, 2));
  auto first = TakeAssignments();
  ASSERT_EQ(first.size(), 2u);
  ASSERT_TRUE(first.count(w0) && first.count(w1));
  v1::FailureReport f;
  f.set_job_id(job);
  f.set_generation(1);
  f.set_message("out of memory (forged)");
  f.set_fatal(true);
  Decisions d;
  ASSERT_TRUE(core_.ReportFailure(w1, f, now_, &d).ok());
  Collect(d);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING);
  EXPECT_NE(Job(job).recovery_history(0).reason().find("worker w1 (" + w1 + ") reported"),
            std::string::npos)
      << Job(job).recovery_history(0).reason();
  EXPECT_EQ(TakeAborts(), std::vector<std::string>{w0});
  // The others get a moment to report the same; then the job re-forms without the reporter.
  now_ += absl::Seconds(1);
  Tick();
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING);
  now_ += absl::Seconds(1.5);
  Tick();
  ASSERT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  auto second = TakeAssignments();
  EXPECT_EQ(second.size(), 2u);
  EXPECT_TRUE(second.count(w0) && second.count(w2)) << "w1 is out of this job for good";
  // Its report failed nobody else's job: w1 is idle and takes the next one.
  const std::string next = Submit(Spec(1, 1));
  auto third = TakeAssignments();
  ASSERT_EQ(third.size(), 1u);
  EXPECT_EQ(third.begin()->first, w1);
  EXPECT_EQ(Job(next).state(), v1::JOB_STATE_RUNNING);
}

// A fatal report that leaves too few workers to re-form (every other worker counted, busy or
// not) fails the job with the report, instead of waiting for workers that do not exist.
TEST_F(CoreTest, AFatalReportThatLeavesTooFewWorkersFailsTheJob) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string job = Submit(Spec(2, 2));
  TakeAssignments();
  v1::FailureReport f;
  f.set_job_id(job);
  f.set_generation(1);
  f.set_message("init_from_checkpoint: no checkpoint of this model");
  f.set_fatal(true);
  Decisions d;
  ASSERT_TRUE(core_.ReportFailure(w0, f, now_, &d).ok());
  Collect(d);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING);
  now_ += absl::Seconds(3);
  Tick();
  const v1::Job j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(j.reason().find("worker w0 (" + w0 + ") reported: init_from_checkpoint"),
            std::string::npos)
      << j.reason();
  EXPECT_NE(j.reason().find("cannot re-form (min_workers 2, 1 other worker"), std::string::npos)
      << j.reason();
}

TEST_F(CoreTest, FatalReportsFromEveryMemberFailTheJobNamingThem) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string job = Submit(Spec(2, 2));
  TakeAssignments();
  for (const std::string& w : {w0, w1}) {
    v1::FailureReport f;
    f.set_job_id(job);
    f.set_generation(1);
    f.set_message("loading data set at /nope: dataset directory /nope does not exist");
    f.set_fatal(true);
    Decisions d;
    // The second report arrives while the job waits to re-form: it still counts.
    ASSERT_TRUE(core_.ReportFailure(w, f, now_, &d).ok());
    Collect(d);
    now_ += absl::Milliseconds(500);
    Tick();
  }
  const v1::Job j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(j.reason().find("worker w1 (" + w1 + ") reported: loading data set at /nope"),
            std::string::npos)
      << j.reason();
  EXPECT_NE(j.reason().find("worker w0 (" + w0 + ") reported"), std::string::npos) << j.reason();
  // A report of a generation that has ended by now is refused, as before.
  v1::FailureReport late;
  late.set_job_id(job);
  late.set_generation(1);
  late.set_fatal(true);
  Decisions d;
  EXPECT_FALSE(core_.ReportFailure(w0, late, now_, &d).ok());
}

// ListJobs pages newest first; tokens carry on where a page ended, even while jobs are
// submitted meanwhile; bad pages are refused naming the field.
TEST_F(CoreTest, ListJobsPagesNewestFirst) {
  std::vector<std::string> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(Submit(Spec(1, 1)));
  v1::ListJobsRequest request;
  request.set_page_size(2);
  std::vector<std::string> listed;
  int pages = 0;
  do {
    auto page = core_.ListJobs(request);
    ASSERT_TRUE(page.ok()) << page.status();
    EXPECT_EQ(page->total_jobs(), pages == 0 ? 5 : 6);
    for (const v1::Job& j : page->jobs()) listed.push_back(j.job_id());
    request.set_page_token(page->next_page_token());
    if (++pages == 1) Submit(Spec(1, 1));  // newer: not on the later pages
  } while (!request.page_token().empty());
  EXPECT_EQ(pages, 3);
  EXPECT_EQ(listed, (std::vector<std::string>{ids[4], ids[3], ids[2], ids[1], ids[0]}));
  EXPECT_EQ(core_.ListJobs()->jobs_size(), 6);  // the default page holds them all
  // A page also ends before it passes 4 MiB (jobs saved by an older version may be big).
  Core restored(Options());
  std::vector<v1::Job> big;
  for (int i = 1; i <= 6; ++i) {
    v1::Job j;
    j.set_job_id("job-" + std::to_string(i));
    j.set_state(v1::JOB_STATE_SUCCEEDED);
    j.set_reason(std::string(1 << 20, 'x'));
    big.push_back(j);
  }
  Decisions d;
  restored.RestoreJobs(big, now_, &d);
  auto first = restored.ListJobs();
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->jobs_size(), 3);
  EXPECT_LT(first->ByteSizeLong(), Core::kMaxJobsPageBytes + 1024);
  v1::ListJobsRequest rest;
  rest.set_page_token(first->next_page_token());
  auto second = restored.ListJobs(rest);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->jobs_size(), 3);
  EXPECT_EQ(second->jobs(2).job_id(), "job-1");
  EXPECT_TRUE(second->next_page_token().empty());
  request.set_page_size(-1);
  request.clear_page_token();
  EXPECT_NE(core_.ListJobs(request).status().message().find("page_size"), std::string::npos);
  request.set_page_size(0);
  for (const std::string token : {"x", "0", "99", "-3"}) {
    request.set_page_token(token);
    EXPECT_EQ(core_.ListJobs(request).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(core_.ListJobs(request).status().message().find("page_token"), std::string::npos);
  }
}

// Memory per job stays linear in its workers: an event records the job without its members
// and spec (only the event that ends the job carries the whole job), and an assignment names a
// bounded few members, so N assignments are O(N) in all.
TEST_F(CoreTest, EventsAndAssignmentsDoNotGrowWithTheMembers) {
  constexpr int kWorkers = 100;
  std::vector<std::string> ids;
  for (int i = 0; i < kWorkers; ++i) ids.push_back(Register("w" + std::to_string(i)));
  v1::JobSpec spec = Spec(kWorkers, kWorkers);
  spec.set_name("wide");
  spec.set_micro_shards(kWorkers);
  spec.set_global_batch_size(kWorkers * 2);
  const std::string job = Submit(spec);
  auto assigned = TakeAssignments();
  ASSERT_EQ(assigned.size(), static_cast<size_t>(kWorkers));
  for (const auto& [worker, a] : assigned) {
    EXPECT_EQ(a.world_size(), kWorkers);
    EXPECT_EQ(a.member_names_size(), static_cast<int>(Core::kMaxAssignmentNames));
  }
  for (int step = 1; step <= 20; ++step) {
    now_ += absl::Seconds(1);
    ASSERT_TRUE(Progress(ids[0], job, 1, step).ok());
  }
  for (const std::string& w : ids) ASSERT_TRUE(Finished(w, job, 1, "c0ffee").ok());
  ASSERT_EQ(Job(job).state(), v1::JOB_STATE_SUCCEEDED);
  auto events = core_.EventsSince(job, 0);
  ASSERT_TRUE(events.ok());
  ASSERT_GT(events->size(), 20u);
  for (size_t i = 0; i + 1 < events->size(); ++i) {
    const v1::Job& j = (*events)[i].job();
    EXPECT_EQ(j.members_size(), 0) << (*events)[i].message();
    EXPECT_FALSE(j.spec().has_model());
    EXPECT_EQ(j.spec().name(), "wide");
    EXPECT_LT(j.ByteSizeLong(), 512u) << (*events)[i].message();
    EXPECT_LT((*events)[i].message().size(), 256u) << "an event names a bounded few members";
  }
  const auto formed = std::find_if(events->begin(), events->end(), [](const v1::JobEvent& e) {
    return e.message().find("generation 1 formed: w0, w1, ") == 0;
  });
  ASSERT_NE(formed, events->end());
  EXPECT_NE(formed->message().find(" and 84 more (100 workers)"), std::string::npos)
      << formed->message();
  EXPECT_EQ(events->back().job().state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(events->back().job().members_size(), kWorkers) << "the result, whole";
  EXPECT_EQ(Job(job).members_size(), kWorkers) << "the job itself keeps everything";
  EXPECT_FALSE(Job(job).has_sample()) << "recording an event changes nothing of the job";
  EXPECT_TRUE(Job(job).spec().has_model());
}

// A wide job that re-forms again and again keeps the generation records its member budget
// allows, not kMaxGenerations copies of a thousand-member list.
TEST_F(CoreTest, GenerationHistoryIsBoundedByItsMembers) {
  constexpr int kWorkers = 1000, kLosses = 150;
  std::vector<std::string> ids;
  for (int i = 0; i < kWorkers; ++i) ids.push_back(Register("w" + std::to_string(i)));
  v1::JobSpec spec = Spec(1, kWorkers);
  spec.set_micro_shards(kWorkers);
  spec.set_global_batch_size(kWorkers);
  spec.set_max_restarts(kLosses);
  const std::string job = Submit(spec);
  for (int i = 0; i < kLosses; ++i) {
    Decisions d;
    now_ += absl::Milliseconds(10);
    core_.WorkerDisconnected(ids[kWorkers - 1 - i], "stream closed", now_, &d);
  }
  const v1::Job j = Job(job);
  ASSERT_EQ(j.state(), v1::JOB_STATE_RUNNING);
  ASSERT_EQ(j.generation(), kLosses + 1);
  int64_t members = 0;
  for (const v1::Generation& g : j.generations()) members += g.member_ids_size();
  EXPECT_LT(j.generations_size(), kLosses + 1) << "older generations were dropped";
  EXPECT_GT(j.generations_size(), 2);
  EXPECT_LE(members, Core::kMaxGenerationMembers);
  EXPECT_GT(members + kWorkers, Core::kMaxGenerationMembers) << "no more dropped than needed";
  EXPECT_EQ(j.generations().rbegin()->generation(), kLosses + 1);
  EXPECT_EQ(j.generations().rbegin()->member_ids_size(), kWorkers - kLosses);
  EXPECT_EQ(j.generations().rbegin()->left_size(), 1) << "joined and left still come out right";
}

// A job behind a head job that cannot start says what it waits for.
TEST_F(CoreTest, JobsQueuedBehindTheHeadSayWhy) {
  Register("w0");
  const std::string big = Submit(Spec(4, 4));
  const std::string small = Submit(Spec(1, 1));
  EXPECT_NE(Job(big).reason().find("waiting for 4 idle"), std::string::npos) << Job(big).reason();
  EXPECT_NE(Job(small).reason().find("queued behind " + big), std::string::npos)
      << Job(small).reason();
}

// Heartbeats the shell collected between ticks (NoteHeartbeat) keep a worker alive like direct
// ones; a late, older one never moves its clock back, and one for a lost worker is ignored.
TEST_F(CoreTest, CollectedHeartbeatsKeepWorkersAlive) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  for (int i = 0; i < 20; ++i) {  // 10 s: w0 beats, w1 is silent
    now_ += absl::Milliseconds(500);
    core_.NoteHeartbeat(w0, now_ - absl::Milliseconds(100));
    core_.NoteHeartbeat(w0, now_ - absl::Seconds(30));  // stale: changes nothing
    Tick();
  }
  auto workers = core_.ListWorkers();
  ASSERT_EQ(workers.size(), 2u);
  for (const v1::WorkerInfo& w : workers) {
    EXPECT_EQ(w.state(), w.name() == "w0" ? "idle" : "lost") << w.name();
  }
  core_.NoteHeartbeat(w1, now_);  // too late: lost stays lost
  Tick();
  for (const v1::WorkerInfo& w : core_.ListWorkers()) {
    if (w.name() == "w1") {
      EXPECT_EQ(w.state(), "lost");
    }
  }
}

// Lost workers stay listed until there are twice max_lost_workers of them; then the earliest
// registered go, down to max_lost_workers.
TEST_F(CoreTest, LostWorkersArePrunedDownToTheLimitEarliestFirst) {
  const size_t limit = Options().max_lost_workers;
  std::vector<std::string> ids;
  for (size_t i = 0; i < 2 * limit + 2; ++i) ids.push_back(Register("w" + std::to_string(i)));
  auto lost = [&] {
    std::vector<std::string> names;
    for (const v1::WorkerInfo& w : core_.ListWorkers()) {
      if (w.state() == "lost") names.push_back(w.name());
    }
    return names;
  };
  Decisions d;
  for (size_t i = 0; i + 1 < 2 * limit; ++i) core_.WorkerDisconnected(ids[i], "gone", now_, &d);
  EXPECT_EQ(lost().size(), 2 * limit - 1) << "below twice the limit: all still listed";
  core_.WorkerDisconnected(ids[2 * limit - 1], "gone", now_, &d);
  std::vector<std::string> left = lost();
  ASSERT_EQ(left.size(), limit);
  for (const std::string& name : left) {
    EXPECT_GE(std::stoul(name.substr(1)), limit) << name << " registered among the earliest";
  }
  core_.WorkerDisconnected(ids[2 * limit], "gone", now_, &d);
  EXPECT_EQ(lost().size(), limit + 1);
  EXPECT_EQ(core_.ListWorkers().size(), limit + 2) << "the live one and the lost still listed";
}

// The service submits without scheduling (the RPC returns once the job is stored); the next
// tick starts it.
TEST_F(CoreTest, ASubmissionWithoutSchedulingStartsAtTheNextTick) {
  Register("w0");
  Decisions d;
  auto job = core_.SubmitJob(Spec(1, 1), now_, &d, /*schedule=*/false);
  ASSERT_TRUE(job.ok()) << job.status();
  Collect(d);
  EXPECT_EQ(job->state(), v1::JOB_STATE_PENDING);
  EXPECT_TRUE(TakeAssignments().empty());
  Tick();
  EXPECT_EQ(Job(job->job_id()).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(TakeAssignments().size(), 1u);
}

TEST_F(CoreTest, HeartbeatSilenceLosesWorkerWithFakeClock) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  v1::JobSpec spec = Spec(2, 2);
  spec.set_max_restarts(0);
  const std::string job = Submit(spec);
  TakeAssignments();
  for (int i = 0; i < 8; ++i) {  // 4 s: both alive
    now_ += absl::Milliseconds(500);
    Heartbeats({w0, w1});
    Tick();
  }
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  for (int i = 0; i < 11; ++i) {  // w1 goes silent (SIGSTOP): 5.5 s later it is lost
    now_ += absl::Milliseconds(500);
    Heartbeats({w0});
    ASSERT_TRUE(Progress(w0, job, 1, i + 1).ok());
    Tick();
  }
  EXPECT_EQ(closed_, std::vector<std::string>{w1});
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(Job(job).reason().find("no heartbeat"), std::string::npos) << Job(job).reason();
  // The fenced worker's late reports are rejected.
  EXPECT_EQ(Progress(w1, job, 1, 3).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(core_.Heartbeat(w1, now_).code(), absl::StatusCode::kNotFound);
}

TEST_F(CoreTest, JobHeartbeatTimeoutOverridesDefault) {
  const std::string w0 = Register("w0");
  v1::JobSpec spec = Spec(1, 1);
  spec.set_max_restarts(0);
  spec.set_heartbeat_timeout_ms(1000);
  const std::string job = Submit(spec);
  now_ += absl::Milliseconds(1500);
  Tick();
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_FAILED);
}

TEST_F(CoreTest, StepTimeoutReformsAStalledJobWithinMaxRestarts) {
  const std::string w0 = Register("w0");
  v1::JobSpec spec = Spec(1, 1);
  spec.set_step_timeout_ms(2000);
  spec.set_max_restarts(1);
  const std::string job = Submit(spec);
  TakeAssignments();
  now_ += absl::Milliseconds(2500);
  Heartbeats({w0});
  Tick();
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING);
  now_ += absl::Milliseconds(400);  // after the grace period the group re-forms
  Heartbeats({w0});
  Tick();
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(job).generation(), 2);
  now_ += absl::Milliseconds(2500);  // stalls again: max_restarts is used up
  Heartbeats({w0});
  Tick();
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(Job(job).reason().find("no step completed"), std::string::npos) << Job(job).reason();
}

TEST_F(CoreTest, StepTimeoutFailsAStalledJob) {
  const std::string w0 = Register("w0");
  v1::JobSpec spec = Spec(1, 1);
  spec.set_step_timeout_ms(2000);
  spec.set_max_restarts(0);
  const std::string job = Submit(spec);
  TakeAssignments();
  for (int i = 1; i <= 3; ++i) {
    now_ += absl::Milliseconds(1500);
    Heartbeats({w0});
    ASSERT_TRUE(Progress(w0, job, 1, i).ok());
    Tick();
  }
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  now_ += absl::Milliseconds(1500);
  Heartbeats({w0});
  Tick();
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  now_ += absl::Milliseconds(1000);
  Heartbeats({w0});
  Tick();
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(Job(job).reason().find("no step completed"), std::string::npos) << Job(job).reason();
  EXPECT_EQ(TakeAborts(), std::vector<std::string>{w0});
}

TEST_F(CoreTest, RendezvousTimeoutFailsAPendingJob) {
  v1::JobSpec spec = Spec(2, 2);
  spec.set_rendezvous_timeout_ms(3000);
  const std::string job = Submit(spec);
  now_ += absl::Seconds(2);
  Tick();
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_PENDING);
  now_ += absl::Seconds(2);
  Tick();
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(Job(job).reason().find("waited"), std::string::npos) << Job(job).reason();
}

TEST_F(CoreTest, CancelPendingRunningAndFinished) {
  const std::string w0 = Register("w0");
  const std::string running = Submit(Spec(1, 1));
  const std::string pending = Submit(Spec(1, 1));
  TakeAssignments();
  Decisions d;
  ASSERT_TRUE(core_.CancelJob(pending, now_, &d).ok());
  EXPECT_EQ(Job(pending).state(), v1::JOB_STATE_CANCELLED);
  d = {};
  ASSERT_TRUE(core_.CancelJob(running, now_, &d).ok());
  Collect(d);
  EXPECT_EQ(Job(running).state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(TakeAborts(), std::vector<std::string>{w0});
  EXPECT_EQ(core_.CancelJob(running, now_, &d).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(core_.CancelJob("job-999", now_, &d).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(core_.GetJob("job-999").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CoreTest, InvalidSpecIsRefusedAndNothingIsQueued) {
  v1::JobSpec spec = Spec(1, 1);
  spec.set_global_batch_size(-1);
  Decisions d;
  absl::StatusOr<v1::Job> job = core_.SubmitJob(spec, now_, &d);
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(core_.ListJobs()->jobs_size(), 0);
}

TEST_F(CoreTest, EventsRecordStateMembershipAndFirstStepLatency) {
  const std::string w0 = Register("w0");
  const std::string job = Submit(Spec(1, 1));
  now_ += absl::Milliseconds(250);
  ASSERT_TRUE(Progress(w0, job, 1, 1).ok());
  EXPECT_EQ(Job(job).first_step_latency_ms(), 250);
  auto events = core_.EventsSince(job, 0).value();
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events[0].kind(), v1::JobEvent::STATE);
  bool membership = false, progress = false;
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].sequence(), static_cast<int64_t>(i));
    membership |= events[i].kind() == v1::JobEvent::MEMBERSHIP &&
                  events[i].message().find("generation 1 formed: w0") != std::string::npos;
    progress |= events[i].kind() == v1::JobEvent::PROGRESS && events[i].job().step() == 1;
  }
  EXPECT_TRUE(membership);
  EXPECT_TRUE(progress);
  EXPECT_EQ(core_.EventsSince(job, 3).value().size(), events.size() - 3);
}

// --- Elastic recovery ---

// The shell's wire form of decisions: an abort folds into the assignment that follows it for
// the same worker, and nothing else changes.
TEST(FoldAbortsIntoAssignmentsTest, FoldsOnlyAnAbortFollowedByThatWorkersAssignment) {
  auto abort = [](const std::string& worker, int64_t generation, bool job_ended = false,
                  const std::string& job = "job-1") {
    return Decisions::Outgoing{worker, Core::AbortMessage(job, generation, "lost", job_ended)};
  };
  auto assign = [](const std::string& worker, int64_t generation,
                   const std::string& job = "job-1") {
    Decisions::Outgoing m{worker, {}};
    m.message.mutable_assignment()->set_job_id(job);
    m.message.mutable_assignment()->set_generation(generation);
    return m;
  };
  std::vector<Decisions::Outgoing> messages = {
      abort("a", 1),
      abort("b", 1),
      abort("c", 1),  // c is not re-assigned: its abort stays
      assign("b", 2),
      assign("a", 2),
      assign("d", 2),  // a new member: nothing to fold
      abort("a", 2),
      assign("a", 3),  // a second re-formation in the same decisions
      assign("e", 1),
      abort("e", 1),  // an assignment then an abort: order matters, no fold
      // Another job's assignment, after an abort and after one that ends the job: both aborts
      // stay messages of their own.
      abort("f", 1),
      assign("f", 1, "job-2"),
      abort("g", 1, /*job_ended=*/true),
      assign("g", 1, "job-2"),
  };
  FoldAbortsIntoAssignments(messages);
  std::vector<std::string> got;
  for (const Decisions::Outgoing& m : messages) {
    std::string s = m.worker_id;
    if (m.message.has_abort()) s += ":abort" + std::to_string(m.message.abort().generation());
    if (m.message.has_assignment()) {
      s += ":assign" + std::to_string(m.message.assignment().generation());
      if (m.message.assignment().has_abort_previous()) {
        s += "+abort" + std::to_string(m.message.assignment().abort_previous().generation());
      }
    }
    got.push_back(s);
  }
  EXPECT_EQ(got, (std::vector<std::string>{"c:abort1", "b:assign2+abort1", "a:assign2+abort1",
                                           "d:assign2", "a:assign3+abort2", "e:assign1", "e:abort1",
                                           "f:abort1", "f:assign1", "g:abort1", "g:assign1"}));
  std::vector<Decisions::Outgoing> none;
  FoldAbortsIntoAssignments(none);
  EXPECT_TRUE(none.empty());
}

TEST_F(CoreTest, LostMemberReformsFromSurvivorsWithoutTheLostOne) {
  const std::string w0 = Register("w0"), w1 = Register("w1"), w2 = Register("w2");
  const std::string job = Submit(Spec(2, 3));
  TakeAssignments();
  ASSERT_TRUE(Progress(w0, job, 1, 40).ok());
  Decisions d;
  now_ += absl::Milliseconds(5);
  core_.WorkerDisconnected(w1, "stream closed", now_, &d);
  Collect(d);
  EXPECT_EQ(d.ended_generations.front(), std::make_pair(job, int64_t{1}));
  // Survivors get Abort(1) and then their assignment in generation 2, in that order.
  std::vector<std::string> order;
  for (const auto& m : sent_) {
    order.push_back(m.worker_id + (m.message.has_abort() ? ":abort" : ":assign"));
  }
  EXPECT_EQ(order, (std::vector<std::string>{w0 + ":abort", w2 + ":abort", w0 + ":assign",
                                             w2 + ":assign"}));
  // On the wire each survivor's abort travels inside its assignment: one message each, the
  // abort still first for the worker.
  std::vector<Decisions::Outgoing> wire = sent_;
  FoldAbortsIntoAssignments(wire);
  ASSERT_EQ(wire.size(), 2u);
  EXPECT_EQ(wire[0].worker_id, w0);
  EXPECT_EQ(wire[1].worker_id, w2);
  for (const Decisions::Outgoing& m : wire) {
    ASSERT_TRUE(m.message.has_assignment());
    EXPECT_EQ(m.message.assignment().generation(), 2);
    ASSERT_TRUE(m.message.assignment().has_abort_previous());
    EXPECT_EQ(m.message.assignment().abort_previous().job_id(), job);
    EXPECT_EQ(m.message.assignment().abort_previous().generation(), 1);
    EXPECT_NE(m.message.assignment().abort_previous().reason().find("stream closed"),
              std::string::npos);
  }
  auto a = TakeAssignments();
  EXPECT_EQ(a[w0].generation(), 2);
  EXPECT_EQ(a[w0].rank(), 0);
  EXPECT_EQ(a[w2].rank(), 1) << "survivors keep their relative order";
  EXPECT_EQ(a[w0].world_size(), 2);
  EXPECT_EQ(a[w0].start_step(), 41);
  v1::Job j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(j.generation(), 2);
  EXPECT_EQ(j.recoveries(), 1);
  ASSERT_EQ(j.recovery_history_size(), 1);
  EXPECT_EQ(j.recovery_history(0).from_generation(), 1);
  EXPECT_EQ(j.recovery_history(0).to_generation(), 2);
  EXPECT_EQ(j.recovery_history(0).step_at_detection(), 40);
  EXPECT_NE(j.recovery_history(0).reason().find("w1"), std::string::npos);
  // The fenced generation is rejected; the new one is accepted.
  EXPECT_EQ(Progress(w0, job, 1, 41).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(core_.Fence(job, 1).code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(core_.Fence(job, 2).ok());
  // Generation 2 healed from step 40 (the group agreed on it), then its first step: nothing
  // redone, and the recovery took detection to first step.
  v1::ResumedReport resumed;
  resumed.set_job_id(job);
  resumed.set_generation(2);
  resumed.set_resumed_from_step(40);
  resumed.set_source_rank(0);
  resumed.set_heal_ms(3);
  ASSERT_TRUE(core_.ReportResumed(w0, resumed, now_, &d).ok());
  EXPECT_EQ(Job(job).recovery_history(0).first_step_unix_ms(), 0) << "no step yet";
  now_ += absl::Milliseconds(100);
  v1::ProgressReport p;
  p.set_job_id(job);
  p.set_generation(2);
  p.set_step(41);
  p.set_first_of_generation(true);
  ASSERT_TRUE(core_.ReportProgress(w0, p, now_, &d).ok());
  j = Job(job);
  EXPECT_FALSE(j.recovery_history(0).steps_redone_lower_bound());
  EXPECT_EQ(j.step(), 41);
  EXPECT_EQ(j.recovery_history(0).steps_redone(), 0);
  EXPECT_EQ(j.recovery_history(0).resumed_from_step(), 40);
  EXPECT_EQ(j.recovery_history(0).first_step_unix_ms() - j.recovery_history(0).detect_unix_ms(),
            100);
  // The timeline: generation 1 of all three ended when w1 was lost; generation 2 is w0 and w2,
  // with w1 gone and nobody new.
  ASSERT_EQ(j.generations_size(), 2);
  const v1::Generation& first = j.generations(0);
  EXPECT_EQ(first.generation(), 1);
  EXPECT_EQ(std::vector<std::string>(first.members().begin(), first.members().end()),
            (std::vector<std::string>{"w0", "w1", "w2"}));
  EXPECT_EQ(first.joined_size(), 3) << "everyone joins the first generation";
  EXPECT_EQ(first.left_size(), 0);
  EXPECT_NE(first.end_reason().find("w1"), std::string::npos) << first.end_reason();
  EXPECT_EQ(first.ended_unix_ms(), j.recovery_history(0).detect_unix_ms());
  const v1::Generation& second = j.generations(1);
  EXPECT_EQ(second.generation(), 2);
  EXPECT_EQ(std::vector<std::string>(second.members().begin(), second.members().end()),
            (std::vector<std::string>{"w0", "w2"}));
  EXPECT_EQ(std::vector<std::string>(second.member_ids().begin(), second.member_ids().end()),
            (std::vector<std::string>{w0, w2}));
  EXPECT_EQ(second.joined_size(), 0);
  EXPECT_EQ(std::vector<std::string>(second.left().begin(), second.left().end()),
            (std::vector<std::string>{"w1"}));
  EXPECT_EQ(second.formed_unix_ms(), j.recovery_history(0).reformed_unix_ms());
  EXPECT_EQ(second.ended_unix_ms(), 0) << "still training";
  EXPECT_EQ(second.end_reason(), "");
}

TEST_F(CoreTest, MemberLostAfterAnotherFinishedCompletesTheJob) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string job = Submit(Spec(1, 2));
  TakeAssignments();
  ASSERT_TRUE(Finished(w1, job, 1, "abc").ok());  // rank 1 done; rank 0 dies before reporting
  Decisions d;
  core_.WorkerDisconnected(w0, "stream closed", now_, &d);
  v1::Job j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED) << j.reason();
  EXPECT_DOUBLE_EQ(j.eval().test_accuracy(), 0.9) << "the surviving member's evaluation";
  EXPECT_EQ(j.recoveries(), 0);
}

// Results a user can trust: a job succeeds only when the members of its generation agree.
TEST_F(CoreTest, MembersThatDisagreeOnTheResultFailTheJobNamingThem) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string job = Submit(Spec(2, 2));
  TakeAssignments();
  ASSERT_TRUE(Finished(w0, job, 1, "abc").ok());
  ASSERT_TRUE(Finished(w1, job, 1, "deadbeefdeadbeef").ok());
  v1::Job j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(j.reason().find("disagree"), std::string::npos) << j.reason();
  EXPECT_NE(j.reason().find("w0: step 100, parameters abc"), std::string::npos) << j.reason();
  EXPECT_NE(j.reason().find("w1: step 100, parameters deadbeefdeadbeef"), std::string::npos);
}

TEST_F(CoreTest, AnEvaluationOnlyOneMemberReportsIsNotTheResult) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string job = Submit(Spec(2, 2));
  TakeAssignments();
  ASSERT_TRUE(Finished(w0, job, 1, "abc").ok());
  v1::FinishedReport forged;
  forged.set_job_id(job);
  forged.set_generation(1);
  forged.set_step(100);
  forged.set_parameter_checksum("abc");
  forged.mutable_eval()->set_test_accuracy(0.9999);
  Decisions d;
  ASSERT_TRUE(core_.ReportFinished(w1, forged, now_, &d).ok());
  v1::Job j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(j.reason().find("w1: step 100, parameters abc, a different evaluation"),
            std::string::npos)
      << j.reason();
}

// A lone Finished (true or forged) followed by a disconnect does not end the job for the
// members still training: the job re-forms and trains on to their result.
TEST_F(CoreTest, ALoneFinishedThenADisconnectReformsInsteadOfSucceeding) {
  const std::string w0 = Register("w0"), w1 = Register("w1"), w2 = Register("w2");
  const std::string job = Submit(Spec(2, 2));
  auto first = TakeAssignments();
  ASSERT_EQ(first.size(), 2u);
  const std::string forger = first.count(w1) ? w1 : w0;
  v1::FinishedReport forged;
  forged.set_job_id(job);
  forged.set_generation(1);
  forged.set_step(100);
  forged.set_parameter_checksum("deadbeefdeadbeef");
  forged.mutable_eval()->set_test_accuracy(0.9999);
  Decisions d;
  ASSERT_TRUE(core_.ReportFinished(forger, forged, now_, &d).ok());
  core_.WorkerDisconnected(forger, "stream closed", now_, &d);
  Collect(d);
  v1::Job j = Job(job);
  EXPECT_NE(j.state(), v1::JOB_STATE_SUCCEEDED) << j.reason();
  EXPECT_EQ(j.generation(), 2) << "re-formed with the spare";
  EXPECT_EQ(j.recoveries(), 1);
  // The new generation finishes with its own agreed result.
  const auto next = TakeAssignments();
  ASSERT_EQ(next.size(), 2u);
  for (const auto& [worker, assignment] : next) {
    ASSERT_TRUE(Finished(worker, job, 2, "abc").ok());
  }
  j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED) << j.reason();
  EXPECT_DOUBLE_EQ(j.eval().test_accuracy(), 0.9) << "not the forged 0.9999";
  EXPECT_EQ(j.members(0).parameter_checksum(), "abc");
}

TEST_F(CoreTest, BelowMinWorkersWaitsThenFailsAfterRendezvousTimeout) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  v1::JobSpec spec = Spec(2, 2);
  spec.set_rendezvous_timeout_ms(3000);
  const std::string job = Submit(spec);
  TakeAssignments();
  Decisions d;
  core_.WorkerDisconnected(w1, "stream closed", now_, &d);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING);
  EXPECT_NE(Job(job).reason().find("waiting for 2 workers"), std::string::npos)
      << Job(job).reason();
  now_ += absl::Seconds(2);
  Heartbeats({w0});
  Tick();
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING);
  now_ += absl::Seconds(2);
  Heartbeats({w0});
  Tick();
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(Job(job).reason().find("rendezvous_timeout_ms"), std::string::npos);
}

TEST_F(CoreTest, ReconfiguringJobResumesWhenAWorkerArrives) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string job = Submit(Spec(2, 2));
  TakeAssignments();
  Decisions d;
  core_.WorkerDisconnected(w1, "stream closed", now_, &d);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING);
  const std::string w1b = Register("w1");  // restarted by its service manager
  auto a = TakeAssignments();
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a[w0].rank(), 0);
  EXPECT_EQ(a[w1b].rank(), 1);
  EXPECT_EQ(Job(job).generation(), 2);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
}

TEST_F(CoreTest, CollectiveErrorReportWaitsForTheCulpritThenReforms) {
  const std::string w0 = Register("w0"), w1 = Register("w1"), w2 = Register("w2");
  const std::string job = Submit(Spec(1, 3));
  TakeAssignments();
  // All three formed their group (they wrote to the generation's store).
  for (const std::string& w : {w0, w1, w2}) core_.NoteMemberActivity(w, job, 1);
  v1::FailureReport f;
  f.set_job_id(job);
  f.set_generation(1);
  f.set_message("allreduce: Connection reset by peer");
  Decisions d;
  ASSERT_TRUE(core_.ReportFailure(w0, f, now_, &d).ok());
  Collect(d);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING);
  EXPECT_EQ(TakeAborts().size(), 3u);
  // Within the grace period the dead peer's stream closes: it is left out.
  now_ += absl::Milliseconds(50);
  d = {};
  core_.WorkerDisconnected(w2, "stream closed", now_, &d);
  Collect(d);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING);
  now_ += absl::Milliseconds(300);
  Heartbeats({w0, w1});
  Tick();
  auto a = TakeAssignments();
  EXPECT_EQ(a.size(), 2u);
  EXPECT_EQ(a.count(w2), 0u);
  EXPECT_EQ(Job(job).recoveries(), 1) << "one failure, one recovery";
}

TEST_F(CoreTest, MaxRestartsBoundsRecoveries) {
  std::vector<std::string> w;
  for (int i = 0; i < 4; ++i) w.push_back(Register("w" + std::to_string(i)));
  v1::JobSpec spec = Spec(1, 2);
  spec.set_max_restarts(1);
  const std::string job = Submit(spec);
  auto a = TakeAssignments();
  ASSERT_EQ(a.size(), 2u);
  Decisions d;
  core_.WorkerDisconnected(a.begin()->first, "killed", now_, &d);
  Collect(d);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(job).recoveries(), 1);
  a = TakeAssignments();
  ASSERT_EQ(a.size(), 2u) << "the survivor and a spare";
  d = {};
  core_.WorkerDisconnected(a.begin()->first, "killed again", now_, &d);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(Job(job).reason().find("max_restarts 1 used up"), std::string::npos)
      << Job(job).reason();
}

TEST_F(CoreTest, SpareJoinsARunningJobBelowMaxAfterItsFirstStep) {
  const std::string w0 = Register("w0");
  const std::string job = Submit(Spec(1, 2));
  TakeAssignments();
  const std::string w1 = Register("w1");
  EXPECT_TRUE(TakeAssignments().empty()) << "no re-formation before the first step";
  v1::ProgressReport p;
  p.set_job_id(job);
  p.set_generation(1);
  p.set_step(1);
  p.set_first_of_generation(true);
  Decisions d;
  ASSERT_TRUE(core_.ReportProgress(w0, p, now_, &d).ok());
  Tick();
  auto a = TakeAssignments();
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a[w0].rank(), 0);
  EXPECT_EQ(a[w1].rank(), 1);
  v1::Job j = Job(job);
  EXPECT_EQ(j.generation(), 2);
  EXPECT_EQ(j.recoveries(), 0) << "scale-ups do not count against max_restarts";
  ASSERT_EQ(j.recovery_history_size(), 1);
  EXPECT_TRUE(j.recovery_history(0).scale_up());
  ASSERT_EQ(j.generations_size(), 2);
  EXPECT_EQ(
      std::vector<std::string>(j.generations(1).joined().begin(), j.generations(1).joined().end()),
      (std::vector<std::string>{"w1"}));
  EXPECT_EQ(j.generations(1).left_size(), 0);
  EXPECT_EQ(j.generations(0).end_reason(), j.recovery_history(0).reason());
  // Full: a third worker stays a spare.
  Register("w2");
  Tick();
  EXPECT_TRUE(TakeAssignments().empty());
  // Cancelled: the last generation ends with the job's reason.
  Decisions cancel;
  ASSERT_TRUE(core_.CancelJob(job, now_, &cancel).ok());
  j = Job(job);
  EXPECT_EQ(j.generations(1).end_reason(), "cancelled by user");
  EXPECT_GT(j.generations(1).ended_unix_ms(), 0);
}

TEST_F(CoreTest, AWorkerBackUnderItsOldNameLeftAndJoined) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string job = Submit(Spec(2, 2));
  TakeAssignments();
  Decisions d;
  core_.WorkerDisconnected(w1, "stream closed", now_, &d);
  Collect(d);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING);
  const std::string again = Register("w1");  // restarted: a new id under the same name
  ASSERT_NE(again, w1);
  v1::Job j = Job(job);
  ASSERT_EQ(j.state(), v1::JOB_STATE_RUNNING);
  ASSERT_EQ(j.generations_size(), 2);
  EXPECT_EQ(
      std::vector<std::string>(j.generations(1).joined().begin(), j.generations(1).joined().end()),
      (std::vector<std::string>{"w1"}));
  EXPECT_EQ(
      std::vector<std::string>(j.generations(1).left().begin(), j.generations(1).left().end()),
      (std::vector<std::string>{"w1"}));
}

TEST_F(CoreTest, TrainingCurveKeepsRankZerosReportsAndUnknownJobsAreNotFound) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string job = Submit(Spec(2, 2));
  TakeAssignments();
  for (int step = 1; step <= 5; ++step) {
    now_ += absl::Milliseconds(10);
    ASSERT_TRUE(Progress(w0, job, 1, step).ok());
    ASSERT_TRUE(Progress(w1, job, 1, step).ok());  // only rank 0 speaks for the group
  }
  absl::StatusOr<v1::TrainingCurve> curve = core_.GetTrainingCurve(job);
  ASSERT_TRUE(curve.ok()) << curve.status();
  EXPECT_EQ(curve->job_id(), job);
  ASSERT_EQ(curve->points_size(), 5);
  EXPECT_EQ(curve->points(4).step(), 5);
  EXPECT_DOUBLE_EQ(curve->points(4).loss(), 1.0 / 5);
  EXPECT_DOUBLE_EQ(curve->points(4).samples_per_second(), 1000);
  EXPECT_EQ(curve->points(4).time_unix_ms() - curve->points(0).time_unix_ms(), 40);
  EXPECT_EQ(core_.GetTrainingCurve("job-404").status().code(), absl::StatusCode::kNotFound);
}

v1::TrainingPoint Point(int64_t step, double loss) {
  v1::TrainingPoint p;
  p.set_step(step);
  p.set_loss(loss);
  return p;
}

TEST(TrainingCurveTest, StepsTrainedAgainReplaceTheOldPoints) {
  TrainingCurve curve;
  for (int64_t step = 1; step <= 10; ++step) curve.Add(Point(step, 1.0));
  curve.Add(Point(7, 2.0));  // a group resumed from step 6
  ASSERT_EQ(curve.points().size(), 7u);
  EXPECT_EQ(curve.points().back().step(), 7);
  EXPECT_EQ(curve.points().back().loss(), 2.0);
}

TEST(TrainingCurveTest, StaysBoundedAndEvenlySpacedOverALongJob) {
  TrainingCurve curve;
  // Reports every third step for a long time.
  const int64_t last = 3 * 100'000;
  for (int64_t step = 3; step <= last; step += 3) {
    curve.Add(Point(step, 1.0));
    ASSERT_LE(curve.points().size(), TrainingCurve::kMaxPoints);
  }
  const std::vector<v1::TrainingPoint>& points = curve.points();
  ASSERT_GT(points.size(), TrainingCurve::kMaxPoints / 2);
  EXPECT_EQ(points.front().step(), 3) << "the first point stays";
  EXPECT_GT(points.back().step(), last - 2 * curve.spacing()) << "the curve reaches the end";
  // Even: the largest gap is at most twice the smallest (the old half thinned once more than
  // the newest points would be otherwise).
  int64_t smallest = last, largest = 0;
  for (size_t i = 1; i < points.size(); ++i) {
    const int64_t gap = points[i].step() - points[i - 1].step();
    smallest = std::min(smallest, gap);
    largest = std::max(largest, gap);
  }
  EXPECT_GE(smallest, 1);
  EXPECT_LE(largest, 2 * smallest + 3) << "smallest " << smallest << ", largest " << largest;
}

TEST_F(CoreTest, PendingJobsTakeIdleWorkersBeforeScaleUp) {
  const std::string w0 = Register("w0");
  const std::string first = Submit(Spec(1, 2));
  TakeAssignments();
  v1::ProgressReport p;
  p.set_job_id(first);
  p.set_generation(1);
  p.set_step(1);
  p.set_first_of_generation(true);
  Decisions d;
  ASSERT_TRUE(core_.ReportProgress(w0, p, now_, &d).ok());
  const std::string second = Submit(Spec(1, 1));
  const std::string w1 = Register("w1");
  EXPECT_EQ(Job(second).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(first).generation(), 1);
}

TEST(AssignRanksTest, SurvivorsKeepOrderNewcomersAfterHostsContiguous) {
  struct Case {
    std::vector<RankCandidate> survivors, newcomers;
    std::vector<std::string> want;
  };
  const std::vector<Case> cases = {
      {{}, {{"a", "h1", 1}, {"b", "h1", 2}}, {"a", "b"}},
      {{}, {{"b", "h1", 2}, {"a", "h1", 1}}, {"a", "b"}},
      // Hosts interleaved by registration are made contiguous, first host first.
      {{}, {{"a", "h1", 1}, {"b", "h2", 2}, {"c", "h1", 3}}, {"a", "c", "b"}},
      // Survivors keep their order even when it is not registration order.
      {{{"c", "h1", 3}, {"a", "h1", 1}}, {{"d", "h1", 4}}, {"c", "a", "d"}},
      // A newcomer on a survivor's host joins that host's block, after the survivors there.
      {{{"a", "h1", 1}, {"b", "h2", 2}}, {{"c", "h1", 5}, {"d", "h3", 4}}, {"a", "c", "b", "d"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(AssignRanks(cases[i].survivors, cases[i].newcomers), cases[i].want) << "case " << i;
  }
}

// A restarted coordinator gets the previous one's saved jobs: the running one re-forms from the
// workers that register, in a generation after the saved one, without counting a restart;
// the pending one queues behind it; the finished one is listed as it was; new ids continue.
TEST_F(CoreTest, RestoredJobsResumeAsWorkersRegister) {
  // The first coordinator's life: job-1 finished, job-2 running at step 40 in generation 3,
  // job-3 pending.
  const std::string a = Register("a");
  const std::string b = Register("b");
  const std::string done = Submit(Spec(2, 2));
  TakeAssignments();
  ASSERT_TRUE(Finished(a, done, 1, "c").ok());
  ASSERT_TRUE(Finished(b, done, 1, "c").ok());
  ASSERT_EQ(Job(done).state(), v1::JOB_STATE_SUCCEEDED);
  RecordEnds();
  const std::string running = Submit(Spec(2, 2));
  std::map<std::string, v1::Assignment> first = TakeAssignments();
  ASSERT_EQ(first.size(), 2u);
  ASSERT_TRUE(Progress(a, running, first[a].generation(), 40).ok());
  const std::string pending = Submit(Spec(2, 2));
  std::vector<v1::Job> saved = {Job(pending), Job(done), Job(running)};
  saved[2].set_generation(3);
  saved[2].set_recoveries(1);

  Core fresh(Options());
  Decisions d;
  EXPECT_EQ(fresh.RestoreJobs(saved, now_, &d), 2);
  v1::Job r = fresh.GetJob(running).value();
  EXPECT_EQ(r.state(), v1::JOB_STATE_RECONFIGURING);
  EXPECT_EQ(r.step(), 40);
  EXPECT_EQ(r.recoveries(), 1);
  ASSERT_EQ(r.recovery_history_size(), 1);
  EXPECT_EQ(r.recovery_history(0).reason(), "coordinator restarted");
  EXPECT_EQ(r.recovery_history(0).step_at_detection(), 40);
  EXPECT_EQ(fresh.GetJob(pending).value().state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(fresh.GetJob(done).value().state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(fresh.ListJobs()->jobs_size(), 3);

  // The workers come back (new sessions, new ids): the running job re-forms first, in
  // generation 4; the pending one waits for idle workers.
  std::map<std::string, v1::Assignment> assigned;
  for (const char* name : {"a", "b"}) {
    v1::RegisterRequest req;
    req.set_name(name);
    req.set_host("h1");
    req.set_device("cpu");
    Decisions rd;
    ASSERT_TRUE(fresh.RegisterWorker(req, now_, &rd).ok());
    for (const auto& m : rd.messages) {
      if (m.message.has_assignment()) assigned[m.worker_id] = m.message.assignment();
    }
  }
  ASSERT_EQ(assigned.size(), 2u);
  for (const auto& [worker, assignment] : assigned) {
    EXPECT_EQ(assignment.job_id(), running);
    EXPECT_EQ(assignment.generation(), 4);
  }
  EXPECT_EQ(fresh.GetJob(running).value().state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(fresh.GetJob(pending).value().state(), v1::JOB_STATE_PENDING);

  Decisions sd;
  absl::StatusOr<v1::Job> next = fresh.SubmitJob(Spec(1, 1), now_, &sd);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->job_id(), "job-4");
}

// Worker ids start again at w-1 in every coordinator, so a restored job's timeline compares
// names: here the new c gets the id the old a had, and a the one b had.
TEST_F(CoreTest, TimelineAfterACoordinatorRestartComparesNames) {
  const std::string a = Register("a"), b = Register("b");
  const std::string running = Submit(Spec(2, 2));
  TakeAssignments();
  std::vector<v1::Job> saved = {Job(running)};
  ASSERT_EQ(saved[0].generations_size(), 1);

  Core fresh(Options());
  Decisions d;
  ASSERT_EQ(fresh.RestoreJobs(saved, now_, &d), 1);
  std::vector<std::string> ids;
  for (const char* name : {"c", "a"}) {
    v1::RegisterRequest req;
    req.set_name(name);
    req.set_host("h1");
    req.set_device("cpu");
    Decisions rd;
    absl::StatusOr<std::string> id = fresh.RegisterWorker(req, now_, &rd);
    ASSERT_TRUE(id.ok());
    ids.push_back(*id);
  }
  EXPECT_EQ(ids, (std::vector<std::string>{a, b})) << "the ids collide";
  // b does not come back: the job re-forms without it once the restart's grace is over.
  EXPECT_EQ(fresh.GetJob(running).value().state(), v1::JOB_STATE_RECONFIGURING);
  now_ += Options().restart_grace;
  Decisions td;
  fresh.Tick(now_, &td);
  v1::Job j = fresh.GetJob(running).value();
  ASSERT_EQ(j.state(), v1::JOB_STATE_RUNNING);
  ASSERT_EQ(j.generations_size(), 2);
  EXPECT_EQ(j.generations(0).end_reason(), "coordinator restarted");
  EXPECT_EQ(
      std::vector<std::string>(j.generations(1).joined().begin(), j.generations(1).joined().end()),
      (std::vector<std::string>{"c"}));
  EXPECT_EQ(
      std::vector<std::string>(j.generations(1).left().begin(), j.generations(1).left().end()),
      (std::vector<std::string>{"b"}));
}

// The coordinator is not on the step path: a group that trained on while it restarted is kept
// as it is when all its members come back training it, and re-formed otherwise.
class AdoptionTest : public CoreTest {
 protected:
  // A 2-worker job running generation 1 at step 40, saved, and a fresh core that restored it.
  void SetUp() override {
    a_ = Register("a");
    b_ = Register("b");
    job_ = Submit(Spec(1, 2));
    TakeAssignments();
    ASSERT_TRUE(Progress(a_, job_, 1, 40).ok());
    ASSERT_TRUE(Progress(b_, job_, 1, 40).ok());
    fresh_ = std::make_unique<Core>(Options());
    Decisions d;
    ASSERT_EQ(fresh_->RestoreJobs({Job(job_)}, now_, &d), 1);
  }
  // Registers `name` with the fresh core, training `generation` as `rank` (none: -1); returns
  // its id and collects what the core sent.
  std::string Back(const std::string& name, int64_t generation, int32_t rank, int64_t step = 45,
                   int32_t world_size = 2) {
    v1::RegisterRequest r;
    r.set_name(name);
    r.set_host("h1");
    r.set_device("cpu");
    if (rank >= 0) {
      r.mutable_running()->set_job_id(job_);
      r.mutable_running()->set_generation(generation);
      r.mutable_running()->set_rank(rank);
      r.mutable_running()->set_world_size(world_size);
      r.mutable_running()->set_step(step);
    }
    r.mutable_held()->set_job_id(job_);
    r.mutable_held()->set_step(step);
    Decisions d;
    absl::StatusOr<std::string> id = fresh_->RegisterWorker(r, now_, &d);
    EXPECT_TRUE(id.ok()) << id.status();
    Collect(d);
    return id.value_or("");
  }
  v1::Job Fresh() { return fresh_->GetJob(job_).value(); }
  // Messages sent since the last call, as "worker: abort job/gen" or "worker: assign job/gen".
  std::vector<std::string> Take() {
    std::vector<std::string> out;
    for (const auto& m : sent_) {
      if (m.message.has_abort()) {
        out.push_back(absl::StrCat(m.worker_id, ": abort ", m.message.abort().generation(),
                                   m.message.abort().job_ended() ? " (job ended)" : ""));
      }
      if (m.message.has_assignment()) {
        out.push_back(absl::StrCat(m.worker_id, ": assign ", m.message.assignment().generation()));
      }
    }
    sent_.clear();
    return out;
  }

  std::string a_, b_, job_;
  std::unique_ptr<Core> fresh_;
};

TEST_F(AdoptionTest, AGroupWhoseMembersAllComeBackTrainingItIsKept) {
  v1::Job restored = Fresh();
  EXPECT_EQ(restored.state(), v1::JOB_STATE_RECONFIGURING);
  EXPECT_EQ(restored.recovery_history_size(), 0);
  EXPECT_TRUE(absl::StrContains(restored.reason(), "may train on")) << restored.reason();

  const std::string a = Back("a", 1, 0, 44);
  EXPECT_TRUE(Take().empty()) << "nothing is aborted while the others may still come back";
  // Its reports wait: neither recorded nor answered with an abort.
  v1::ProgressReport p;
  p.set_job_id(job_);
  p.set_generation(1);
  p.set_step(46);
  Decisions pd;
  EXPECT_TRUE(absl::IsUnavailable(fresh_->ReportProgress(a, p, now_, &pd)));
  EXPECT_TRUE(pd.messages.empty());

  const std::string b = Back("b", 1, 1, 45);
  EXPECT_TRUE(Take().empty()) << "kept as it is: no abort, no assignment";
  v1::Job kept = Fresh();
  EXPECT_EQ(kept.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(kept.generation(), 1);
  EXPECT_EQ(kept.generations_size(), 1);
  EXPECT_EQ(kept.generations(0).ended_unix_ms(), 0);
  EXPECT_EQ(kept.recovery_history_size(), 0);
  EXPECT_EQ(kept.recoveries(), 0);
  EXPECT_EQ(kept.step(), 45);
  ASSERT_EQ(kept.members_size(), 2);
  EXPECT_EQ(kept.members(0).worker_id(), a);
  EXPECT_EQ(kept.members(1).worker_id(), b);
  EXPECT_EQ(kept.generations(0).member_ids(0), a);

  // It trains and ends as any generation does.
  Decisions d;
  p.set_step(47);
  EXPECT_TRUE(fresh_->ReportProgress(a, p, now_, &d).ok());
  EXPECT_EQ(Fresh().step(), 47);
  for (const std::string& w : {a, b}) {
    v1::FinishedReport f;
    f.set_job_id(job_);
    f.set_generation(1);
    f.set_step(100);
    f.set_parameter_checksum("c");
    ASSERT_TRUE(fresh_->ReportFinished(w, f, now_, &d).ok());
  }
  EXPECT_EQ(Fresh().state(), v1::JOB_STATE_SUCCEEDED);
}

TEST_F(AdoptionTest, AMemberBackWithoutItsGroupReformsTheJobAndStopsTheOthers) {
  const std::string a = Back("a", 1, 0);
  const std::string b = Back("b", 1, /*rank=*/-1);  // its process restarted: nothing trains
  const std::vector<std::string> sent = Take();
  // a's group is stopped first, then both form generation 2 and heal from what they hold.
  ASSERT_EQ(sent.size(), 3u) << absl::StrJoin(sent, "; ");
  EXPECT_EQ(sent[0], absl::StrCat(a, ": abort 1"));
  v1::Job j = Fresh();
  EXPECT_EQ(j.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(j.generation(), 2);
  ASSERT_EQ(j.recovery_history_size(), 1);
  EXPECT_EQ(j.recovery_history(0).reason(), "coordinator restarted");
  EXPECT_FALSE(j.recovery_history(0).counted());
  EXPECT_EQ(j.recoveries(), 0);
  EXPECT_EQ(j.generations(0).end_reason(), "coordinator restarted");
  bool said = false;
  absl::StatusOr<std::vector<v1::JobEvent>> events = fresh_->EventsSince(job_, 0);
  ASSERT_TRUE(events.ok());
  for (const v1::JobEvent& e : *events) {
    said = said || absl::StrContains(e.message(),
                                     "generation 1 is not kept: b came back "
                                     "without its group training");
  }
  EXPECT_TRUE(said);
}

TEST_F(AdoptionTest, AMemberThatNeverComesBackEndsTheWaitAfterTheGrace) {
  const std::string a = Back("a", 1, 0);
  now_ += Options().restart_grace - absl::Milliseconds(1);
  Decisions d;
  fresh_->Tick(now_, &d);
  Collect(d);
  EXPECT_TRUE(Take().empty());
  EXPECT_TRUE(absl::StrContains(Fresh().reason(), "1 of 2 back training")) << Fresh().reason();
  now_ += absl::Milliseconds(1);
  Decisions t;
  fresh_->Tick(now_, &t);
  Collect(t);
  EXPECT_EQ(Take(), (std::vector<std::string>{absl::StrCat(a, ": abort 1"),
                                              absl::StrCat(a, ": assign 2")}));
  v1::Job j = Fresh();
  EXPECT_EQ(j.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(j.members_size(), 1);
  ASSERT_EQ(j.recovery_history_size(), 1);
  EXPECT_EQ(j.recovery_history(0).detect_unix_ms(),
            absl::ToUnixMillis(now_ - Options().restart_grace));
}

TEST_F(AdoptionTest, AMemberLostOrFailedWhileAwaitedEndsTheWait) {
  const std::string a = Back("a", 1, 0);
  v1::FailureReport f;
  f.set_job_id(job_);
  f.set_generation(1);
  f.set_message("peer closed the connection");
  Decisions d;
  ASSERT_TRUE(fresh_->ReportFailure(a, f, now_, &d).ok());
  Collect(d);
  // Its group broke: it is stopped (already stopped, but the abort costs nothing) and the job
  // re-forms with it as soon as b is back.
  EXPECT_EQ(Take(), (std::vector<std::string>{absl::StrCat(a, ": abort 1")}));
  EXPECT_EQ(Fresh().recovery_history_size(), 1);
  const std::string b = Back("b", 1, 1);
  const std::vector<std::string> sent = Take();
  EXPECT_EQ(sent.size(), 3u) << absl::StrJoin(sent, "; ");  // b aborted; both assigned 2
  EXPECT_EQ(Fresh().generation(), 2);
}

TEST_F(AdoptionTest, AFatalReportWhileAwaitedLeavesItsReporterOut) {
  const std::string a = Back("a", 1, 0);
  v1::FailureReport f;
  f.set_job_id(job_);
  f.set_generation(1);
  f.set_fatal(true);
  f.set_message("cannot read the data set");
  Decisions d;
  ASSERT_TRUE(fresh_->ReportFailure(a, f, now_, &d).ok());
  Collect(d);
  const std::string b = Back("b", 1, 1);
  std::map<std::string, v1::Assignment> assigned = TakeAssignments();
  ASSERT_EQ(assigned.size(), 1u);
  EXPECT_EQ(assigned.begin()->first, b);
  EXPECT_EQ(assigned.begin()->second.generation(), 2);
  v1::Job j = Fresh();
  ASSERT_EQ(j.members_size(), 1);
  EXPECT_EQ(j.members(0).worker_id(), b);
}

TEST_F(AdoptionTest, AWorkerLostWhileAwaitedEndsTheWait) {
  const std::string a = Back("a", 1, 0);
  Decisions d;
  fresh_->WorkerDisconnected(a, "stream closed", now_, &d);
  Collect(d);
  EXPECT_EQ(Fresh().state(), v1::JOB_STATE_RECONFIGURING);
  EXPECT_EQ(Fresh().recovery_history_size(), 1);
  Back("b", 1, 1);
  const std::vector<std::string> sent = Take();
  ASSERT_FALSE(sent.empty());
  EXPECT_TRUE(absl::StrContains(sent[0], ": abort 1")) << sent[0];
}

TEST_F(AdoptionTest, AGenerationOrRankThatDoesNotMatchIsNotKept) {
  // b claims rank 0, which a holds in the saved generation.
  const std::string b = Back("b", 1, 0);
  EXPECT_EQ(Take(), (std::vector<std::string>{absl::StrCat(b, ": abort 1")}));
  EXPECT_EQ(Fresh().recovery_history_size(), 1);
  // An unknown job's group is told the job is over; a stale generation of a live job only
  // stops.
  v1::RegisterRequest r;
  r.set_name("c");
  r.set_device("cpu");
  r.mutable_running()->set_job_id("job-9-zzzzzz");
  r.mutable_running()->set_generation(3);
  r.mutable_running()->set_world_size(1);
  Decisions d;
  absl::StatusOr<std::string> c = fresh_->RegisterWorker(r, now_, &d);
  ASSERT_TRUE(c.ok());
  Collect(d);
  const std::vector<std::string> sent = Take();
  EXPECT_NE(std::find(sent.begin(), sent.end(), absl::StrCat(*c, ": abort 3 (job ended)")),
            sent.end())
      << absl::StrJoin(sent, "; ");
}

// Suspended while awaited: the members back training it stop their generation and park its
// state; one that comes back training it afterwards is told the job is suspended.
TEST_F(AdoptionTest, ASuspendedJobsGroupStopsAndParksItsState) {
  const std::string a = Back("a", 1, 0);
  Decisions d;
  ASSERT_TRUE(fresh_->SuspendJob(job_, now_, &d).ok());
  Collect(d);
  bool stopped = false;
  for (const auto& m : sent_) {
    if (m.worker_id == a && m.message.has_abort()) {
      EXPECT_EQ(m.message.abort().generation(), 1);
      EXPECT_TRUE(m.message.abort().suspended());
      stopped = true;
    }
  }
  EXPECT_TRUE(stopped);
  sent_.clear();
  v1::Job j = Fresh();
  EXPECT_EQ(j.state(), v1::JOB_STATE_SUSPENDED);
  EXPECT_NE(j.generations(0).ended_unix_ms(), 0) << "the generation ended with the suspension";
  const std::string b = Back("b", 1, 1);
  bool told = false;
  for (const auto& m : sent_) {
    if (m.worker_id == b && m.message.has_abort() && m.message.abort().generation() == 1) {
      EXPECT_TRUE(m.message.abort().suspended());
      EXPECT_NE(m.message.abort().reason().find("the job is suspended"), std::string::npos)
          << m.message.abort().reason();
      told = true;
    }
  }
  EXPECT_TRUE(told);
}

// Jobs saved to --state_dir come back after a restart; a corrupt file is skipped (and kept
// aside as *.corrupt), never fatal; a later save replaces the earlier one.
TEST(FileJobStoreTest, SavesReloadsAndSkipsCorruptFiles) {
  const std::string dir = ::testing::TempDir() + "/job-store-test";
  std::filesystem::remove_all(dir);
  auto store = FileJobStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  v1::Job job;
  job.set_job_id("job-7");
  job.set_state(v1::JOB_STATE_RUNNING);
  job.set_step(10);
  ASSERT_TRUE((*store)->Save(job).ok());
  job.set_step(20);
  ASSERT_TRUE((*store)->Save(job).ok());
  std::ofstream(dir + "/jobs/job-8.pb") << "\xff\xff not a job";
  v1::Job bad_id;
  bad_id.set_job_id("../escape");
  EXPECT_FALSE((*store)->Save(bad_id).ok());

  auto reopened = FileJobStore::Open(dir);
  ASSERT_TRUE(reopened.ok());
  auto jobs = (*reopened)->LoadAll();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 1u);
  EXPECT_EQ((*jobs)[0].job_id(), "job-7");
  EXPECT_EQ((*jobs)[0].step(), 20);
  EXPECT_TRUE(std::filesystem::exists(dir + "/jobs/job-8.pb.corrupt"));
  EXPECT_FALSE(FileJobStore::Open("/proc/no-such-dir").ok());
}

// The reference MLP (784-512-512-10, SGD, batch 256): the estimate follows the formulas.
TEST(MemoryEstimateTest, ReferenceModel) {
  v1::JobSpec spec;
  spec.mutable_model()->set_type("mlp");
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(512);
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(512);
  spec.mutable_dataset()->set_type("fashion_mnist");
  spec.mutable_optimizer()->set_learning_rate(0.05);
  spec.set_global_batch_size(256);
  spec.set_epochs(1);
  ApplyJobSpecDefaults(&spec);
  const int64_t params = 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10;
  EXPECT_EQ(ShareSamples(spec, 2), 128);
  EXPECT_EQ(ShareSamples(spec, 1), 256);
  const MemoryEstimate two = EstimateWorkerMemory(spec, ShareSamples(spec, 2));
  EXPECT_EQ(two.parameters, 4 * params);
  EXPECT_EQ(two.gradients, 4 * params);
  EXPECT_EQ(two.optimizer, 4 * params);
  EXPECT_EQ(two.communication, 4 * params);
  EXPECT_EQ(two.micro_batch, 128);
  EXPECT_EQ(two.activations, 4 * 128 * (784 + 2 * (512 + 512 + 10) + 2 * 512));
  // AdamW keeps two moments.
  spec.mutable_optimizer()->set_type("adamw");
  EXPECT_EQ(EstimateWorkerMemory(spec, 128).optimizer, 8 * params);
  // Deterministic mode holds one micro-shard at a time, and int64 sums.
  spec.set_deterministic(true);
  spec.set_micro_shards(8);
  EXPECT_EQ(ChooseMicroBatch(spec, 2, 0), 32);
  EXPECT_EQ(MinMicroBatch(spec), 32);
  const MemoryEstimate det = EstimateWorkerMemory(spec, 32);
  EXPECT_EQ(det.micro_batch, 32);
  EXPECT_EQ(det.communication, 16 * (params + 2));
  EXPECT_NE(det.ToString().find("32 samples at once"), std::string::npos) << det.ToString();

  EXPECT_EQ(det.device, 0) << "CPU workers hold no device buffers";

  // GPU workers also hold the second upload slot, the cuBLAS workspaces and, in a group,
  // NCCL's buffers.
  spec.set_device("cuda");
  spec.set_max_workers(1);
  const MemoryEstimate gpu = EstimateWorkerMemory(spec, 32);
  EXPECT_EQ(gpu.device, 4 * 32 * (784 + 1) + (int64_t{64} << 20));
  EXPECT_EQ(gpu.total(), det.total() + gpu.device);
  EXPECT_NE(gpu.ToString().find("GPU buffers"), std::string::npos) << gpu.ToString();
  spec.set_max_workers(4);
  EXPECT_EQ(EstimateWorkerMemory(spec, 32).device, gpu.device + (int64_t{256} << 20));
}

// A GPT on GPU workers: the head's logits in the GPU's larger chunks (a line through 0 up to
// kGpuHeadChunkValues), counted with the device buffers instead of the CPU's chunk.
TEST(MemoryEstimateTest, GptOnGpuCountsTheHeadsChunkAndTheBuffers) {
  v1::JobSpec spec;
  v1::ModelSpec* m = spec.mutable_model();
  m->set_type("gpt");
  m->mutable_gpt()->set_vocab_size(50257);
  m->mutable_gpt()->set_context_length(1024);
  m->mutable_gpt()->set_n_layer(12);
  m->mutable_gpt()->set_n_head(12);
  m->mutable_gpt()->set_d_model(768);
  spec.mutable_dataset()->set_type("tokens");
  spec.mutable_optimizer()->set_type("adamw");
  spec.set_global_batch_size(64);
  spec.set_micro_shards(64);
  spec.set_max_workers(1);
  const MemoryEstimate cpu = EstimateWorkerMemory(spec, 1);
  EXPECT_EQ(cpu.device, 0);
  spec.set_device("cuda");
  const int64_t head = int64_t{1024} * 50257;  // logits of one window
  for (int64_t mb : {1, 2, 16}) {
    const MemoryEstimate gpu = EstimateWorkerMemory(spec, mb);
    const MemoryEstimate on_cpu = [&] {
      v1::JobSpec c = spec;
      c.set_device("cpu");
      return EstimateWorkerMemory(c, mb);
    }();
    EXPECT_EQ(gpu.activations, on_cpu.activations - 4 * (int64_t{1} << 22)) << mb;
    EXPECT_EQ(gpu.device, 4 * 1025 * mb + (int64_t{64} << 20) +
                              4 * std::min<int64_t>(int64_t{1} << 26, head * mb))
        << mb;
  }
  // The line ChooseMicroBatch draws never under-counts: E(k shards) <= E(0) + k (E(1) - E(0)).
  const int64_t e0 = EstimateWorkerMemory(spec, 0).total();
  const int64_t e1 = EstimateWorkerMemory(spec, 1).total();
  for (int64_t k : {2, 8, 32}) EXPECT_LE(EstimateWorkerMemory(spec, k).total(), e0 + k * (e1 - e0));
  // bf16: the activations but the residual stream (14 C a block, and the final LayerNorm's C,
  // a token) in two bytes a value instead of four.
  v1::JobSpec bf16 = spec;
  bf16.set_precision("bf16");
  for (int64_t mb : {1, 16}) {
    EXPECT_EQ(
        EstimateWorkerMemory(bf16, mb).activations,
        EstimateWorkerMemory(spec, mb).activations - 2 * int64_t{1024} * (12 * 14 * 768 + 768) * mb)
        << mb;
    // The GPU buffers add, in bf16: the parameters' copy, a layer's output gradient (4 C a
    // token) and a chunk of the logits' gradient, rounded once for their two products.
    const int64_t params = EstimateWorkerMemory(spec, mb).parameters / 4;
    EXPECT_EQ(EstimateWorkerMemory(bf16, mb).device,
              EstimateWorkerMemory(spec, mb).device +
                  2 * (params + int64_t{1024} * 4 * 768 * mb +
                       std::min<int64_t>(int64_t{1} << 26, head * mb)))
        << mb;
  }
}

// Gradient accumulation: the whole share when it fits (or no budget is known), else the most
// whole micro-shards that fit, at least one; micro_batch_size when set.
TEST(MemoryEstimateTest, ChooseMicroBatchFitsTheBudget) {
  v1::JobSpec spec;
  spec.mutable_model()->set_type("mlp");
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(1000);
  spec.mutable_dataset()->set_type("synthetic");
  spec.mutable_dataset()->mutable_synthetic()->set_input_dim(100);
  spec.mutable_dataset()->mutable_synthetic()->set_num_classes(10);
  spec.mutable_optimizer()->set_learning_rate(0.05);
  spec.set_global_batch_size(1200);
  spec.set_micro_shards(12);  // micro-shards of 100 samples
  spec.set_epochs(1);
  ApplyJobSpecDefaults(&spec);
  EXPECT_EQ(ShareSamples(spec, 2), 600);
  EXPECT_EQ(ShareSamples(spec, 5), 300);  // 12 shards over 5: the largest share is 3 shards
  EXPECT_EQ(ChooseMicroBatch(spec, 2, 0), 600);
  const int64_t whole = EstimateWorkerMemory(spec, 600).total();
  EXPECT_EQ(ChooseMicroBatch(spec, 2, whole), 600);
  // Room for 2.5 micro-shards of activations: 2 of them at a time.
  const int64_t fixed = EstimateWorkerMemory(spec, 0).total();
  const int64_t per_shard = EstimateWorkerMemory(spec, 100).total() - fixed;
  EXPECT_EQ(ChooseMicroBatch(spec, 2, fixed + per_shard * 5 / 2), 200);
  EXPECT_LE(EstimateWorkerMemory(spec, 200).total(), fixed + per_shard * 5 / 2);
  // Not even one fits: one anyway (admission decides whether the worker may run the job).
  EXPECT_EQ(ChooseMicroBatch(spec, 2, fixed / 2), 100);
  spec.set_micro_batch_size(300);
  EXPECT_EQ(ChooseMicroBatch(spec, 2, whole), 300);
  EXPECT_EQ(ChooseMicroBatch(spec, 6, whole), 200);  // capped at the share
  EXPECT_EQ(MinMicroBatch(spec), 300);
}

// A job whose share fits on no worker but whose micro-shards do is admitted (the workers
// accumulate gradients over micro-batches); the estimate it is admitted with is one micro-batch.
TEST_F(CoreTest, MemoryPreflightAdmitsWhatFitsWithGradientAccumulation) {
  v1::JobSpec spec = Spec(1, 1);
  spec.set_device("cuda");
  spec.mutable_dataset()->mutable_synthetic()->set_input_dim(4096);
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(4096);
  spec.mutable_dataset()->mutable_synthetic()->set_train_samples(65536);
  spec.set_global_batch_size(65536);
  spec.set_micro_shards(64);
  ApplyJobSpecDefaults(&spec);
  const int64_t share = EstimateWorkerMemory(spec, ShareSamples(spec, 1)).total();
  const int64_t one = EstimateWorkerMemory(spec, MinMicroBatch(spec)).total();
  ASSERT_GT(share, 2 * one);
  const std::string w = Register("g", "h1", "cuda:0", (share + one) / 2);
  const std::string job = Submit(spec);
  std::map<std::string, v1::Assignment> assigned = TakeAssignments();
  ASSERT_EQ(assigned.size(), 1u) << Job(job).reason();
  EXPECT_EQ(assigned.at(w).job_id(), job);
  // micro_batch_size larger than what fits is the user's choice, and is refused up front.
  v1::JobSpec forced = spec;
  forced.set_micro_batch_size(65536);
  Decisions d;
  absl::StatusOr<v1::Job> refused = core_.SubmitJob(forced, now_, &d);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("65536 samples at once"), std::string::npos)
      << refused.status();
}

// A job that fits on no registered worker is refused with the numbers; one that fits only on
// some runs there and never on the others.
TEST_F(CoreTest, MemoryPreflightRefusesWhatFitsNowhereAndSkipsSmallWorkers) {
  auto register_with = [&](const std::string& name, int64_t free_bytes) {
    return Register(name, "h1", "cuda:0", free_bytes);
  };
  const std::string small = register_with("small", int64_t{64} << 20);
  v1::JobSpec huge = Spec(1, 1);
  huge.set_device("cuda");
  huge.mutable_dataset()->mutable_synthetic()->set_input_dim(8192);
  for (int i = 0; i < 3; ++i) huge.mutable_model()->mutable_mlp()->add_hidden_widths(8192);
  Decisions d;
  absl::StatusOr<v1::Job> refused = core_.SubmitJob(huge, now_, &d);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("each worker would need about"), std::string::npos);
  EXPECT_NE(refused.status().message().find("64.0 MiB (small on cuda:0)"), std::string::npos)
      << refused.status();

  // 2 workers needed, ~900 MiB each: only "big" has the memory, so the job waits and says why.
  v1::JobSpec medium = Spec(2, 2);
  medium.set_device("cuda");
  medium.mutable_dataset()->mutable_synthetic()->set_input_dim(4096);
  medium.mutable_model()->mutable_mlp()->add_hidden_widths(4096);
  medium.mutable_model()->mutable_mlp()->add_hidden_widths(4096);
  const std::string big = register_with("big", int64_t{8} << 30);
  const std::string job = Submit(medium);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_PENDING);
  EXPECT_NE(Job(job).reason().find("1 with the"), std::string::npos) << Job(job).reason();
  EXPECT_TRUE(TakeAssignments().empty());
  const std::string big2 = register_with("big2", int64_t{8} << 30);
  std::map<std::string, v1::Assignment> assigned = TakeAssignments();
  EXPECT_EQ(assigned.size(), 2u);
  EXPECT_EQ(assigned.count(small), 0u);
  EXPECT_EQ(assigned.count(big), 1u);
  EXPECT_EQ(assigned.count(big2), 1u);
}

// A job runs on one kind of device: GPU workers never join a CPU job's group and vice versa
// (their collectives could not meet), and an unknown kind is refused.
TEST_F(CoreTest, JobsUseOnlyWorkersOfTheirDevice) {
  const std::string gpu = Register("g0", "h1", "cuda:0");
  const std::string cpu = Register("c0");
  v1::JobSpec on_cpu = Spec(1, 2);
  const std::string cpu_job = Submit(on_cpu);
  std::map<std::string, v1::Assignment> assigned = TakeAssignments();
  ASSERT_EQ(assigned.size(), 1u);
  EXPECT_EQ(assigned.count(cpu), 1u);
  v1::JobSpec on_gpu = Spec(1, 1);
  on_gpu.set_device("cuda");
  const std::string gpu_job = Submit(on_gpu);
  assigned = TakeAssignments();
  ASSERT_EQ(assigned.size(), 1u);
  EXPECT_EQ(assigned.at(gpu).job_id(), gpu_job);
  EXPECT_EQ(Job(cpu_job).members_size(), 1);
  // More GPUs than this cluster has: pending, and the reason says what it waits for (the idle
  // CPU worker does not count).
  Register("c1");
  v1::JobSpec two_gpus = Spec(2, 2);
  two_gpus.set_device("cuda");
  const std::string waiting = Submit(two_gpus);
  EXPECT_EQ(Job(waiting).state(), v1::JOB_STATE_PENDING);
  EXPECT_NE(Job(waiting).reason().find("waiting for 2 idle cuda workers (0 idle)"),
            std::string::npos)
      << Job(waiting).reason();
  v1::JobSpec bad = Spec(1, 1);
  bad.set_device("tpu");
  Decisions bd;
  absl::StatusOr<v1::Job> refused = core_.SubmitJob(bad, now_, &bd);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("device"), std::string::npos);
}

// GPU workers on one GPU: two ranks of a group share a GPU only when both workers' NCCL lets
// them (the capability) and the GPU's memory holds both; otherwise the job waits, saying why,
// and a running job neither re-forms nor grows onto a worker whose GPU a member uses.
class GpuPlacementTest : public CoreTest {
 protected:
  std::string RegisterGpu(const std::string& name, const std::string& uuid, bool may_share,
                          int64_t free_memory_bytes = 0) {
    v1::RegisterRequest r;
    r.set_name(name);
    r.set_host("h1");
    r.set_device("cuda:0");
    r.set_device_uuid(uuid);
    r.set_free_memory_bytes(free_memory_bytes);
    r.add_capabilities("gloo");
    if (may_share) r.add_capabilities(kSharedGpuCapability);
    Decisions d;
    absl::StatusOr<std::string> id = core_.RegisterWorker(r, now_, &d);
    EXPECT_TRUE(id.ok()) << id.status();
    Collect(d);
    return id.value_or("");
  }
  static v1::JobSpec GpuSpec(int min_workers, int max_workers) {
    v1::JobSpec spec = Spec(min_workers, max_workers);
    spec.set_device("cuda");
    return spec;
  }
};

TEST_F(GpuPlacementTest, TwoRanksShareAGpuOnlyWhenBothWorkersMay) {
  const std::string a = RegisterGpu("a", "GPU-0", /*may_share=*/true);
  const std::string b = RegisterGpu("b", "GPU-0", /*may_share=*/false);
  const std::string job = Submit(GpuSpec(2, 2));
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_PENDING);
  EXPECT_NE(Job(job).reason().find("(2 idle, 1 left out for a GPU that another one uses"),
            std::string::npos)
      << Job(job).reason();
  EXPECT_NE(Job(job).reason().find("NCCL_MULTI_RANK_GPU_ENABLE=1"), std::string::npos);
  EXPECT_TRUE(TakeAssignments().empty());
  // A worker on a GPU of its own completes the group; the worker that may not share stays out.
  const std::string c = RegisterGpu("c", "GPU-1", /*may_share=*/false);
  std::map<std::string, v1::Assignment> assigned = TakeAssignments();
  ASSERT_EQ(assigned.size(), 2u);
  EXPECT_EQ(assigned.count(b), 0u);
  EXPECT_EQ(assigned.at(a).ranks_on_device(), 1);
  EXPECT_EQ(assigned.at(c).ranks_on_device(), 1);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  // Both may share: two ranks of the next group on one GPU, each told it has half of it; b,
  // alone on its GPU in this group, has all of its own.
  const std::string d = RegisterGpu("d", "GPU-2", true), e = RegisterGpu("e", "GPU-2", true);
  const std::string shared = Submit(GpuSpec(3, 3));
  assigned = TakeAssignments();
  ASSERT_EQ(assigned.size(), 3u);
  EXPECT_EQ(assigned.at(b).ranks_on_device(), 1);
  EXPECT_EQ(assigned.at(d).ranks_on_device(), 2);
  EXPECT_EQ(assigned.at(e).ranks_on_device(), 2);
  EXPECT_EQ(Job(shared).state(), v1::JOB_STATE_RUNNING);
  // The UUID is listed.
  for (const v1::WorkerInfo& w : core_.ListWorkers()) {
    if (w.worker_id() == d) {
      EXPECT_EQ(w.device_uuid(), "GPU-2");
    }
  }
}

TEST_F(GpuPlacementTest, SharingNeedsTheGpusMemoryForEveryRank) {
  v1::JobSpec spec = GpuSpec(2, 2);
  ApplyJobSpecDefaults(&spec);
  const int64_t need = EstimateWorkerMemory(spec, MinMicroBatch(spec)).total();
  ASSERT_GT(need, 0);
  // Each reports enough for one rank, not for two.
  RegisterGpu("a", "GPU-0", true, need + need / 2);
  RegisterGpu("b", "GPU-0", true, need + need / 2);
  const std::string job = Submit(spec);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_PENDING);
  EXPECT_NE(Job(job).reason().find("1 left out for a GPU"), std::string::npos) << Job(job).reason();
  // The GPU's own memory for both: they form the group.
  RegisterGpu("c", "GPU-1", true, 3 * need);
  RegisterGpu("d", "GPU-1", true, 3 * need);
  Tick();
  EXPECT_EQ(TakeAssignments().size(), 2u);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(job).members_size(), 2);
}

TEST_F(GpuPlacementTest, AJobNeitherReformsNorGrowsOntoAMembersGpu) {
  const std::string a = RegisterGpu("a", "GPU-0", false);
  const std::string b = RegisterGpu("b", "GPU-1", false);
  const std::string job = Submit(GpuSpec(2, 3));
  ASSERT_EQ(TakeAssignments().size(), 2u);
  ASSERT_TRUE(Progress(a, job, 1, 1).ok());
  ASSERT_TRUE(Progress(b, job, 1, 1).ok());
  // An idle worker on a's GPU is no spare: no scale-up, the generation goes on.
  const std::string c = RegisterGpu("c", "GPU-0", false);
  Tick();
  EXPECT_TRUE(TakeAborts().empty());
  EXPECT_EQ(Job(job).generation(), 1);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  // b dies: the job may not re-form on c, whose GPU a uses; it waits and says why.
  Decisions d;
  core_.WorkerDisconnected(b, "stream closed", now_, &d);
  Collect(d);
  now_ += absl::Seconds(1);
  Heartbeats({a, c});
  Tick();
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING);
  EXPECT_NE(Job(job).reason().find("(1 survivor, 0 idle, 1 left out for a GPU"), std::string::npos)
      << Job(job).reason();
  EXPECT_EQ(TakeAssignments().count(c), 0u);
  // A worker on another GPU re-forms it.
  const std::string e = RegisterGpu("e", "GPU-3", false);
  Tick();
  std::map<std::string, v1::Assignment> assigned = TakeAssignments();
  EXPECT_EQ(assigned.count(a), 1u);
  EXPECT_EQ(assigned.count(e), 1u);
  EXPECT_EQ(assigned.count(c), 0u);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
}

TEST(OneRankPerGpuTest, KeepsCandidatesThatAddNoForbiddenSharing) {
  auto ids = [](const std::vector<RankCandidate>& cs) {
    std::vector<std::string> out;
    for (const RankCandidate& c : cs) out.push_back(c.worker_id);
    return out;
  };
  auto gpu = [](std::string id, std::string uuid, bool share, int64_t free = 0) {
    return RankCandidate{std::move(id), "h1", 0, std::move(uuid), share, free};
  };
  std::vector<RankCandidate> left;
  // CPU workers (no UUID) always stay; the second on GPU-0 does not (a may not share).
  EXPECT_EQ(ids(OneRankPerGpu({},
                              {gpu("c1", "", false), gpu("c2", "", false), gpu("a", "G0", false),
                               gpu("b", "G0", true)},
                              0, &left)),
            (std::vector<std::string>{"c1", "c2", "a"}));
  EXPECT_EQ(ids(left), std::vector<std::string>{"b"});
  // Against the members: a member that may not share blocks its GPU; one that may, does not.
  EXPECT_EQ(
      ids(OneRankPerGpu({gpu("m", "G0", false), gpu("n", "G1", true)},
                        {gpu("x", "G0", true), gpu("y", "G1", true), gpu("z", "G1", false)}, 0)),
      std::vector<std::string>{"y"});
  // Memory: 3 ranks on G0 need 3 x 10 within the least free reported (35 holds 3, not 4).
  left.clear();
  EXPECT_EQ(ids(OneRankPerGpu({},
                              {gpu("p", "G0", true, 40), gpu("q", "G0", true, 35),
                               gpu("r", "G0", true, 36), gpu("s", "G0", true, 50)},
                              10, &left)),
            (std::vector<std::string>{"p", "q", "r"}));
  EXPECT_EQ(ids(left), std::vector<std::string>{"s"});
  // A rejected candidate leaves the GPU as it was: the next one is judged against the rest.
  EXPECT_EQ(
      ids(OneRankPerGpu(
          {}, {gpu("p", "G0", true, 40), gpu("q", "G0", true, 15), gpu("r", "G0", true, 40)}, 10)),
      (std::vector<std::string>{"p", "r"}));
}

// Job ids carry the cluster's suffix, so a coordinator that lost its state never hands out
// an earlier one's ids; restored ids ("job-N-SUFFIX") are continued after.
TEST(CoreIdsTest, JobIdsCarryTheClusterSuffixAndContinueAfterRestore) {
  CoreOptions options;
  options.job_id_suffix = "a1b2c3";
  Core core(options);
  const absl::Time now = absl::FromUnixSeconds(1'700'000'000);
  Decisions d;
  absl::StatusOr<v1::Job> first = core.SubmitJob(Spec(1, 1), now, &d);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->job_id(), "job-1-a1b2c3");
  Core restarted(options);
  v1::Job saved = *first;
  saved.set_job_id("job-7-ffffff");
  saved.set_state(v1::JOB_STATE_SUCCEEDED);
  restarted.RestoreJobs({saved}, now, &d);
  absl::StatusOr<v1::Job> next = restarted.SubmitJob(Spec(1, 1), now, &d);
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->job_id(), "job-8-a1b2c3");
}

// A coordinator that was away (no Tick for seconds: frozen, descheduled) does not blame the
// workers for the silence it caused: their heartbeats are credited, and the member losses its
// absence caused re-form the job without counting against max_restarts (0 here: any counted
// recovery would fail the job).
TEST(CorePauseTest, SilenceTheCoordinatorCausedIsNotChargedToTheJob) {
  CoreOptions options;
  options.heartbeat_timeout = absl::Seconds(2);
  options.tick_interval = absl::Milliseconds(100);
  Core core(options);
  absl::Time now = absl::FromUnixSeconds(1'700'000'000);
  Decisions d;
  auto reg = [&](const std::string& name) {
    v1::RegisterRequest r;
    r.set_name(name);
    r.set_host("h1");
    r.set_device("cpu");
    return core.RegisterWorker(r, now, &d).value();
  };
  const std::string w0 = reg("w0"), w1 = reg("w1");
  v1::JobSpec spec = Spec(2, 2);
  spec.set_max_restarts(0);
  const std::string job = core.SubmitJob(spec, now, &d)->job_id();
  core.Tick(now, &d);
  now += absl::Seconds(6);  // frozen: no ticks, no heartbeats heard
  Decisions after;
  core.Tick(now, &after);
  EXPECT_TRUE(after.close_sessions.empty()) << "no worker is declared lost for our silence";
  EXPECT_EQ(core.GetJob(job)->state(), v1::JOB_STATE_RUNNING);
  // The workers' sessions broke meanwhile (their keepalives went unanswered).
  core.WorkerDisconnected(w0, "connection lost", now, &after);
  v1::Job j = core.GetJob(job).value();
  EXPECT_EQ(j.state(), v1::JOB_STATE_RECONFIGURING) << j.reason();
  EXPECT_EQ(j.recoveries(), 0);
  ASSERT_EQ(j.recovery_history_size(), 1);
  EXPECT_TRUE(j.recovery_history(0).coordinator_caused());
  EXPECT_FALSE(j.recovery_history(0).counted());
  EXPECT_NE(j.recovery_history(0).reason().find("unresponsive for 6.0s"), std::string::npos)
      << j.recovery_history(0).reason();
  // The job re-forms; once the grace after the absence is over (ticks and heartbeats as
  // usual), a loss is the worker's again, and max_restarts 0 fails the job.
  const std::string w2 = reg("w2");
  ASSERT_EQ(core.GetJob(job)->state(), v1::JOB_STATE_RUNNING);
  for (int i = 0; i < 60; ++i) {
    now += absl::Milliseconds(100);
    ASSERT_TRUE(core.Heartbeat(w1, now).ok());
    ASSERT_TRUE(core.Heartbeat(w2, now).ok());
    core.Tick(now, &after);
  }
  core.WorkerDisconnected(w2, "connection lost", now, &after);
  EXPECT_EQ(core.GetJob(job)->state(), v1::JOB_STATE_FAILED) << core.GetJob(job)->reason();
}

TEST_F(CoreTest, ResumedReportsRecordTheHealAndCloseARecoveryWithNothingLeft) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string job = Submit(Spec(1, 2));
  TakeAssignments();
  ASSERT_TRUE(Progress(w0, job, 1, 100).ok());  // total_steps 100: the last step is done
  // w1 is lost during the final evaluation.
  Decisions d;
  core_.WorkerDisconnected(w1, "connection lost", now_, &d);
  Collect(d);
  ASSERT_EQ(Job(job).generation(), 2);
  EXPECT_EQ(Job(job).recoveries(), 1);
  v1::ResumedReport r;
  r.set_job_id(job);
  r.set_generation(2);
  r.set_resumed_from_step(100);
  r.set_source_rank(0);
  now_ += absl::Milliseconds(20);
  ASSERT_TRUE(core_.ReportResumed(w0, r, now_, &d).ok());
  v1::Recovery rec = Job(job).recovery_history(0);
  EXPECT_EQ(rec.resumed_from_step(), 100);
  EXPECT_EQ(rec.source_rank(), 0);
  EXPECT_EQ(rec.steps_redone(), 0);
  EXPECT_FALSE(rec.steps_redone_lower_bound());
  EXPECT_GT(rec.first_step_unix_ms(), 0) << "no step left: the recovery ends at the heal";
  EXPECT_EQ(Finished(w0, job, 2, "abc").code(), absl::StatusCode::kOk);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_SUCCEEDED);
}

// After every member died, the new group resumes from a disk checkpoint: what the dead members
// did after their last report is unknown, so steps_redone is marked as a lower bound.
TEST_F(CoreTest, StepsRedoneAfterLosingEveryMemberIsALowerBound) {
  const std::string w0 = Register("w0");
  const std::string job = Submit(Spec(1, 1));
  TakeAssignments();
  ASSERT_TRUE(Progress(w0, job, 1, 60).ok());
  Decisions d;
  core_.WorkerDisconnected(w0, "connection lost", now_, &d);
  const std::string w1 = Register("w1");
  ASSERT_EQ(Job(job).generation(), 2);
  v1::ResumedReport r;
  r.set_job_id(job);
  r.set_generation(2);
  r.set_resumed_from_step(50);
  r.set_source_rank(0);
  r.set_from_checkpoint(true);
  ASSERT_TRUE(core_.ReportResumed(w1, r, now_, &d).ok());
  v1::Recovery rec = Job(job).recovery_history(0);
  EXPECT_EQ(rec.steps_redone(), 10);
  EXPECT_TRUE(rec.steps_redone_lower_bound());
  EXPECT_EQ(Job(job).step(), 50) << "the job's step follows the state it resumed from";
}

TEST_F(CoreTest, CheckpointReportsAreRecordedAndFailuresAreEvents) {
  const std::string w0 = Register("w0");
  const std::string job = Submit(Spec(1, 1));
  TakeAssignments();
  v1::CheckpointReport c;
  c.set_job_id(job);
  c.set_generation(1);
  c.set_step(20);
  c.set_path("/ckpt/job.step-20.ckpt");
  Decisions d;
  ASSERT_TRUE(core_.ReportCheckpoint(w0, c, now_, &d).ok());
  c.set_step(40);
  c.set_path("");
  c.set_error("writing /ckpt/x.tmp: No space left on device");
  ASSERT_TRUE(core_.ReportCheckpoint(w0, c, now_, &d).ok());
  c.set_generation(7);
  EXPECT_EQ(core_.ReportCheckpoint(w0, c, now_, &d).code(), absl::StatusCode::kAborted);
  const v1::CheckpointStatus s = Job(job).checkpoints();
  EXPECT_EQ(s.last_good_step(), 20);
  EXPECT_EQ(s.last_good_path(), "/ckpt/job.step-20.ckpt");
  EXPECT_EQ(s.failed_writes(), 1);
  EXPECT_EQ(s.last_failed_step(), 40);
  EXPECT_NE(s.last_error().find("No space left"), std::string::npos);
  auto events = core_.EventsSince(job, 0).value();
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().kind(), v1::JobEvent::CHECKPOINT);
  EXPECT_NE(events.back().message().find("step 40"), std::string::npos);
}

// A job that ends tells its unfinished members so (they drop what they kept), and every
// generation's start and end is listed for the store's scopes.
TEST_F(CoreTest, EndedJobsTellTheirMembersAndGenerationsAreListed) {
  const std::string w0 = Register("w0");
  Decisions d;
  absl::StatusOr<v1::Job> job = core_.SubmitJob(Spec(1, 1), now_, &d);
  ASSERT_TRUE(job.ok());
  ASSERT_EQ(d.started_generations.size(), 1u);
  EXPECT_EQ(d.started_generations[0].job_id, job->job_id());
  EXPECT_EQ(d.started_generations[0].generation, 1);
  EXPECT_EQ(d.started_generations[0].world_size, 1);
  Decisions c;
  ASSERT_TRUE(core_.CancelJob(job->job_id(), now_, &c).ok());
  bool told = false;
  for (const auto& m : c.messages) {
    if (m.worker_id == w0 && m.message.has_abort()) told = m.message.abort().job_ended();
  }
  EXPECT_TRUE(told);
  ASSERT_EQ(c.ended_generations.size(), 1u);
  EXPECT_EQ(core_.Fence(job->job_id(), 1, w0).code(), absl::StatusCode::kAborted);
}

// --- A finished job stays finished: nothing after the last step trains the job again. ---

class FinishTest : public CoreTest {
 protected:
  // A small language model: rank 0 writes a sample of its text at the end.
  static v1::JobSpec GptSpec(int min_workers, int max_workers) {
    v1::JobSpec spec = Spec(min_workers, max_workers);
    v1::ModelSpec* m = spec.mutable_model();
    m->set_type("gpt");
    m->mutable_gpt()->set_vocab_size(256);
    m->mutable_gpt()->set_context_length(32);
    m->mutable_gpt()->set_n_layer(1);
    m->mutable_gpt()->set_n_head(2);
    m->mutable_gpt()->set_d_model(32);
    spec.mutable_dataset()->Clear();
    spec.mutable_dataset()->set_type("text");
    spec.mutable_dataset()->set_path("/usr/share/games/fortunes");
    spec.mutable_sample()->set_max_tokens(16);
    return spec;
  }
  absl::Status LastStep(const std::string& worker, const std::string& job, int64_t generation) {
    v1::ProgressReport p;
    p.set_job_id(job);
    p.set_generation(generation);
    p.set_step(100);
    p.set_total_steps(100);
    p.set_first_of_generation(true);
    Decisions d;
    absl::Status s = core_.ReportProgress(worker, p, now_, &d);
    Collect(d);
    return s;
  }
  void Lose(const std::string& worker) {
    Decisions d;
    core_.WorkerDisconnected(worker, "stream closed", now_, &d);
    Collect(d);
  }
  absl::Status Resumed(const std::string& worker, const std::string& job, int64_t generation) {
    v1::ResumedReport r;
    r.set_job_id(job);
    r.set_generation(generation);
    r.set_resumed_from_step(100);
    r.set_source_rank(0);
    Decisions d;
    absl::Status s = core_.ReportResumed(worker, r, now_, &d);
    Collect(d);
    return s;
  }
  // A job saved by a coordinator that then died, and a fresh core that restored it.
  std::unique_ptr<Core> Restart(const std::vector<std::string>& job_ids) {
    std::vector<v1::Job> saved;
    for (const std::string& id : job_ids) saved.push_back(Job(id));
    auto fresh = std::make_unique<Core>(Options());
    Decisions d;
    fresh->RestoreJobs(saved, now_, &d);
    return fresh;
  }
  static absl::StatusOr<std::string> RegisterOn(Core& core, const std::string& name, absl::Time now,
                                                Decisions* d, const std::string& held_job = "",
                                                int64_t held_step = 0) {
    v1::RegisterRequest r;
    r.set_name(name);
    r.set_host("h1");
    r.set_device("cpu");
    if (!held_job.empty()) {
      r.mutable_held()->set_job_id(held_job);
      r.mutable_held()->set_step(held_step);
    }
    return core.RegisterWorker(r, now, d);
  }
  static std::map<std::string, v1::Assignment> Assignments(const Decisions& d) {
    std::map<std::string, v1::Assignment> out;
    for (const auto& m : d.messages) {
      if (m.message.has_assignment()) out[m.worker_id] = m.message.assignment();
    }
    return out;
  }
};

TEST_F(FinishTest, ASpareArrivingAfterTheLastStepDoesNotScaleTheJobUp) {
  const std::string w0 = Register("w0");
  const std::string job = Submit(Spec(1, 2));
  TakeAssignments();
  ASSERT_TRUE(LastStep(w0, job, 1).ok());
  const std::string w1 = Register("w1");  // while rank 0 evaluates and writes its sample
  Tick();
  EXPECT_TRUE(TakeAssignments().empty()) << "a spare never joins a job that has trained every step";
  EXPECT_EQ(Job(job).generation(), 1);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  ASSERT_TRUE(Finished(w0, job, 1, "abc").ok());
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_SUCCEEDED) << Job(job).reason();
  EXPECT_EQ(Job(job).recovery_history_size(), 0);
}

TEST_F(FinishTest, AStepTimeoutDoesNotApplyAfterTheLastStep) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string job = Submit(Spec(2, 2));
  TakeAssignments();
  ASSERT_TRUE(LastStep(w0, job, 1).ok());
  ASSERT_TRUE(LastStep(w1, job, 1).ok());
  // A long evaluation and sample: the members still beat, no step is left to complete.
  for (int i = 0; i < 70; ++i) {
    now_ += absl::Seconds(1);
    Heartbeats({w0, w1});
    Tick();
  }
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING) << Job(job).reason();
  EXPECT_EQ(Job(job).generation(), 1);
}

// A member that finished and is then lost (rank 0 is still writing its sample) costs nothing:
// no re-formation, no waiting for workers at the last step.
TEST_F(FinishTest, AFinishedMemberLostWhileRankZeroSamplesChangesNothing) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string job = Submit(Spec(2, 2));
  TakeAssignments();
  ASSERT_TRUE(LastStep(w0, job, 1).ok());
  ASSERT_TRUE(LastStep(w1, job, 1).ok());
  ASSERT_TRUE(Finished(w1, job, 1, "abc").ok());
  Lose(w1);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING) << Job(job).reason();
  EXPECT_EQ(Job(job).generation(), 1);
  EXPECT_TRUE(TakeAborts().empty()) << "rank 0 is not disturbed";
  ASSERT_TRUE(Finished(w0, job, 1, "abc").ok());
  const v1::Job j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED) << j.reason();
  EXPECT_EQ(j.recoveries(), 0);
  EXPECT_EQ(j.members_size(), 2) << "both finished: both are final members";
}

// Rank 0 lost after the last step, before its sample and export: the others' result stands,
// the job says what was not written and why, and the lost member is no final member.
TEST_F(FinishTest, RankZeroLostBeforeItsSampleSucceedsSayingWhy) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  v1::JobSpec spec = GptSpec(2, 2);
  spec.set_output_dir("/tmp/out");
  const std::string job = Submit(spec);
  TakeAssignments();
  ASSERT_TRUE(LastStep(w0, job, 1).ok());
  ASSERT_TRUE(LastStep(w1, job, 1).ok());
  ASSERT_TRUE(Finished(w1, job, 1, "abc").ok());
  Lose(w0);
  const v1::Job j = Job(job);
  ASSERT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED) << j.reason();
  EXPECT_EQ(j.step(), 100);
  EXPECT_EQ(j.recoveries(), 0);
  EXPECT_FALSE(j.has_sample());
  EXPECT_NE(j.sample_error().find("not written: rank 0, w0"), std::string::npos)
      << j.sample_error();
  EXPECT_NE(j.export_error().find("not written: rank 0, w0"), std::string::npos)
      << j.export_error();
  ASSERT_EQ(j.members_size(), 1) << "a member lost before it reported is no final member";
  EXPECT_EQ(j.members(0).worker_name(), "w1");
}

// A member lost during the final evaluation (the others wait in its collective): the others
// finish by themselves, below min_workers, without a spare, and train nothing.
TEST_F(FinishTest, AMemberLostDuringTheFinalEvaluationLeavesTheOthersToFinish) {
  const std::string w0 = Register("w0"), w1 = Register("w1"), w2 = Register("w2");
  const std::string job = Submit(Spec(3, 4));
  TakeAssignments();
  const std::string spare = Register("w3");  // arrives at the last step: stays a spare
  for (const std::string& w : {w0, w1, w2}) ASSERT_TRUE(LastStep(w, job, 1).ok());
  Lose(w2);
  auto next = TakeAssignments();
  ASSERT_EQ(next.size(), 2u) << "w0 and w1 alone, below min_workers 3";
  EXPECT_EQ(next.count(spare), 0u);
  EXPECT_EQ(next[w0].start_step(), 101) << "nothing is left to train";
  v1::Job j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_RUNNING) << j.reason();
  EXPECT_EQ(j.generation(), 2);
  // The finishing generation: healed at 100, evaluates (longer than any step timeout), ends.
  ASSERT_TRUE(Resumed(w0, job, 2).ok());
  ASSERT_TRUE(Resumed(w1, job, 2).ok());
  now_ += absl::Seconds(120);
  Heartbeats({w0, w1, spare});
  Tick();
  EXPECT_EQ(Job(job).generation(), 2) << Job(job).reason();
  // A second loss in the finishing generation: the last one finishes alone.
  Lose(w1);
  next = TakeAssignments();
  ASSERT_EQ(next.size(), 1u);
  EXPECT_EQ(next.count(w0), 1u);
  ASSERT_TRUE(Finished(w0, job, 3, "abc").ok());
  j = Job(job);
  ASSERT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED) << j.reason();
  EXPECT_EQ(j.step(), 100);
  for (const v1::Recovery& r : j.recovery_history()) {
    EXPECT_EQ(r.steps_redone(), 0) << r.reason();
  }
}

// The last member of a finishing generation lost before it reported: no result stands (no
// member finished), so the job does not succeed; it waits for a worker that holds the state.
TEST_F(FinishTest, ALoneFinishingMemberLostBeforeItReportedLeavesNoResult) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string job = Submit(Spec(2, 2));
  TakeAssignments();
  ASSERT_TRUE(LastStep(w0, job, 1).ok());
  ASSERT_TRUE(LastStep(w1, job, 1).ok());
  Lose(w1);
  ASSERT_EQ(TakeAssignments().size(), 1u) << "w0 finishes alone";
  Lose(w0);
  const v1::Job j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_RECONFIGURING) << j.reason();
}

// The coordinator is lost after the members reported Finished but before the end was saved:
// the members kept the trained state; the restarted coordinator waits for them and the
// finishing generation they form trains nothing.
TEST_F(FinishTest, AnEndLostWithTheCoordinatorIsFinishedFromTheMembersMemory) {
  const std::string a = Register("a"), b = Register("b");
  const std::string job = Submit(Spec(2, 2));
  TakeAssignments();
  ASSERT_TRUE(LastStep(a, job, 1).ok());
  ASSERT_TRUE(LastStep(b, job, 1).ok());
  const std::vector<std::string> saved = {job};  // the last save: RUNNING at step 100
  const std::unique_ptr<Core> fresh = Restart(saved);
  ASSERT_EQ(fresh->GetJob(job)->state(), v1::JOB_STATE_RECONFIGURING);
  Decisions d;
  // A spare registers first; then a and b, holding the job's state of step 100.
  ASSERT_TRUE(RegisterOn(*fresh, "c", now_, &d).ok());
  ASSERT_TRUE(Assignments(d).empty()) << "the job waits for the members that hold its state";
  d = {};
  ASSERT_TRUE(RegisterOn(*fresh, "a", now_, &d, job, 100).ok());
  ASSERT_TRUE(Assignments(d).empty());
  EXPECT_NE(fresh->GetJob(job)->reason().find("1 of 2 back"), std::string::npos)
      << fresh->GetJob(job)->reason();
  d = {};
  ASSERT_TRUE(RegisterOn(*fresh, "b", now_, &d, job, 100).ok());
  const auto assigned = Assignments(d);
  ASSERT_EQ(assigned.size(), 2u) << "one re-formation, once both are back";
  for (const auto& [worker, assignment] : assigned) {
    EXPECT_EQ(assignment.start_step(), 101);
    EXPECT_EQ(fresh->ListWorkers()[0].name(), "c");
    EXPECT_NE(worker, fresh->ListWorkers()[0].worker_id()) << "the spare stays out";
  }
  for (const auto& [worker, assignment] : assigned) {
    v1::FinishedReport f;
    f.set_job_id(job);
    f.set_generation(assignment.generation());
    f.set_step(100);
    f.set_parameter_checksum("abc");
    d = {};
    ASSERT_TRUE(fresh->ReportFinished(worker, f, now_, &d).ok());
  }
  const v1::Job j = fresh->GetJob(job).value();
  EXPECT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED) << j.reason();
  EXPECT_EQ(j.step(), 100);
}

// After a restart only the workers that came back holding the last step's state finish the
// job, however few: the others' absence never makes it wait at its last step.
TEST_F(FinishTest, AfterARestartTheWorkersHoldingTheLastStepFinishAloneOnceTheGraceIsOver) {
  const std::string a = Register("a"), b = Register("b");
  const std::string job = Submit(Spec(2, 2));
  TakeAssignments();
  ASSERT_TRUE(LastStep(a, job, 1).ok());
  ASSERT_TRUE(LastStep(b, job, 1).ok());
  const std::unique_ptr<Core> fresh = Restart({job});
  Decisions d;
  ASSERT_TRUE(RegisterOn(*fresh, "a", now_, &d, job, 100).ok());
  ASSERT_TRUE(RegisterOn(*fresh, "c", now_, &d).ok());
  ASSERT_TRUE(Assignments(d).empty());
  now_ += Options().restart_grace;
  d = {};
  fresh->Tick(now_, &d);
  const auto assigned = Assignments(d);
  ASSERT_EQ(assigned.size(), 1u) << "a alone: b is gone, and the spare holds nothing";
  EXPECT_EQ(fresh->ListWorkers()[0].name(), "a");
  EXPECT_EQ(assigned.begin()->first, fresh->ListWorkers()[0].worker_id());
}

// A job restored in the middle of training waits for its members too, and a pending job does
// not take them meanwhile; a member that does not come back is not waited for past the grace.
TEST_F(FinishTest, ARestartedCoordinatorKeepsTheMembersForTheirJobAndReformsOnce) {
  const std::string a = Register("a"), b = Register("b");
  const std::string job = Submit(Spec(1, 2));
  TakeAssignments();
  ASSERT_TRUE(Progress(a, job, 1, 40).ok());
  const std::unique_ptr<Core> fresh = Restart({job});
  Decisions d;
  absl::StatusOr<v1::Job> other = fresh->SubmitJob(Spec(1, 1), now_, &d);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(RegisterOn(*fresh, "a", now_, &d, job, 40).ok());
  EXPECT_TRUE(Assignments(d).empty()) << "a is kept for its job, which waits for b";
  EXPECT_EQ(fresh->GetJob(other->job_id())->state(), v1::JOB_STATE_PENDING);
  now_ += absl::Seconds(1);
  d = {};
  ASSERT_TRUE(RegisterOn(*fresh, "b", now_, &d, job, 40).ok());
  auto assigned = Assignments(d);
  ASSERT_EQ(assigned.size(), 2u);
  for (const auto& [worker, assignment] : assigned) EXPECT_EQ(assignment.job_id(), job);
  const v1::Job j = fresh->GetJob(job).value();
  EXPECT_EQ(j.recovery_history_size(), 1) << "one re-formation for one restart";
  EXPECT_EQ(fresh->GetJob(other->job_id())->state(), v1::JOB_STATE_PENDING);
}

// A worker that keeps the state of a job that has ended (its job_ended abort went to a session
// that broke), or of a job this coordinator does not know, is told to drop it.
TEST_F(FinishTest, AWorkerHoldingAnEndedOrUnknownJobsStateIsToldToDropIt) {
  const std::string a = Register("a");
  const std::string job = Submit(Spec(1, 1));
  TakeAssignments();
  ASSERT_TRUE(Finished(a, job, 1, "abc").ok());
  RecordEnds();
  Lose(a);
  for (const std::string& held : {job, std::string("job-9-ffffff")}) {
    Decisions d;
    absl::StatusOr<std::string> id =
        RegisterOn(core_, absl::StrCat("a", held.size()), now_, &d, held, 100);
    ASSERT_TRUE(id.ok());
    bool told = false;
    for (const auto& m : d.messages) {
      told = told || (m.worker_id == *id && m.message.has_abort() &&
                      m.message.abort().job_ended() && m.message.abort().job_id() == held);
    }
    EXPECT_TRUE(told) << held;
  }
}

// Results only from the members' agreement: a member that reports a forged Finished (an
// evaluation the job never ran, a sample, an export path) and disconnects leaves nothing of it
// in the job, which finishes with what its real members report.
TEST_F(FinishTest, AForgedFinishedLeavesNothingInTheResult) {
  const std::string w0 = Register("w0"), w1 = Register("w1"), w2 = Register("w2");
  v1::JobSpec spec = GptSpec(2, 2);
  spec.set_skip_evaluation(true);
  const std::string job = Submit(spec);
  auto first = TakeAssignments();
  ASSERT_EQ(first.size(), 2u);
  std::string forger, honest;
  for (const auto& [w, a] : first) (a.rank() == 0 ? forger : honest) = w;
  ASSERT_TRUE(Progress(honest, job, 1, 50).ok());
  v1::FinishedReport forged;
  forged.set_job_id(job);
  forged.set_generation(1);
  forged.set_step(100);
  forged.set_parameter_checksum("deadbeefdeadbeef");
  forged.mutable_eval()->set_test_accuracy(0.9999);
  forged.mutable_sample()->set_text("forged");
  forged.set_export_path("/etc/passwd");
  forged.set_train_samples_per_second(1e12);
  Decisions d;
  ASSERT_TRUE(core_.ReportFinished(forger, forged, now_, &d).ok());
  EXPECT_FALSE(Job(job).has_eval());
  EXPECT_FALSE(Job(job).has_sample());
  Lose(forger);
  auto next = TakeAssignments();
  ASSERT_EQ(next.size(), 2u) << "re-formed with the spare";
  for (const auto& [w, a] : next) {
    v1::FinishedReport f;
    f.set_job_id(job);
    f.set_generation(a.generation());
    f.set_step(100);
    f.set_parameter_checksum("abc");
    if (a.rank() == 0) f.mutable_sample()->set_text("real");
    f.set_train_samples_per_second(a.rank() == 0 ? 500 : 600);
    d = {};
    ASSERT_TRUE(core_.ReportFinished(w, f, now_, &d).ok());
  }
  const v1::Job j = Job(job);
  ASSERT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED) << j.reason();
  EXPECT_FALSE(j.has_eval()) << "a job without evaluation shows none";
  EXPECT_EQ(j.reason().find("accuracy"), std::string::npos) << j.reason();
  EXPECT_EQ(j.sample().text(), "real");
  EXPECT_EQ(j.export_path(), "");
  EXPECT_EQ(j.train_samples_per_second(), 500) << "rank 0's";
}

// --- One worker cannot use up a job's restarts (fatal reports, losses, silence). ---

class ChargeTest : public CoreTest {
 protected:
  // The job's current generation completed a step (spares may join after that).
  void Stepped(const std::string& worker, const std::string& job) {
    v1::ProgressReport p;
    p.set_job_id(job);
    p.set_generation(Job(job).generation());
    p.set_step(Job(job).step() + 1);
    p.set_total_steps(100);
    p.set_first_of_generation(true);
    Decisions d;
    ASSERT_TRUE(core_.ReportProgress(worker, p, now_, &d).ok());
    Collect(d);
  }
  absl::Status Fatal(const std::string& worker, const std::string& job) {
    v1::FailureReport f;
    f.set_job_id(job);
    f.set_generation(Job(job).generation());
    f.set_message("cannot load the data set");
    f.set_fatal(true);
    Decisions d;
    absl::Status s = core_.ReportFailure(worker, f, now_, &d);
    Collect(d);
    return s;
  }
  // Passes the grace after a fatal report, with heartbeats, so the job re-forms.
  void Later(const std::vector<std::string>& alive) {
    now_ += absl::Seconds(3);
    for (const std::string& w : alive) ASSERT_TRUE(core_.Heartbeat(w, now_).ok());
    Tick();
  }
};

TEST_F(ChargeTest, FatalReportsFromWorkersThatKeepRejoiningDoNotUseUpMaxRestarts) {
  const std::string w0 = Register("w0");
  v1::JobSpec spec = Spec(1, 2);
  spec.set_max_restarts(1);
  const std::string job = Submit(spec);
  TakeAssignments();
  for (int i = 0; i < 5; ++i) {
    Stepped(w0, job);
    // A token holder joins as a spare (a new name each time) and reports a fatal error.
    const std::string fake = Register(absl::StrCat("fake-", i));
    ASSERT_EQ(TakeAssignments().count(fake), 1u) << "the spare joined";
    ASSERT_TRUE(Fatal(fake, job).ok());
    Later({w0, fake});
    EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING) << i << ": " << Job(job).reason();
    EXPECT_EQ(Job(job).members_size(), 1) << "the reporter left the job";
  }
  EXPECT_EQ(Job(job).recoveries(), 0) << "a fatal report is its reporter's, not the job's";
  // Back under a name that reported a fatal error: never this job's again.
  Stepped(w0, job);
  Decisions d;
  core_.WorkerDisconnected(FindId("fake-0"), "bye", now_, &d);
  const std::string again = Register("fake-0");
  Tick();
  EXPECT_EQ(TakeAssignments().count(again), 0u);
}

TEST_F(ChargeTest, AWorkerLostAgainAndAgainCostsTheJobAtMostItsShare) {
  const std::string w0 = Register("w0");
  v1::JobSpec spec = Spec(1, 2);
  spec.set_max_restarts(Core::kMaxChargesPerWorker + 1);
  const std::string job = Submit(spec);
  TakeAssignments();
  for (int i = 0; i <= Core::kMaxChargesPerWorker; ++i) {
    Stepped(w0, job);
    const std::string flapper = Register("flapper");
    ASSERT_EQ(TakeAssignments().count(flapper), 1u) << i;
    Decisions d;
    core_.WorkerDisconnected(flapper, "stream closed", now_, &d);
    Collect(d);
    EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING) << i << ": " << Job(job).reason();
  }
  const v1::Job j = Job(job);
  EXPECT_EQ(j.recoveries(), Core::kMaxChargesPerWorker) << "its further losses are its own";
  int counted = 0;
  for (const v1::Recovery& r : j.recovery_history()) counted += r.counted() ? 1 : 0;
  EXPECT_EQ(counted, j.recoveries()) << "each recovery says whether it counted";
  EXPECT_FALSE(j.recovery_history().rbegin()->counted());
  EXPECT_NE(j.recovery_history().rbegin()->reason().find("no longer one of its members"),
            std::string::npos)
      << j.recovery_history().rbegin()->reason();
  Stepped(w0, job);
  const std::string back = Register("flapper");
  Tick();
  EXPECT_EQ(TakeAssignments().count(back), 0u) << "excluded from this job";
  // Other jobs still take it.
  const std::string other = Submit(Spec(1, 1));
  EXPECT_EQ(Job(other).state(), v1::JOB_STATE_RUNNING);
}

// A member that stays connected and silent (never writes to its generation's store, never
// reports) while the others form the group: the failure that follows is its own.
TEST_F(ChargeTest, ASilentMemberIsLeftOutWithoutChargingTheJob) {
  const std::string w0 = Register("w0"), w1 = Register("w1"), silent = Register("silent");
  v1::JobSpec spec = Spec(1, 3);
  spec.set_max_restarts(0);
  const std::string job = Submit(spec);
  ASSERT_EQ(TakeAssignments().size(), 3u);
  for (int round = 0; round < Core::kMaxChargesPerWorker; ++round) {
    const int64_t g = Job(job).generation();
    core_.NoteMemberActivity(w0, job, g);
    core_.NoteMemberActivity(w1, job, g);
    v1::FailureReport f;
    f.set_job_id(job);
    f.set_generation(g);
    f.set_message("gloo rendezvous: timed out waiting for rank 2");
    Decisions d;
    ASSERT_TRUE(core_.ReportFailure(w0, f, now_, &d).ok());
    Collect(d);
    EXPECT_NE(Job(job).state(), v1::JOB_STATE_FAILED) << Job(job).reason();
    now_ += absl::Milliseconds(400);
    Heartbeats({w0, w1, silent});
    Tick();
    auto a = TakeAssignments();
    ASSERT_EQ(a.size(), 2u) << round << ": " << Job(job).reason();
    EXPECT_EQ(a.count(silent), 0u);
    EXPECT_EQ(Job(job).recoveries(), 0);
    // It comes back as a spare once the group has stepped (until it is excluded).
    Stepped(w0, job);
    Heartbeats({w0, w1, silent});
    Tick();
    a = TakeAssignments();
    if (round + 1 < Core::kMaxChargesPerWorker) {
      ASSERT_EQ(a.count(silent), 1u) << round;
    } else {
      EXPECT_EQ(a.count(silent), 0u) << "left out " << Core::kMaxChargesPerWorker << " times";
    }
  }
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
}

// A fatal report after the last step is its reporter's: not charged (max_restarts 0 does not
// fail the job), and the others' reports of the same error come first.
TEST_F(FinishTest, AFatalReportAfterTheLastStepIsNotCharged) {
  const std::string w0 = Register("w0"), w1 = Register("w1"), w2 = Register("w2");
  v1::JobSpec spec = Spec(3, 3);
  spec.set_max_restarts(0);
  const std::string job = Submit(spec);
  TakeAssignments();
  for (const std::string& w : {w0, w1, w2}) ASSERT_TRUE(LastStep(w, job, 1).ok());
  v1::FailureReport f;
  f.set_job_id(job);
  f.set_generation(1);
  f.set_fatal(true);
  f.set_message("out of memory in the evaluation");
  Decisions d;
  ASSERT_TRUE(core_.ReportFailure(w2, f, now_, &d).ok());
  Collect(d);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING) << Job(job).reason();
  EXPECT_TRUE(TakeAssignments().empty()) << "the others' reports come first";
  now_ += absl::Seconds(3);
  Heartbeats({w0, w1, w2});
  Tick();
  auto next = TakeAssignments();
  ASSERT_EQ(next.size(), 2u) << Job(job).reason();
  EXPECT_EQ(next.count(w2), 0u);
  EXPECT_EQ(Job(job).recoveries(), 0);
}

// A worker excluded from a job (lost too often) that comes back holding the job's state is
// told to drop it, and serves other jobs: it is not kept for a job that will never take it.
TEST_F(ChargeTest, AnExcludedWorkerHoldingTheJobsStateIsNotKeptForIt) {
  const std::string w0 = Register("w0");
  const std::string job = Submit(Spec(1, 2));
  TakeAssignments();
  for (int i = 0; i <= Core::kMaxChargesPerWorker; ++i) {
    Stepped(w0, job);
    const std::string flapper = Register("flapper");
    ASSERT_EQ(TakeAssignments().count(flapper), 1u) << i;
    Decisions d;
    core_.WorkerDisconnected(flapper, "stream closed", now_, &d);
    Collect(d);
  }
  v1::RegisterRequest r;
  r.set_name("flapper");
  r.set_host("h1");
  r.set_device("cpu");
  r.mutable_held()->set_job_id(job);
  r.mutable_held()->set_step(5);
  Decisions d;
  absl::StatusOr<std::string> back = core_.RegisterWorker(r, now_, &d);
  ASSERT_TRUE(back.ok());
  bool told = false;
  for (const auto& m : d.messages) {
    told = told || (m.worker_id == *back && m.message.has_abort() &&
                    m.message.abort().job_ended() && m.message.abort().job_id() == job);
  }
  EXPECT_TRUE(told) << "drop the state of a job that will never take you";
  const std::string other = Submit(Spec(1, 1));
  EXPECT_EQ(Job(other).state(), v1::JOB_STATE_RUNNING) << Job(other).reason();
}

// A member left out for silence (it was loading its data, say) is taken back at once when the
// job cannot re-form without it, instead of the job waiting beside an idle worker.
TEST_F(ChargeTest, AMemberLeftOutIsTakenBackWhenTheJobNeedsIt) {
  const std::string w0 = Register("w0"), w1 = Register("w1"), slow = Register("slow");
  const std::string job = Submit(Spec(3, 3));
  ASSERT_EQ(TakeAssignments().size(), 3u);
  core_.NoteMemberActivity(w0, job, 1);
  core_.NoteMemberActivity(w1, job, 1);
  v1::FailureReport f;
  f.set_job_id(job);
  f.set_generation(1);
  f.set_message("gloo rendezvous: timed out");
  Decisions d;
  ASSERT_TRUE(core_.ReportFailure(w0, f, now_, &d).ok());
  Collect(d);
  now_ += absl::Milliseconds(400);
  Heartbeats({w0, w1, slow});
  Tick();
  auto a = TakeAssignments();
  EXPECT_EQ(a.size(), 3u) << Job(job).reason();
  EXPECT_EQ(a.count(slow), 1u);
  EXPECT_EQ(Job(job).recoveries(), 0);
}

// The coordinator frozen while rank 0 writes its sample (the other member has finished): the
// sessions break, but the job does not end without rank 0's sample for a loss it caused
// itself; the members come back holding the final state and finish it.
TEST(CorePauseTest, APauseAfterTheLastStepDoesNotCostTheSample) {
  CoreOptions options;
  options.tick_interval = absl::Milliseconds(100);
  Core core(options);
  absl::Time now = absl::FromUnixSeconds(1'700'000'000);
  Decisions d;
  // Registers `name`, holding `held_job` at `held_step` when given.
  auto reg = [&](const std::string& name, Decisions* out, const std::string& held_job = "",
                 int64_t held_step = 0) {
    v1::RegisterRequest r;
    r.set_name(name);
    r.set_host("h1");
    r.set_device("cpu");
    if (!held_job.empty()) {
      r.mutable_held()->set_job_id(held_job);
      r.mutable_held()->set_step(held_step);
    }
    return core.RegisterWorker(r, now, out);
  };
  const std::string w0 = reg("w0", &d).value(), w1 = reg("w1", &d).value();
  v1::JobSpec spec = Spec(2, 2);
  spec.mutable_model()->set_type("gpt");
  spec.mutable_model()->mutable_gpt()->set_vocab_size(256);
  spec.mutable_model()->mutable_gpt()->set_context_length(32);
  spec.mutable_model()->mutable_gpt()->set_n_layer(1);
  spec.mutable_model()->mutable_gpt()->set_n_head(2);
  spec.mutable_model()->mutable_gpt()->set_d_model(32);
  spec.mutable_dataset()->Clear();
  spec.mutable_dataset()->set_type("text");
  spec.mutable_dataset()->set_path("/usr/share/games/fortunes");
  spec.mutable_sample()->set_max_tokens(16);
  const std::string job = core.SubmitJob(spec, now, &d)->job_id();
  for (const std::string& w : {w0, w1}) {
    v1::ProgressReport p;
    p.set_job_id(job);
    p.set_generation(1);
    p.set_step(100);
    p.set_total_steps(100);
    ASSERT_TRUE(core.ReportProgress(w, p, now, &d).ok());
  }
  const std::string rank0 = core.GetJob(job)->members(0).worker_id();
  const std::string rank1 = rank0 == w0 ? w1 : w0;
  v1::FinishedReport f;
  f.set_job_id(job);
  f.set_generation(1);
  f.set_step(100);
  f.set_parameter_checksum("abc");
  ASSERT_TRUE(core.ReportFinished(rank1, f, now, &d).ok());
  now += absl::Seconds(8);  // frozen; every session broke meanwhile
  core.WorkerDisconnected(rank1, "connection lost", now, &d);
  core.WorkerDisconnected(rank0, "connection lost", now, &d);
  v1::Job j = core.GetJob(job).value();
  EXPECT_NE(j.state(), v1::JOB_STATE_SUCCEEDED) << "not without the sample: " << j.reason();
  EXPECT_EQ(j.recoveries(), 0);
  // Both come back holding the job's last step: they finish it, rank 0 writing the sample.
  Decisions back;
  for (const char* name : {"w0", "w1"}) reg(name, &back, job, 100).IgnoreError();
  now += absl::Milliseconds(100);
  core.Tick(now, &back);
  std::map<std::string, v1::Assignment> assigned;
  for (const auto& m : back.messages) {
    if (m.message.has_assignment()) assigned[m.worker_id] = m.message.assignment();
  }
  // The first to come back forms the finishing generation (the other stays kept for the job
  // and is told to drop its state once the end is recorded).
  ASSERT_GE(assigned.size(), 1u) << core.GetJob(job)->reason();
  for (const auto& [worker, a] : assigned) {
    v1::FinishedReport done;
    done.set_job_id(job);
    done.set_generation(a.generation());
    done.set_step(100);
    done.set_parameter_checksum("abc");
    if (a.rank() == 0) done.mutable_sample()->set_text("a sample");
    ASSERT_TRUE(core.ReportFinished(worker, done, now, &back).ok());
  }
  j = core.GetJob(job).value();
  EXPECT_EQ(j.state(), v1::JOB_STATE_SUCCEEDED) << j.reason();
  EXPECT_EQ(j.sample().text(), "a sample") << j.sample_error();
}

// ---- Priorities, aging and preemption by shrinking (docs/scheduling.md) ----

v1::JobSpec PrioritySpec(int min_workers, int max_workers, int priority) {
  v1::JobSpec spec = Spec(min_workers, max_workers);
  spec.set_priority(priority);
  return spec;
}

class SchedulingTest : public CoreTest {
 protected:
  explicit SchedulingTest(CoreOptions options = Options()) : CoreTest(options) {}
  // The queued jobs' ids in the order they will start.
  std::vector<std::string> Queue() {
    v1::ListJobsRequest request;
    request.set_queue(true);
    const v1::ListJobsResponse queue = core_.ListJobs(request).value();
    std::vector<std::string> ids;
    for (const v1::Job& j : queue.jobs()) ids.push_back(j.job_id());
    return ids;
  }
  // Every member reports step `step` of the job's current generation (its first of it).
  void Step(const std::string& job, int64_t step) {
    const v1::Job j = Job(job);
    for (const v1::Member& m : j.members()) {
      v1::ProgressReport p;
      p.set_job_id(job);
      p.set_generation(j.generation());
      p.set_step(step);
      p.set_first_of_generation(true);
      p.set_total_steps(100);
      Decisions d;
      ASSERT_TRUE(core_.ReportProgress(m.worker_id(), p, now_, &d).ok());
      Collect(d);
    }
  }
  void Cancel(const std::string& job) {
    Decisions d;
    ASSERT_TRUE(core_.CancelJob(job, now_, &d).ok());
    Collect(d);
  }
  std::set<std::string> Members(const std::string& job) {
    const v1::Job j = Job(job);
    std::set<std::string> ids;
    for (const v1::Member& m : j.members()) ids.insert(m.worker_id());
    return ids;
  }
};

TEST_F(SchedulingTest, TheQueueStartsJobsByPriorityFirstComeFirstServedWithinOne) {
  Register("w0");
  const std::string running = Submit(PrioritySpec(1, 1, 0));
  const std::string b = Submit(PrioritySpec(1, 1, 0));
  const std::string c = Submit(PrioritySpec(1, 1, 5));
  const std::string d = Submit(PrioritySpec(1, 1, 5));
  const std::string e = Submit(PrioritySpec(1, 1, -3));
  EXPECT_EQ(Queue(), (std::vector<std::string>{c, d, b, e}));
  // The running job is at its min_workers: nothing to take from it.
  EXPECT_EQ(Job(running).state(), v1::JOB_STATE_RUNNING);
  EXPECT_TRUE(absl::StrContains(Job(d).reason(), "queued behind " + c)) << Job(d).reason();
  EXPECT_TRUE(absl::StrContains(Job(b).reason(), "queued behind " + c + " (priority 5)"))
      << Job(b).reason();
  std::string current = running;
  for (const std::string& next : {c, d, b, e}) {
    Cancel(current);
    EXPECT_EQ(Job(next).state(), v1::JOB_STATE_RUNNING) << next;
    current = next;
  }
}

TEST_F(SchedulingTest, AHigherPriorityJobShrinksALowerOneWhichGrowsBackAfterIt) {
  for (int i = 0; i < 4; ++i) Register(absl::StrCat("w", i));
  const std::string low = Submit(PrioritySpec(1, 4, 0));
  Step(low, 1);
  ASSERT_EQ(Members(low).size(), 4u);
  TakeAssignments();
  const std::string high = Submit(PrioritySpec(2, 2, 10));
  // Two of low's four are taken (its highest ranks), and it re-forms on the other two at once.
  const v1::Job h = Job(high);
  ASSERT_EQ(h.state(), v1::JOB_STATE_RUNNING) << h.reason();
  ASSERT_EQ(h.members_size(), 2);
  v1::Job l = Job(low);
  EXPECT_EQ(l.state(), v1::JOB_STATE_RUNNING) << l.reason();
  EXPECT_EQ(l.members_size(), 2);
  EXPECT_EQ(l.generation(), 2);
  for (const std::string& id : Members(high)) EXPECT_EQ(Members(low).count(id), 0u);
  ASSERT_EQ(l.recovery_history_size(), 1);
  const v1::Recovery& r = l.recovery_history(0);
  EXPECT_TRUE(absl::StrContains(r.reason(), "preempted by " + high + " (priority 10)"))
      << r.reason();
  EXPECT_FALSE(r.counted()) << "a preemption is not a failure";
  EXPECT_EQ(l.recoveries(), 0);
  auto a = TakeAssignments();
  EXPECT_EQ(a.size(), 4u);  // two for low's next generation, two for high
  // While high runs, low does not grow onto anything.
  Step(low, 2);
  Tick();
  EXPECT_EQ(Job(low).members_size(), 2);
  // high's history says whose workers it took.
  bool took = false;
  auto events = core_.EventsSince(high, 0).value();
  for (const v1::JobEvent& e : events) took = took || absl::StrContains(e.message(), "from " + low);
  EXPECT_TRUE(took);
  // high ends (here: cancelled; a failure frees them the same way): low grows back to 4.
  Cancel(high);
  Tick();
  EXPECT_EQ(Job(low).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(low).members_size(), 4);
  EXPECT_EQ(Job(low).recoveries(), 0);
}

TEST_F(SchedulingTest, NoPreemptionOfAnEqualOrHigherPriority) {
  Register("w0");
  Register("w1");
  const std::string peer = Submit(PrioritySpec(1, 2, 5));
  Step(peer, 1);
  ASSERT_EQ(Members(peer).size(), 2u);
  for (int priority : {5, 3}) {
    const std::string other = Submit(PrioritySpec(1, 1, priority));
    EXPECT_EQ(Job(other).state(), v1::JOB_STATE_PENDING) << priority;
    EXPECT_TRUE(absl::StrContains(Job(other).reason(), "waiting for 1 idle"))
        << Job(other).reason();
    EXPECT_EQ(Members(peer).size(), 2u);
    Cancel(other);
  }
}

TEST_F(SchedulingTest, ShrinkingComesBeforeSuspendingAndNobodyGivesUpWorkersForNothing) {
  for (int i = 0; i < 4; ++i) Register(absl::StrCat("w", i));
  const std::string peer = Submit(PrioritySpec(1, 2, 5));
  const std::string firm = Submit(PrioritySpec(2, 2, 0));
  Step(peer, 1);
  Step(firm, 1);
  // Needs 5 of 4: suspending firm and peer frees only 4, so nobody is shrunk or suspended.
  const std::string big = Submit(PrioritySpec(5, 5, 6));
  EXPECT_EQ(Job(big).state(), v1::JOB_STATE_PENDING);
  EXPECT_TRUE(absl::StrContains(Job(big).reason(), "would free only 4")) << Job(big).reason();
  EXPECT_EQ(Members(peer).size(), 2u);
  EXPECT_EQ(Members(firm).size(), 2u);
  EXPECT_EQ(Job(peer).generation(), 1);
  Cancel(big);
  // Needs 1: firm (the lowest priority) is at its min_workers, peer can shrink: peer gives up
  // its rank 1, never its last, and firm is not suspended.
  const std::string fits = Submit(PrioritySpec(1, 1, 6));
  EXPECT_EQ(Job(fits).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Members(peer).size(), 1u);
  EXPECT_EQ(Job(firm).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Members(firm).size(), 2u);
}

TEST_F(SchedulingTest, LowerPriorityJobsGiveUpWorkersLowestPriorityFirst) {
  for (int i = 0; i < 4; ++i) Register(absl::StrCat("w", i));
  const std::string p1 = Submit(PrioritySpec(1, 2, 1));
  const std::string p0 = Submit(PrioritySpec(1, 2, 0));
  Step(p1, 1);
  Step(p0, 1);
  const std::string urgent = Submit(PrioritySpec(1, 1, 9));
  EXPECT_EQ(Job(urgent).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Members(p0).size(), 1u) << "the lowest priority gives first";
  EXPECT_EQ(Members(p1).size(), 2u);
}

TEST_F(SchedulingTest, RunningJobsDoNotGrowOntoWorkersAHigherPriorityJobWaitsFor) {
  Register("w0");
  Register("w1");
  const std::string low = Submit(PrioritySpec(1, 4, 0));
  Step(low, 1);
  ASSERT_EQ(Members(low).size(), 2u);
  // Needs 4: one idle soon, one from low's shrink (or two suspending it): 3, not enough.
  const std::string high = Submit(PrioritySpec(4, 4, 10));
  Register("w2");
  Step(low, 2);
  Tick();
  EXPECT_EQ(Job(high).state(), v1::JOB_STATE_PENDING) << Job(high).reason();
  EXPECT_TRUE(absl::StrContains(Job(high).reason(), "would free only 2")) << Job(high).reason();
  EXPECT_EQ(Members(low).size(), 2u) << "low grew onto a worker high waits for";
  EXPECT_EQ(Job(low).generation(), 1);
  // With a fourth, suspending low completes high's four (shrinking it would not): the idle two
  // are kept for high meanwhile.
  Register("w3");
  Tick();
  EXPECT_EQ(Job(high).state(), v1::JOB_STATE_RUNNING) << Job(high).reason();
  EXPECT_EQ(Members(high).size(), 4u);
  EXPECT_EQ(Job(low).state(), v1::JOB_STATE_SUSPENDED) << Job(low).reason();
}

TEST_F(SchedulingTest, AJobIsShrunkOnlyAtAStepBoundary) {
  for (int i = 0; i < 4; ++i) Register(absl::StrCat("w", i));
  const std::string low = Submit(PrioritySpec(1, 4, 0));
  Step(low, 1);
  // A member lost: low re-forms on three at once, and has not completed a step in it yet.
  Decisions lost;
  core_.WorkerDisconnected(FindId("w3"), "stream closed", now_, &lost);
  Collect(lost);
  ASSERT_EQ(Job(low).state(), v1::JOB_STATE_RUNNING);
  ASSERT_EQ(Members(low).size(), 3u);
  const std::string high = Submit(PrioritySpec(1, 1, 10));
  EXPECT_EQ(Job(high).state(), v1::JOB_STATE_PENDING) << "shrunk before a step of its generation";
  Step(low, 2);
  Tick();
  EXPECT_EQ(Job(high).state(), v1::JOB_STATE_RUNNING) << Job(high).reason();
  EXPECT_EQ(Members(low).size(), 2u);
}

TEST_F(SchedulingTest, AJobPastItsMaxWallTimeFailsNamingTheLimitAndFreesItsWorkers) {
  const std::string w0 = Register("w0");
  v1::JobSpec spec = PrioritySpec(1, 1, 0);
  spec.set_max_wall_time_ms(60'000);
  spec.set_step_timeout_ms(600'000);
  const std::string job = Submit(spec);
  const std::string next = Submit(PrioritySpec(1, 1, 0));
  Step(job, 1);
  for (int i = 0; i < 59; ++i) {
    now_ += absl::Seconds(1);
    Heartbeats({w0});
    Tick();
  }
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  now_ += absl::Seconds(2);
  Heartbeats({w0});
  Tick();
  const v1::Job j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(j.reason(), "max_wall_time_ms 60000")) << j.reason();
  EXPECT_EQ(Job(next).state(), v1::JOB_STATE_RUNNING) << "its worker went to the next job";
}

// ---- Suspension: when shrinking is not enough, and by hand (suspension.cc) ----

class SuspensionTest : public SchedulingTest {
 protected:
  // A spec whose steps may take long (the tests move the clock by minutes).
  static v1::JobSpec Patient(int min_workers, int max_workers, int priority) {
    v1::JobSpec spec = PrioritySpec(min_workers, max_workers, priority);
    spec.set_step_timeout_ms(3'600'000);
    return spec;
  }
  absl::Status SuspendByHand(const std::string& job) {
    Decisions d;
    absl::StatusOr<v1::Job> j = core_.SuspendJob(job, now_, &d);
    Collect(d);
    return j.status();
  }
  absl::Status ResumeByHand(const std::string& job) {
    Decisions d;
    absl::StatusOr<v1::Job> j = core_.ResumeJob(job, now_, &d);
    Collect(d);
    return j.status();
  }
  std::set<std::string> Holders(const std::string& job) {
    const v1::Job j = Job(job);
    return {j.suspension().holders().begin(), j.suspension().holders().end()};
  }
  // Aborts of `job` sent since the last TakeAssignments, by worker id: whether each said
  // suspended (and job_ended).
  std::map<std::string, std::string> AbortsOf(const std::string& job) {
    std::map<std::string, std::string> out;
    for (const auto& m : sent_) {
      if (!m.message.has_abort() || m.message.abort().job_id() != job) continue;
      const v1::Abort& a = m.message.abort();
      out[m.worker_id] = a.job_ended() ? "ended" : a.suspended() ? "suspended" : "aborted";
    }
    return out;
  }
  std::set<std::string> MemberNames(const std::string& job) {
    std::set<std::string> names;
    const v1::Job j = Job(job);
    for (const v1::Member& m : j.members()) names.insert(m.worker_name());
    return names;
  }
};

TEST_F(SuspensionTest, AJobIsSuspendedWhenShrinkingIsNotEnoughAndResumesFromItsMembersMemory) {
  const std::string w0 = Register("w0");
  const std::string w1 = Register("w1");
  v1::JobSpec low_spec = Patient(2, 2, 0);
  low_spec.set_max_wall_time_ms(120'000);
  const std::string low = Submit(low_spec);
  Step(low, 5);
  TakeAssignments();
  const std::string high = Submit(Patient(2, 2, 10));
  v1::Job l = Job(low);
  ASSERT_EQ(l.state(), v1::JOB_STATE_SUSPENDED) << l.reason();
  EXPECT_TRUE(absl::StrContains(l.reason(), "preempted by " + high + " (priority 10)"))
      << l.reason();
  EXPECT_TRUE(absl::StrContains(
      l.reason(), "waiting for a worker that keeps its state of step 5 (w0, w1 are busy)"))
      << l.reason();
  EXPECT_EQ(l.suspension().step(), 5);
  EXPECT_EQ(l.suspension().by_job(), high);
  EXPECT_FALSE(l.suspension().by_user());
  EXPECT_EQ(Holders(low), (std::set<std::string>{"w0", "w1"}));
  EXPECT_EQ(l.members_size(), 0);
  // Its members were told that it is suspended (they park its state), then given to high.
  EXPECT_EQ(AbortsOf(low),
            (std::map<std::string, std::string>{{w0, "suspended"}, {w1, "suspended"}}));
  std::map<std::string, v1::Assignment> a = TakeAssignments();
  ASSERT_EQ(a.size(), 2u);
  for (const auto& [id, assignment] : a) EXPECT_EQ(assignment.job_id(), high);
  EXPECT_EQ(Job(high).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Queue(), (std::vector<std::string>{low}));
  bool said = false;
  const std::vector<v1::JobEvent> events_of_high = core_.EventsSince(high, 0).value();
  for (const v1::JobEvent& e : events_of_high) {
    said = said || absl::StrContains(e.message(), "from " + low + " (priority 0), suspended");
  }
  EXPECT_TRUE(said);
  // Only a job a user suspended is resumed by hand.
  EXPECT_EQ(ResumeByHand(low).code(), absl::StatusCode::kFailedPrecondition);
  // Suspended for longer than its max wall time: that time does not count.
  Step(high, 1);
  for (int i = 0; i < 150; ++i) {
    now_ += absl::Seconds(1);
    Heartbeats({w0, w1});
    Tick();
  }
  EXPECT_EQ(Job(low).state(), v1::JOB_STATE_SUSPENDED);
  // high fails (a fatal error of one member, without whom it cannot go on): its workers go
  // back, and low resumes on them from step 6, in a re-formation that is not a failure.
  v1::FailureReport f;
  f.set_job_id(high);
  f.set_generation(Job(high).generation());
  f.set_message("out of memory");
  f.set_fatal(true);
  Decisions d;
  ASSERT_TRUE(core_.ReportFailure(w0, f, now_, &d).ok());
  Collect(d);
  for (int i = 0; i < 10 && Job(high).state() != v1::JOB_STATE_FAILED; ++i) {
    now_ += absl::Seconds(1);
    Heartbeats({w0, w1});
    Tick();
  }
  ASSERT_EQ(Job(high).state(), v1::JOB_STATE_FAILED) << Job(high).reason();
  l = Job(low);
  ASSERT_EQ(l.state(), v1::JOB_STATE_RUNNING) << l.reason();
  EXPECT_EQ(l.generation(), 2);
  EXPECT_FALSE(l.has_suspension());
  EXPECT_GE(l.suspended_ms(), 150'000);
  EXPECT_EQ(l.recoveries(), 0);
  ASSERT_EQ(l.recovery_history_size(), 1);
  EXPECT_TRUE(absl::StartsWith(l.recovery_history(0).reason(),
                               "resumed after 152.0s suspended (preempted by " + high))
      << l.recovery_history(0).reason();
  EXPECT_FALSE(l.recovery_history(0).counted());
  EXPECT_EQ(l.recovery_history(0).to_generation(), 2);
  a = TakeAssignments();
  ASSERT_EQ(a.size(), 2u);
  for (const auto& [id, assignment] : a) {
    EXPECT_EQ(assignment.job_id(), low);
    EXPECT_EQ(assignment.start_step(), 6);
  }
  Step(low, 6);
  now_ += absl::Seconds(10);
  Heartbeats({w0, w1});
  Tick();
  EXPECT_EQ(Job(low).state(), v1::JOB_STATE_RUNNING) << Job(low).reason();
}

TEST_F(SuspensionTest, ASuspendedJobWaitsForAWorkerThatKeepsItsStateUnlessNoneIsLeft) {
  const std::string w0 = Register("w0");
  const std::string w1 = Register("w1");
  const std::string low = Submit(Patient(2, 2, 0));
  Step(low, 3);
  const std::string high = Submit(Patient(2, 2, 10));
  ASSERT_EQ(Job(low).state(), v1::JOB_STATE_SUSPENDED);
  Register("w2");
  Register("w3");
  // Two idle workers, but neither keeps its state: it waits for one that does, and so does the
  // job behind it.
  v1::Job l = Job(low);
  EXPECT_EQ(l.state(), v1::JOB_STATE_SUSPENDED);
  EXPECT_TRUE(absl::StrContains(
      l.reason(), "waiting for a worker that keeps its state of step 3 (w0, w1 are busy)"))
      << l.reason();
  const std::string behind = Submit(Patient(1, 1, 0));
  EXPECT_EQ(Job(behind).state(), v1::JOB_STATE_PENDING);
  EXPECT_TRUE(absl::StrContains(Job(behind).reason(), "queued behind " + low))
      << Job(behind).reason();
  Cancel(behind);
  // high ends: low resumes on its holders, not on the idle others.
  Cancel(high);
  ASSERT_EQ(Job(low).state(), v1::JOB_STATE_RUNNING) << Job(low).reason();
  EXPECT_EQ(MemberNames(low), (std::set<std::string>{"w0", "w1"}));
  Step(low, 4);
  // Suspended again (by hand), its holders lost, and back as new processes without its state:
  // nobody keeps it any more, so it resumes on whichever workers are idle.
  ASSERT_TRUE(SuspendByHand(low).ok());
  EXPECT_EQ(Holders(low), (std::set<std::string>{"w0", "w1"}));
  Decisions d;
  core_.WorkerDisconnected(w0, "stream closed", now_, &d);
  core_.WorkerDisconnected(w1, "stream closed", now_, &d);
  Collect(d);
  Register("w0");
  EXPECT_EQ(Holders(low), (std::set<std::string>{"w1"}));
  ASSERT_TRUE(ResumeByHand(low).ok());
  l = Job(low);
  ASSERT_EQ(l.state(), v1::JOB_STATE_RUNNING) << l.reason();
  EXPECT_EQ(l.generation(), 3);
  bool said = false;
  const std::vector<v1::JobEvent> events_of_low = core_.EventsSince(low, 0).value();
  for (const v1::JobEvent& e : events_of_low) {
    said = said || absl::StrContains(e.message(), "w0 registered again without its state");
  }
  EXPECT_TRUE(said);
}

TEST_F(SuspensionTest, AUserSuspendsAndResumesJobsWithClearErrors) {
  const std::string w0 = Register("w0");
  const std::string w1 = Register("w1");
  const std::string job = Submit(Patient(1, 2, 0));
  Step(job, 4);
  TakeAssignments();
  EXPECT_EQ(SuspendByHand("job-404").code(), absl::StatusCode::kNotFound);
  const absl::Status running = ResumeByHand(job);
  EXPECT_EQ(running.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(running.message(), "is not suspended (JOB_STATE_RUNNING)"))
      << running;
  ASSERT_TRUE(SuspendByHand(job).ok());
  v1::Job j = Job(job);
  EXPECT_EQ(j.state(), v1::JOB_STATE_SUSPENDED);
  EXPECT_TRUE(j.suspension().by_user());
  EXPECT_TRUE(absl::StrContains(j.reason(), "suspended by a user")) << j.reason();
  EXPECT_EQ(Holders(job), (std::set<std::string>{"w0", "w1"}));
  EXPECT_EQ(AbortsOf(job),
            (std::map<std::string, std::string>{{w0, "suspended"}, {w1, "suspended"}}));
  EXPECT_TRUE(Queue().empty()) << "a job a user suspended waits for resume, not for workers";
  const absl::Status twice = SuspendByHand(job);
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(twice.message(), "already suspended")) << twice;
  // Its workers serve another job meanwhile.
  const std::string other = Submit(Patient(2, 2, 0));
  EXPECT_EQ(Job(other).state(), v1::JOB_STATE_RUNNING);
  ASSERT_TRUE(ResumeByHand(job).ok());
  EXPECT_EQ(Queue(), (std::vector<std::string>{job}));
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_SUSPENDED);
  Cancel(other);
  j = Job(job);
  ASSERT_EQ(j.state(), v1::JOB_STATE_RUNNING) << j.reason();
  EXPECT_EQ(j.generation(), 2);
  // Cancelled while suspended: its holders are told to drop its state.
  ASSERT_TRUE(SuspendByHand(job).ok());
  TakeAssignments();
  Cancel(job);
  EXPECT_EQ(AbortsOf(job), (std::map<std::string, std::string>{{w0, "ended"}, {w1, "ended"}}));
  const absl::Status ended = SuspendByHand(job);
  EXPECT_EQ(ended.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(ended.message(), "has already ended")) << ended;
  // A pending job suspended by hand leaves the queue, and comes back to it pending.
  const std::string big = Submit(Patient(3, 3, 0));
  ASSERT_EQ(Job(big).state(), v1::JOB_STATE_PENDING);
  ASSERT_TRUE(SuspendByHand(big).ok());
  EXPECT_EQ(Job(big).state(), v1::JOB_STATE_SUSPENDED);
  EXPECT_TRUE(Queue().empty());
  ASSERT_TRUE(ResumeByHand(big).ok());
  EXPECT_EQ(Job(big).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Queue(), (std::vector<std::string>{big}));
}

TEST_F(SuspensionTest, ASuspendedJobTakesAHolderBackFromALowerPriorityJob) {
  Register("w0");
  Register("w1");
  const std::string x = Submit(Patient(2, 2, 5));
  Step(x, 3);
  ASSERT_TRUE(SuspendByHand(x).ok());
  // While it is suspended by hand, a job of a lower priority runs on its holders.
  const std::string low = Submit(Patient(2, 2, 0));
  ASSERT_EQ(Job(low).state(), v1::JOB_STATE_RUNNING);
  Step(low, 1);
  // Resumed: it does not wait for low to end, it takes its holders back (low is at its
  // min_workers: suspended), and resumes on them.
  ASSERT_TRUE(ResumeByHand(x).ok());
  const v1::Job j = Job(x);
  ASSERT_EQ(j.state(), v1::JOB_STATE_RUNNING) << j.reason();
  EXPECT_EQ(j.generation(), 2);
  EXPECT_EQ(MemberNames(x), (std::set<std::string>{"w0", "w1"}));
  const v1::Job l = Job(low);
  ASSERT_EQ(l.state(), v1::JOB_STATE_SUSPENDED) << l.reason();
  EXPECT_TRUE(absl::StrContains(l.reason(), "preempted by " + x + " (priority 5)")) << l.reason();
  // Its workers keep low's state aside while they run x (they park one state besides x's).
  EXPECT_EQ(Holders(low), (std::set<std::string>{"w0", "w1"}));
}

TEST_F(SuspensionTest, AHolderLeftOutOfTheResumeIsToldToDropTheState) {
  Register("w0");
  Register("w1");
  Register("w2");
  const std::string x = Submit(Patient(2, 2, 5));
  Step(x, 3);
  // Needs 2: w2 idle and one of x's, which is at its min_workers: x is suspended, w1 taken.
  const std::string high = Submit(Patient(2, 2, 9));
  ASSERT_EQ(Job(high).state(), v1::JOB_STATE_RUNNING);
  ASSERT_EQ(Job(x).state(), v1::JOB_STATE_SUSPENDED);
  ASSERT_EQ(Holders(x), (std::set<std::string>{"w0", "w1"}));
  EXPECT_EQ(MemberNames(high), (std::set<std::string>{"w1", "w2"}));
  // One holder idle, one busy with a job of a higher priority: it waits for a second worker.
  EXPECT_TRUE(absl::StrContains(Job(x).reason(), "waiting for 2 idle")) << Job(x).reason();
  TakeAssignments();
  const std::string w3 = Register("w3");
  ASSERT_EQ(Job(x).state(), v1::JOB_STATE_RUNNING) << Job(x).reason();
  EXPECT_EQ(MemberNames(x), (std::set<std::string>{"w0", "w3"}));
  // Not before the resumed generation has trained a step (w1 is its fallback meanwhile).
  EXPECT_TRUE(AbortsOf(x).empty());
  Step(x, 4);
  bool told = false;
  for (const auto& m : sent_) {
    told = told || (m.worker_id == FindId("w1") && m.message.has_abort() &&
                    m.message.abort().job_id() == x && m.message.abort().drop_parked() &&
                    !m.message.abort().job_ended());
  }
  EXPECT_TRUE(told) << "w1 may drop x's state";
}

TEST_F(SuspensionTest, TheQueueSaysWhatEachJobWouldPreemptAtItsHead) {
  Register("w0");
  Register("w1");
  const std::string low = Submit(PrioritySpec(1, 2, 0));
  Step(low, 1);
  const std::string head = Submit(PrioritySpec(3, 3, 5));  // more than there are
  const std::string shrinks = Submit(PrioritySpec(1, 1, 4));
  const std::string suspends = Submit(PrioritySpec(2, 2, 3));
  const std::string equal = Submit(PrioritySpec(1, 1, 0));
  v1::ListJobsRequest request;
  request.set_queue(true);
  const v1::ListJobsResponse queue = core_.ListJobs(request).value();
  ASSERT_EQ(queue.jobs_size(), 4);
  std::map<std::string, std::string> plans;
  for (const v1::Job& j : queue.jobs()) plans[j.job_id()] = j.would_preempt();
  EXPECT_EQ(plans[head],
            "not enough: shrinking or suspending lower-priority jobs would free only 2");
  EXPECT_EQ(plans[shrinks], "shrink " + low + " (priority 0) by 1");
  EXPECT_EQ(plans[suspends], "suspend " + low + " (priority 0)");
  EXPECT_EQ(plans[equal], "");
  // Only a listing of the queue says it; nothing was preempted.
  EXPECT_EQ(Job(shrinks).would_preempt(), "");
  EXPECT_EQ(Members(low).size(), 2u);
}

TEST_F(SuspensionTest, ARestartedCoordinatorKeepsASuspendedJobAndLearnsItsHoldersAgain) {
  Register("w0");
  Register("w1");
  const std::string low = Submit(Patient(2, 2, 0));
  Step(low, 7);
  const std::string high = Submit(Patient(2, 2, 10));
  ASSERT_EQ(Job(low).state(), v1::JOB_STATE_SUSPENDED);
  const std::vector<v1::Job> saved = {Job(low), Job(high)};

  Core fresh(Options());
  Decisions d;
  EXPECT_EQ(fresh.RestoreJobs(saved, now_, &d), 2);
  ASSERT_EQ(fresh.GetJob(low)->state(), v1::JOB_STATE_SUSPENDED);
  // Another worker registers first: low waits for its holders rather than start from nothing.
  {
    v1::RegisterRequest r;
    r.set_name("w5");
    r.set_host("h1");
    r.set_device("cpu");
    Decisions rd;
    ASSERT_TRUE(fresh.RegisterWorker(r, now_, &rd).ok());
  }
  EXPECT_EQ(fresh.GetJob(low)->state(), v1::JOB_STATE_SUSPENDED);
  EXPECT_TRUE(absl::StrContains(fresh.GetJob(low)->reason(),
                                "(w0, w1) to register again after the coordinator restarted"))
      << fresh.GetJob(low)->reason();
  // w0 comes back keeping low's state aside, w1 as a new process without it, w9 keeping the
  // state of a job this coordinator does not know.
  std::map<std::string, std::string> ids;
  std::vector<Decisions::Outgoing> sent;
  for (const char* name : {"w0", "w1", "w9"}) {
    v1::RegisterRequest r;
    r.set_name(name);
    r.set_host("h1");
    r.set_device("cpu");
    if (std::string(name) == "w0") {
      r.mutable_parked()->set_job_id(low);
      r.mutable_parked()->set_step(7);
    } else if (std::string(name) == "w9") {
      r.mutable_parked()->set_job_id("job-999");
    }
    Decisions rd;
    ids[name] = fresh.RegisterWorker(r, now_, &rd).value();
    sent.insert(sent.end(), rd.messages.begin(), rd.messages.end());
  }
  const v1::Job l = fresh.GetJob(low).value();
  EXPECT_EQ(l.state(), v1::JOB_STATE_SUSPENDED);
  EXPECT_EQ(
      std::vector<std::string>(l.suspension().holders().begin(), l.suspension().holders().end()),
      std::vector<std::string>{"w0"});
  bool told_w9 = false;
  for (const auto& m : sent) {
    told_w9 = told_w9 || (m.worker_id == ids["w9"] && m.message.has_abort() &&
                          m.message.abort().job_id() == "job-999" && m.message.abort().job_ended());
  }
  EXPECT_TRUE(told_w9);
  // high re-forms on its members; once it ends, low resumes from w0's state.
  ASSERT_EQ(fresh.GetJob(high)->state(), v1::JOB_STATE_RUNNING) << fresh.GetJob(high)->reason();
  Decisions cd;
  ASSERT_TRUE(fresh.CancelJob(high, now_, &cd).ok());
  const v1::Job resumed = fresh.GetJob(low).value();
  ASSERT_EQ(resumed.state(), v1::JOB_STATE_RUNNING) << resumed.reason();
  std::set<std::string> names;
  for (const v1::Member& m : resumed.members()) names.insert(m.worker_name());
  EXPECT_EQ(names.count("w0"), 1u);
}

class AgingTest : public SchedulingTest {
 protected:
  AgingTest() : SchedulingTest(AgingOptions()) {}
  static CoreOptions AgingOptions() {
    CoreOptions o = Options();
    o.priority_aging = absl::Minutes(1);
    return o;
  }
};

TEST_F(AgingTest, AQueuedJobAgesPastNewerHigherPriorityOnesButPreemptsByItsDeclaredOne) {
  const std::string w0 = Register("w0"), w1 = Register("w1");
  const std::string running = Submit(PrioritySpec(1, 2, 1));
  Step(running, 1);
  const std::string old = Submit(PrioritySpec(1, 1, 0));
  for (int minute = 1; minute <= 5; ++minute) {
    now_ += absl::Minutes(1);
    Heartbeats({w0, w1});
    Step(running, 1 + minute);
    Tick();
  }
  const std::string fresh = Submit(PrioritySpec(1, 1, 2));
  // Without aging the newer one would lead.
  EXPECT_EQ(Queue(), (std::vector<std::string>{old, fresh}));
  EXPECT_TRUE(absl::StrContains(Job(old).reason(), "priority 5 after waiting (declared 0)"))
      << Job(old).reason();
  // Aged to 5, it still does not preempt the running job of priority 1 (its declared 0 is
  // lower), and `fresh`, which could, waits behind it.
  EXPECT_EQ(Members(running).size(), 2u);
  EXPECT_EQ(Job(fresh).state(), v1::JOB_STATE_PENDING);
}

TEST_F(AgingTest, AgingStopsAtTheHighestPriority) {
  const std::string job = Submit(PrioritySpec(1, 1, kMaxPriority - 2));
  now_ += absl::Minutes(10);
  Tick();
  EXPECT_TRUE(absl::StrContains(Job(job).reason(),
                                absl::StrCat("priority ", kMaxPriority, " after waiting")))
      << Job(job).reason();
}

}  // namespace
}  // namespace lockstep::coordinator
