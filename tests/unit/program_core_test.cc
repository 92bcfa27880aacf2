// Program jobs in the coordinator core, with an explicit clock: placement only on workers that
// run programs, each member's place on its host, a fatal exit code failing the job at once, a
// program's failure restarting the group, and the step timer armed by the program's reports.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/program.h"
#include "coordinator/core/core.h"
#include "gtest/gtest.h"

namespace lockstep::coordinator {
namespace {

v1::JobSpec ProgramSpec(int min_workers, int max_workers) {
  v1::JobSpec spec;
  spec.set_min_workers(min_workers);
  spec.set_max_workers(max_workers);
  spec.set_step_timeout_ms(10000);
  spec.mutable_program()->add_argv("/usr/bin/python3");
  spec.mutable_program()->add_argv("train.py");
  spec.mutable_program()->set_workdir("/srv/p");
  spec.mutable_program()->add_fatal_exit_codes(9);
  return spec;
}

class ProgramCoreTest : public ::testing::Test {
 protected:
  std::string Register(const std::string& name, const std::string& host, bool programs = true,
                       const std::string& uuid = "") {
    v1::RegisterRequest r;
    r.set_name(name);
    r.set_host(host);
    r.set_device(uuid.empty() ? "cpu" : "cuda:0");
    r.set_device_uuid(uuid);
    if (programs) r.add_capabilities(kProgramCapability);
    r.set_peer_address(name + ":4000");
    Decisions d;
    absl::StatusOr<std::string> id = core_.RegisterWorker(r, now_, &d);
    EXPECT_TRUE(id.ok()) << id.status();
    Collect(d);
    if (id.ok()) workers_.push_back(*id);
    return id.value_or("");
  }
  std::string Submit(const v1::JobSpec& spec) {
    Decisions d;
    absl::StatusOr<v1::Job> job = core_.SubmitJob(spec, now_, &d);
    EXPECT_TRUE(job.ok()) << job.status();
    Collect(d);
    return job.ok() ? job->job_id() : "";
  }
  void Collect(const Decisions& d) {
    for (const auto& m : d.messages) {
      if (m.message.has_assignment()) assignments_[m.worker_id] = m.message.assignment();
    }
  }
  // Time passes in heartbeat-sized pieces, every worker alive.
  void Tick(absl::Duration advance) {
    while (advance > absl::ZeroDuration()) {
      const absl::Duration piece = std::min(advance, absl::Seconds(1));
      now_ += piece;
      advance -= piece;
      for (const std::string& w : workers_) (void)core_.Heartbeat(w, now_);
      Decisions d;
      core_.Tick(now_, &d);
      Collect(d);
    }
  }
  absl::Status Fail(const std::string& worker, const std::string& job, int64_t generation,
                    int exit_code, bool fatal) {
    v1::FailureReport f;
    f.set_job_id(job);
    f.set_generation(generation);
    f.set_fatal(fatal);
    f.set_message(absl::StrCat("rank 1 exited with code ", exit_code));
    f.mutable_program_exit()->set_rank(1);
    f.mutable_program_exit()->set_exit_code(exit_code);
    f.mutable_program_exit()->set_summary("ValueError: x");
    Decisions d;
    absl::Status s = core_.ReportFailure(worker, f, now_, &d);
    Collect(d);
    return s;
  }
  absl::Status Report(const std::string& worker, const std::string& job, int64_t generation,
                      int64_t step, bool first) {
    v1::ProgressReport p;
    p.set_job_id(job);
    p.set_generation(generation);
    p.set_step(step);
    p.set_first_of_generation(first);
    Decisions d;
    absl::Status s = core_.ReportProgress(worker, p, now_, &d);
    Collect(d);
    return s;
  }
  v1::Job Job(const std::string& id) { return core_.GetJob(id).value(); }

