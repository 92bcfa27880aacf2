#include "coordinator/core/eligibility.h"

namespace lockstep::coordinator {

bool MayTakeRank(const PlacementView& w, const std::string& job_id, const std::string& device,
                 int64_t memory_needed, bool program) {
  if (!w.idle) return false;
  if (program && !w.runs_programs) return false;
  // Kept for another job (a restarted coordinator's awaited member, a survivor with state).
  if (!w.reserved_for.empty() && (job_id.empty() || w.reserved_for != job_id)) return false;
  if (!job_id.empty() && (w.excluded || w.benched)) return false;
  if (!device.empty() && w.device != device) return false;
  // A worker that did not say what it has free is not turned away for memory.
  return w.free_memory == 0 || w.free_memory >= memory_needed;
}

HeldVerdict JudgeHeldState(const HeldJob& held) {
  if (!held.holds) return HeldVerdict::kNone;
  // Job ids do not repeat: a job this coordinator does not know will never resume.
  if (!held.known) return HeldVerdict::kDropUnknown;
  if (held.ended_recorded) return HeldVerdict::kDropEnded;
  if (held.excluded) return HeldVerdict::kDropExcluded;
  return HeldVerdict::kResume;
}

}  // namespace lockstep::coordinator
