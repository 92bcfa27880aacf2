// The agreement on a job's result: the members that finished must report the same step, the
// same parameters (checksum) and the same evaluation, byte for byte; a job's result is never
// one member's word. Pure: the core (reports.cc) gathers the members' reports and calls it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep::coordinator {

// One finished member's result, as the agreement compares it.
struct FinishedResult {
  std::string name;  // how the message names the member
  int64_t step = 0;
  std::string checksum;  // of the parameters
  std::string eval;      // the evaluation, serialized
};

// Empty when the results agree (also for none or one); otherwise why not, naming every
// member's step and parameters and marking an evaluation that differs from the first's:
// "the members disagree on the result (w0: step 10, parameters ab; w1: step 10, parameters cd)".
std::string Disagreement(const std::vector<FinishedResult>& results);

}  // namespace lockstep::coordinator
