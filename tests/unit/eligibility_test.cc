// Placement's and the registry's rules over one worker (coordinator/core/eligibility.h), case
// by case.
#include "coordinator/core/eligibility.h"

#include <string>

#include "gtest/gtest.h"

namespace lockstep::coordinator {
namespace {

PlacementView Idle() {
  PlacementView w;
  w.idle = true;
  w.device = "cpu";
  return w;
}

TEST(EligibilityTest, WhoMayTakeARank) {
  const int64_t kGiB = int64_t{1} << 30;
  struct Case {
    const char* what;
    PlacementView worker;
    std::string job, device;
    int64_t memory;
    bool may;
  };
  auto with = [](auto change) {
    PlacementView w = Idle();
    change(w);
    return w;
  };
  const Case cases[] = {
      {"an idle worker", Idle(), "job-1", "cpu", kGiB, true},
      {"a busy worker", with([](PlacementView& w) { w.idle = false; }), "job-1", "cpu", kGiB,
       false},
      {"kept for this job", with([](PlacementView& w) { w.reserved_for = "job-1"; }), "job-1",
       "cpu", kGiB, true},
      {"kept for another job", with([](PlacementView& w) { w.reserved_for = "job-2"; }),
       "job-1", "cpu", kGiB, false},
      {"kept for a job, asked for none", with([](PlacementView& w) { w.reserved_for = "job-1"; }),
       "", "", 0, false},
      {"excluded from the job", with([](PlacementView& w) { w.excluded = true; }), "job-1",
       "cpu", kGiB, false},
      {"benched in the job's re-formation", with([](PlacementView& w) { w.benched = true; }),
       "job-1", "cpu", kGiB, false},
      {"excluded, asked for no job", with([](PlacementView& w) { w.excluded = true; }), "", "",
       0, true},
      {"another device", Idle(), "job-1", "cuda", kGiB, false},
      {"any device", Idle(), "job-1", "", kGiB, true},
      {"too little memory", with([](PlacementView& w) { w.free_memory = kGiB - 1; }), "job-1",
       "cpu", kGiB, false},
      {"just enough memory", with([](PlacementView& w) { w.free_memory = kGiB; }), "job-1",
       "cpu", kGiB, true},
      {"memory not reported", with([](PlacementView& w) { w.free_memory = 0; }), "job-1", "cpu",
       64 * kGiB, true},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(MayTakeRank(c.worker, c.job, c.device, c.memory), c.may) << c.what;
  }
  // A program job only on workers that run programs; a worker that runs them takes any job.
  const PlacementView runner = with([](PlacementView& w) { w.runs_programs = true; });
  EXPECT_FALSE(MayTakeRank(Idle(), "job-1", "cpu", 0, /*program=*/true));
  EXPECT_TRUE(MayTakeRank(runner, "job-1", "cpu", 0, /*program=*/true));
  EXPECT_TRUE(MayTakeRank(runner, "job-1", "cpu", 0, /*program=*/false));
  EXPECT_FALSE(MayTakeRank(with([](PlacementView& w) {
                             w.runs_programs = true;
                             w.idle = false;
                           }),
                           "job-1", "cpu", 0, /*program=*/true));
}

TEST(EligibilityTest, WhatAHeldStateMeans) {
  struct Case {
    const char* what;
    HeldJob held;
    HeldVerdict verdict;
  };
  const Case cases[] = {
      {"holds nothing", {false, false, false, false}, HeldVerdict::kNone},
      {"a job this coordinator does not know", {true, false, false, false},
       HeldVerdict::kDropUnknown},
      {"a job that ended and was recorded", {true, true, true, false}, HeldVerdict::kDropEnded},
      {"ended and excluded: the end says more", {true, true, true, true}, HeldVerdict::kDropEnded},
      {"a live job it was excluded from", {true, true, false, true}, HeldVerdict::kDropExcluded},
      {"a live job (or one whose end is not saved yet)", {true, true, false, false},
       HeldVerdict::kResume},
  };
  for (const Case& c : cases) EXPECT_EQ(JudgeHeldState(c.held), c.verdict) << c.what;
}

}  // namespace
}  // namespace lockstep::coordinator
