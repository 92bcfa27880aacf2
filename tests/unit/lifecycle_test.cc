// The worker's lifecycle rules (worker/lifecycle.h), one table case per rule and per defect
// that was a lifecycle rule: each case is a sequence of events and the transcript of what the
// lifecycle decided after each one.
#include "worker/lifecycle.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"

namespace lockstep::worker {
namespace {

v1::JobSpec Spec(uint64_t seed) {
  v1::JobSpec spec;
  spec.mutable_model()->set_type("mlp");
  spec.set_global_batch_size(64);
  spec.set_seed(seed);
  return spec;
}

// One event; `spec` distinguishes two specs under one job id.
struct Event {
  enum Kind {
    kAssign,
    kAbort,
    kSuspend,
    kDropParked,
    kJobEnded,
    kSessionEnded,
    kStopping,
    kHealed,
    kTraining,
    kEnded,
    kTick
  } kind;
  std::string job = "job-1";
  int64_t generation = 1;
  RunId run = 0;
  RunResult::Kind result = RunResult::kStopped;
  bool holds_state = true;
  uint64_t spec = 1;
  absl::Duration after;  // kTick: time passed
};
Event Assign(const std::string& job, int64_t generation, uint64_t spec = 1) {
  return {Event::kAssign, job, generation, 0, RunResult::kStopped, true, spec};
}
Event Abort(const std::string& job, int64_t generation) { return {Event::kAbort, job, generation}; }
Event Suspend(const std::string& job, int64_t generation) {
  return {Event::kSuspend, job, generation};
}
Event DropParked(const std::string& job) { return {Event::kDropParked, job, 0}; }
Event JobEnded(const std::string& job) { return {Event::kJobEnded, job, 0}; }
Event SessionEnded() { return {Event::kSessionEnded}; }
Event Stopping() { return {Event::kStopping}; }  // the agent stops: its session ends
Event Training(RunId run) { return {Event::kTraining, "", 0, run}; }
Event Healed(RunId run) { return {Event::kHealed, "", 0, run}; }
Event Ended(RunId run, RunResult::Kind result, bool holds_state = true) {
  return {Event::kEnded, "", 0, run, result, holds_state};
}
Event Tick(absl::Duration after) {
  Event e{Event::kTick};
  e.after = after;
  return e;
}

std::string Describe(const LifecycleActions& a) {
  std::vector<std::string> parts;
  for (const auto& x : a.abort) {
    parts.push_back(absl::StrCat("abort #", x.run, x.job_ended ? " (job ended)" : ""));
  }
  if (a.drop_kept_state) parts.push_back("drop kept");
  if (a.drop_parked_state) parts.push_back("drop parked");
  if (a.swap_kept_and_parked) parts.push_back("swap kept and parked");
  if (a.park_kept_state) parts.push_back("park kept");
  if (a.keep_state_of.has_value()) parts.push_back(absl::StrCat("keep #", *a.keep_state_of));
  if (a.park_state_of.has_value()) parts.push_back(absl::StrCat("park #", *a.park_state_of));
  for (const auto& s : a.start) {
    parts.push_back(absl::StrCat("start #", s.run, " ", s.assignment.job_id(), "/",
                                 s.assignment.generation(),
                                 s.with_kept_state     ? " with state"
                                 : s.with_parked_state ? " with parked state"
                                                       : " fresh"));
  }
  if (a.park_state_after_start_of.has_value()) {
    parts.push_back(absl::StrCat("then park #", *a.park_state_after_start_of));
  }

  for (const v1::WorkerMessage& m : a.send) {
    if (m.has_failure()) {
      parts.push_back(absl::StrCat("report failure", m.failure().fatal() ? " (fatal)" : "",
                                   " at step ", m.failure().step()));
    } else if (m.has_resumed()) {
      parts.push_back(
          absl::StrCat("report resumed ", m.resumed().job_id(), "/", m.resumed().generation()));
    }
  }
  return parts.empty() ? "nothing" : absl::StrJoin(parts, ", ");
}

struct Case {
  std::string name;
  std::vector<Event> events;
  std::vector<std::string> transcript;  // Describe() after each event
};

std::vector<std::string> Play(const std::vector<Event>& events) {
  WorkerLifecycle lifecycle(absl::Seconds(10));
  absl::Time now = absl::FromUnixSeconds(1'700'000'000);
  std::vector<std::string> out;
  for (const Event& e : events) {
    LifecycleActions a;
    switch (e.kind) {
      case Event::kAssign: {
        v1::Assignment assignment;
        assignment.set_job_id(e.job);
        assignment.set_generation(e.generation);
        *assignment.mutable_spec() = Spec(e.spec);
        a = lifecycle.OnAssignment(assignment, now);
        break;
      }
      case Event::kAbort:
        a = lifecycle.OnAbort(e.job, e.generation, "aborted", /*job_ended=*/false, now);
        break;
      case Event::kSuspend:
        a = lifecycle.OnAbort(e.job, e.generation, "suspended", /*job_ended=*/false, now,
                              /*suspended=*/true);
        break;
      case Event::kDropParked:
        a = lifecycle.OnAbort(e.job, e.generation, "resumed elsewhere", /*job_ended=*/false, now,
                              /*suspended=*/false, /*drop_parked=*/true);
        break;
      case Event::kJobEnded:
        a = lifecycle.OnAbort(e.job, e.generation, "the job ended", /*job_ended=*/true, now);
        break;
      case Event::kSessionEnded:
        a = lifecycle.OnSessionEnded("session ended", now);
        break;
      case Event::kStopping:
        a = lifecycle.OnSessionEnded("stopping", now, /*keep_training=*/false);
        break;
      case Event::kHealed:
        a = lifecycle.OnHealed(e.run, v1::ResumedReport(), now);
        break;
      case Event::kTraining:
        a = lifecycle.OnTraining(e.run, now);
        break;
      case Event::kEnded: {
        RunResult r;
        r.kind = e.result;
        r.holds_state = e.holds_state;
        r.step = 10;
        r.message = "why";
        a = lifecycle.OnRunEnded(e.run, r, now);
        break;
      }
      case Event::kTick:
        now += e.after;
        a = lifecycle.Tick(now);
        break;
    }
    out.push_back(Describe(a));
  }
  return out;
}

class LifecycleTest : public ::testing::TestWithParam<Case> {};

TEST_P(LifecycleTest, Transcript) {
  const Case& c = GetParam();
  EXPECT_EQ(Play(c.events), c.transcript);
}

using K = RunResult::Kind;

INSTANTIATE_TEST_SUITE_P(
    Rules, LifecycleTest,
    ::testing::Values(
        Case{"FreshAssignmentStartsWithoutState", {Assign("job-1", 1)}, {"start #1 job-1/1 fresh"}},
        // Rules 1 and 4: the next generation takes over the state of the one before it.
        Case{"NextGenerationWaitsForThePreviousAndTakesItsState",
             {Assign("job-1", 1), Assign("job-1", 2), Ended(1, K::kStopped)},
             {"start #1 job-1/1 fresh", "abort #1", "keep #1, start #2 job-1/2 with state"}},
        Case{"StateKeptBetweenAnAbortAndTheNextGeneration",
             {Assign("job-1", 1), Abort("job-1", 1), Ended(1, K::kStopped), Assign("job-1", 2)},
             {"start #1 job-1/1 fresh", "abort #1", "keep #1", "start #2 job-1/2 with state"}},
        // Rule 2.
        Case{"StaleAssignmentsAreIgnored",
             {Assign("job-1", 2), Assign("job-1", 1), Assign("job-1", 2)},
             {"start #1 job-1/2 fresh", "nothing", "nothing"}},
        // Rule 1's timeout: a run that does not stop in time loses the race for the state, and
        // its state is stale once it stops.
        Case{"HandoverTimeoutStartsWithoutTheStateAndDropsItLater",
             {Assign("job-1", 1), Assign("job-1", 2), Tick(absl::Seconds(5)),
              Tick(absl::Seconds(6)), Ended(1, K::kStopped), Assign("job-1", 3)},
             {"start #1 job-1/1 fresh", "abort #1", "nothing", "start #2 job-1/2 fresh", "nothing",
              "abort #2"}},
        // Rule 3, defect 1: a new coordinator's job (another id) never gets an old job's state.
        Case{"AnotherJobDropsTheKeptState",
             {Assign("job-1-aaaaaa", 1), SessionEnded(), Ended(1, K::kStopped),
              Assign("job-1-bbbbbb", 1)},
             {"start #1 job-1-aaaaaa/1 fresh", "abort #1", "keep #1",
              "drop kept, start #2 job-1-bbbbbb/1 fresh"}},
        Case{
            "TheSameIdWithAnotherSpecDropsTheKeptState",
            {Assign("job-1", 1, 1), Abort("job-1", 1), Ended(1, K::kStopped),
             Assign("job-1", 2, 2)},
            {"start #1 job-1/1 fresh", "abort #1", "keep #1", "drop kept, start #2 job-1/2 fresh"}},
        // Rules 4 and 5.
        Case{"AFailureIsReportedAndItsStateKept",
             {Assign("job-1", 1), Ended(1, K::kFailed)},
             {"start #1 job-1/1 fresh", "keep #1, report failure at step 10"}},
        Case{"AFatalFailureIsReportedAndItsStateDropped",
             {Assign("job-1", 1), Ended(1, K::kFatal), Assign("job-1", 2)},
             {"start #1 job-1/1 fresh", "report failure (fatal) at step 10",
              "start #2 job-1/2 fresh"}},
        Case{"AnAbortedRunIsNotReported",
             {Assign("job-1", 1), Abort("job-1", 1), Ended(1, K::kFailed)},
             {"start #1 job-1/1 fresh", "abort #1", "keep #1"}},
        Case{"AFailureWithoutStateKeepsNothing",
             {Assign("job-1", 1), Ended(1, K::kFailed, /*holds_state=*/false)},
             {"start #1 job-1/1 fresh", "report failure at step 0"}},
        // Rule 4, two-phase finish: a finished run keeps its state until the coordinator says
        // the job's end is recorded; a coordinator that lost the end (a restart) re-forms the
        // job, and the members finish it from that state instead of training it again.
        Case{"AFinishedRunKeepsItsStateUntilTheEndIsRecorded",
             {Assign("job-1", 1), Ended(1, K::kFinished), JobEnded("job-1"), Assign("job-1", 2)},
             {"start #1 job-1/1 fresh", "keep #1", "drop kept", "start #2 job-1/2 fresh"}},
        Case{"AFinishedRunsStateFinishesTheJobAfterACoordinatorRestart",
             {Assign("job-1", 3), Ended(1, K::kFinished), SessionEnded(), Assign("job-1", 4)},
             {"start #1 job-1/3 fresh", "keep #1", "nothing", "start #2 job-1/4 with state"}},
        // The end recorded before the run has returned: nothing is kept.
        Case{"AnEndRecordedBeforeTheFinishedRunReturnsDropsItsState",
             {Assign("job-1", 1), JobEnded("job-1"), Ended(1, K::kFinished)},
             {"start #1 job-1/1 fresh", "abort #1 (job ended)", "nothing"}},
        // The next job assigned (the coordinator freed the worker after the record) drops it.
        Case{"AFinishedRunsStateGoesWithTheNextJob",
             {Assign("job-1", 1), Ended(1, K::kFinished), Assign("job-2", 1)},
             {"start #1 job-1/1 fresh", "keep #1", "drop kept, start #2 job-2/1 fresh"}},
        Case{"AnEndedJobDropsWhatIsKept",
             {Assign("job-1", 1), Abort("job-1", 1), Ended(1, K::kStopped), JobEnded("job-1")},
             {"start #1 job-1/1 fresh", "abort #1", "keep #1", "drop kept"}},
        Case{"AJobThatEndsWhileRunningKeepsNothing",
             {Assign("job-1", 1), JobEnded("job-1"), Ended(1, K::kStopped)},
             {"start #1 job-1/1 fresh", "abort #1 (job ended)", "nothing"}},
        // A run already stopping (still loading its data) hears that the job ended: it may
        // stop loading too.
        Case{"AStoppingRunHearsThatItsJobEnded",
             {Assign("job-1", 1), Abort("job-1", 1), JobEnded("job-1"), Ended(1, K::kStopped)},
             {"start #1 job-1/1 fresh", "abort #1", "abort #1 (job ended)", "nothing"}},
        // Rule 6.
        Case{"TheSessionEndingAbortsEveryRunAndKeepsTheirState",
             {Assign("job-1", 1), SessionEnded(), Ended(1, K::kStopped), Assign("job-1", 2)},
             {"start #1 job-1/1 fresh", "abort #1", "keep #1", "start #2 job-1/2 with state"}},
        // Rule 6: a group that trains goes on without the coordinator, until the next one
        // aborts it (or keeps it: then nothing happens at all).
        Case{"AGroupThatTrainsGoesOnWhenTheSessionEnds",
             {Assign("job-1", 1), Training(1), SessionEnded(), Abort("job-1", 1),
              Ended(1, K::kStopped), Assign("job-1", 2)},
             {"start #1 job-1/1 fresh", "nothing", "nothing", "abort #1", "keep #1",
              "start #2 job-1/2 with state"}},
        // The next coordinator did not keep it and assigns the same generation number again.
        Case{"AGroupThatTrainedOnIsReplacedByTheNextCoordinatorsAssignment",
             {Assign("job-1", 3), Training(1), SessionEnded(), Assign("job-1", 3),
              Ended(1, K::kStopped)},
             {"start #1 job-1/3 fresh", "nothing", "nothing", "abort #1",
              "keep #1, start #2 job-1/3 with state"}},
        Case{"AGroupThatFailsWhileTheCoordinatorIsAwayKeepsItsState",
             {Assign("job-1", 1), Training(1), SessionEnded(), Ended(1, K::kFailed),
              Assign("job-1", 2)},
             {"start #1 job-1/1 fresh", "nothing", "nothing", "keep #1, report failure at step 10",
              "start #2 job-1/2 with state"}},
        Case{"AStoppingAgentAbortsEvenAGroupThatTrains",
             {Assign("job-1", 1), Training(1), Stopping()},
             {"start #1 job-1/1 fresh", "nothing", "abort #1"}},
        // Only the newest run trains on: an older one that is stopping is not reported.
        Case{"ARunThatIsStoppingDoesNotTrainOn",
             {Assign("job-1", 1), Training(1), Abort("job-1", 1), SessionEnded()},
             {"start #1 job-1/1 fresh", "nothing", "abort #1", "nothing"}},
        // Rule 5 for heals.
        Case{"AHealIsReportedUnlessTheRunWasAborted",
             {Assign("job-1", 1), Healed(1), Assign("job-1", 2), Healed(1)},
             {"start #1 job-1/1 fresh", "report resumed job-1/1", "abort #1", "nothing"}},
        // Rule 1 across jobs: one job at a time, even while the other's run stops.
        Case{"AnotherJobWaitsForTheStoppingRunButNotForItsState",
             {Assign("job-1", 1), Assign("job-2", 1), Ended(1, K::kStopped)},
             {"start #1 job-1/1 fresh", "abort #1", "start #2 job-2/1 fresh"}},
        Case{"AnAssignmentAbortedBeforeItStartedNeverStarts",
             {Assign("job-1", 1), Assign("job-1", 2), Abort("job-1", 2), Ended(1, K::kStopped),
              Assign("job-1", 3)},
             {"start #1 job-1/1 fresh", "abort #1", "nothing", "keep #1",
              "start #3 job-1/3 with state"}},
        // The run that timed out is stale for good: even after the run that replaced it has
        // ended, its late state never replaces the newer kept state.
        Case{"ALateRunsStateNeverReplacesANewerOne",
             {Assign("job-1", 5), Assign("job-1", 6), Tick(absl::Seconds(11)), Assign("job-1", 7),
              Ended(2, K::kStopped), Ended(1, K::kStopped)},
             {"start #1 job-1/5 fresh", "abort #1", "start #2 job-1/6 fresh", "abort #2", "keep #2",
              "start #3 job-1/7 with state"}},
        // Rule 6: a coordinator restarted from older saved state assigns generation 3 again.
        Case{"ANewSessionForgetsWhichGenerationsWereAssigned",
             {Assign("job-1", 3), SessionEnded(), Assign("job-1", 3), Ended(1, K::kStopped)},
             {"start #1 job-1/3 fresh", "abort #1", "nothing",
              "keep #1, start #2 job-1/3 with state"}},
        // A run of another job still stopping does not make a handover within this job stale.
        Case{"AnotherJobsStoppingRunDoesNotCostTheHandover",
             {Assign("job-2", 1), Assign("job-1", 5), Tick(absl::Seconds(11)), Assign("job-1", 6),
              Ended(2, K::kStopped), Ended(1, K::kStopped)},
             {"start #1 job-2/1 fresh", "abort #1", "start #2 job-1/5 fresh", "abort #2", "keep #2",
              "start #3 job-1/6 with state"}},
        // Rule 7: a suspended job's state waits beside the job that took the worker, and the
        // job resumes with it; that job's own state goes (the resumed job was assigned since).
        Case{"ASuspendedJobsStateIsParkedForAnotherJobAndResumesWithIt",
             {Assign("job-1", 1), Suspend("job-1", 1), Ended(1, K::kStopped), Assign("job-2", 1),
              Assign("job-1", 2), Ended(2, K::kStopped)},
             {"start #1 job-1/1 fresh", "abort #1", "keep #1", "park kept, start #2 job-2/1 fresh",
              "abort #2", "start #3 job-1/2 with parked state"}},
        // The other job assigned before the suspended run returned: its state is parked then.
        Case{"ASuspendedRunEndingAfterAnotherJobWasAssignedIsParked",
             {Assign("job-1", 1), Suspend("job-1", 1), Assign("job-2", 1), Ended(1, K::kStopped),
              Ended(2, K::kFinished), Assign("job-1", 2)},
             {"start #1 job-1/1 fresh", "abort #1", "nothing", "park #1, start #2 job-2/1 fresh",
              "keep #2", "drop kept, start #3 job-1/2 with parked state"}},
        Case{"ASuspendedJobThatEndsDropsItsParkedState",
             {Assign("job-1", 1), Suspend("job-1", 1), Ended(1, K::kStopped), Assign("job-2", 1),
              JobEnded("job-1")},
             {"start #1 job-1/1 fresh", "abort #1", "keep #1", "park kept, start #2 job-2/1 fresh",
              "drop parked"}},
        // One parked state: a second suspended job's replaces the first's.
        Case{"ANewerParkedStateReplacesTheOlder",
             {Assign("job-1", 1), Suspend("job-1", 1), Ended(1, K::kStopped), Assign("job-2", 1),
              Suspend("job-2", 1), Ended(2, K::kStopped), Assign("job-3", 1)},
             {"start #1 job-1/1 fresh", "abort #1", "keep #1", "park kept, start #2 job-2/1 fresh",
              "abort #2", "keep #2", "drop parked, park kept, start #3 job-3/1 fresh"}},
        // A job resumed is no longer suspended: its state is dropped for another job as usual.
        Case{"AResumedJobIsNoLongerSuspended",
             {Assign("job-1", 1), Suspend("job-1", 1), Ended(1, K::kStopped), Assign("job-1", 2),
              Abort("job-1", 2), Ended(2, K::kStopped), Assign("job-2", 1)},
             {"start #1 job-1/1 fresh", "abort #1", "keep #1", "start #2 job-1/2 with state",
              "abort #2", "keep #2", "drop kept, start #3 job-2/1 fresh"}},
        // A job resumed on a worker that keeps another suspended job's state uses its own
        // parked state; the other's takes the parked place.
        Case{"AResumedJobSwapsItsParkedStateWithASuspendedJobsKeptOne",
             {Assign("job-1", 1), Suspend("job-1", 1), Ended(1, K::kStopped), Assign("job-2", 1),
              Suspend("job-2", 1), Ended(2, K::kStopped), Assign("job-1", 2)},
             {"start #1 job-1/1 fresh", "abort #1", "keep #1", "park kept, start #2 job-2/1 fresh",
              "abort #2", "keep #2", "swap kept and parked, start #3 job-1/2 with state"}},
        // ... and when the other suspended job's run ends only after the assignment, its state
        // is parked once the resumed job's run has taken the parked one.
        Case{"ASuspendedRunEndingWhileAJobWaitsForItsParkedStateIsParkedAfterIt",
             {Assign("job-1", 1), Suspend("job-1", 1), Ended(1, K::kStopped), Assign("job-2", 1),
              Suspend("job-2", 1), Assign("job-1", 2), Ended(2, K::kStopped)},
             {"start #1 job-1/1 fresh", "abort #1", "keep #1", "park kept, start #2 job-2/1 fresh",
              "abort #2", "nothing", "start #3 job-1/2 with parked state, then park #2"}},
        // Resumed on other workers: what this one keeps or parks of it goes.
        Case{"AJobResumedElsewhereDropsItsParkedAndKeptState",
             {Assign("job-1", 1), Suspend("job-1", 1), Ended(1, K::kStopped), Assign("job-2", 1),
              DropParked("job-1"), Assign("job-3", 1), Ended(2, K::kStopped), Suspend("job-3", 1),
              Ended(3, K::kStopped), DropParked("job-3")},
             {"start #1 job-1/1 fresh", "abort #1", "keep #1", "park kept, start #2 job-2/1 fresh",
              "drop parked", "abort #2", "start #3 job-3/1 fresh", "abort #3", "keep #3",
              "drop kept"}},
        Case{"AnAbortOfAnOlderGenerationLeavesTheCurrentRunAlone",
             {Assign("job-1", 1), Assign("job-1", 2), Ended(1, K::kStopped), Abort("job-1", 1)},
             {"start #1 job-1/1 fresh", "abort #1", "keep #1, start #2 job-1/2 with state",
              "nothing"}}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// What a new registration reports (RegisterRequest.running): the run whose group trains.
TEST(LifecycleTrainingTest, OnlyARunWhoseGroupTrainedAStepIsReported) {
  WorkerLifecycle lifecycle(absl::Seconds(10));
  const absl::Time now = absl::FromUnixSeconds(1'700'000'000);
  v1::Assignment a;
  a.set_job_id("job-1");
  a.set_generation(4);
  a.set_rank(1);
  *a.mutable_spec() = Spec(1);
  LifecycleActions started = lifecycle.OnAssignment(a, now);
  ASSERT_EQ(started.start.size(), 1u);
  const RunId run = started.start[0].run;
  EXPECT_FALSE(lifecycle.training().has_value());  // still forming its group
  lifecycle.OnTraining(run, now);
  ASSERT_TRUE(lifecycle.training().has_value());
  EXPECT_EQ(lifecycle.training()->run, run);
  EXPECT_EQ(lifecycle.training()->assignment.generation(), 4);
  EXPECT_EQ(lifecycle.training()->assignment.rank(), 1);
  lifecycle.OnSessionEnded("session ended", now);
  EXPECT_TRUE(lifecycle.training().has_value()) << "it trains on";
  lifecycle.OnAbort("job-1", 4, "not kept", /*job_ended=*/false, now);
  EXPECT_FALSE(lifecycle.training().has_value()) << "an aborted run is no longer reported";
}

// Rule 6's bound: a group no coordinator keeps stops after keep_training_for, counted from the
// session's end and reset by a registration.
TEST(LifecycleTrainingTest, AGroupNoCoordinatorKeepsStopsAfterKeepTrainingFor) {
  WorkerLifecycle lifecycle(absl::Seconds(10), absl::Seconds(60));
  const absl::Time t0 = absl::FromUnixSeconds(1'700'000'000);
  v1::Assignment a;
  a.set_job_id("job-1");
  a.set_generation(2);
  *a.mutable_spec() = Spec(1);
  const RunId run = lifecycle.OnAssignment(a, t0).start.at(0).run;
  lifecycle.OnTraining(run, t0);
  EXPECT_TRUE(lifecycle.OnSessionEnded("gone", t0).abort.empty());
  EXPECT_TRUE(lifecycle.Tick(t0 + absl::Seconds(30)).abort.empty());
  lifecycle.OnRegistered(t0 + absl::Seconds(30));  // a coordinator decides now
  EXPECT_TRUE(lifecycle.Tick(t0 + absl::Seconds(89)).abort.empty());
  EXPECT_TRUE(lifecycle.OnSessionEnded("gone again", t0 + absl::Seconds(100)).abort.empty());
  EXPECT_TRUE(lifecycle.Tick(t0 + absl::Seconds(159)).abort.empty());
  LifecycleActions stop = lifecycle.Tick(t0 + absl::Seconds(160));
  ASSERT_EQ(stop.abort.size(), 1u);
  EXPECT_EQ(stop.abort[0].run, run);
  EXPECT_NE(stop.abort[0].reason.find("no coordinator for 1m"), std::string::npos)
      << stop.abort[0].reason;
  EXPECT_FALSE(lifecycle.training().has_value());
  // Its state is kept, as for any abort.
  RunResult r;
  r.kind = RunResult::kStopped;
  r.holds_state = true;
  EXPECT_TRUE(lifecycle.OnRunEnded(run, r, t0 + absl::Seconds(161)).keep_state_of.has_value());
}

TEST(LifecycleTrainingTest, ZeroOrAProgramsRunMeansNothingTrainsOn) {
  const absl::Time now = absl::FromUnixSeconds(1'700'000'000);
  v1::Assignment a;
  a.set_job_id("job-1");
  a.set_generation(1);
  *a.mutable_spec() = Spec(1);
  {
    WorkerLifecycle lifecycle(absl::Seconds(10), absl::ZeroDuration());
    lifecycle.OnTraining(lifecycle.OnAssignment(a, now).start.at(0).run, now);
    EXPECT_EQ(lifecycle.OnSessionEnded("gone", now).abort.size(), 1u);
  }
  {
    // A program's process reaches the coordinator's store through the session.
    WorkerLifecycle lifecycle(absl::Seconds(10), absl::Seconds(60));
    a.mutable_spec()->mutable_program()->add_argv("/usr/bin/python3");
    lifecycle.OnTraining(lifecycle.OnAssignment(a, now).start.at(0).run, now);
    EXPECT_FALSE(lifecycle.training().has_value());
    EXPECT_EQ(lifecycle.OnSessionEnded("gone", now).abort.size(), 1u);
  }
}

}  // namespace
}  // namespace lockstep::worker