  Core core_;
  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
  std::map<std::string, v1::Assignment> assignments_;
  std::vector<std::string> workers_;
};

TEST_F(ProgramCoreTest, RunsOnlyOnWorkersThatRunProgramsAndSaysWhyItWaits) {
  const std::string plain = Register("plain", "h1", /*programs=*/false);
  const std::string job = Submit(ProgramSpec(1, 1));
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_PENDING);
  EXPECT_TRUE(absl::StrContains(Job(job).reason(),
                                "(1 idle, 0 that run programs (lockstep-worker --programs_root))"))
      << Job(job).reason();
  EXPECT_TRUE(assignments_.empty());
  const std::string runner = Register("runner", "h1");
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  ASSERT_EQ(assignments_.size(), 1u);
  EXPECT_EQ(assignments_.count(runner), 1u);
  EXPECT_EQ(assignments_.count(plain), 0u);
}

TEST_F(ProgramCoreTest, MembersLearnTheirPlaceOnTheirHostAndTheirHostsGpus) {
  // Registered interleaved; ranks are host-contiguous all the same.
  const std::string a0 = Register("a0", "alpha", true, "GPU-a0");
  const std::string b0 = Register("b0", "beta", true, "GPU-b0");
  const std::string a1 = Register("a1", "alpha", true, "GPU-a1");
  Submit([] {
    v1::JobSpec spec = ProgramSpec(3, 3);
    spec.set_device("cuda");
    return spec;
  }());
  ASSERT_EQ(assignments_.size(), 3u);
  const v1::Assignment& x0 = assignments_.at(a0);
  const v1::Assignment& x1 = assignments_.at(a1);
  const v1::Assignment& y0 = assignments_.at(b0);
  EXPECT_EQ(x0.rank(), 0);
  EXPECT_EQ(x1.rank(), 1);
  EXPECT_EQ(y0.rank(), 2);
  EXPECT_EQ(x0.local_rank(), 0);
  EXPECT_EQ(x1.local_rank(), 1);
  EXPECT_EQ(y0.local_rank(), 0);
  for (const v1::Assignment* a : {&x0, &x1}) {
    EXPECT_EQ(a->local_world_size(), 2);
    EXPECT_EQ(a->host_rank(), 0);
    EXPECT_EQ(a->host_count(), 2);
    EXPECT_EQ(std::vector<std::string>(a->local_device_uuids().begin(),
                                       a->local_device_uuids().end()),
              (std::vector<std::string>{"GPU-a0", "GPU-a1"}));
  }
  EXPECT_EQ(y0.local_world_size(), 1);
  EXPECT_EQ(y0.host_rank(), 1);
  EXPECT_EQ(std::vector<std::string>(y0.local_device_uuids().begin(),
                                     y0.local_device_uuids().end()),
            (std::vector<std::string>{"GPU-b0"}));
  EXPECT_EQ(x0.restart_count(), 0);
}

TEST_F(ProgramCoreTest, CheckpointPeersAreARingOverTheHosts) {
  // alpha: a0 a1 a2; beta: b0; gamma: c0 c1. Each member's copies go to the next host's
  // member at its local rank (modulo), and the last host's to the first's.
  for (const char* name : {"a0", "b0", "c0", "a1", "c1", "a2"}) {
    Register(name, std::string(name[0] == 'a' ? "alpha" : name[0] == 'b' ? "beta" : "gamma"));
  }
  Submit(ProgramSpec(6, 6));
  ASSERT_EQ(assignments_.size(), 6u);
  std::map<std::string, std::string> peer_of;
  for (const auto& [id, a] : assignments_) {
    ASSERT_TRUE(a.has_checkpoint_peer()) << a.ShortDebugString();
    const std::string name = a.member_names(a.rank());
    peer_of[name] = a.checkpoint_peer().worker_name();
    EXPECT_EQ(a.checkpoint_peer().address(), peer_of[name] + ":4000");
    EXPECT_NE(name.front(), peer_of[name].front()) << name << " keeps its copies on its own host";
  }
  EXPECT_EQ(peer_of["a0"], "b0");
  EXPECT_EQ(peer_of["a1"], "b0");
  EXPECT_EQ(peer_of["a2"], "b0");
  EXPECT_EQ(peer_of["b0"], "c0");
  EXPECT_EQ(peer_of["c0"], "a0");
  EXPECT_EQ(peer_of["c1"], "a1");
}

TEST_F(ProgramCoreTest, OnOneHostTheNextRankKeepsTheCopiesAndAlonePeerless) {
  Register("w0", "h1");
  Register("w1", "h1");
  Register("w2", "h1");
  Submit(ProgramSpec(3, 3));
  ASSERT_EQ(assignments_.size(), 3u);
  for (const auto& [id, a] : assignments_) {
    EXPECT_EQ(a.checkpoint_peer().worker_name(), a.member_names((a.rank() + 1) % 3));
  }
  assignments_.clear();
  Register("solo", "h2");
  Submit(ProgramSpec(1, 1));
  ASSERT_EQ(assignments_.size(), 1u);
  EXPECT_FALSE(assignments_.begin()->second.has_checkpoint_peer())
      << "a job of one member keeps no copy";
}

TEST_F(ProgramCoreTest, AMemberThatJoinedIsToldSoTheOthersAreNot) {
  const std::string w0 = Register("w0", "h1");
  const std::string job = Submit(ProgramSpec(1, 2));
  ASSERT_EQ(assignments_.size(), 1u);
  EXPECT_FALSE(assignments_.at(w0).joined()) << "the first generation has nobody before it";
  ASSERT_TRUE(Report(w0, job, 1, 1, true).ok());
  assignments_.clear();
  const std::string w1 = Register("w1", "h2");
  Tick(absl::Seconds(1));
  ASSERT_EQ(assignments_.size(), 2u) << "a scale-up";
  EXPECT_FALSE(assignments_.at(w0).joined());
  EXPECT_TRUE(assignments_.at(w1).joined());
}

TEST_F(ProgramCoreTest, AFailedProcessRestartsTheGroupAndAFatalCodeFailsTheJob) {
  const std::string w0 = Register("w0", "h1");
  const std::string w1 = Register("w1", "h1");
  const std::string job = Submit(ProgramSpec(2, 2));
  ASSERT_EQ(assignments_.size(), 2u);
  assignments_.clear();
  // Exit code 1: a recovery on the same two (healthy) workers, after the short grace.
  ASSERT_TRUE(Fail(w1, job, 1, 1, /*fatal=*/false).ok());
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING);
  Tick(absl::Seconds(1));
  ASSERT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(job).generation(), 2);
  EXPECT_EQ(Job(job).recoveries(), 1);
  ASSERT_EQ(assignments_.size(), 2u);
  EXPECT_EQ(assignments_.at(w0).restart_count(), 1);
  ASSERT_EQ(Job(job).program_exits_size(), 1);
  EXPECT_EQ(Job(job).program_exits(0).worker(), "w1");
  EXPECT_EQ(Job(job).program_exits(0).generation(), 1);
  EXPECT_EQ(Job(job).program_exits(0).exit_code(), 1);
  // A fatal exit code fails the job at once, although rank 0 is still running.
  ASSERT_TRUE(Fail(w1, job, 2, 9, /*fatal=*/true).ok());
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(Job(job).reason(), "exited with code 9")) << Job(job).reason();
  EXPECT_EQ(Job(job).program_exits_size(), 2);
}

