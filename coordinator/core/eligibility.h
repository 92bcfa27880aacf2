// Two of the core's decisions as pure functions over what the core knows of one worker, with
// table tests (tests/unit/eligibility_test.cc): whether an idle worker may take a rank of a job
// (placement.cc's IdleWorkers), and what a registering worker's held state means
// (registry.cc's ReserveOrRelease).
#pragma once

#include <cstdint>
#include <string>

namespace lockstep::coordinator {

// A worker as placement sees it.
struct PlacementView {
  bool idle = false;
  std::string reserved_for;  // the job it is kept for ("" none)
  bool excluded = false;     // from the job asked about (lost too often, or left out)
  bool benched = false;      // sat out the job's current re-formation
  std::string device;        // its kind: "cpu" or "cuda"
  int64_t free_memory = 0;   // bytes it reported (0: it did not say)
  bool runs_programs = false;  // started with --programs_root (kProgramCapability)
};

// Whether `w` may take a rank of job `job_id` ("" for a question about no job: any idle worker
// not kept for a job) on `device` ("" any kind) with `memory_needed` bytes; a program job
// (`program`) only on a worker that runs programs.
bool MayTakeRank(const PlacementView& w, const std::string& job_id, const std::string& device,
                 int64_t memory_needed, bool program = false);

// What a registering worker's held state (the job whose state it kept, if any) means.
enum class HeldVerdict {
  kNone,         // it holds nothing
  kDropUnknown,  // of a job this coordinator does not know: drop it
  kDropEnded,    // of a job that ended and was recorded: drop it
  kDropExcluded, // of a job it is no longer a member of: drop it, and serve other jobs
  kResume,       // of a live job: kept for it, at the step it holds
};
struct HeldJob {
  bool holds = false;          // it said it holds a job's state
  bool known = false;          // this coordinator knows that job
  bool ended_recorded = false; // the job ended and its end was saved
  bool excluded = false;       // the worker is excluded from it
};
HeldVerdict JudgeHeldState(const HeldJob& held);

}  // namespace lockstep::coordinator