// An exit code may be a dead peer seen through a collective: the group re-forms after the
// grace that lets a dead worker's stream close. A process killed from outside (SIGKILL) was
// not: its own live worker reports it, and the group re-forms at once.
TEST_F(ProgramCoreTest, AProcessKilledFromOutsideReformsAtOnceAnExitCodeAfterTheGrace) {
  Register("w0", "h1");
  const std::string w1 = Register("w1", "h1");
  const std::string job = Submit(ProgramSpec(2, 2));
  ASSERT_TRUE(Fail(w1, job, 1, 1, /*fatal=*/false).ok());
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING);
  Tick(absl::Milliseconds(100));
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING) << "re-formed within the grace";
  Tick(absl::Milliseconds(300));
  ASSERT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  ASSERT_EQ(Job(job).generation(), 2);

  v1::FailureReport f;
  f.set_job_id(job);
  f.set_generation(2);
  f.set_message("rank 1 (w1) was killed by SIGKILL");
  f.mutable_program_exit()->set_rank(1);
  f.mutable_program_exit()->set_signal("SIGKILL");
  Decisions d;
  ASSERT_TRUE(core_.ReportFailure(w1, f, now_, &d).ok());
  Collect(d);
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(job).generation(), 3);
  EXPECT_EQ(Job(job).recoveries(), 2);
}

TEST_F(ProgramCoreTest, TheStepTimerRunsOnlyOnceTheProgramReports) {
  const std::string w0 = Register("w0", "h1");
  const std::string job = Submit(ProgramSpec(1, 1));
  // A program that never reports is never timed out (it may run for hours between steps).
  Tick(absl::Seconds(30));
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(job).generation(), 1);
  ASSERT_TRUE(Report(w0, job, 1, 1, /*first=*/true).ok());
  Tick(absl::Seconds(5));
  ASSERT_TRUE(Report(w0, job, 1, 2, false).ok());
  Tick(absl::Seconds(8));
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  // No step for longer than step_timeout_ms (10 s): the group is restarted.
  Tick(absl::Seconds(3));
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RECONFIGURING);
  Tick(absl::Seconds(1));
  EXPECT_EQ(Job(job).generation(), 2) << Job(job).reason();
  ASSERT_EQ(Job(job).recovery_history_size(), 1);
  EXPECT_TRUE(absl::StrContains(Job(job).recovery_history(0).reason(), "no step completed"));
  EXPECT_EQ(Job(job).recovery_history(0).step_at_detection(), 2);
  // The new generation's first report says where the program resumed (its own checkpoint).
  ASSERT_TRUE(Report(w0, job, 2, 2, true).ok());
  EXPECT_EQ(Job(job).recovery_history(0).resumed_from_step(), 1);
  EXPECT_EQ(Job(job).recovery_history(0).steps_redone(), 1);
  EXPECT_GT(Job(job).recovery_history(0).first_step_unix_ms(), 0);
  EXPECT_EQ(Job(job).step(), 2);
}

}  // namespace
}  // namespace lockstep::coordinator
